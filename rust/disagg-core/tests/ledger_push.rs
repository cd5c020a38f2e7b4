//! proptest: `PinLedger::start_push` against an oracle of what a push destination must state,
//! and `filler_push` against the push it stands in for.
#![allow(clippy::unwrap_used, missing_docs)]

use disagg_core::ledger::{PinLedger, PushDestination};
use disagg_core::DisaggError;
use proptest::prelude::*;

const BS: u32 = 4;

fn destination() -> impl Strategy<Value = Option<PushDestination>> {
    proptest::option::of(
        (
            proptest::option::of(proptest::collection::vec(0u32..64, 0..5)),
            proptest::option::of(0u32..24),
            0u32..24,
            proptest::option::of(0u32..4),
        )
            .prop_map(|(dst_block_ids, num_tokens, token_start, dst_ssm_slot)| {
                PushDestination { dst_block_ids, num_tokens, token_start, dst_ssm_slot }
            }),
    )
}

fn field(e: &DisaggError) -> String {
    match e {
        DisaggError::Wire { field, .. } => field.clone(),
        other => other.kind().to_owned(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_push_sends_the_pinned_suffix_to_the_first_stated_destination_or_changes_nothing(
        n in 1u32..5, ssm: bool, pinned: bool,
        dests in proptest::collection::vec(destination(), 0..3),
    ) {
        let mut l = PinLedger::new(8, BS, 2).unwrap();
        let blocks = l.pool_mut().allocate(n).unwrap();
        let slot = if ssm { Some(l.slots_mut().allocate().unwrap()) } else { None };
        if pinned {
            l.pin(1, &blocks, slot, 100, 0).unwrap();
        }
        let got = l.start_push(1, &dests);
        let first = dests.iter().flatten().next();
        let expected: Result<(), String> = match first {
            _ if !pinned => Err("State".into()),
            None => Err("destination".into()),
            Some(d) if d.dst_block_ids.is_none() || d.num_tokens.is_none() => Err("destination".into()),
            Some(d) if ssm && d.dst_ssm_slot.is_none() => Err("destination".into()),
            Some(d) if d.token_start > d.num_tokens.unwrap() || d.token_start / BS > n => {
                Err("token_start".into())
            }
            Some(_) => Ok(()),
        };
        match (got, expected) {
            (Ok(plan), Ok(())) => {
                let d = first.unwrap();
                let from = (d.token_start / BS) as usize;
                prop_assert_eq!(&plan.src_block_ids, &blocks[from..].to_vec());
                prop_assert_eq!(&plan.dst_block_ids, d.dst_block_ids.as_ref().unwrap());
                prop_assert_eq!(plan.num_tokens, d.num_tokens.unwrap() - d.token_start);
                prop_assert_eq!(plan.ssm_slots.map(|(src, _)| src), slot);
                prop_assert_eq!(plan.ssm_slots.map(|(_, dst)| dst), if ssm { d.dst_ssm_slot } else { None });
                prop_assert_eq!(Some(plan.epoch), l.epoch_of(1));
                prop_assert_eq!(l.pending_kv_push_count(), 1);
                // One push at a time: a second start is refused while the first is in flight.
                let again = l.start_push(1, &dests);
                let refused = matches!(again, Err(DisaggError::State { .. }));
                prop_assert!(refused, "second push gave {:?}", again);
                l.push_settled(1, plan.epoch).unwrap();
                prop_assert_eq!(l.pending_kv_push_count(), 0);
            }
            (Err(e), Err(want)) => {
                prop_assert_eq!(field(&e), want);
                prop_assert_eq!(l.pending_kv_push_count(), 0);
            }
            (got, want) => prop_assert!(false, "got {:?}, expected {:?}", got, want),
        }
        l.check().unwrap();
    }

    #[test]
    fn a_filler_moves_what_the_push_would_and_changes_nothing(
        tokens in 1u32..20, start in 0u32..24, ssm: bool, dst_slot in proptest::option::of(0u32..4),
    ) {
        // A prompt of `tokens` pinned in its blocks, and the destination the decode posted.
        let n = tokens.div_ceil(BS);
        let dest = PushDestination {
            dst_block_ids: Some((0..n).collect()),
            num_tokens: Some(tokens),
            token_start: start,
            dst_ssm_slot: if ssm { Some(dst_slot.unwrap_or(1)) } else { dst_slot },
        };
        let mut l = PinLedger::new(8, BS, 2).unwrap();
        let blocks = l.pool_mut().allocate(n).unwrap();
        let slot = if ssm { Some(l.slots_mut().allocate().unwrap()) } else { None };
        let filler = l.filler_push(1, &[None, Some(dest.clone())]);
        prop_assert_eq!(l.pending_kv_push_count(), 0);
        l.pin(1, &blocks, slot, 100, 0).unwrap();
        let push = l.start_push(1, &[None, Some(dest.clone())]);
        match (filler, push) {
            (Ok(f), Ok(p)) => {
                prop_assert_eq!(f.src_block_ids.len(), p.src_block_ids.len());
                prop_assert_eq!(f.num_tokens, p.num_tokens);
                prop_assert_eq!(&f.dst_block_ids, &p.dst_block_ids);
                if ssm {
                    prop_assert_eq!(f.ssm_slots.map(|(_, d)| d), p.ssm_slots.map(|(_, d)| d));
                    prop_assert!(f.ssm_slots.is_some());
                }
            }
            (Err(f), Err(p)) => prop_assert_eq!(field(&f), field(&p)),
            (f, p) => prop_assert!(false, "filler {:?}, push {:?}", f, p),
        }
    }

    #[test]
    fn a_filler_longer_than_the_pool_or_without_a_destination_is_refused(
        tokens in 33u32..200,
    ) {
        let l = PinLedger::new(8, BS, 0).unwrap();
        let dest = PushDestination {
            dst_block_ids: Some(vec![0]),
            num_tokens: Some(tokens),
            token_start: 0,
            dst_ssm_slot: None,
        };
        let e = l.filler_push(1, &[Some(dest)]).unwrap_err();
        prop_assert_eq!(e.kind(), "Capacity");
        prop_assert_eq!(field(&l.filler_push(1, &[None]).unwrap_err()), "destination");
        l.check().unwrap();
    }
}
