//! The engine-side handoff driver's decisions, sans-IO.
//!
//! An engine serves control messages from the coordinator (`PREFILL`, `SUBMIT_REQUEST_WITH_KV`,
//! `SEND_KV`, `RELEASE_KV`, `ABORT`, `SHUTDOWN`) and reports what its handoffs did. The control
//! plane delivers at least once and may reorder, so the engine must act on each (kind, request,
//! attempt epoch) once, remember which attempt a request is on, report each import's outcome
//! once, and know when a shutdown may end (nothing in flight, or the grace period over). Those
//! decisions live here; the Python driver only moves messages and calls the engine.
//!
//! Memory is bounded: at most `capacity` (kind, request, epoch) keys and request epochs are
//! remembered, the oldest forgotten first.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// Control-message kinds the engine side acts on; everything else is [`MsgKind::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MsgKind {
    /// Run a prompt (prefill engine).
    Prefill,
    /// Import a prompt's state with its ticket (decode engine).
    SubmitWithKv,
    /// Push the pinned state to a decode (push transports, prefill engine).
    SendKv,
    /// Release a request's pinned blocks (prefill engine).
    ReleaseKv,
    /// Stop a request (either engine).
    Abort,
    /// Drain and stop.
    Shutdown,
    /// The peer table (registered with the engine; never de-duplicated).
    Peers,
    /// Any other message type (not acted on by the driver).
    Other,
}

impl MsgKind {
    /// The kind of a message type name (`"PREFILL"`, ...).
    pub fn parse(name: &str) -> Self {
        match name {
            "PREFILL" => Self::Prefill,
            "SUBMIT_REQUEST_WITH_KV" => Self::SubmitWithKv,
            "SEND_KV" => Self::SendKv,
            "RELEASE_KV" => Self::ReleaseKv,
            "ABORT" => Self::Abort,
            "SHUTDOWN" => Self::Shutdown,
            "PEERS" => Self::Peers,
            _ => Self::Other,
        }
    }

    /// Kinds that start work: acting on a duplicate would start it twice.
    fn starts_work(self) -> bool {
        matches!(self, Self::Prefill | Self::SubmitWithKv | Self::SendKv)
    }

    /// Kinds that carry the request's current attempt epoch.
    fn opens_attempt(self) -> bool {
        matches!(self, Self::Prefill | Self::SubmitWithKv)
    }

    /// What an engine of `role` does with a message of this kind it accepted (`None`: the
    /// message is meant for the other role, or for no engine).
    fn action(self, role: Role) -> Option<Action> {
        match (self, role) {
            (Self::Prefill, Role::Prefill) => Some(Action::Prefill),
            (Self::SendKv, Role::Prefill) => Some(Action::SendKv),
            (Self::ReleaseKv, Role::Prefill) => Some(Action::Release),
            (Self::SubmitWithKv, Role::Decode) => Some(Action::Ticket),
            (Self::Abort, _) => Some(Action::Abort),
            (Self::Shutdown, _) => Some(Action::Shutdown),
            _ => None,
        }
    }
}

/// The engine's part in a handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Runs prompts and hands their state over.
    Prefill,
    /// Imports handed-over state and decodes.
    Decode,
}

impl Role {
    /// `"decode"` is a decode engine; any other name a prefill engine.
    pub fn parse(name: &str) -> Self {
        if name == "decode" {
            Self::Decode
        } else {
            Self::Prefill
        }
    }
}

/// What the driver does with a message it acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Register the peer table with the engine.
    Peers,
    /// Start a prompt (prefill).
    Prefill,
    /// Start an import from a ticket (decode).
    Ticket,
    /// Push the pinned state, or fillers (prefill, push transports).
    SendKv,
    /// Release pinned blocks (prefill).
    Release,
    /// Stop the request.
    Abort,
    /// Drain and stop.
    Shutdown,
}

impl Action {
    /// Stable name (`"peers"`, `"prefill"`, `"ticket"`, `"send_kv"`, `"release"`, `"abort"`,
    /// `"shutdown"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Peers => "peers",
            Self::Prefill => "prefill",
            Self::Ticket => "ticket",
            Self::SendKv => "send_kv",
            Self::Release => "release",
            Self::Abort => "abort",
            Self::Shutdown => "shutdown",
        }
    }
}

/// What the receiving end does with one message before every rank sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound {
    /// Pass it on as it is.
    Keep,
    /// Drop it (a `PEERS` replaced by the announcement of the current table).
    Drop,
    /// A ticket: remove any metadata it carries, and attach the metadata of `source` from the
    /// peer table (`None`: its provenance failed, the ticket has no source).
    Ticket {
        /// The peer whose metadata the ticket reads from.
        source: Option<String>,
    },
    /// Attach the metadata of this decode engine (named by the message, in the peer table).
    DecodeMeta(String),
}

/// The peer table as the driver's rules read it: engine id -> incarnation (`None` when the
/// entry has none that is a non-negative int).
pub type PeerIncarnations = BTreeMap<String, Option<u64>>;

/// What the driver does with one incoming message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Dispatch it to the engine.
    Act,
    /// The same (kind, request, epoch) was acted on already: drop it.
    Duplicate,
    /// A request id or epoch that is not a non-negative int: drop it and count it.
    Malformed,
    /// Not a kind the driver acts on.
    Ignore,
}

impl Verdict {
    /// Stable name (`"act"`, `"duplicate"`, `"malformed"`, `"ignore"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Act => "act",
            Self::Duplicate => "duplicate",
            Self::Malformed => "malformed",
            Self::Ignore => "ignore",
        }
    }
}

/// The one report of a settled import (the `KV_IMPORTED` message's fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportReport {
    /// The attempt epoch the report is for.
    pub epoch: u64,
    /// Whether the import succeeded.
    pub ok: bool,
    /// A failure whose reads are known to have stopped (not quarantined): the prefill may
    /// release its pins at once.
    pub quiet: bool,
}

/// Counters of what the driver dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCounters {
    /// Duplicated messages dropped.
    pub duplicates: u64,
    /// Messages with a request id or epoch that is not a non-negative int.
    pub malformed: u64,
    /// Outcomes for requests whose attempt epoch the driver no longer (or never) knew.
    pub unknown: u64,
    /// Tickets refused before any read: their source engine is not in the peer table at the
    /// incarnation the ticket names (forged or stale provenance).
    pub forged: u64,
}

/// Turns without messages or work after which the driver polls with a wait.
const IDLE_TURNS: u32 = 50;
/// How long an idle driver waits for a message, in milliseconds.
const IDLE_POLL_MS: u32 = 5;

/// The engine-side handoff driver's state: de-duplication, attempt epochs, once-only import
/// reports, the shutdown horizon and the idle back-off.
#[derive(Debug, Clone)]
pub struct EngineDriver {
    capacity: usize,
    seen: BTreeSet<(MsgKind, u64, u64)>,
    seen_order: VecDeque<(MsgKind, u64, u64)>,
    epochs: BTreeMap<u64, u64>,
    epoch_order: VecDeque<u64>,
    reported: BTreeSet<(u64, u64)>,
    sources: BTreeMap<u64, Option<String>>,
    source_order: VecDeque<u64>,
    announced: Option<PeerIncarnations>,
    acted: u64,
    stop_by_ns: Option<u64>,
    idle: u32,
    counters: DriverCounters,
}

impl EngineDriver {
    /// A driver remembering at most `capacity` (at least 1) message keys and request epochs.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            seen: BTreeSet::new(),
            seen_order: VecDeque::new(),
            epochs: BTreeMap::new(),
            epoch_order: VecDeque::new(),
            reported: BTreeSet::new(),
            sources: BTreeMap::new(),
            source_order: VecDeque::new(),
            announced: None,
            acted: 0,
            stop_by_ns: None,
            idle: 0,
            counters: DriverCounters::default(),
        }
    }

    /// Decide what to do with a message of `kind` for `request_id` at `epoch` (`None` where
    /// the field is missing or not a non-negative int). Work-starting kinds are acted on once
    /// per (kind, request, epoch); `PREFILL` and `SUBMIT_REQUEST_WITH_KV` record the epoch.
    pub fn accept(
        &mut self,
        kind: MsgKind,
        request_id: Option<u64>,
        epoch: Option<u64>,
    ) -> Verdict {
        match kind {
            MsgKind::Other | MsgKind::Peers => return Verdict::Ignore,
            MsgKind::Shutdown => return Verdict::Act,
            _ => {}
        }
        let Some(rid) = request_id else {
            self.counters.malformed += 1;
            return Verdict::Malformed;
        };
        if !kind.starts_work() {
            return Verdict::Act;
        }
        let Some(epoch) = epoch else {
            self.counters.malformed += 1;
            return Verdict::Malformed;
        };
        let key = (kind, rid, epoch);
        if self.seen.contains(&key) {
            self.counters.duplicates += 1;
            return Verdict::Duplicate;
        }
        self.seen.insert(key);
        self.seen_order.push_back(key);
        while self.seen_order.len() > self.capacity {
            if let Some(old) = self.seen_order.pop_front() {
                self.seen.remove(&old);
            }
        }
        if kind.opens_attempt() {
            if self.epochs.insert(rid, epoch).is_none() {
                self.epoch_order.push_back(rid);
            }
            while self.epoch_order.len() > self.capacity {
                if let Some(old) = self.epoch_order.pop_front() {
                    self.epochs.remove(&old);
                }
            }
        }
        Verdict::Act
    }

    /// The peer table `table` as it is now: whether it differs from the one last announced
    /// (the receiving end then announces it to every rank, as a `PEERS` message, and drops the
    /// `PEERS` messages it received).
    pub fn announce(&mut self, table: &PeerIncarnations) -> bool {
        if self.announced.as_ref() == Some(table) {
            return false;
        }
        self.announced = Some(table.clone());
        true
    }

    /// What the receiving end does with a message of `kind` before every rank sees it.
    /// `ticket`: the ticket's named source engine and incarnation, when the message carries a
    /// ticket that is a map; `decode_engine`: the decode engine the message names; `peers`:
    /// the peer table; `fresh`: the table is being announced this turn. A ticket reads only
    /// from the peer table, at the incarnation it names ([`EngineDriver::ticket_source_ok`]).
    pub fn inbound(
        &mut self,
        kind: MsgKind,
        ticket: Option<(Option<&str>, Option<u64>)>,
        decode_engine: Option<&str>,
        peers: &PeerIncarnations,
        fresh: bool,
    ) -> Inbound {
        match (kind, ticket, decode_engine) {
            (MsgKind::Peers, _, _) if fresh => Inbound::Drop,
            (MsgKind::SubmitWithKv, Some((engine, named)), _) => {
                let known = engine.and_then(|e| peers.get(e).copied().flatten());
                let ok = self.ticket_source_ok(named, known);
                Inbound::Ticket { source: engine.filter(|_| ok).map(str::to_owned) }
            }
            (MsgKind::Prefill | MsgKind::SendKv, _, Some(d)) if peers.contains_key(d) => {
                Inbound::DecodeMeta(d.to_owned())
            }
            _ => Inbound::Keep,
        }
    }

    /// What an engine of `role` does with a message of `kind` ([`EngineDriver::accept`], then
    /// the role's part; `PEERS` is registered when its table is a map, `peers_ok`). A ticket
    /// acted on names its `source` until its import settles (see
    /// [`EngineDriver::source_of`]). Counts the messages acted on for [`EngineDriver::turn`].
    pub fn dispatch(
        &mut self,
        role: Role,
        kind: MsgKind,
        ids: (Option<u64>, Option<u64>),
        peers_ok: bool,
        source: Option<&str>,
    ) -> Option<Action> {
        if kind == MsgKind::Peers {
            return peers_ok.then_some(Action::Peers);
        }
        if self.accept(kind, ids.0, ids.1) != Verdict::Act {
            return None;
        }
        let action = kind.action(role)?;
        self.acted += 1;
        if let (Action::Ticket, Some(rid)) = (action, ids.0) {
            if self.sources.insert(rid, source.map(str::to_owned)).is_none() {
                self.source_order.push_back(rid);
            }
            while self.sources.len() > self.capacity {
                if let Some(old) = self.source_order.pop_front() {
                    self.sources.remove(&old);
                }
            }
        }
        Some(action)
    }

    /// The prefill engine the ticket of `request_id` named, until its import settled (a
    /// decode names it when it reports posted receives).
    pub fn source_of(&self, request_id: u64) -> Option<&str> {
        self.sources.get(&request_id).and_then(Option::as_deref)
    }

    /// Imports that settled, `(request_id, failed)` in order (`quarantined`: those whose reads
    /// may still run): the reports to send, once per attempt ([`EngineDriver::import_settled`]),
    /// each with its request's text in `reasons` (empty without one). Each request's ticket
    /// source is forgotten.
    pub fn imports_settled(
        &mut self,
        settled: &[(u64, bool)],
        quarantined: &BTreeSet<u64>,
        reasons: &HashMap<u64, Option<String>>,
    ) -> Vec<(u64, ImportReport, String)> {
        let mut out = Vec::new();
        for &(rid, failed) in settled {
            if self.sources.remove(&rid).is_some() {
                self.source_order.retain(|r| *r != rid);
            }
            let report = self.import_settled(rid, failed, quarantined.contains(&rid));
            let why = || reasons.get(&rid).cloned().flatten().unwrap_or_default();
            out.extend(report.map(|r| (rid, r, why())));
        }
        out
    }

    /// The epoch to stamp on an outcome of `request_id`: `epoch` when the caller has one, else
    /// the request's attempt ([`EngineDriver::outcome_epoch`]; `None`: drop the outcome).
    pub fn stamp(&mut self, request_id: u64, epoch: Option<u64>) -> Option<u64> {
        epoch.or_else(|| self.outcome_epoch(request_id))
    }

    /// Whether a ticket's source may be read: the ticket names its source engine at
    /// incarnation `named` and this engine's peer table holds that engine at incarnation
    /// `known` (`None` where missing, unknown or not a non-negative int). Only the same
    /// incarnation on both sides passes; anything else is refused and counted as forged (the
    /// coordinator writes a ticket's provenance from its own state, so a mismatch is a forged
    /// ticket or one from an incarnation that is gone, whose blocks may be reused).
    pub fn ticket_source_ok(&mut self, named: Option<u64>, known: Option<u64>) -> bool {
        let ok = matches!((named, known), (Some(a), Some(b)) if a == b);
        if !ok {
            self.counters.forged += 1;
        }
        ok
    }

    /// The attempt epoch of `request_id`, if known.
    pub fn epoch_of(&self, request_id: u64) -> Option<u64> {
        self.epochs.get(&request_id).copied()
    }

    /// The epoch to stamp on an outcome of `request_id` (counted as unknown when there is none:
    /// the caller then drops the outcome, the coordinator's deadline ends the request).
    pub fn outcome_epoch(&mut self, request_id: u64) -> Option<u64> {
        let e = self.epoch_of(request_id);
        if e.is_none() {
            self.counters.unknown += 1;
        }
        e
    }

    /// An import of `request_id` settled (`failed`; `quarantined`: its reads may still run).
    /// Returns the report to send, once per attempt; `None` for a repeat or an unknown request.
    pub fn import_settled(
        &mut self,
        request_id: u64,
        failed: bool,
        quarantined: bool,
    ) -> Option<ImportReport> {
        let epoch = self.outcome_epoch(request_id)?;
        if !self.reported.insert((request_id, epoch)) {
            return None;
        }
        while self.reported.len() > self.capacity {
            let first = self.reported.iter().next().copied();
            if let Some(k) = first {
                self.reported.remove(&k);
            }
        }
        Some(ImportReport { epoch, ok: !failed, quiet: failed && !quarantined })
    }

    /// `SHUTDOWN` arrived at `now_ns`: drain until `now_ns + grace_ns` at the latest (a second
    /// one never extends the horizon).
    pub fn shutdown(&mut self, now_ns: u64, grace_ns: u64) {
        let by = now_ns.saturating_add(grace_ns);
        self.stop_by_ns = Some(self.stop_by_ns.map_or(by, |b| b.min(by)));
    }

    /// Whether a shutdown was asked for.
    pub fn stopping(&self) -> bool {
        self.stop_by_ns.is_some()
    }

    /// Whether the serving loop goes on at `now_ns`: always before `SHUTDOWN`; after it, while
    /// the engine is `busy` (work, imports, pushes, quarantined reads or pins) and the
    /// horizon has not passed.
    pub fn running(&self, now_ns: u64, busy: bool) -> bool {
        match self.stop_by_ns {
            None => true,
            Some(by) => busy && now_ns < by,
        }
    }

    /// One serving turn ended (engine `busy`; whether messages were acted on is counted by
    /// [`EngineDriver::dispatch`]); returns how long the next poll may wait for a message, in
    /// milliseconds (0 while there is anything to do or the engine was idle only briefly).
    pub fn turn(&mut self, busy: bool) -> u32 {
        let had_messages = std::mem::take(&mut self.acted) > 0;
        self.idle = if had_messages || busy { 0 } else { self.idle.saturating_add(1) };
        if busy || self.idle < IDLE_TURNS {
            0
        } else {
            IDLE_POLL_MS
        }
    }

    /// What was dropped so far.
    pub fn counters(&self) -> DriverCounters {
        self.counters
    }
}

crate::ledger::named_counters!(DriverCounters { duplicates, malformed, unknown, forged });

/// What the coordinator knows when a decode says it posted receives (`KV_RECV_POSTED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvPosted<'a> {
    /// Whether the transport is two-sided (the prefill pushes).
    pub push_transport: bool,
    /// The sending engine's id and role (`""` for an unregistered identity).
    pub sender: (&'a str, &'a str),
    /// The message's attempt epoch.
    pub epoch: u64,
    /// The live request of that id: its decode, epoch, whether its blocks are pinned and its
    /// prefill (`(None, 0, false, None)` when there is none).
    pub request: (Option<&'a str>, u64, bool, Option<&'a str>),
    /// The prefill engine the message names, and its role (`""` if unregistered).
    pub named: (&'a str, &'a str),
}

/// Where a `KV_RECV_POSTED` goes: `(prefill, abort)` for a `SEND_KV`, or `None` (ignored).
/// The request's own decode at its epoch, pinned: the request's prefill pushes. Otherwise the
/// receives are posted all the same and messages match by post order per pair (NCCL): the
/// prefill the message names answers them with fillers (`abort`), or its next push to that
/// decode would land in them; only a registered decode naming a registered prefill is heard.
pub fn recv_posted_route(m: &RecvPosted<'_>) -> Option<(String, bool)> {
    let (decode, epoch, pinned, prefill) = m.request;
    if !m.push_transport {
        return None;
    }
    if pinned && decode == Some(m.sender.0) && epoch == m.epoch {
        return prefill.map(|p| (p.to_owned(), false));
    }
    (m.sender.1 == "decode" && m.named.1 == "prefill").then(|| (m.named.0.to_owned(), true))
}

#[cfg(test)]
mod tests {
    use super::{recv_posted_route, RecvPosted};

    #[test]
    fn a_posted_receive_is_pushed_by_its_prefill_or_answered_with_fillers() {
        let live = RecvPosted {
            push_transport: true,
            sender: ("d0", "decode"),
            epoch: 3,
            request: (Some("d0"), 3, true, Some("p0")),
            named: ("p0", "prefill"),
        };
        assert_eq!(recv_posted_route(&live), Some(("p0".into(), false)));
        // Gone, unpinned, another epoch or another decode: the named prefill sends fillers.
        let gone = RecvPosted { request: (None, 0, false, None), ..live };
        let unpinned = RecvPosted { request: (Some("d0"), 3, false, Some("p0")), ..live };
        let stale = RecvPosted { epoch: 2, ..live };
        let other = RecvPosted { sender: ("d1", "decode"), ..live };
        for m in [gone, unpinned, stale, other] {
            assert_eq!(recv_posted_route(&m), Some(("p0".into(), true)), "{m:?}");
        }
        // Ignored: a one-sided transport, an unregistered sender, a name that is no prefill.
        assert_eq!(recv_posted_route(&RecvPosted { push_transport: false, ..live }), None);
        assert_eq!(recv_posted_route(&RecvPosted { sender: ("x", ""), ..gone }), None);
        assert_eq!(recv_posted_route(&RecvPosted { named: ("d1", "decode"), ..gone }), None);
    }

    use super::*;

    #[test]
    fn a_duplicated_work_message_is_acted_on_once() {
        let mut d = EngineDriver::new(16);
        assert_eq!(d.accept(MsgKind::Prefill, Some(1), Some(3)), Verdict::Act);
        assert_eq!(d.accept(MsgKind::Prefill, Some(1), Some(3)), Verdict::Duplicate);
        assert_eq!(d.accept(MsgKind::Prefill, Some(1), Some(4)), Verdict::Act);
        assert_eq!(d.epoch_of(1), Some(4));
        assert_eq!(d.counters().duplicates, 1);
    }

    #[test]
    fn a_ticket_is_read_only_from_the_incarnation_the_peer_table_holds() {
        let mut d = EngineDriver::new(8);
        assert!(d.ticket_source_ok(Some(3), Some(3)));
        assert!(!d.ticket_source_ok(Some(4), Some(3)));
        assert!(!d.ticket_source_ok(None, Some(3)));
        assert!(!d.ticket_source_ok(Some(3), None));
        assert!(!d.ticket_source_ok(None, None));
        assert_eq!(d.counters().forged, 4);
    }

    #[test]
    fn release_and_abort_are_never_deduplicated() {
        let mut d = EngineDriver::new(16);
        for _ in 0..3 {
            assert_eq!(d.accept(MsgKind::ReleaseKv, Some(1), Some(0)), Verdict::Act);
            assert_eq!(d.accept(MsgKind::Abort, Some(1), None), Verdict::Act);
        }
        assert_eq!(d.epoch_of(1), None);
    }

    #[test]
    fn a_bad_request_id_or_missing_epoch_is_malformed() {
        let mut d = EngineDriver::new(16);
        assert_eq!(d.accept(MsgKind::Abort, None, Some(0)), Verdict::Malformed);
        assert_eq!(d.accept(MsgKind::SubmitWithKv, Some(2), None), Verdict::Malformed);
        assert_eq!(d.accept(MsgKind::Other, None, None), Verdict::Ignore);
        assert_eq!(d.accept(MsgKind::Shutdown, None, None), Verdict::Act);
        assert_eq!(d.counters().malformed, 2);
    }

    #[test]
    fn an_import_is_reported_once_per_attempt() {
        let mut d = EngineDriver::new(16);
        assert_eq!(d.import_settled(5, false, false), None);
        assert_eq!(d.counters().unknown, 1);
        d.accept(MsgKind::SubmitWithKv, Some(5), Some(2));
        let r = d.import_settled(5, true, false);
        assert_eq!(r, Some(ImportReport { epoch: 2, ok: false, quiet: true }));
        assert_eq!(d.import_settled(5, true, false), None);
        d.accept(MsgKind::SubmitWithKv, Some(5), Some(3));
        let r = d.import_settled(5, true, true);
        assert_eq!(r, Some(ImportReport { epoch: 3, ok: false, quiet: false }));
    }

    #[test]
    fn shutdown_runs_while_busy_until_the_horizon() {
        let mut d = EngineDriver::new(4);
        assert!(d.running(0, false));
        d.shutdown(100, 50);
        d.shutdown(110, 500); // never extends
        assert!(d.stopping());
        assert!(d.running(120, true));
        assert!(!d.running(120, false));
        assert!(!d.running(150, true));
    }

    #[test]
    fn an_idle_driver_waits_only_after_many_idle_turns() {
        let mut d = EngineDriver::new(4);
        for _ in 0..IDLE_TURNS - 1 {
            assert_eq!(d.turn(false), 0);
        }
        assert_eq!(d.turn(false), IDLE_POLL_MS);
        d.dispatch(Role::Prefill, MsgKind::Shutdown, (None, None), false, None);
        assert_eq!(d.turn(false), 0);
        assert_eq!(d.turn(true), 0);
    }

    fn table(entries: &[(&str, Option<u64>)]) -> PeerIncarnations {
        entries.iter().map(|(e, i)| ((*e).to_owned(), *i)).collect()
    }

    #[test]
    fn a_changed_peer_table_is_announced_once() {
        let mut d = EngineDriver::new(8);
        let empty = table(&[]);
        assert!(d.announce(&empty));
        assert!(!d.announce(&empty));
        let one = table(&[("p0", Some(1))]);
        assert!(d.announce(&one));
        assert!(!d.announce(&one));
        assert!(d.announce(&table(&[("p0", Some(2))])));
        // Announced this turn: the PEERS messages received are replaced; otherwise kept.
        assert_eq!(d.inbound(MsgKind::Peers, None, None, &one, true), Inbound::Drop);
        assert_eq!(d.inbound(MsgKind::Peers, None, None, &one, false), Inbound::Keep);
    }

    #[test]
    fn a_ticket_reads_only_from_its_named_incarnation_and_work_names_its_decode() {
        let mut d = EngineDriver::new(8);
        let peers = table(&[("p0", Some(3)), ("d0", Some(1)), ("px", None)]);
        let sub = MsgKind::SubmitWithKv;
        let ok = d.inbound(sub, Some((Some("p0"), Some(3))), None, &peers, false);
        assert_eq!(ok, Inbound::Ticket { source: Some("p0".into()) });
        for named in [(Some("p0"), Some(2)), (Some("px"), Some(0)), (Some("zz"), Some(3))] {
            let got = d.inbound(sub, Some(named), None, &peers, false);
            assert_eq!(got, Inbound::Ticket { source: None }, "{named:?}");
        }
        assert_eq!(
            d.inbound(sub, Some((None, Some(3))), None, &peers, false),
            Inbound::Ticket { source: None }
        );
        assert_eq!(d.counters().forged, 4);
        assert_eq!(d.inbound(sub, None, None, &peers, false), Inbound::Keep);
        for kind in [MsgKind::Prefill, MsgKind::SendKv] {
            let got = d.inbound(kind, None, Some("d0"), &peers, false);
            assert_eq!(got, Inbound::DecodeMeta("d0".into()));
            assert_eq!(d.inbound(kind, None, Some("d9"), &peers, false), Inbound::Keep);
        }
        assert_eq!(d.inbound(MsgKind::ReleaseKv, None, Some("d0"), &peers, false), Inbound::Keep);
    }

    #[test]
    fn each_role_acts_only_on_its_own_messages() {
        let all = [
            MsgKind::Prefill,
            MsgKind::SubmitWithKv,
            MsgKind::SendKv,
            MsgKind::ReleaseKv,
            MsgKind::Abort,
            MsgKind::Shutdown,
            MsgKind::Other,
        ];
        for (role, acts) in [
            (Role::Prefill, vec!["prefill", "send_kv", "release", "abort", "shutdown"]),
            (Role::Decode, vec!["ticket", "abort", "shutdown"]),
        ] {
            let mut d = EngineDriver::new(8);
            let got: Vec<_> = all
                .iter()
                .filter_map(|k| d.dispatch(role, *k, (Some(1), Some(1)), false, None))
                .map(Action::name)
                .collect();
            assert_eq!(got, acts);
            // A message meant for the other role is still recorded: its duplicate is dropped.
            assert_eq!(d.counters().duplicates, 0);
            assert_eq!(d.dispatch(role, MsgKind::Prefill, (Some(1), Some(1)), false, None), None);
            assert_eq!(d.counters().duplicates, 1);
        }
        let mut d = EngineDriver::new(8);
        assert_eq!(
            d.dispatch(Role::Decode, MsgKind::Peers, (None, None), true, None),
            Some(Action::Peers)
        );
        assert_eq!(d.dispatch(Role::Decode, MsgKind::Peers, (None, None), false, None), None);
        assert_eq!(Role::parse("decode"), Role::Decode);
        assert_eq!(Role::parse("anything"), Role::Prefill);
    }

    #[test]
    fn a_ticket_names_its_source_until_its_import_settles_and_each_outcome_is_stamped() {
        let mut d = EngineDriver::new(8);
        let ticket = |d: &mut EngineDriver, rid, epoch, src| {
            d.dispatch(Role::Decode, MsgKind::SubmitWithKv, (Some(rid), Some(epoch)), false, src)
        };
        assert_eq!(ticket(&mut d, 1, 2, Some("p0")), Some(Action::Ticket));
        assert_eq!(ticket(&mut d, 2, 5, None), Some(Action::Ticket));
        assert_eq!((d.source_of(1), d.source_of(2), d.source_of(3)), (Some("p0"), None, None));
        assert_eq!(d.stamp(1, Some(9)), Some(9));
        assert_eq!(d.stamp(1, None), Some(2));
        assert_eq!(d.stamp(3, None), None);
        assert_eq!(d.counters().unknown, 1);
        let quarantined: BTreeSet<u64> = [2].into();
        let reasons: HashMap<u64, Option<String>> = [(2, Some("gone".into())), (1, None)].into();
        let settled = [(1, false), (2, true), (3, true), (1, false)];
        let reports = d.imports_settled(&settled, &quarantined, &reasons);
        assert_eq!(
            reports,
            vec![
                (1, ImportReport { epoch: 2, ok: true, quiet: false }, String::new()),
                (2, ImportReport { epoch: 5, ok: false, quiet: false }, "gone".into()),
            ]
        );
        assert_eq!(d.source_of(1), None);
        assert!(d.sources.is_empty() && d.source_order.is_empty());
    }

    #[test]
    fn memory_stays_bounded_by_capacity() {
        let mut d = EngineDriver::new(8);
        for rid in 0..1000 {
            d.accept(MsgKind::Prefill, Some(rid), Some(0));
            d.import_settled(rid, false, false);
            d.dispatch(Role::Decode, MsgKind::SubmitWithKv, (Some(rid), Some(0)), false, None);
        }
        assert!(d.seen.len() <= 8 && d.seen_order.len() <= 8);
        assert!(d.sources.len() <= 8 && d.source_order.len() <= 8);
        assert!(d.epochs.len() <= 8 && d.reported.len() <= 8);
    }
}
