//! Bindings of the two-sided transfers' decisions: message tags (`disagg_core::tags`) and
//! the order of a chunked transfer's steps (`disagg_core::chunks`) and the in-band header of
//! every message (`disagg_core::p2p_header`).

use disagg_core::chunks::{self, ChunkStep};
use disagg_core::error::DisaggError;
use disagg_core::p2p_header::{self, MessageKind};
use disagg_core::tags;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::IntoPyResult;

/// The message tag of `request_id`'s `kind` state (`"kv"`, `"conv"`, `"recurrent"`) on a
/// two-sided transport; injective. Raises `ArgumentError` naming `request_id` (outside
/// `[0, MAX_TWO_SIDED_REQUEST_ID]`) or `kind`.
#[pyfunction]
pub fn two_sided_tag(request_id: &Bound<'_, PyAny>, kind: &str) -> PyResult<i64> {
    let kind = tags::TagKind::from_name(kind).py()?;
    // An int beyond 64 bits is out of range like any other, not an OverflowError.
    let rid = request_id.extract::<i64>().unwrap_or(-1);
    match tags::two_sided_tag(rid, kind) {
        Err(_) if rid == -1 => Err(DisaggError::Argument {
            field: "request_id".into(),
            detail: format!(
                "request_id={} must be an int in [0, {}] on a two-sided transport (its \
                 message tags are 31-bit)",
                request_id.repr().map(|r| r.to_string()).unwrap_or_default(),
                tags::MAX_TWO_SIDED_REQUEST_ID
            ),
        })
        .py(),
        r => r.py(),
    }
}

/// The `(request_id, kind)` a two-sided tag was made from; raises `ArgumentError` for a tag
/// no request has.
#[pyfunction]
pub fn two_sided_tag_owner(tag: i64) -> PyResult<(i64, &'static str)> {
    let (rid, kind) = tags::tag_owner(tag).py()?;
    let name = match kind {
        tags::TagKind::Kv => "kv",
        tags::TagKind::Conv => "conv",
        tags::TagKind::Recurrent => "recurrent",
    };
    Ok((rid, name))
}

/// The steps of a chunked two-sided transfer whose chunk `k` is a send when `sends[k]`,
/// through `slots` round-robin slots: `k` posts chunk `k`, `-(k + 1)` lands it (see
/// `disagg_core::chunks::chunk_steps`).
#[pyfunction]
pub fn chunk_steps(sends: Vec<bool>, slots: usize) -> PyResult<Vec<i64>> {
    let steps = chunks::chunk_steps(&sends, slots).py()?;
    // A chunk index is below `sends.len()`, which fits an i64.
    let index = |k: usize| i64::try_from(k).unwrap_or(i64::MAX);
    Ok(steps
        .into_iter()
        .map(|s| match s {
            ChunkStep::Post(k) => index(k),
            ChunkStep::Land(k) => -index(k) - 1,
        })
        .collect())
}

/// The headers of one pair's messages of a handoff, concatenated (`P2P_HEADER_BYTES` each):
/// message `i` carries `nbytes[i]` payload bytes; `kind` is `"data"` or `"aborted"` (a
/// filler). Raises `ArgumentError` naming a field beyond its cap.
#[pyfunction]
pub fn p2p_headers<'py>(
    py: Python<'py>,
    kind: &str,
    tag: u64,
    incarnation: u64,
    nbytes: Vec<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let kind = MessageKind::from_name(kind).py()?;
    let bytes = p2p_header::encode_headers(kind, tag, incarnation, &nbytes).py()?;
    Ok(PyBytes::new(py, &bytes))
}

/// Check the received headers of messages `first..` of a pair's `len(nbytes)` messages:
/// `"data"` or `"aborted"` (every one a filler), else `MessageOrderError` naming the first
/// field that is not what the receive was posted for, with both values.
#[pyfunction]
#[pyo3(signature = (got, tag, incarnation, nbytes, first = 0))]
pub fn check_p2p_headers(
    got: &[u8],
    tag: u64,
    incarnation: u64,
    nbytes: Vec<u64>,
    first: usize,
) -> PyResult<&'static str> {
    Ok(p2p_header::check_headers(got, tag, incarnation, &nbytes, first).py()?.name())
}
