//! Bindings of the two-sided transfers' decisions: message tags (`disagg_core::tags`) and
//! the order of a chunked transfer's steps (`disagg_core::chunks`) and the in-band header of
//! every message (`disagg_core::p2p_header`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::chunks::{self, ChunkPair, ChunkSchedule};
use disagg_core::p2p_header::PeerSteps;
use disagg_core::tags;
use pyo3::prelude::*;

use crate::args::{convs, Raw};
use crate::error::IntoPyResult;
use crate::pool::{core_fns, core_methods, lock_with, outs};
use crate::stream::Bytes;

/// `tags::two_sided_tag_named`: the message tag of `request_id`'s `kind` state.
#[pyfunction]
pub fn two_sided_tag(request_id: &Bound<'_, PyAny>, kind: &str) -> PyResult<i64> {
    let repr = || request_id.repr().map(|r| r.to_string()).unwrap_or_default();
    tags::two_sided_tag_named(request_id.extract().ok(), repr, kind).py()
}

/// A chunked transfer's pair as Python gives it.
type PairArg = (bool, bool, u64, u64, u64, Vec<u64>);

outs! {
    ChunkSchedule => (Vec<i64>, Vec<Bytes>, Vec<i64>)
        = |v| (v.0, v.1.into_iter().map(Cow::Owned).collect(), v.2);
}

convs! {
    /// Pairs of a chunked transfer.
    Pairs: Vec<PairArg> => Vec<ChunkPair> = |_f, v| Ok(v.into_iter().map(|p| ChunkPair {
        send: p.0, filler: p.1, tag: p.2, incarnation: p.3, item_bytes: p.4, sizes: p.5 }).collect());
}

core_fns! {
    /// `tags::tag_owner_named`: the `(request_id, kind)` a two-sided tag was made from.
    fn two_sided_tag_owner(tag: Raw<i64>) -> (i64, &'static str) = tags::tag_owner_named(tag);
    /// `tags::p2p_matching`: `(nccl, match_by_order, ordered)`.
    #[pyo3(signature = (group_backend, match_by_order = None))]
    fn p2p_matching(group_backend: Raw<String>, match_by_order: Raw<Option<bool>>)
        -> (bool, bool, bool) = tags::p2p_matching(&group_backend, match_by_order);
    /// `chunks::chunk_schedule` of `(send, filler, tag, incarnation, item_bytes, sizes)` pairs:
    /// `(signed steps, headers per pair, wire tag per pair)`.
    fn chunk_schedule(pairs: Pairs, slot_bytes: Raw<u64>, slots: Raw<usize>,
        match_by_order: Raw<bool>) -> (Vec<i64>, Vec<Bytes>, Vec<i64>)
        = chunks::chunk_schedule(&pairs, slot_bytes, slots, match_by_order);
}

/// `disagg_core::p2p_header::PeerSteps`, shared by the transfer threads of a backend.
#[pyclass(name = "PeerSteps", module = "disagg_rs", frozen)]
#[derive(Default)]
pub struct PyPeerSteps {
    inner: Mutex<PeerSteps>,
}

core_methods!(PyPeerSteps, lock_with, inner,
calls {
    /// `PeerSteps::check` of received headers (`PushAbortedError` for fillers,
    /// `MessageOrderError` marking the peer out of step).
    #[pyo3(signature = (peer, got, tag, incarnation, nbytes, first = 0))]
    fn check(peer: Raw<u64>, got: Raw<Vec<u8>>, tag: Raw<u64>, incarnation: Raw<u64>,
        nbytes: Raw<Vec<u64>>, first: Raw<usize>) -> ()
        = check(peer, &got, tag, incarnation, &nbytes, first);
    /// Raise `HandoffStateError` naming the first of `peers` that is out of step.
    fn refuse(peers: Raw<Vec<u64>>) -> () = refuse(&peers);
    #[getter] fn out_of_step() -> BTreeMap<u64, String> = out_of_step().clone();
}
methods {
    #[new]
    fn new() -> Self {
        Self::default()
    }
});
