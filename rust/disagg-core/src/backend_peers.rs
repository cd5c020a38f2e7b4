//! The transfer backends' rules over the peers a handoff names: how the peer-metadata argument
//! (one dict, a list, `{"tp_metas": [...]}`, `{"pp_metas": [...]}`) unwraps into one record
//! per source rank, which block ids each source rank gets, when a metadata object seen before
//! is still the same peer, and what a two-sided handoff sends, receives and reports. Pure
//! functions over a [`MetaNode`] view, so the bindings walk Python objects in place and the
//! tests walk wire values.

use std::collections::HashMap;
use std::sync::Arc;

use crate::chunks::wire_tag;
use crate::p2p_header::{encode_headers, MessageKind};
use crate::refmeta;
use crate::wire::peer::{PeerMeta, PeerTable};
use crate::wire::value::WireValue;
use crate::{DisaggError, DisaggResult};

/// What one node of a peer-metadata argument is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeShape {
    /// A mapping (a dict).
    Map,
    /// `None`.
    Null,
    /// A text or byte string (never a list of peers).
    Text,
    /// Anything else: read as a sequence.
    Seq,
}

/// A read-only view of one node of a peer-metadata argument.
pub trait MetaNode: Clone {
    /// What the node is.
    fn shape(&self) -> NodeShape;
    /// The value under text key `key` of a map (`None`: no such key, or not a map).
    fn field(&self, key: &str) -> Option<Self>;
    /// The value under integer key `rank` of a map (`None`: no such key, or not a map).
    fn rank_entry(&self, rank: u32) -> Option<Self>;
    /// The elements of a sequence (`None`: not iterable).
    fn elements(&self) -> Option<Vec<Self>>;
    /// The node's type name, for error messages.
    fn type_name(&self) -> String;
}

/// One source rank of a handoff: its metadata node and its own block ids (`None`: the
/// call's `src_block_ids`).
#[derive(Clone, Debug, PartialEq)]
pub struct PeerRecord<N> {
    /// The rank's metadata.
    pub meta: N,
    /// The block ids the metadata (or its pipeline stage) carries.
    pub ids: Option<N>,
}

fn append<N: MetaNode>(
    raw: &N,
    stage_ids: Option<&N>,
    out: &mut Vec<PeerRecord<N>>,
) -> DisaggResult<()> {
    let metas = match raw.shape() {
        NodeShape::Map => vec![raw.clone()],
        _ => raw.elements().ok_or_else(|| not_peers(raw))?,
    };
    for meta in metas {
        if meta.shape() != NodeShape::Map {
            return Err(DisaggError::wire(
                "peer_meta",
                format!("peer metadata entries must be dicts, got {}", meta.type_name()),
            ));
        }
        let ids = meta.field("block_ids").or_else(|| stage_ids.cloned());
        out.push(PeerRecord { meta, ids });
    }
    Ok(())
}

fn not_peers<N: MetaNode>(raw: &N) -> DisaggError {
    DisaggError::wire(
        "peer_meta",
        format!("peer metadata must be a dict or a list of dicts, got {}", raw.type_name()),
    )
}

/// Unwrap a handoff's peer metadata into one record per source rank: one dict, a sequence
/// of dicts, `{"tp_metas": ...}`, or `{"pp_metas": [stage, ...]}` whose stages are dicts
/// (`{"tp_metas": ..., "block_ids": ...}`, or a rank's metadata itself) and lend their
/// `block_ids` to their ranks. A dict's own `block_ids` win. `Wire` errors name `peer_meta`
/// (no dict or sequence, an entry that is not a dict) or `pp_metas` (a stage that is not).
pub fn peer_records<N: MetaNode>(peer_meta: &N) -> DisaggResult<Vec<PeerRecord<N>>> {
    let mut out = Vec::new();
    if let Some(stages) = peer_meta.field("pp_metas") {
        for stage in stages.elements().ok_or_else(|| not_peers(&stages))? {
            if stage.shape() != NodeShape::Map {
                return Err(DisaggError::wire("pp_metas", "pp_metas entries must be dicts"));
            }
            let ranks = stage.field("tp_metas").unwrap_or_else(|| stage.clone());
            append(&ranks, stage.field("block_ids").as_ref(), &mut out)?;
        }
        return Ok(out);
    }
    let ranks = peer_meta.field("tp_metas").unwrap_or_else(|| peer_meta.clone());
    if matches!(ranks.shape(), NodeShape::Null | NodeShape::Text) {
        return Err(not_peers(&ranks));
    }
    append(&ranks, None, &mut out)?;
    Ok(out)
}

/// [`peer_records`] of a handoff, which must name at least one source rank (`Wire` on
/// `peer_meta` otherwise).
pub fn source_records<N: MetaNode>(peer_meta: &N) -> DisaggResult<Vec<PeerRecord<N>>> {
    let records = peer_records(peer_meta)?;
    if records.is_empty() {
        return Err(DisaggError::wire("peer_meta", "no peer metadata given"));
    }
    Ok(records)
}

/// The source block ids of a resolved handoff.
#[derive(Clone, Debug, PartialEq)]
pub enum ResolvedIds<N> {
    /// Every source rank uses the call's `src_block_ids` as given.
    Given,
    /// One list per source global rank, in first-seen order.
    ByRank(Vec<(u32, N)>),
}

/// The block ids of each source rank: the call's where no record carries its own; else, per
/// record (its global rank, its own ids), those ids (`default` where it has none): a map
/// gives its entry for the rank (none: the rank gets nothing from it), `None` gives nothing,
/// a list is the rank's. A later record of a rank replaces an earlier one's ids.
pub fn ids_by_rank<N: MetaNode>(records: &[(u32, Option<N>)], default: &N) -> ResolvedIds<N> {
    if records.iter().all(|(_, ids)| ids.is_none()) {
        return ResolvedIds::Given;
    }
    let mut out: Vec<(u32, N)> = Vec::new();
    for (rank, ids) in records {
        let ids = ids.as_ref().unwrap_or(default);
        let pick = match ids.shape() {
            NodeShape::Map => ids.rank_entry(*rank),
            NodeShape::Null => None,
            _ => Some(ids.clone()),
        };
        if let Some(pick) = pick {
            match out.iter_mut().find(|(r, _)| r == rank) {
                Some(slot) => slot.1 = pick,
                None => out.push((*rank, pick)),
            }
        }
    }
    ResolvedIds::ByRank(out)
}

/// What [`adopt_peer`] builds beside a new peer from it and its schema.
pub type Attach<'a, A> = &'a mut dyn FnMut(&Arc<PeerMeta>, &WireValue) -> DisaggResult<A>;

/// The table entry of one metadata value a backend is handed: kept without the `block_ids` a
/// dict carries for one handoff and found again by content; else parsed and adopted with
/// `attach(peer, schema)` beside it, where `schema` is the value in this library's schema (a
/// dict without `version` holds the reference design's fields only: translated with `local`
/// first). `to_plan`: a value to plan with, found by content as given, else adopted over
/// [`planning_defaults`] (its own fields win; not a dict: `Wire` on `peer_meta`). Errors: the
/// table's, the translation's, `attach`'s.
pub fn adopt_peer<A: Clone>(
    table: &mut PeerTable<A>,
    (meta, to_plan): (WireValue, bool),
    local: &refmeta::LocalFacts,
    attach: Attach<'_, A>,
) -> DisaggResult<(Arc<PeerMeta>, A)> {
    let meta = if to_plan {
        if let Some(hit) = table.lookup(&meta) {
            return Ok(hit);
        }
        over_planning_defaults(meta)?
    } else {
        meta
    };
    let reference = meta.shape() == NodeShape::Map && meta.field("version").is_none();
    let raw = match meta {
        WireValue::Map(mut entries) => {
            entries.retain(|(k, _)| k != "block_ids");
            WireValue::Map(entries)
        }
        other => other,
    };
    if let Some(hit) = table.lookup(&raw) {
        return Ok(hit);
    }
    let schema = if reference { refmeta::meta_from_reference(&raw, local)? } else { raw.clone() };
    table.adopt(raw, &schema, |m| attach(m, &schema))
}

/// `meta` (a dict) over [`planning_defaults`]: its own fields win.
fn over_planning_defaults(meta: WireValue) -> DisaggResult<WireValue> {
    let WireValue::Map(given) = meta else {
        let got = meta.type_name();
        return Err(DisaggError::wire(
            "peer_meta",
            format!("peer metadata must be a dict, got {got}"),
        ));
    };
    let mut full = planning_entries();
    for (k, v) in given {
        match full.iter_mut().find(|(have, _)| *have == k) {
            Some(slot) => slot.1 = v,
            None => full.push((k, v)),
        }
    }
    Ok(WireValue::Map(full))
}

/// The transport fields a metadata dict is planned with where it carries none of its own (a
/// sibling's or this rank's metadata, derived without the transport's registration): no agent
/// blob, no staging pool, process rank 0.
pub fn planning_defaults() -> WireValue {
    WireValue::Map(planning_entries())
}

fn planning_entries() -> Vec<(String, WireValue)> {
    vec![
        ("agent_metadata".to_owned(), WireValue::Str(String::new())),
        ("staging".to_owned(), WireValue::Null),
        ("dist_rank".to_owned(), WireValue::Int(0)),
    ]
}

/// Whether a handoff has nothing to move: every block id list given (`None`s skipped; a
/// per-rank map counts all its lists) is empty. `counts` holds each argument's list lengths.
pub fn nothing_to_move(counts: &[Vec<usize>]) -> bool {
    counts.iter().flatten().all(|&n| n == 0)
}

/// Objects remembered by identity (`id`) with what was derived from them, up to `limit`
/// entries; past it the memo starts again.
#[derive(Debug)]
pub struct IdentityMemo<V> {
    entries: HashMap<usize, V>,
    limit: usize,
}

impl<V> IdentityMemo<V> {
    /// An empty memo of at most `limit` entries.
    pub fn new(limit: usize) -> Self {
        Self { entries: HashMap::new(), limit }
    }

    /// The entry of `id` if `still` says it still describes the object now under that id.
    pub fn get(&self, id: usize, still: impl FnOnce(&V) -> bool) -> Option<&V> {
        self.entries.get(&id).filter(|v| still(v))
    }

    /// Remember `value` for `id` (a full memo is emptied first).
    pub fn insert(&mut self, id: usize, value: V) {
        if self.entries.len() >= self.limit {
            self.entries.clear();
        }
        self.entries.insert(id, value);
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The outcome of a two-sided transfer once every part completed: the first failure, in this
/// order: the posting's own, a work's, a transfer thread's; `None` (the scatters may run)
/// when there is none.
pub fn p2p_outcome(
    posted: Option<String>,
    works: Vec<Option<String>>,
    threads: Vec<String>,
) -> Option<String> {
    posted.or_else(|| works.into_iter().flatten().next()).or_else(|| threads.into_iter().next())
}

/// Where a pollable transfer stands after one poll.
#[derive(Clone, Debug, PartialEq)]
pub enum PollVerdict {
    /// Parts are still running and the deadline has not passed.
    Running,
    /// Every part is terminal and none failed.
    Done,
    /// Every part is terminal and one failed: its error.
    Failed(String),
    /// The deadline passed with parts still running (they may still write).
    TimedOut(String),
}

/// The verdict of one poll at `now` of a transfer due by `deadline`, `timeout_s` after its
/// submission: terminal (`done`) with or without an `error`, or running, timed out once `now`
/// is past the deadline. A terminal transfer never times out.
pub fn poll_verdict(done: bool, error: Option<String>, now: f64, due: (f64, f64)) -> PollVerdict {
    let (deadline, timeout_s) = due;
    match (done, error) {
        (true, Some(e)) => PollVerdict::Failed(e),
        (true, None) => PollVerdict::Done,
        (false, _) if now > deadline => PollVerdict::TimedOut(format!(
            "transfer not finished {timeout_s:.3} s after submission; its destinations may \
             still be written"
        )),
        (false, _) => PollVerdict::Running,
    }
}

/// A peer of a two-sided handoff as its messages need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessagePeer {
    /// The peer's global rank.
    pub global_rank: u32,
    /// Its rank in the process group.
    pub dist_rank: u64,
    /// Its incarnation (what its headers say).
    pub incarnation: u64,
}

/// The receives of a destination: one per source rank of its program (`(rank, packed bytes)`
/// in plan order) that sends bytes, with that rank's peer, and the tag they travel on
/// ([`wire_tag`] of the handoff's `tag`). A source rank no peer names is a `Wire` error on
/// `peer_meta`.
pub fn p2p_receives(
    sources: &[(u32, u64)],
    peers: &[MessagePeer],
    (tag, match_by_order): (u64, bool),
) -> DisaggResult<(i64, Vec<(MessagePeer, u64)>)> {
    let mut out = Vec::new();
    for &(rank, nbytes) in sources {
        let peer = peers.iter().find(|p| p.global_rank == rank).ok_or_else(|| {
            DisaggError::wire(
                "peer_meta",
                format!("the plan reads source rank {rank} but no metadata names it"),
            )
        })?;
        if nbytes > 0 {
            out.push((*peer, nbytes));
        }
    }
    Ok((wire_tag(tag, match_by_order)?, out))
}

/// The sends of source rank `me`: for each destination's program (its source ranks with
/// their packed bytes), the destination's index and the bytes `me` sends it; destinations
/// that read nothing from `me` get no message.
pub fn p2p_sends(me: u32, programs: &[Vec<(u32, u64)>]) -> Vec<(usize, u64)> {
    programs
        .iter()
        .enumerate()
        .filter_map(|(i, srcs)| srcs.iter().find(|(r, _)| *r == me).map(|&(_, n)| (i, n)))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// One message a source sends: `(destination index, packed bytes, header)`.
pub type SendMessage = (usize, u64, Vec<u8>);

/// [`p2p_sends`] with each message's header (`p2p_header::encode_headers` of one message of
/// `kind`): `(destination index, packed bytes, header)`, and the tag they travel on
/// ([`wire_tag`]).
pub fn p2p_send_messages(
    me: u32,
    programs: &[Vec<(u32, u64)>],
    kind: MessageKind,
    (tag, incarnation): (u64, u64),
    match_by_order: bool,
) -> DisaggResult<(i64, Vec<SendMessage>)> {
    let sends = p2p_sends(me, programs)
        .into_iter()
        .map(|(i, n)| Ok((i, n, encode_headers(kind, tag, incarnation, &[n])?)))
        .collect::<DisaggResult<_>>()?;
    Ok((wire_tag(tag, match_by_order)?, sends))
}

impl MetaNode for WireValue {
    fn shape(&self) -> NodeShape {
        match self {
            Self::Map(_) => NodeShape::Map,
            Self::Null => NodeShape::Null,
            Self::Str(_) | Self::Bytes(_) => NodeShape::Text,
            _ => NodeShape::Seq,
        }
    }
    fn field(&self, key: &str) -> Option<Self> {
        match self {
            Self::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone()),
            _ => None,
        }
    }
    fn rank_entry(&self, rank: u32) -> Option<Self> {
        self.field(&rank.to_string())
    }
    fn elements(&self) -> Option<Vec<Self>> {
        match self {
            Self::List(items) => Some(items.clone()),
            _ => None,
        }
    }
    fn type_name(&self) -> String {
        WireValue::type_name(self).to_owned()
    }
}

#[cfg(test)]
#[path = "backend_peers_tests.rs"]
mod tests;
