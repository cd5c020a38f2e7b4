//! proptest-state-machine: `ImportLedger` against an independent reference model.
//!
//! The reference model keeps only counts (free blocks, free slots), per-request phases and the
//! quarantine (the ledger's FIFO queues are views of the phases: deferred requests in
//! submission order, ready ones in the order they became ready), and predicts the exact action
//! list (or error kind) of every event. Push mode (no prefix trimming) keeps the block arithmetic of the model exact.
// The model mirrors the whole event table in one match on purpose: it reads as a spec.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines, missing_docs)]

use std::collections::BTreeMap;

use disagg_core::{
    DisaggError, ImportLedger, ImportLedgerConfig, ImportRequest, LedgerAction, RankOutcome,
};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

#[macro_use]
mod common;
use common::{assert_matches_model, by_epoch, BLOCKS, SLOTS};

const BS: u32 = 4;
const WORLD: u32 = 2;
const HORIZON: u64 = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bad {
    SrcLen,
    Deadline,
    ZeroTokens,
}

#[derive(Debug, Clone)]
enum Tr {
    Submit {
        rid: u64,
        n: u32,
        resume: u32,
        ssm: bool,
        finished: bool,
        ttl: u64,
        bad: Option<Bad>,
    },
    Report {
        pick: usize,
        stale: bool,
        rank: u32,
        outcome: RankOutcome,
    },
    Settle {
        pick: usize,
    },
    Abort {
        rid: u64,
    },
    Advance {
        dt: u64,
    },
    Admit {
        room: u32,
    },
    Finish {
        pick: usize,
    },
    /// The engine allocates blocks of its own (capacity shrinks until it releases them).
    EngineAlloc {
        n: u32,
    },
    Reset,
}

/// The compact, comparable form of a ledger action.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Act {
    Start(u64),
    Admit(u64),
    Complete(u64),
    Fail(u64, &'static str, bool),
    Release(u64, &'static str),
}

fn compact(a: &LedgerAction) -> Act {
    match a {
        LedgerAction::StartImport(s) => Act::Start(s.request_id),
        LedgerAction::Admit { request_id, .. } => Act::Admit(*request_id),
        LedgerAction::CompleteWithoutForward { request_id, .. } => Act::Complete(*request_id),
        LedgerAction::Fail { request_id, reason, quarantined, .. } => {
            Act::Fail(*request_id, reason.name(), *quarantined)
        }
        LedgerAction::Released { request_id, cause, .. } => Act::Release(*request_id, cause.name()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    Running,
    Quiet,
    MayWrite,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Deferred,
    Importing {
        local: Local,
        reports: Vec<Option<RankOutcome>>,
    },
    /// Every rank reported ok, as the `n`-th request to get there.
    Ready(u64),
}

#[derive(Debug, Clone)]
struct Req {
    epoch: u64,
    need: u32,
    ssm: bool,
    finished: bool,
    deadline: u64,
    phase: Phase,
}

#[derive(Debug, Clone)]
struct Quar {
    need: u32,
    ssm: bool,
    drain_at: u64,
    local_reported: bool,
}

#[derive(Debug, Clone)]
struct Model {
    now: u64,
    free_blocks: u32,
    free_slots: u32,
    next_epoch: u64,
    live: BTreeMap<u64, Req>,
    quarantine: BTreeMap<(u64, u64), Quar>,
    engine: Vec<(u32, bool)>,
    attempts: Vec<(u64, u64)>,
    /// How many requests have become ready so far.
    readied: u64,
    /// What the last transition must have produced.
    expect: Result<Vec<Act>, &'static str>,
}

reference_model!(
    ImportRef,
    Model {
        now: 0,
        free_blocks: BLOCKS,
        free_slots: SLOTS,
        next_epoch: 1,
        live: BTreeMap::new(),
        quarantine: BTreeMap::new(),
        engine: Vec::new(),
        attempts: Vec::new(),
        readied: 0,
        expect: Ok(Vec::new()),
    },
    {
        let outcome = prop_oneof![
            4 => Just(RankOutcome::Ok),
            1 => Just(RankOutcome::Error),
            1 => Just(RankOutcome::Timeout),
            1 => Just(RankOutcome::MayStillWrite),
        ];
        let bad = prop_oneof![
            6 => Just(None),
            1 => Just(Some(Bad::SrcLen)),
            1 => Just(Some(Bad::Deadline)),
            1 => Just(Some(Bad::ZeroTokens)),
        ];
        prop_oneof![
            4 => (1u64..6, 1u32..36, 0u32..4, any::<bool>(), prop::bool::weighted(0.2), 1u64..60, bad)
                .prop_map(|(rid, n, resume, ssm, finished, ttl, bad)| Tr::Submit { rid, n, resume, ssm, finished, ttl, bad }),
            6 => (any::<usize>(), prop::bool::weighted(0.1), 0..WORLD, outcome)
                .prop_map(|(pick, stale, rank, outcome)| Tr::Report { pick, stale, rank, outcome }),
            1 => any::<usize>().prop_map(|pick| Tr::Settle { pick }),
            1 => (0u64..7).prop_map(|rid| Tr::Abort { rid }),
            2 => (0u64..25).prop_map(|dt| Tr::Advance { dt }),
            2 => (0u32..3).prop_map(|room| Tr::Admit { room }),
            1 => any::<usize>().prop_map(|pick| Tr::Finish { pick }),
            1 => (0u32..5).prop_map(|n| Tr::EngineAlloc { n }),
            1 => Just(Tr::Reset),
        ]
    }
);

impl Model {
    /// The deferred requests, first submitted (smallest epoch) first.
    fn deferred(&self) -> Vec<u64> {
        let deferred = self.live.iter().filter(|(_, r)| r.phase == Phase::Deferred);
        by_epoch(deferred.map(|(rid, r)| (r.epoch, *rid)))
    }

    /// The ready requests, first to become ready first.
    fn ready(&self) -> Vec<u64> {
        let mut ready: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter_map(|(rid, r)| match r.phase {
                Phase::Ready(n) => Some((n, *rid)),
                _ => None,
            })
            .collect();
        ready.sort_unstable();
        ready.into_iter().map(|(_, rid)| rid).collect()
    }

    fn drain(&mut self, out: &mut Vec<Act>) {
        for rid in self.deferred() {
            let r = &self.live[&rid];
            if r.need > self.free_blocks || (r.ssm && self.free_slots == 0) {
                break;
            }
            self.free_blocks -= r.need;
            self.free_slots -= u32::from(r.ssm);
            let r = self.live.get_mut(&rid).unwrap();
            r.phase =
                Phase::Importing { local: Local::Running, reports: vec![None; WORLD as usize] };
            out.push(Act::Start(rid));
        }
    }

    fn give_back(&mut self, need: u32, ssm: bool) {
        self.free_blocks += need;
        self.free_slots += u32::from(ssm);
    }

    fn fail(&mut self, rid: u64, reason: &'static str, out: &mut Vec<Act>) {
        let r = self.live.remove(&rid).unwrap();
        let (held, may_write, local_reported) = match &r.phase {
            Phase::Deferred => (false, false, false),
            Phase::Ready(_) => (true, false, false),
            Phase::Importing { local, .. } => {
                (true, *local != Local::Quiet, *local == Local::MayWrite)
            }
        };
        if may_write {
            let q = Quar { need: r.need, ssm: r.ssm, drain_at: self.now + HORIZON, local_reported };
            self.quarantine.insert((rid, r.epoch), q);
        } else if held {
            self.give_back(r.need, r.ssm);
        }
        out.push(Act::Fail(rid, reason, may_write));
    }

    fn release_quarantine(&mut self, key: (u64, u64), cause: &'static str, out: &mut Vec<Act>) {
        let q = self.quarantine.remove(&key).unwrap();
        self.give_back(q.need, q.ssm);
        out.push(Act::Release(key.0, cause));
    }

    fn step(&mut self, t: &Tr) -> Result<Vec<Act>, &'static str> {
        let mut out = Vec::new();
        match *t {
            Tr::Submit { rid, n, resume, ssm, finished, ttl, bad } => {
                if self.live.contains_key(&rid) {
                    return Err("DuplicateRequest");
                }
                match bad {
                    Some(Bad::ZeroTokens | Bad::Deadline) => return Err("Argument"),
                    Some(Bad::SrcLen) => return Err("Block"),
                    None => {}
                }
                let need = (n + resume).div_ceil(BS);
                if need > BLOCKS {
                    return Err("Capacity");
                }
                let epoch = self.next_epoch;
                self.next_epoch += 1;
                self.attempts.push((rid, epoch));
                let deadline = self.now + ttl;
                self.live.insert(
                    rid,
                    Req { epoch, need, ssm, finished, deadline, phase: Phase::Deferred },
                );
                self.drain(&mut out);
            }
            Tr::Report { pick, stale, rank, outcome } => {
                let Some(&(rid, e)) = self.attempts.get(pick % self.attempts.len().max(1)) else {
                    return Ok(out);
                };
                let epoch = if stale { e + 1000 } else { e };
                if let Some(q) = self.quarantine.get_mut(&(rid, epoch)) {
                    if rank == 0 && !q.local_reported {
                        q.local_reported = true;
                        if outcome.is_quiet() {
                            self.release_quarantine((rid, epoch), "settled", &mut out);
                            self.drain(&mut out);
                        }
                    }
                    return Ok(out);
                }
                let Some(r) = self.live.get_mut(&rid) else { return Ok(out) };
                if r.epoch != epoch {
                    return Ok(out);
                }
                let Phase::Importing { local, reports } = &mut r.phase else {
                    // Ready: every rank already reported ok; Deferred: not started.
                    if matches!(r.phase, Phase::Ready(_)) && outcome != RankOutcome::Ok {
                        return Err("State");
                    }
                    return Ok(out);
                };
                match reports[rank as usize] {
                    Some(prev) if prev == outcome => return Ok(out),
                    Some(_) => return Err("State"),
                    None => {}
                }
                reports[rank as usize] = Some(outcome);
                if rank == 0 {
                    *local = if outcome.is_quiet() { Local::Quiet } else { Local::MayWrite };
                }
                if outcome != RankOutcome::Ok {
                    let reason =
                        if outcome == RankOutcome::Error { "rank_error" } else { "rank_timeout" };
                    self.fail(rid, reason, &mut out);
                    self.drain(&mut out);
                } else if reports.iter().all(|x| *x == Some(RankOutcome::Ok)) {
                    r.phase = Phase::Ready(self.readied);
                    self.readied += 1;
                }
            }
            Tr::Settle { pick } => {
                if let Some(&key) = self.attempts.get(pick % self.attempts.len().max(1)) {
                    if self.quarantine.contains_key(&key) {
                        self.release_quarantine(key, "settled", &mut out);
                        self.drain(&mut out);
                    }
                }
            }
            Tr::Abort { rid } => {
                if self.live.contains_key(&rid) {
                    self.fail(rid, "aborted", &mut out);
                    self.drain(&mut out);
                }
            }
            Tr::Advance { dt } => {
                self.now += dt;
                let due = self.live.iter().filter(|(_, r)| r.deadline <= self.now);
                for rid in by_epoch(due.map(|(rid, r)| (r.epoch, *rid))) {
                    self.fail(rid, "deadline", &mut out);
                }
                let drained: Vec<(u64, u64)> = self
                    .quarantine
                    .iter()
                    .filter(|(_, q)| q.drain_at <= self.now)
                    .map(|(k, _)| *k)
                    .collect();
                for key in drained {
                    self.release_quarantine(key, "horizon", &mut out);
                }
                self.drain(&mut out);
            }
            Tr::Admit { room } => {
                let mut room = room;
                for rid in self.ready() {
                    let r = &self.live[&rid];
                    if !r.finished && room == 0 {
                        break;
                    }
                    let r = self.live.remove(&rid).unwrap();
                    if r.finished {
                        self.give_back(r.need, r.ssm);
                        out.push(Act::Complete(rid));
                    } else {
                        room -= 1;
                        self.engine.push((r.need, r.ssm));
                        out.push(Act::Admit(rid));
                    }
                }
                self.drain(&mut out);
            }
            Tr::Finish { pick } => {
                if !self.engine.is_empty() {
                    let (need, ssm) = self.engine.remove(pick % self.engine.len());
                    self.give_back(need, ssm);
                }
            }
            Tr::EngineAlloc { n } => {
                if n > self.free_blocks {
                    return Err("Capacity");
                }
                self.free_blocks -= n;
                self.engine.push((n, false));
            }
            Tr::Reset => {
                let busy = self.live.values().any(|r| matches!(&r.phase, Phase::Importing { local, .. } if *local != Local::Quiet));
                if busy || !self.quarantine.is_empty() {
                    return Err("ResetRefused");
                }
                for rid in by_epoch(self.live.iter().map(|(rid, r)| (r.epoch, *rid))) {
                    self.fail(rid, "reset", &mut out);
                }
            }
        }
        Ok(out)
    }
}

struct Sut {
    ledger: ImportLedger,
    engine: Vec<(Vec<u32>, Option<u32>)>,
}

fn sut_step(s: &mut Sut, m: &Model, t: &Tr) -> Result<Vec<LedgerAction>, DisaggError> {
    let now = m.now;
    match *t {
        Tr::Submit { rid, n, resume, ssm, finished, ttl, bad } => {
            let n = if bad == Some(Bad::ZeroTokens) { 0 } else { n };
            let mut src: Vec<u32> = (0..n.div_ceil(BS)).collect();
            if bad == Some(Bad::SrcLen) {
                src.push(0);
            }
            let deadline = if bad == Some(Bad::Deadline) { now } else { now + ttl };
            let req = ImportRequest {
                request_id: rid,
                num_prompt_tokens: n,
                prompt_hashes: Vec::new(),
                src_block_ids: src,
                src_block_size_tokens: BS,
                resume_tokens: resume,
                has_ssm: ssm,
                finished,
                deadline,
                reuse_align_tokens: 1,
                source_lease: None,
            };
            s.ledger.submit(req, now)
        }
        Tr::Report { pick, stale, rank, outcome } => {
            // `m` is the state after the transition; attempts only grow on submit.
            let Some(&(rid, e)) = m.attempts.get(pick % m.attempts.len().max(1)) else {
                return Ok(Vec::new());
            };
            s.ledger.report(rid, if stale { e + 1000 } else { e }, rank, outcome, now)
        }
        Tr::Settle { pick } => match m.attempts.get(pick % m.attempts.len().max(1)) {
            Some(&(rid, e)) => s.ledger.settle(rid, e),
            None => Ok(Vec::new()),
        },
        Tr::Abort { rid } => s.ledger.abort(rid, now),
        Tr::Advance { .. } => s.ledger.poll(now),
        Tr::Admit { room } => s.ledger.admit(room, Some(now)),
        Tr::Finish { pick } => {
            if !s.engine.is_empty() {
                let (blocks, slot) = s.engine.remove(pick % s.engine.len());
                s.ledger.pool_mut().release(&blocks)?;
                if let Some(x) = slot {
                    s.ledger.slots_mut().free(x)?;
                }
            }
            Ok(Vec::new())
        }
        Tr::EngineAlloc { n } => {
            let blocks = s.ledger.pool_mut().allocate(n)?;
            s.engine.push((blocks, None));
            Ok(Vec::new())
        }
        Tr::Reset => s.ledger.reset(now),
    }
}

struct ImportTest;

impl StateMachineTest for ImportTest {
    type SystemUnderTest = Sut;
    type Reference = ImportRef;

    fn init_test(_: &Model) -> Sut {
        let cfg = ImportLedgerConfig {
            world_size: WORLD,
            rank: 0,
            pull: false,
            lookahead_tokens: 0,
            drain_horizon: HORIZON,
            clock_offset_bound: 0,
        };
        Sut { ledger: ImportLedger::new(BLOCKS, BS, SLOTS, cfg).unwrap(), engine: Vec::new() }
    }

    fn apply(mut s: Sut, m: &Model, t: Tr) -> Sut {
        let got = sut_step(&mut s, m, &t);
        assert_matches_model(&got, &m.expect, |acts| acts.iter().map(compact).collect(), &t);
        // A push ledger names every import this step started whose receives are still
        // posted: in flight, or failed into quarantine.
        let posted = |key: &(u64, u64)| {
            m.quarantine.contains_key(key)
                || m.live
                    .get(&key.0)
                    .is_some_and(|r| r.epoch == key.1 && matches!(r.phase, Phase::Importing { .. }))
        };
        let started: Vec<(u64, u64)> = got
            .iter()
            .flatten()
            .filter_map(|a| match a {
                LedgerAction::StartImport(st) => Some((st.request_id, st.epoch)),
                _ => None,
            })
            .filter(posted)
            .collect();
        assert_eq!(s.ledger.drain_started_pushes(), started, "after {t:?}");
        for a in got.iter().flatten() {
            if let LedgerAction::Admit { block_ids, ssm_slot, .. } = a {
                s.engine.push((block_ids.clone(), *ssm_slot));
            }
        }
        s
    }

    fn check_invariants(s: &Sut, m: &Model) {
        let l = &s.ledger;
        l.check().unwrap();
        // Conservation: free + owned (live, engine) + quarantined == pool size, blocks and slots.
        assert_eq!(l.pool().num_free(), m.free_blocks);
        assert_eq!(l.slots().num_free(), m.free_slots);
        let quarantined: u32 = m.quarantine.values().map(|q| q.need).sum();
        assert_eq!(l.num_quarantined_blocks() as u32, quarantined);
        assert_eq!(l.num_quarantined(), m.quarantine.len());
        assert_eq!(l.deferred_ids(), m.deferred());
        assert_eq!(l.pending_kv_import_count(), m.live.len());
        assert_eq!(l.num_ready(), m.ready().len());
        for (rid, r) in &m.live {
            let want = match r.phase {
                Phase::Deferred => "deferred",
                Phase::Importing { .. } => "importing",
                Phase::Ready(_) => "ready",
            };
            assert_eq!(l.state_of(*rid), Some(want));
            assert_eq!(l.epoch_of(*rid), Some(r.epoch));
        }
    }

    fn teardown(mut s: Sut, m: Model) {
        // With all handles terminal and no new input, everything drains.
        let keys: Vec<(u64, u64)> = m.quarantine.keys().copied().collect();
        for (rid, e) in keys {
            s.ledger.settle(rid, e).unwrap();
        }
        for rid in m.live.keys() {
            s.ledger.abort(*rid, m.now).unwrap();
        }
        s.ledger.poll(m.now + HORIZON).unwrap();
        for (blocks, slot) in s.engine.drain(..) {
            s.ledger.pool_mut().release(&blocks).unwrap();
            if let Some(x) = slot {
                s.ledger.slots_mut().free(x).unwrap();
            }
        }
        s.ledger.check().unwrap();
        assert_eq!(s.ledger.pool().num_free(), BLOCKS);
        assert_eq!(s.ledger.slots().num_free(), SLOTS);
        assert_eq!(s.ledger.num_quarantined(), 0);
        assert_eq!(s.ledger.pending_kv_import_count(), 0);
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn import_ledger_matches_its_reference_model(sequential 1..300 => ImportTest);
}

#[test]
fn a_source_without_a_block_size_shares_the_ledger_s() {
    let ledger = ImportLedger::new(BLOCKS, BS, SLOTS, ImportLedgerConfig::default()).unwrap();
    assert_eq!(ledger.src_block_size(None), BS);
    assert_eq!(ledger.src_block_size(Some(BS * 4)), BS * 4);
}
