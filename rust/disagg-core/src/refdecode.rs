//! Decisions of a reference-design engine's handoff steps (the engine brings its own block
//! allocator and attaches no ledger): what `setup_kv_transfer` configures, which blocks of an
//! admitted import enter the prefix cache, what an import looks up and reserves, what the
//! handed-off first token does to the request, and the live SSM slot an import reserves.
//! The engine-side Python gathers the facts, calls one of these per step and carries the
//! result out.

use crate::error::{DisaggError, DisaggResult};
use crate::ledger::admission::continuation_blocks;
use crate::reference::{ReferenceCheck, Role};
use crate::wire::value::{Obj, WireValue};

/// What `setup_kv_transfer` configures on a reference-design engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetupPlan {
    /// The allocator pins a finished request's blocks until the decode has read them: only
    /// on a prefill.
    pub pinning: bool,
    /// KV heads across TP ranks: the model's query groups (GQA), else its attention heads.
    pub kv_heads: u64,
}

/// Check `setup_kv_transfer`'s facts (see [`ReferenceCheck::Setup`]: `role`, `hybrid`,
/// `state_cache`, `prefix_caching`) and plan it from `num_query_groups` (None or 0: no GQA)
/// and `num_attention_heads`.
pub fn setup_plan(facts: &WireValue) -> DisaggResult<SetupPlan> {
    let check = ReferenceCheck::parse("setup", facts)?;
    check.check()?;
    let ReferenceCheck::Setup { role, .. } = check else {
        unreachable!("the setup stage parses to ReferenceCheck::Setup")
    };
    let o = Obj::of(facts, "facts")?;
    let kv_heads = match o.opt_u64("num_query_groups")? {
        Some(groups) if groups > 0 => groups,
        _ => o.u64("num_attention_heads")?,
    };
    Ok(SetupPlan { pinning: role == Role::Prefill, kv_heads })
}

/// The part of an admitted import that enters the engine's prefix cache: blocks
/// `[start, end)` of its prompt blocks (the imported suffix after the reused prefix, as far as
/// hashes reach), and whether the request is given its first `end` hashes (none: `end` is 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashSpan {
    /// First block to register (the reused prefix is registered already).
    pub start: usize,
    /// One past the last block with a hash.
    pub end: usize,
    /// Whether the request gets precomputed hashes (`end > 0`).
    pub precomputed: bool,
}

/// See [`HashSpan`]: `local_blocks` prompt blocks of which `cached` were reused, `hashes`
/// hashes.
pub fn hash_span(local_blocks: usize, hashes: usize, cached: usize) -> HashSpan {
    let end = local_blocks.min(hashes);
    HashSpan { start: cached.min(end), end, precomputed: end > 0 }
}

/// What an admitted import registers in the prefix cache, as [`HashSpan`] spans it:
/// `(blocks, hashes, parent_hashes, precomputed)`, each block's parent the hash before its
/// own (`zero` before the first), and the request's first `end` hashes (none when `end` is 0).
#[allow(clippy::type_complexity)]
pub fn hash_registration<T: Clone>(
    local_blocks: &[T],
    hashes: &[T],
    zero: T,
    cached: usize,
) -> (Vec<T>, Vec<T>, Vec<T>, Option<Vec<T>>) {
    let HashSpan { start, end, precomputed } = hash_span(local_blocks.len(), hashes.len(), cached);
    let parents = std::iter::once(zero).chain(hashes.iter().cloned());
    let parents = parents.skip(start).take(end - start).collect();
    let precomputed = precomputed.then(|| hashes[..end].to_vec());
    (local_blocks[start..end].to_vec(), hashes[start..end].to_vec(), parents, precomputed)
}

/// What an import needs before anything is reserved: how many of its `num_blocks` prompt
/// blocks to look up in the engine's prefix cache (none on a push transport: the prefill
/// writes every block) and the continuation blocks beyond the prompt for its
/// `resume_tokens` (see [`crate::ledger::admission::continuation_blocks`]).
pub fn import_sizes(
    is_push: bool,
    num_blocks: u64,
    prompt_len: u64,
    resume_tokens: u64,
    block_size: u64,
) -> DisaggResult<(u64, u64)> {
    let more = continuation_blocks(prompt_len, resume_tokens, block_size, false)?;
    Ok((if is_push { 0 } else { num_blocks }, more))
}

/// The reusable prefix of an import: the cached block of each looked-up hash (`None`: not
/// cached), as far as they run unbroken from the first block.
pub fn cached_prefix(found: &[Option<u64>]) -> Vec<u64> {
    found.iter().map_while(|b| *b).collect()
}

/// A request after the handed-off first token: its token limit and whether it is already
/// finished (a forward step would generate nothing more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstToken {
    /// The token limit: a termination token or a stop word ends it at the tokens it has.
    pub limit: i64,
    /// The request has generated as many tokens as its limit.
    pub done: bool,
}

/// See [`FirstToken`]: `limit` the request's token limit, `generated` its tokens once the
/// `first` token was appended (a request that generates nothing, `limit` <= 0, appended
/// nothing and keeps its limit), `stop_hit` whether that token completed a stop word.
pub fn first_token(
    limit: i64,
    generated: u64,
    first: i64,
    termination_id: Option<i64>,
    stop_hit: bool,
) -> FirstToken {
    let generated = i64::try_from(generated).unwrap_or(i64::MAX);
    let ends = limit > 0 && (termination_id == Some(first) || stop_hit);
    let limit = if ends { generated } else { limit };
    FirstToken { limit, done: generated >= limit }
}

/// Where a finished request's record goes on a reference-design engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordSink {
    /// This rank coordinates its model-parallel group: the record goes to the coordinator
    /// (streamed partial outputs too).
    Coordinator,
    /// No coordinator: the caller's future gets the record, detokenized here.
    Caller,
    /// Another rank of the group sends it to the coordinator.
    Elsewhere,
}

impl RecordSink {
    /// The name the engine-side Python matches on.
    pub fn name(self) -> &'static str {
        match self {
            Self::Coordinator => "coordinator",
            Self::Caller => "caller",
            Self::Elsewhere => "elsewhere",
        }
    }
}

/// See [`RecordSink`].
pub fn record_sink(use_coordinator: bool, is_mp_coordinator: bool) -> RecordSink {
    match (use_coordinator, is_mp_coordinator) {
        (false, _) => RecordSink::Caller,
        (true, true) => RecordSink::Coordinator,
        (true, false) => RecordSink::Elsewhere,
    }
}

/// The live SSM slot the engine reserved for an import, or a `HandoffState` error when it
/// had none left although its free count allowed the reservation.
pub fn live_slot(slot: Option<u64>) -> DisaggResult<u64> {
    slot.ok_or_else(|| {
        DisaggError::handoff_state(
            "mamba_state_free_slot_count",
            "live SSM slot capacity changed between the check and the reservation",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(role: &str, groups: WireValue, heads: i128) -> WireValue {
        let entries = [
            ("role", WireValue::Str(role.to_owned())),
            ("hybrid", WireValue::Bool(false)),
            ("state_cache", WireValue::Bool(false)),
            ("prefix_caching", WireValue::Bool(true)),
            ("num_query_groups", groups),
            ("num_attention_heads", WireValue::Int(heads)),
        ];
        WireValue::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }

    #[test]
    fn setup_pins_only_on_a_prefill_and_counts_query_groups_before_heads() {
        let plan = setup_plan(&facts("prefill", WireValue::Int(2), 8)).unwrap();
        assert_eq!(plan, SetupPlan { pinning: true, kv_heads: 2 });
        let plan = setup_plan(&facts("decode", WireValue::Null, 8)).unwrap();
        assert_eq!(plan, SetupPlan { pinning: false, kv_heads: 8 });
        assert_eq!(setup_plan(&facts("decode", WireValue::Int(0), 8)).unwrap().kv_heads, 8);
        // The setup check runs first: its error, not a plan.
        let e = setup_plan(&facts("both", WireValue::Null, 8)).unwrap_err();
        assert!(matches!(e, DisaggError::HandoffState { ref field, .. } if field == "role"));
    }

    #[test]
    fn the_hash_span_is_the_imported_suffix_as_far_as_hashes_reach() {
        // Oracle: every block index in [cached, min(blocks, hashes)).
        for blocks in 0..6 {
            for hashes in 0..6 {
                for cached in 0..=blocks {
                    let span = hash_span(blocks, hashes, cached);
                    let want: Vec<usize> = (cached..blocks).filter(|&i| i < hashes).collect();
                    assert_eq!((span.start..span.end).collect::<Vec<_>>(), want);
                    assert_eq!(span.precomputed, blocks.min(hashes) > 0);
                    assert_eq!(span.end, blocks.min(hashes));
                }
            }
        }
    }

    #[test]
    fn the_registered_suffix_links_each_block_to_the_hash_before_it() {
        let got = hash_registration(&[10, 11, 12, 13], &[1, 2, 3], 0, 1);
        assert_eq!(got, (vec![11, 12], vec![2, 3], vec![1, 2], Some(vec![1, 2, 3])));
        assert_eq!(
            hash_registration(&[10], &[1], 0, 0),
            (vec![10], vec![1], vec![0], Some(vec![1]))
        );
        assert_eq!(hash_registration::<u8>(&[10], &[], 0, 0), (vec![], vec![], vec![], None));
    }

    #[test]
    fn a_termination_token_or_stop_word_ends_the_request_at_its_tokens() {
        let ft = |limit, done| FirstToken { limit, done };
        assert_eq!(first_token(4, 1, 9, Some(9), false), ft(1, true));
        assert_eq!(first_token(4, 1, 9, None, true), ft(1, true));
        assert_eq!(first_token(4, 1, 9, Some(8), false), ft(4, false));
        assert_eq!(first_token(4, 1, 9, None, false), ft(4, false));
        // A limit of one token is reached by the handed-off token alone.
        assert_eq!(first_token(1, 1, 9, None, false), ft(1, true));
        // Nothing to generate: no token was appended, the limit stays and the request is done.
        assert_eq!(first_token(0, 0, 9, Some(9), true), ft(0, true));
        assert_eq!(first_token(-1, 0, 9, Some(9), false), ft(-1, true));
    }

    #[test]
    fn first_token_matches_a_direct_model() {
        // Oracle: the request's rule written out step by step.
        for limit in -1..4_i64 {
            for generated in 0..4_u8 {
                let (generated, as_count) = (i64::from(generated), u64::from(generated));
                for stop_hit in [false, true] {
                    for termination_id in [None, Some(7), Some(9)] {
                        let mut want = limit;
                        if limit > 0 && (termination_id == Some(9) || stop_hit) {
                            want = generated;
                        }
                        let got = first_token(limit, as_count, 9, termination_id, stop_hit);
                        assert_eq!(got, FirstToken { limit: want, done: generated >= want });
                    }
                }
            }
        }
    }

    #[test]
    fn a_push_looks_nothing_up_and_the_resume_tokens_get_continuation_blocks() {
        assert_eq!(import_sizes(false, 3, 12, 1, 4).unwrap(), (3, 1));
        assert_eq!(import_sizes(true, 3, 12, 1, 4).unwrap(), (0, 1));
        assert_eq!(import_sizes(false, 3, 11, 1, 4).unwrap(), (3, 0));
        assert_eq!(import_sizes(false, 3, 11, 2, 4).unwrap(), (3, 1));
        assert!(import_sizes(false, 1, 1, 1, 0).is_err());
    }

    #[test]
    fn the_cached_prefix_stops_at_the_first_miss() {
        assert_eq!(cached_prefix(&[Some(4), Some(2), None, Some(7)]), vec![4, 2]);
        assert_eq!(cached_prefix(&[None, Some(2)]), Vec::<u64>::new());
        assert_eq!(cached_prefix(&[Some(1), Some(3)]), vec![1, 3]);
        assert_eq!(cached_prefix(&[]), Vec::<u64>::new());
    }

    #[test]
    fn only_the_coordinating_rank_sends_records_and_without_a_coordinator_the_caller_gets_them() {
        assert_eq!(record_sink(true, true), RecordSink::Coordinator);
        assert_eq!(record_sink(true, false), RecordSink::Elsewhere);
        assert_eq!(record_sink(false, true), RecordSink::Caller);
        assert_eq!(record_sink(false, false), RecordSink::Caller);
        assert_eq!(RecordSink::Coordinator.name(), "coordinator");
    }

    #[test]
    fn a_missing_live_slot_names_the_free_count() {
        assert_eq!(live_slot(Some(3)).unwrap(), 3);
        let e = live_slot(None).unwrap_err();
        assert!(
            matches!(e, DisaggError::HandoffState { ref field, .. } if field == "mamba_state_free_slot_count"),
            "{e:?}"
        );
        assert!(e.to_string().contains("changed between the check and the reservation"), "{e}");
    }
}
