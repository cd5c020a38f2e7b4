//! proptest-state-machine: `PinLedger` against a reference model of pins, pushes and leases.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;

use disagg_core::{LedgerAction, PinLedger};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

#[macro_use]
mod common;
use common::{assert_matches_model, by_epoch, BLOCKS, SLOTS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EpochArg {
    Omitted,
    Current,
    Stale,
}

#[derive(Debug, Clone)]
enum Tr {
    /// The prefill engine finishes a request of `n` blocks and pins them with a lease.
    Pin {
        rid: u64,
        n: u32,
        ssm: bool,
        ttl: u64,
    },
    Release {
        rid: u64,
        epoch: EpochArg,
    },
    Advance {
        dt: u64,
    },
    BeginPush {
        rid: u64,
    },
    PushSettled {
        rid: u64,
    },
    Reset,
}

#[derive(Debug, Clone)]
struct Pin {
    epoch: u64,
    n: u32,
    ssm: bool,
    lease: u64,
    pushing: bool,
    release_waiting: Option<&'static str>,
}

#[derive(Debug, Clone)]
struct Model {
    now: u64,
    next_epoch: u64,
    pins: BTreeMap<u64, Pin>,
    free_blocks: u32,
    free_slots: u32,
    expect: Result<Vec<(u64, &'static str)>, &'static str>,
}

reference_model!(
    PinRef,
    Model {
        now: 0,
        next_epoch: 1,
        pins: BTreeMap::new(),
        free_blocks: BLOCKS,
        free_slots: SLOTS,
        expect: Ok(Vec::new()),
    },
    {
        let epoch =
            prop_oneof![Just(EpochArg::Omitted), Just(EpochArg::Current), Just(EpochArg::Stale)];
        prop_oneof![
            3 => (1u64..6, 0u32..5, any::<bool>(), 0u64..40).prop_map(|(rid, n, ssm, ttl)| Tr::Pin { rid, n, ssm, ttl }),
            3 => (0u64..7, epoch).prop_map(|(rid, epoch)| Tr::Release { rid, epoch }),
            2 => (0u64..20).prop_map(|dt| Tr::Advance { dt }),
            1 => (0u64..7).prop_map(|rid| Tr::BeginPush { rid }),
            1 => (0u64..7).prop_map(|rid| Tr::PushSettled { rid }),
            1 => Just(Tr::Reset),
        ]
    }
);

impl Model {
    fn unpin_or_wait(&mut self, rid: u64, cause: &'static str, out: &mut Vec<(u64, &'static str)>) {
        let p = self.pins.get_mut(&rid).unwrap();
        if p.pushing {
            p.release_waiting.get_or_insert(cause);
            return;
        }
        let p = self.pins.remove(&rid).unwrap();
        self.free_blocks += p.n;
        self.free_slots += u32::from(p.ssm);
        out.push((rid, cause));
    }

    fn step(&mut self, t: &Tr) -> Result<Vec<(u64, &'static str)>, &'static str> {
        let mut out = Vec::new();
        match *t {
            Tr::Pin { rid, n, ssm, ttl } => {
                if n > self.free_blocks || (ssm && self.free_slots == 0) {
                    return Ok(out); // the engine could not even run this request
                }
                if self.pins.contains_key(&rid) {
                    return Err("DuplicateRequest");
                }
                if ttl == 0 {
                    return Err("Argument");
                }
                self.free_blocks -= n;
                self.free_slots -= u32::from(ssm);
                let epoch = self.next_epoch;
                self.next_epoch += 1;
                let pin = Pin {
                    epoch,
                    n,
                    ssm,
                    lease: self.now + ttl,
                    pushing: false,
                    release_waiting: None,
                };
                self.pins.insert(rid, pin);
            }
            Tr::Release { rid, epoch } => {
                if epoch != EpochArg::Stale && self.pins.contains_key(&rid) {
                    self.unpin_or_wait(rid, "release_kv", &mut out);
                }
            }
            Tr::Advance { dt } => {
                self.now += dt;
                let due = self.pins.iter().filter(|(_, p)| p.lease <= self.now);
                for rid in by_epoch(due.map(|(r, p)| (p.epoch, *r))) {
                    self.unpin_or_wait(rid, "lease_expired", &mut out);
                }
            }
            Tr::BeginPush { rid } => {
                if let Some(p) = self.pins.get_mut(&rid) {
                    if p.pushing {
                        return Err("State");
                    }
                    p.pushing = true;
                }
            }
            Tr::PushSettled { rid } => {
                if let Some(p) = self.pins.get_mut(&rid) {
                    if p.pushing {
                        p.pushing = false;
                        if let Some(cause) = p.release_waiting.take() {
                            self.unpin_or_wait(rid, cause, &mut out);
                        }
                    }
                }
            }
            Tr::Reset => {
                if self.pins.values().any(|p| p.pushing) {
                    return Err("ResetRefused");
                }
                for rid in by_epoch(self.pins.iter().map(|(r, p)| (p.epoch, *r))) {
                    self.unpin_or_wait(rid, "reset", &mut out);
                }
            }
        }
        Ok(out)
    }
}

struct PinTest;

fn sut_step(
    l: &mut PinLedger,
    m: &Model,
    t: &Tr,
) -> Result<Vec<LedgerAction>, disagg_core::DisaggError> {
    let epoch_of = |rid: u64, e: EpochArg, l: &PinLedger| match e {
        EpochArg::Omitted => None,
        EpochArg::Current => Some(l.epoch_of(rid).unwrap_or(0)),
        EpochArg::Stale => Some(l.epoch_of(rid).map_or(0, |x| x + 1000)),
    };
    match *t {
        Tr::Pin { rid, n, ssm, ttl } => {
            if !l.pool().can_allocate(n) || (ssm && l.slots().num_free() == 0) {
                return Ok(Vec::new());
            }
            let blocks = l.pool_mut().allocate(n)?;
            let slot = if ssm { Some(l.slots_mut().allocate()?) } else { None };
            let pinned = l.pin(rid, &blocks, slot, m.now + ttl, m.now);
            // The prefill request is finished either way: it drops its own references.
            l.pool_mut().release(&blocks)?;
            if pinned.is_err() {
                if let Some(s) = slot {
                    l.slots_mut().free(s)?;
                }
            }
            pinned.map(|_| Vec::new())
        }
        Tr::Release { rid, epoch } => {
            let e = epoch_of(rid, epoch, l);
            l.release(rid, e)
        }
        Tr::Advance { .. } => l.expire(m.now),
        Tr::BeginPush { rid } => {
            let e = l.epoch_of(rid).unwrap_or(0);
            l.begin_push(rid, e).map(|()| Vec::new())
        }
        Tr::PushSettled { rid } => {
            let e = l.epoch_of(rid).unwrap_or(0);
            l.push_settled(rid, e)
        }
        Tr::Reset => l.reset(),
    }
}

impl StateMachineTest for PinTest {
    type SystemUnderTest = PinLedger;
    type Reference = PinRef;

    fn init_test(_: &Model) -> PinLedger {
        PinLedger::new(BLOCKS, 4, SLOTS).unwrap()
    }

    fn apply(mut l: PinLedger, m: &Model, t: Tr) -> PinLedger {
        let got = sut_step(&mut l, m, &t);
        let compact = |acts: &[LedgerAction]| -> Vec<(u64, &'static str)> {
            acts.iter()
                .map(|a| match a {
                    LedgerAction::Released { request_id, cause, .. } => (*request_id, cause.name()),
                    other => panic!("unexpected pin action {other:?}"),
                })
                .collect()
        };
        assert_matches_model(&got, &m.expect, compact, &t);
        l
    }

    fn check_invariants(l: &PinLedger, m: &Model) {
        l.check().unwrap();
        assert_eq!(l.pool().num_free(), m.free_blocks);
        assert_eq!(l.slots().num_free(), m.free_slots);
        assert_eq!(l.num_pinned(), m.pins.len());
        assert_eq!(l.pending_kv_push_count(), m.pins.values().filter(|p| p.pushing).count());
        assert_eq!(l.pinned_request_ids(), m.pins.keys().copied().collect::<Vec<_>>());
        for (rid, pin) in &m.pins {
            let (blocks, slot) = l.pinned(*rid).unwrap();
            assert_eq!((blocks.len(), slot.is_some()), (pin.n as usize, pin.ssm));
        }
    }

    fn teardown(mut l: PinLedger, m: Model) {
        for rid in m.pins.keys() {
            let e = l.epoch_of(*rid).unwrap();
            l.push_settled(*rid, e).unwrap();
            l.release(*rid, None).unwrap();
        }
        l.check().unwrap();
        assert_eq!(l.pool().num_free(), BLOCKS);
        assert_eq!(l.slots().num_free(), SLOTS);
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn pin_ledger_matches_its_reference_model(sequential 1..300 => PinTest);
}
