//! Decisions of a reference-design engine's handoff steps (the engine brings its own block
//! allocator and attaches no ledger): what `setup_kv_transfer` configures, which blocks of an
//! admitted import enter the prefix cache, what the handed-off first token does to the
//! request's token limit, and the live SSM slot an import reserves. The engine-side Python
//! gathers the facts, calls one of these per step and carries the result out.

use crate::error::{DisaggError, DisaggResult};
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

/// The token limit of a request once the handed-off `first` token was appended (`generated`
/// tokens now): a termination token or a stop word (`stop_hit`) ends it at the tokens it has;
/// a request that generates nothing (`limit` <= 0) appended nothing and keeps its limit.
pub fn first_token_limit(
    limit: i64,
    generated: u64,
    first: i64,
    termination_id: Option<i64>,
    stop_hit: bool,
) -> i64 {
    if limit > 0 && (termination_id == Some(first) || stop_hit) {
        return i64::try_from(generated).unwrap_or(i64::MAX);
    }
    limit
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
    fn a_termination_token_or_stop_word_ends_the_request_at_its_tokens() {
        assert_eq!(first_token_limit(4, 1, 9, Some(9), false), 1);
        assert_eq!(first_token_limit(4, 1, 9, None, true), 1);
        assert_eq!(first_token_limit(4, 1, 9, Some(8), false), 4);
        assert_eq!(first_token_limit(4, 1, 9, None, false), 4);
        // Nothing to generate: no token was appended, the limit stays.
        assert_eq!(first_token_limit(0, 0, 9, Some(9), true), 0);
        assert_eq!(first_token_limit(-1, 0, 9, Some(9), false), -1);
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
