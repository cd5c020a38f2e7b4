//! What the ledgers' reference-model tests share: event order, the model's rejected-event rule
//! and the comparison of the ledger's answer with the model's.

use std::fmt::Debug;

use disagg_core::DisaggError;

/// Request ids of `(epoch, request_id)` pairs, oldest attempt first (the order in which a
/// ledger ends several attempts at once).
pub fn by_epoch(attempts: impl Iterator<Item = (u64, u64)>) -> Vec<u64> {
    let mut all: Vec<(u64, u64)> = attempts.collect();
    all.sort_unstable();
    all.into_iter().map(|(_, rid)| rid).collect()
}

/// A reference model's `apply`: run `step`; a rejected event changes nothing; `record` stores
/// the outcome the ledger must give.
pub fn apply_or_keep<M: Clone, R>(
    mut state: M,
    step: impl FnOnce(&mut M) -> Result<R, &'static str>,
    record: impl FnOnce(&mut M, Result<R, &'static str>),
) -> M {
    let before = state.clone();
    let r = step(&mut state);
    if r.is_err() {
        state = before;
    }
    record(&mut state, r);
    state
}

/// The ledger's answer to `event` is the model's: the same actions (as `compact` writes them)
/// or an error of the same kind.
pub fn assert_matches_model<A: Debug, W: PartialEq + Debug>(
    got: &Result<Vec<A>, DisaggError>,
    want: &Result<W, &'static str>,
    compact: impl FnOnce(&[A]) -> W,
    event: &impl Debug,
) {
    match (got, want) {
        (Ok(acts), Ok(w)) => assert_eq!(&compact(acts), w, "actions after {event:?}"),
        (Err(e), Err(kind)) => assert_eq!(e.kind(), *kind, "error after {event:?}: {e}"),
        _ => panic!("after {event:?}: ledger gave {got:?}, model expected {want:?}"),
    }
}
