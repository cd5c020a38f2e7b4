//! Bindings of the two-sided message tags (`disagg_core::tags`).

use disagg_core::error::DisaggError;
use disagg_core::tags;
use pyo3::prelude::*;

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
