//! What the ledgers' reference-model tests share: event order, the model's rejected-event rule
//! and the comparison of the ledger's answer with the model's.

use std::fmt::Debug;

use disagg_core::DisaggError;

/// Blocks and SSM slots of the ledgers' pools in the model tests.
pub const BLOCKS: u32 = 8;
pub const SLOTS: u32 = 2;

/// Request ids of `(epoch, request_id)` pairs, oldest attempt first (the order in which a
/// ledger ends several attempts at once).
pub fn by_epoch(attempts: impl Iterator<Item = (u64, u64)>) -> Vec<u64> {
    let mut all: Vec<(u64, u64)> = attempts.collect();
    all.sort_unstable();
    all.into_iter().map(|(_, rid)| rid).collect()
}

/// `struct $name`, the reference state machine of the file's `Model` (starting as `$init`)
/// over the transitions `Tr` drawn by `$transitions`. A rejected event changes nothing; the
/// model's `expect` holds what the ledger must answer (`Model::step`'s result).
macro_rules! reference_model {
    ($name:ident, $init:expr, $transitions:expr) => {
        struct $name;

        impl ReferenceStateMachine for $name {
            type State = Model;
            type Transition = Tr;

            fn init_state() -> BoxedStrategy<Model> {
                Just($init).boxed()
            }

            fn transitions(_: &Model) -> BoxedStrategy<Tr> {
                $transitions.boxed()
            }

            fn apply(mut state: Model, t: &Tr) -> Model {
                let before = state.clone();
                let r = state.step(t);
                if r.is_err() {
                    state = before;
                }
                state.expect = r;
                state
            }
        }
    };
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
