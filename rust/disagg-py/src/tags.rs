//! Bindings of the two-sided transfers' decisions: message tags (`disagg_core::tags`) and
//! the order of a chunked transfer's steps (`disagg_core::chunks`) and the in-band header of
//! every message (`disagg_core::p2p_header`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::chunks::{self, ChunkStep};
use disagg_core::p2p_header::{self, MessageKind, PeerSteps};
use disagg_core::tags;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::Raw;
use crate::error::IntoPyResult;
use crate::pool::{core_fns, core_methods, lock_with};

/// The message tag of `request_id`'s `kind` state (`"kv"`, `"conv"`, `"recurrent"`) on a
/// two-sided transport; injective. Raises `ArgumentError` naming `request_id` (outside
/// `[0, MAX_TWO_SIDED_REQUEST_ID]`) or `kind`.
#[pyfunction]
pub fn two_sided_tag(request_id: &Bound<'_, PyAny>, kind: &str) -> PyResult<i64> {
    let repr = || request_id.repr().map(|r| r.to_string()).unwrap_or_default();
    tags::two_sided_tag_named(request_id.extract().ok(), repr, kind).py()
}

core_fns! {
    /// The `(request_id, kind)` a two-sided tag was made from; raises `ArgumentError` for a
    /// tag no request has.
    fn two_sided_tag_owner(tag: Raw<i64>) -> (i64, &'static str) = tags::tag_owner_named(tag);
    /// `(nccl, match_by_order, ordered)` of a two-sided backend on a process group of backend
    /// `group_backend` (see `disagg_core::tags::p2p_matching`).
    #[pyo3(signature = (group_backend, match_by_order = None))]
    fn p2p_matching(group_backend: Raw<String>, match_by_order: Raw<Option<bool>>)
        -> (bool, bool, bool) = tags::p2p_matching(&group_backend, match_by_order);
    /// The tag a message of a handoff tagged `tag` travels on (0 for all when matching by
    /// post order).
    fn p2p_wire_tag(tag: Raw<i64>, match_by_order: Raw<bool>) -> i64
        = tags::p2p_wire_tag(tag, match_by_order);
}

/// The steps of a chunked two-sided transfer whose chunk `k` is a send when `sends[k]`,
/// through `slots` round-robin slots: `k` posts chunk `k`, `-(k + 1)` lands it (see
/// `disagg_core::chunks::chunk_steps`).
#[pyfunction]
pub fn chunk_steps(sends: Vec<bool>, slots: usize) -> PyResult<Vec<i64>> {
    Ok(chunks::chunk_steps(&sends, slots).py()?.into_iter().map(ChunkStep::signed).collect())
}

/// The headers of one pair's messages of a handoff, concatenated (`P2P_HEADER_BYTES` each):
/// message `i` carries `nbytes[i]` payload bytes; `filler`: the headers say `aborted` (the
/// payload means nothing). Raises `ArgumentError` naming a field beyond its cap.
#[pyfunction]
pub fn p2p_headers(
    py: Python<'_>,
    filler: bool,
    tag: u64,
    incarnation: u64,
    nbytes: Vec<u64>,
) -> PyResult<Bound<'_, PyBytes>> {
    let kind = if filler { MessageKind::Aborted } else { MessageKind::Data };
    let bytes = p2p_header::encode_headers(kind, tag, incarnation, &nbytes).py()?;
    Ok(PyBytes::new(py, &bytes))
}

/// Which peers' messages are still in step with this rank's receives (see
/// `disagg_core::p2p_header::PeerSteps`); shared by the transfer threads of a backend.
#[pyclass(name = "PeerSteps", module = "disagg_rs", frozen)]
#[derive(Default)]
pub struct PyPeerSteps {
    inner: Mutex<PeerSteps>,
}

core_methods!(PyPeerSteps, lock_with, inner,
calls {
    /// Check received headers (messages `first..` of the pair's `len(nbytes)`) from process
    /// rank `peer`: returns for data; raises `PushAbortedError` for fillers (the pair stays
    /// in step) or `MessageOrderError` naming the field and both values (the peer is marked
    /// out of step).
    #[pyo3(signature = (peer, got, tag, incarnation, nbytes, first = 0))]
    fn check(peer: Raw<u64>, got: Raw<Vec<u8>>, tag: Raw<u64>, incarnation: Raw<u64>,
        nbytes: Raw<Vec<u64>>, first: Raw<usize>) -> ()
        = check(peer, &got, tag, incarnation, &nbytes, first);
    /// Raise `HandoffStateError` naming the first of `peers` that is out of step.
    fn refuse(peers: Raw<Vec<u64>>) -> () = refuse(&peers);
    /// Peers out of step: process rank -> the first mismatch.
    #[getter] fn out_of_step() -> BTreeMap<u64, String> = out_of_step().clone();
}
methods {
    #[new]
    fn new() -> Self {
        Self::default()
    }
});
