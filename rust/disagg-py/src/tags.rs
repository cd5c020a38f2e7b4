//! Bindings of the two-sided message tags (`disagg_core::tags`).

use disagg_core::tags;
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// The message tag of `request_id`'s `kind` state (`"kv"`, `"conv"`, `"recurrent"`) on a
/// two-sided transport; injective. Raises `ArgumentError` naming `request_id` (outside
/// `[0, MAX_TWO_SIDED_REQUEST_ID]`) or `kind`.
#[pyfunction]
pub fn two_sided_tag(request_id: i64, kind: &str) -> PyResult<i64> {
    tags::two_sided_tag(request_id, tags::TagKind::from_name(kind).py()?).py()
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
