//! The source lease of an import, on a virtual clock: an import never starts, becomes ready or
//! is admitted at or past the local time at which its source may reuse the blocks it reads.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use disagg_core::{
    DisaggError, FailReason, ImportLedger, ImportLedgerConfig, ImportRequest, LedgerAction,
    RankOutcome, SourceLease,
};
use proptest::prelude::*;

const BS: u32 = 4;
const SKEW: u64 = 10;

fn ledger(num_blocks: u32) -> ImportLedger {
    let cfg = ImportLedgerConfig { clock_offset_bound: SKEW, ..ImportLedgerConfig::default() };
    ImportLedger::new(num_blocks, BS, 0, cfg).unwrap()
}

/// A request of `n` tokens whose source lease ends `lease_left` after `now_wall` (source clock).
fn req(rid: u64, n: u32, deadline: u64, lease_left: Option<u64>) -> ImportRequest {
    ImportRequest {
        request_id: rid,
        num_prompt_tokens: n,
        prompt_hashes: Vec::new(),
        src_block_ids: (0..n.div_ceil(BS)).collect(),
        src_block_size_tokens: BS,
        resume_tokens: 1,
        has_ssm: false,
        finished: false,
        deadline,
        reuse_align_tokens: 1,
        source_lease: lease_left
            .map(|left| SourceLease { until_wall: 5_000 + left, now_wall: 5_000 }),
    }
}

fn epoch_of_start(acts: &[LedgerAction]) -> u64 {
    match acts {
        [LedgerAction::StartImport(s)] => s.epoch,
        other => panic!("expected one start, got {other:?}"),
    }
}

fn fail_reason(acts: &[LedgerAction]) -> Option<FailReason> {
    acts.iter().find_map(|a| match a {
        LedgerAction::Fail { reason, .. } => Some(*reason),
        _ => None,
    })
}

#[test]
fn a_lease_with_no_time_left_after_the_clock_offset_bound_is_refused_and_changes_nothing() {
    let mut l = ledger(8);
    let err = l.submit(req(1, 8, 1_000, Some(SKEW)), 0).unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "lease_until_wall"));
    assert!(err.to_string().contains("clock_offset_bound=10"), "{err}");
    assert_eq!((l.pending_kv_import_count(), l.pool().num_free()), (0, 8));
    // A lease already ended by the source's clock (until < now_wall) is refused the same way.
    let mut r = req(1, 8, 1_000, None);
    r.source_lease = Some(SourceLease { until_wall: 4, now_wall: 5 });
    assert!(l.submit(r, 0).is_err());
    l.check().unwrap();
}

#[test]
fn a_read_completed_past_the_lease_fails_instead_of_becoming_ready() {
    let mut l = ledger(8);
    // 50 left by the source's clock, less the 10 of clock offset: local lease deadline 100+40.
    let e = epoch_of_start(&l.submit(req(1, 8, 10_000, Some(50)), 100).unwrap());
    let out = l.report(1, e, 0, RankOutcome::Ok, 140).unwrap();
    assert_eq!(fail_reason(&out), Some(FailReason::LeaseExpired));
    assert_eq!((l.num_ready(), l.pool().num_free(), l.counters().lease_expired), (0, 8, 1));
    assert!(l.admit(4, Some(141)).unwrap().is_empty());
    l.check().unwrap();
}

#[test]
fn a_ready_import_is_admitted_only_with_a_clock_reading_before_the_lease() {
    let mut l = ledger(8);
    let e = epoch_of_start(&l.submit(req(1, 8, 10_000, Some(50)), 100).unwrap());
    assert!(l.report(1, e, 0, RankOutcome::Ok, 120).unwrap().is_empty());
    // Without a clock the ledger cannot prove the lease holds: the import waits.
    assert!(l.admit(4, None).unwrap().is_empty());
    assert_eq!(l.num_ready(), 1);
    // The loop stalled (a stopped process): the next clock reading is past the lease.
    let out = l.admit(4, Some(140)).unwrap();
    assert_eq!(fail_reason(&out), Some(FailReason::LeaseExpired));
    assert!(!out.iter().any(|a| matches!(a, LedgerAction::Admit { .. })));
    // Its blocks went back to the pool and not to the prefix cache.
    assert_eq!(l.pool().num_free(), 8);
    l.check().unwrap();
}

#[test]
fn a_ready_import_within_its_lease_is_admitted() {
    let mut l = ledger(8);
    let e = epoch_of_start(&l.submit(req(1, 8, 10_000, Some(50)), 100).unwrap());
    l.report(1, e, 0, RankOutcome::Ok, 120).unwrap();
    let out = l.admit(4, Some(139)).unwrap();
    assert!(matches!(out.as_slice(), [LedgerAction::Admit { request_id: 1, .. }]), "{out:?}");
    l.check().unwrap();
}

#[test]
fn poll_fails_an_import_at_its_lease_even_before_its_deadline() {
    let mut l = ledger(8);
    let e = epoch_of_start(&l.submit(req(1, 8, 10_000, Some(50)), 100).unwrap());
    assert!(l.poll(139).unwrap().is_empty());
    let out = l.poll(140).unwrap();
    assert!(
        matches!(
            out.as_slice(),
            [LedgerAction::Fail { reason: FailReason::LeaseExpired, quarantined: true, .. }]
        ),
        "{out:?}"
    );
    // The read may still write: the destinations stay quarantined until it settles.
    assert_eq!(l.num_quarantined(), 1);
    l.settle(1, e).unwrap();
    assert_eq!(l.pool().num_free(), 8);
    l.check().unwrap();
}

#[test]
fn a_deferred_import_whose_lease_passed_never_starts() {
    let mut l = ledger(3);
    // Request 1 takes all 3 blocks; request 2 waits for capacity with a short lease.
    let e1 = epoch_of_start(&l.submit(req(1, 8, 10_000, None), 0).unwrap());
    assert!(l.submit(req(2, 8, 10_000, Some(30)), 0).unwrap().is_empty());
    // Request 1 fails (blocks back) after request 2's lease (local deadline 20) passed: 2 fails
    // too, and its reads are never posted.
    let out = l.report(1, e1, 0, RankOutcome::Error, 25).unwrap();
    assert!(
        out.iter().any(|a| matches!(
            a,
            LedgerAction::Fail { request_id: 2, reason: FailReason::LeaseExpired, .. }
        )),
        "{out:?}"
    );
    assert!(!out.iter().any(|a| matches!(a, LedgerAction::StartImport(_))), "{out:?}");
    assert_eq!(l.pool().num_free(), 3);
    l.check().unwrap();
}

#[derive(Debug, Clone)]
enum Ev {
    Submit { n: u32, lease_left: u64 },
    Advance(u64),
    Complete(usize),
    Admit,
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        (1u32..12, 0u64..80).prop_map(|(n, lease_left)| Ev::Submit { n, lease_left }),
        (0u64..30).prop_map(Ev::Advance),
        (0usize..8).prop_map(Ev::Complete),
        Just(Ev::Admit),
    ]
}

proptest! {
    /// Oracle: the local lease deadline of request r is submit time + lease_left - SKEW. No
    /// start, ready-making report or admission ever happens at or past it.
    #[test]
    fn nothing_starts_or_is_admitted_at_or_past_its_source_lease(
        evs in proptest::collection::vec(ev(), 1..60)
    ) {
        let mut l = ledger(6);
        let mut now = 0u64;
        let mut next = 1u64;
        let mut lease_at = std::collections::BTreeMap::new();
        let mut started: Vec<(u64, u64)> = Vec::new();
        for e in evs {
            let acts = match e {
                Ev::Submit { n, lease_left } => {
                    let rid = next;
                    next += 1;
                    if let Ok(a) = l.submit(req(rid, n, now + 1_000, Some(lease_left)), now) {
                        prop_assert!(lease_left > SKEW);
                        lease_at.insert(rid, now + lease_left - SKEW);
                        a
                    } else {
                        prop_assert!(lease_left <= SKEW);
                        Vec::new()
                    }
                }
                Ev::Advance(dt) => {
                    now += dt;
                    l.poll(now).unwrap()
                }
                Ev::Complete(i) => match started.get(i % started.len().max(1)).copied() {
                    Some((rid, ep)) => l.report(rid, ep, 0, RankOutcome::Ok, now).unwrap(),
                    None => Vec::new(),
                },
                Ev::Admit => l.admit(8, Some(now)).unwrap(),
            };
            for a in &acts {
                match a {
                    LedgerAction::StartImport(s) => {
                        prop_assert!(now < lease_at[&s.request_id], "start past lease");
                        started.push((s.request_id, s.epoch));
                    }
                    LedgerAction::Admit { request_id, .. } => {
                        prop_assert!(now < lease_at[request_id], "admitted past lease");
                    }
                    LedgerAction::Fail { request_id, reason: FailReason::LeaseExpired, .. } => {
                        prop_assert!(now >= lease_at[request_id], "failed before its lease");
                    }
                    _ => {}
                }
            }
            l.check().unwrap();
        }
    }
}

#[test]
fn named_counters_list_every_counter_once_under_its_own_name() {
    let mut l = ledger(8);
    for (rid, lease) in [(1, Some(50)), (2, None)] {
        l.submit(req(rid, 8, 10_000, lease), 100).unwrap();
    }
    l.abort(2, 120).unwrap();
    let c = l.counters();
    let named = std::collections::BTreeMap::from(c.named());
    assert_eq!(named.len(), c.named().len(), "a name is listed twice");
    assert_eq!(
        (named["submitted"], named["started"], named["lease_expired"], named["failed"]),
        (c.submitted, c.started, c.lease_expired, c.failed)
    );
    assert_eq!(named.values().sum::<u64>(), c.named().iter().map(|(_, v)| v).sum::<u64>());
    let pins = disagg_core::ledger::PinCounters {
        pinned: 1,
        released: 2,
        expired: 3,
        ignored_messages: 4,
    };
    assert_eq!(
        pins.named(),
        [("pinned", 1), ("released", 2), ("expired", 3), ("ignored_messages", 4)]
    );
}

#[test]
fn a_lease_states_both_clocks_or_neither() {
    assert_eq!(SourceLease::pair(None, None).unwrap(), None);
    assert_eq!(
        SourceLease::pair(Some(9), Some(4)).unwrap(),
        Some(SourceLease { until_wall: 9, now_wall: 4 })
    );
    for (u, w) in [(Some(9), None), (None, Some(4))] {
        let e = SourceLease::pair(u, w).unwrap_err();
        assert!(matches!(&e, DisaggError::Argument { field, .. } if field == "lease_until_wall"));
        assert!(e.to_string().contains("together or neither"), "{e}");
    }
}

#[test]
fn a_prompt_is_its_tokens_hashed_here_or_its_length_alone_never_both() {
    let l = ledger(8);
    let tokens: Vec<i64> = (0..9).collect();
    let hashed = l.pool().block_hashes(&tokens).unwrap();
    assert_eq!(hashed.len(), 2);
    assert_eq!(l.prompt_facts(Some(&tokens), None, None).unwrap(), (9, hashed));
    assert_eq!(l.prompt_facts(Some(&tokens), None, Some(vec![7])).unwrap(), (9, vec![7]));
    assert_eq!(l.prompt_facts(None, Some(5), None).unwrap(), (5, vec![]));
    assert_eq!(l.prompt_facts(None, Some(5), Some(vec![3])).unwrap(), (5, vec![3]));
    for (t, n) in [(Some(&tokens[..]), Some(9)), (None, None)] {
        let e = l.prompt_facts(t, n, None).unwrap_err();
        assert!(matches!(&e, DisaggError::Argument { field, .. } if field == "prompt_tokens"));
    }
}

#[test]
fn a_pull_ledger_never_names_started_pushes_and_a_push_ledger_names_each_once() {
    let none = Vec::<(u64, u64)>::new();
    let mut pull = ledger(8);
    epoch_of_start(&pull.submit(req(1, 8, 1_000, None), 0).unwrap());
    assert_eq!(pull.drain_started_pushes(), none);
    // Push: the first import starts on arrival, the second waits for its blocks.
    let cfg = ImportLedgerConfig { pull: false, ..ImportLedgerConfig::default() };
    let mut push = ImportLedger::new(3, BS, 0, cfg).unwrap();
    let first = epoch_of_start(&push.submit(req(1, 8, 1_000, None), 0).unwrap());
    assert!(push.submit(req(2, 8, 1_000, None), 0).unwrap().is_empty());
    assert_eq!(push.drain_started_pushes(), vec![(1, first)]);
    assert_eq!(push.drain_started_pushes(), none);
    // The first one fails: its blocks free up and the deferred one starts.
    push.abort(1, 1).unwrap();
    push.settle(1, first).unwrap();
    push.poll(2).unwrap();
    let second = push.epoch_of(2).unwrap();
    assert_eq!(push.drain_started_pushes(), vec![(2, second)]);
    push.abort(2, 3).unwrap();
    push.settle(2, second).unwrap();
    // One that started and failed before the drain is still named while its receives may be
    // posted (quarantined): its source must answer them.
    let third = epoch_of_start(&push.submit(req(3, 8, 1_000, None), 4).unwrap());
    push.abort(3, 5).unwrap();
    assert_eq!(push.drain_started_pushes(), vec![(3, third)]);
    push.settle(3, third).unwrap();
    // Once its receives are quiet again, it is not.
    let fourth = epoch_of_start(&push.submit(req(4, 8, 1_000, None), 6).unwrap());
    push.abort(4, 7).unwrap();
    push.settle(4, fourth).unwrap();
    assert_eq!(push.drain_started_pushes(), none);
    push.check().unwrap();
}

#[test]
fn a_quarantine_whose_receives_cannot_be_cancelled_is_held_past_its_horizon() {
    let cfg =
        ImportLedgerConfig { pull: false, drain_horizon: 10, ..ImportLedgerConfig::default() };
    let mut push = ImportLedger::new(3, BS, 0, cfg).unwrap();
    let epoch = epoch_of_start(&push.submit(req(1, 8, 1_000, None), 0).unwrap());
    push.abort(1, 1).unwrap();
    assert_eq!(push.quarantine_due(11), vec![(1, epoch)]);
    // Held: the horizon poll keeps its blocks, until it settles.
    assert!(!push.hold_quarantine(1, epoch, false, 11));
    assert!(push.hold_quarantine(1, epoch, true, 11));
    assert!(push.quarantine_due(12).is_empty());
    assert!(push.poll(12).unwrap().is_empty());
    assert_eq!(push.num_quarantined(), 1);
    assert_eq!(push.counters().quarantine_held, 1);
    push.settle(1, epoch).unwrap();
    assert_eq!(push.num_quarantined(), 0);
    assert!(!push.hold_quarantine(1, epoch, true, 13));
    push.check().unwrap();
}
