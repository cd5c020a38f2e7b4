//! Decisions of the handoff mixin's decode side that need no ledger: the limits a request's
//! sampling parameters set on an import, and how a failed import is reported.
//!
//! Pure functions of plain values: the engine reads its request and its records, and carries
//! the answer out (the ledger decides the import's lifecycle itself).

use crate::error::{DisaggError, DisaggResult};
use crate::ledger::admission::resume_finishes;

/// A request's sampling parameters, as given: the reference design's `SamplingParams` (or any
/// object with its attributes), or a bare number of tokens to generate (then only
/// `num_tokens_to_generate` is set).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SamplingGiven {
    /// `num_tokens_to_generate`, when the object has it.
    pub num_tokens_to_generate: Option<i64>,
    /// `max_new_tokens`, read when `num_tokens_to_generate` is missing.
    pub max_new_tokens: Option<i64>,
    /// `termination_id`; a negative one means none.
    pub termination_id: Option<i64>,
    /// `stop_word_ids`: token sequences that end the request.
    pub stop_word_ids: Vec<Vec<i64>>,
}

/// What an import's sampling parameters decide before it is submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLimits {
    /// Tokens the request may generate.
    pub max_new_tokens: i64,
    /// Whether the handed-off tokens already finish it (it completes without a forward step).
    pub finished: bool,
}

/// The limits of an import whose prefill handed off `resume`: the token limit
/// (`num_tokens_to_generate`, else `max_new_tokens`; a `Wire` error naming `sampling_params`,
/// described by `described`, without either), and whether `resume` already reaches it, ends
/// with the termination token (the request's own when >= 0, else the engine's `eos`) or with
/// a stop word.
pub fn import_limits(
    given: &SamplingGiven,
    described: &str,
    eos: Option<i64>,
    resume: &[i64],
) -> DisaggResult<ImportLimits> {
    let limit = given.num_tokens_to_generate.or(given.max_new_tokens).ok_or_else(|| {
        DisaggError::wire(
            "sampling_params",
            format!(
                "sampling_params={described} has neither num_tokens_to_generate nor \
                 max_new_tokens"
            ),
        )
    })?;
    let termination = given.termination_id.filter(|&t| t >= 0).or(eos);
    let finished = resume_finishes(resume, limit, termination, &given.stop_word_ids);
    Ok(ImportLimits { max_new_tokens: limit, finished })
}

/// How a failed import is reported: to the driver (`reason` and `detail`, the failure reason
/// is `reason + detail`) and to the request's future (`message`, of an integrity error when
/// `integrity`, else of a transfer error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportFailure {
    /// `integrity` when the written state failed the digest check, else the ledger's reason.
    pub reason: String,
    /// What names the failure's cause: the mismatching cell, or the first error a rank saw
    /// (in parentheses); empty when neither is known.
    pub detail: String,
    /// Whether the failure is an integrity failure.
    pub integrity: bool,
    /// The message of the exception the request's future receives.
    pub message: String,
}

/// The report of `request_id`'s failed import: the ledger gave `reason`; `mismatch` describes
/// the first cell that failed the digest check (it wins over every other cause) and
/// `rank_error` the first transport error a rank reported (an empty one is no error).
pub fn import_failure(
    request_id: u64,
    reason: &str,
    mismatch: Option<&str>,
    rank_error: Option<&str>,
) -> ImportFailure {
    if let Some(m) = mismatch {
        return ImportFailure {
            reason: "integrity".into(),
            detail: format!(" {m}"),
            integrity: true,
            message: format!("KV import of request {request_id} failed the integrity check: {m}"),
        };
    }
    let detail =
        rank_error.filter(|e| !e.is_empty()).map_or_else(String::new, |e| format!(" ({e})"));
    ImportFailure {
        reason: reason.into(),
        message: format!("KV import of request {request_id} failed: {reason}{detail}"),
        detail,
        integrity: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params(num: Option<i64>, max_new: Option<i64>, term: Option<i64>) -> SamplingGiven {
        SamplingGiven {
            num_tokens_to_generate: num,
            max_new_tokens: max_new,
            termination_id: term,
            stop_word_ids: vec![vec![5, 6], vec![]],
        }
    }

    #[test]
    fn the_limit_is_num_tokens_to_generate_else_max_new_tokens_else_an_error() {
        let limits =
            |p: &SamplingGiven| import_limits(p, "P", None, &[1]).map(|l| l.max_new_tokens);
        assert_eq!(limits(&params(Some(4), Some(9), None)), Ok(4));
        assert_eq!(limits(&params(None, Some(9), None)), Ok(9));
        let e = limits(&params(None, None, None)).unwrap_err();
        let want = "sampling_params=P has neither num_tokens_to_generate nor max_new_tokens";
        assert_eq!(e, DisaggError::wire("sampling_params", want));
    }

    #[test]
    fn a_negative_termination_id_falls_back_to_the_engines_eos_token() {
        let finished = |term, eos, resume: &[i64]| {
            import_limits(&params(Some(8), None, term), "P", eos, resume).unwrap().finished
        };
        assert!(finished(Some(3), Some(9), &[3]));
        assert!(!finished(Some(3), Some(9), &[9]));
        assert!(finished(Some(-1), Some(9), &[9]));
        assert!(finished(None, Some(9), &[9]));
        assert!(!finished(None, None, &[9]));
        assert!(finished(None, None, &[5, 6]), "a stop word ends it");
        assert!(!finished(None, None, &[]), "empty stop words never match");
    }

    #[test]
    fn an_integrity_mismatch_wins_over_a_ranks_transport_error() {
        let f = import_failure(7, "error", Some("kv=K layer=0 head=1"), Some("rank 1: boom"));
        assert_eq!(f.reason, "integrity");
        assert_eq!(f.detail, " kv=K layer=0 head=1");
        assert!(f.integrity);
        assert_eq!(
            f.message,
            "KV import of request 7 failed the integrity check: kv=K layer=0 head=1"
        );
        let f = import_failure(7, "deadline", None, Some("rank 1: boom"));
        assert_eq!((f.reason.as_str(), f.detail.as_str()), ("deadline", " (rank 1: boom)"));
        assert_eq!(f.message, "KV import of request 7 failed: deadline (rank 1: boom)");
        assert!(!f.integrity);
        assert_eq!(import_failure(7, "aborted", None, Some("")).detail, "");
        assert_eq!(
            import_failure(7, "aborted", None, None).message,
            "KV import of request 7 failed: aborted"
        );
    }

    proptest! {
        /// Against a simple model: the limit is the first given of the two attributes, and the
        /// request is finished exactly when the model says so.
        #[test]
        fn limits_match_a_simple_model(
            num in proptest::option::of(0i64..6),
            max_new in proptest::option::of(0i64..6),
            term in proptest::option::of(-2i64..4),
            eos in proptest::option::of(0i64..4),
            resume in proptest::collection::vec(0i64..4, 0..4),
        ) {
            let given = SamplingGiven {
                num_tokens_to_generate: num,
                max_new_tokens: max_new,
                termination_id: term,
                stop_word_ids: vec![],
            };
            let got = import_limits(&given, "P", eos, &resume);
            match num.or(max_new) {
                None => prop_assert!(got.is_err()),
                Some(limit) => {
                    let end = match term { Some(t) if t >= 0 => Some(t), _ => eos };
                    let reached = i64::try_from(resume.len()).unwrap() >= limit;
                    let terminated = end.is_some() && resume.last().copied() == end;
                    let want = ImportLimits { max_new_tokens: limit, finished: reached || terminated };
                    prop_assert_eq!(got, Ok(want));
                }
            }
        }
    }
}
