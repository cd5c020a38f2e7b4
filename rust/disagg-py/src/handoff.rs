//! Bindings of the handoff mixin's decode-side decisions (`disagg_core::handoff`): argument
//! conversion only.

use disagg_core::handoff::{self, SamplingGiven};
use disagg_core::integrity_tables::{describe, Mismatch};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

use crate::error::IntoPyResult;

/// An ``IntegrityMismatch`` of ``disagg_rs.integrity``, read by its attributes.
#[derive(FromPyObject)]
pub struct MismatchArg {
    #[pyo3(attribute)]
    table: String,
    #[pyo3(attribute)]
    layer: u64,
    #[pyo3(attribute)]
    unit: u64,
    #[pyo3(attribute)]
    expected: u64,
    #[pyo3(attribute)]
    got: u64,
    #[pyo3(attribute)]
    kv: Option<String>,
    #[pyo3(attribute)]
    band: Option<String>,
    #[pyo3(attribute)]
    tokens: Option<(u64, u64)>,
}

impl MismatchArg {
    fn text(self) -> String {
        let MismatchArg { table, layer, unit, expected, got, kv, band, tokens } = self;
        describe(
            &Mismatch { piece: 0, table, layer, unit, expected, got, kv, tokens },
            band.as_deref(),
        )
    }
}

/// `obj.name`, or None when `obj` has no such attribute or it is None.
fn attr<'py>(obj: &Bound<'py, PyAny>, name: &str) -> Option<Bound<'py, PyAny>> {
    obj.getattr(name).ok().filter(|v| !v.is_none())
}

/// `sampling_params` as given: a bare int (not a bool) is the number of tokens to generate,
/// anything else is read by its attributes.
fn sampling_given(sp: &Bound<'_, PyAny>) -> PyResult<SamplingGiven> {
    if sp.is_instance_of::<PyInt>() && !sp.is_instance_of::<PyBool>() {
        return Ok(SamplingGiven {
            num_tokens_to_generate: Some(sp.extract()?),
            ..Default::default()
        });
    }
    Ok(SamplingGiven {
        num_tokens_to_generate: attr(sp, "num_tokens_to_generate")
            .map(|v| v.extract())
            .transpose()?,
        max_new_tokens: attr(sp, "max_new_tokens").map(|v| v.extract()).transpose()?,
        termination_id: attr(sp, "termination_id").map(|v| v.extract()).transpose()?,
        stop_word_ids: attr(sp, "stop_word_ids")
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or_default(),
    })
}

/// ``(max_new_tokens, finished)`` of an import: the token limit its ``sampling_params`` set
/// (``MetadataError`` naming ``sampling_params`` without one) and whether the handed-off
/// ``resume_tokens`` already finish it (the limit, the termination token, the engine's
/// ``eos_token`` when the request has none, or a stop word).
#[pyfunction]
pub fn import_limits(
    sampling_params: &Bound<'_, PyAny>,
    eos_token: Option<i64>,
    resume_tokens: Vec<i64>,
) -> PyResult<(i64, bool)> {
    let given = sampling_given(sampling_params)?;
    let described = sampling_params.repr()?.to_string();
    let limits = handoff::import_limits(&given, &described, eos_token, &resume_tokens).py()?;
    Ok((limits.max_new_tokens, limits.finished))
}

/// ``(reason, detail, integrity, message)`` reporting a failed import: the ledger's
/// ``reason``, the first integrity ``mismatch`` (an ``IntegrityMismatch``, which wins) or
/// ``rank_error`` (the first transport error a rank reported).
#[pyfunction]
#[pyo3(signature = (request_id, reason, mismatch=None, rank_error=None))]
pub fn import_failure(
    request_id: u64,
    reason: &str,
    mismatch: Option<MismatchArg>,
    rank_error: Option<String>,
) -> (String, String, bool, String) {
    let text = mismatch.map(MismatchArg::text);
    let f = handoff::import_failure(request_id, reason, text.as_deref(), rank_error.as_deref());
    (f.reason, f.detail, f.integrity, f.message)
}
