//! Bindings of the two-sided transfers' decisions: message tags (`disagg_core::tags`) and
//! the order of a chunked transfer's steps (`disagg_core::chunks`) and the in-band header of
//! every message (`disagg_core::p2p_header`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::chunks::{self, ChunkStep};
use disagg_core::p2p_header::{self, MessageKind, PeerSteps};
use disagg_core::tags;
use pyo3::prelude::*;

use crate::args::Raw;
use crate::error::IntoPyResult;
use crate::pool::{core_fns, core_methods, lock_with};
use crate::stream::Bytes;

/// `tags::two_sided_tag_named`: the message tag of `request_id`'s `kind` state.
#[pyfunction]
pub fn two_sided_tag(request_id: &Bound<'_, PyAny>, kind: &str) -> PyResult<i64> {
    let repr = || request_id.repr().map(|r| r.to_string()).unwrap_or_default();
    tags::two_sided_tag_named(request_id.extract().ok(), repr, kind).py()
}

core_fns! {
    /// `tags::tag_owner_named`: the `(request_id, kind)` a two-sided tag was made from.
    fn two_sided_tag_owner(tag: Raw<i64>) -> (i64, &'static str) = tags::tag_owner_named(tag);
    /// `tags::p2p_matching`: `(nccl, match_by_order, ordered)`.
    #[pyo3(signature = (group_backend, match_by_order = None))]
    fn p2p_matching(group_backend: Raw<String>, match_by_order: Raw<Option<bool>>)
        -> (bool, bool, bool) = tags::p2p_matching(&group_backend, match_by_order);
    /// `tags::p2p_wire_tag`: the tag a message of a handoff tagged `tag` travels on.
    fn p2p_wire_tag(tag: Raw<i64>, match_by_order: Raw<bool>) -> i64
        = tags::p2p_wire_tag(tag, match_by_order);
    /// `chunks::chunk_steps`: `k` posts chunk `k`, `-(k + 1)` lands it.
    fn chunk_steps(sends: Raw<Vec<bool>>, slots: Raw<usize>) -> Vec<i64> = chunks::chunk_steps(
        &sends, slots).map(|s| s.into_iter().map(ChunkStep::signed).collect::<Vec<_>>());
    /// `p2p_header::encode_headers` of one pair's messages (`filler`: aborted ones).
    fn p2p_headers(filler: Raw<bool>, tag: Raw<u64>, incarnation: Raw<u64>,
        nbytes: Raw<Vec<u64>>) -> Bytes
        = p2p_header::encode_headers(MessageKind::sent(filler), tag, incarnation, &nbytes);
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
