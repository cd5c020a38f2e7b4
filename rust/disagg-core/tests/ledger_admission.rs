//! proptest: the decode admission arithmetic and ticket decisions against plain oracles.
#![allow(clippy::unwrap_used, missing_docs)]

use disagg_core::ledger::admission::{
    check_prefilled_admission, continuation_blocks, import_deadline, resume_finishes,
    source_lease_end, BatchRoom, DecodeSettings, PrefilledRequest,
};
use disagg_core::ledger::{HandleState, RankOutcome};
use disagg_core::DisaggError;
use proptest::prelude::*;

/// The fewest blocks past the prompt's that hold every token, counted one block at a time.
fn continuation_oracle(prompt: u64, inputs: u64, bs: u64, mtp: bool) -> u64 {
    let drafts = if mtp && inputs > 2 { inputs - 2 } else { 0 };
    let total = prompt + inputs + drafts;
    let mut prompt_blocks = 0;
    while prompt_blocks * bs < prompt {
        prompt_blocks += 1;
    }
    let mut extra = 0;
    while (prompt_blocks + extra) * bs < total {
        extra += 1;
    }
    extra
}

fn kind(r: &Result<(), DisaggError>) -> &'static str {
    match r {
        Ok(()) => "ok",
        Err(e) => e.kind(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn continuation_blocks_are_the_fewest_that_hold_every_token(
        prompt in 0u64..400, inputs in 0u64..40, bs in 1u64..64, mtp: bool,
    ) {
        prop_assert_eq!(
            continuation_blocks(prompt, inputs, bs, mtp).unwrap(),
            continuation_oracle(prompt, inputs, bs, mtp)
        );
    }

    #[test]
    fn an_import_deadline_is_the_timeout_or_half_the_lease_whichever_is_sooner(
        now in 0u64..1 << 62, timeout in 0u64..1 << 40, lease in proptest::option::of(-10i128..1 << 41),
    ) {
        let got = import_deadline(3, now, timeout, lease);
        match lease {
            Some(l) if l < 2 => {
                let named = matches!(got, Err(DisaggError::Wire { ref field, .. }) if field == "lease_ns");
                prop_assert!(named, "lease={} gave {:?}", l, got);
            }
            Some(l) => {
                let half = u64::try_from(l / 2).unwrap();
                prop_assert_eq!(got.unwrap(), now + timeout.min(half));
            }
            None => prop_assert_eq!(got.unwrap(), now + timeout),
        }
    }

    #[test]
    fn resume_tokens_finish_a_request_at_its_limit_termination_or_stop_word(
        resume in proptest::collection::vec(0i64..5, 0..6),
        max_new in 0i64..8,
        term in proptest::option::of(0i64..5),
        stops in proptest::collection::vec(proptest::collection::vec(0i64..5, 0..3), 0..3),
    ) {
        let n = resume.len();
        let oracle = i64::try_from(n).unwrap() >= max_new
            || (n > 0 && term == Some(resume[n - 1]))
            || stops.iter().any(|w| !w.is_empty() && w.len() <= n && resume[n - w.len()..] == w[..]);
        prop_assert_eq!(resume_finishes(&resume, max_new, term, &stops), oracle);
    }

    #[test]
    fn admission_accepts_exactly_a_request_whose_shape_matches_and_that_fits(
        prompt in 1u64..40, spec in 0u64..3, bs in 1u64..8, mtp: bool, hybrid: bool,
        prompt_delta in -1i64..2, more_delta in -1i64..2, input_delta in -1i64..2, slot: bool,
        total in 0u64..4, active in 0u64..12,
    ) {
        let inputs = (spec + 1).saturating_add_signed(input_delta);
        let want_prompt = prompt.div_ceil(bs);
        let want_more = continuation_oracle(prompt, inputs, bs, mtp);
        let req = PrefilledRequest {
            request_id: 7,
            prompt_len: prompt,
            prompt_blocks: want_prompt.saturating_add_signed(prompt_delta),
            continuation_blocks: want_more.saturating_add_signed(more_delta),
            input_tokens: inputs,
            has_ssm_slot: slot,
        };
        let room = BatchRoom { total_requests: total, max_requests: 3, active_tokens: active, max_tokens: 10 };
        let settings = DecodeSettings { block_size: bs, num_speculative_tokens: spec, mtp_kv_cache: mtp, hybrid };
        let expected = if total >= 3 || active + inputs > 10 {
            "State"
        } else if req.prompt_blocks != want_prompt || req.continuation_blocks != want_more {
            "Block"
        } else if inputs != spec + 1 || (hybrid && !slot) {
            "Wire"
        } else {
            "ok"
        };
        prop_assert_eq!(kind(&check_prefilled_admission(&req, &room, &settings)), expected);
    }

    #[test]
    fn a_source_lease_needs_both_clocks_and_refuses_a_negative_end(
        end in proptest::option::of(-3i128..1 << 62), wall in proptest::option::of(0i128..1 << 62),
    ) {
        let got = source_lease_end(1, end, wall);
        match (end, wall) {
            (Some(e), Some(_)) if e < 0 => {
                let named = matches!(got, Err(DisaggError::Wire { ref field, .. }) if field == "lease_until_wall_ns");
                prop_assert!(named, "end={} gave {:?}", e, got);
            }
            (Some(e), Some(w)) => {
                prop_assert_eq!(got.unwrap(), Some((u64::try_from(e).unwrap(), u64::try_from(w).unwrap())));
            }
            _ => prop_assert_eq!(got.unwrap(), None),
        }
    }
}

fn handle_state() -> impl Strategy<Value = HandleState> {
    prop_oneof![
        Just(HandleState::Running),
        Just(HandleState::Done),
        Just(HandleState::TimedOut),
        Just(HandleState::Failed),
    ]
}

/// The fold as the handles are polled one by one: wait at the first running handle; a timeout
/// outranks an error, an error outranks ok.
fn fold_oracle(failed_locally: bool, handles: &[HandleState]) -> Option<RankOutcome> {
    let mut outcome = if failed_locally { RankOutcome::Error } else { RankOutcome::Ok };
    for h in handles {
        match h {
            HandleState::Running => return None,
            HandleState::TimedOut => outcome = RankOutcome::MayStillWrite,
            HandleState::Failed if outcome == RankOutcome::Ok => outcome = RankOutcome::Error,
            _ => {}
        }
    }
    Some(outcome)
}

proptest! {
    #[test]
    fn a_rank_outcome_waits_for_every_handle_then_prefers_may_still_write_to_error(
        failed_locally: bool, handles in proptest::collection::vec(handle_state(), 0..5),
    ) {
        let got = RankOutcome::fold_local(failed_locally, &handles);
        prop_assert_eq!(got, fold_oracle(failed_locally, &handles));
        // Only a quiet outcome lets the destinations go back to the pool.
        prop_assert_eq!(
            got.is_some_and(RankOutcome::is_quiet),
            got.is_some() && !handles.contains(&HandleState::TimedOut)
        );
    }
}

#[test]
fn a_zero_block_size_is_refused_naming_the_field() {
    let got = continuation_blocks(3, 1, 0, false);
    assert!(matches!(got, Err(DisaggError::Wire { ref field, .. }) if field == "block_size"));
}
