//! Bindings of the reference-design engine's ticket metadata (`disagg_core::refticket`).

use pyo3::prelude::*;

use crate::args::wire_to_py;
use crate::error::{in_handoff_metadata, IntoPyResult};
use crate::wire::to_wire;

/// The ticket ``kv_meta`` of every finished prefill in ``facts`` (``requests``, ``kv_stages``,
/// ``ssm_stages``, ``pp_size``, ``num_speculative_tokens``), after the whole batch is checked;
/// ``blocks`` are the requests' prompt blocks (kept out of ``facts``: a batch of long prompts
/// holds more ids than one wire value may), ``slots`` (a hybrid engine: per request, the SSM slot cached for its final block) adds the
/// SSM descriptors.
#[pyfunction]
#[pyo3(signature = (facts, blocks, slots=None))]
pub fn reference_prefill_metas<'py>(
    facts: &Bound<'py, PyAny>,
    blocks: Vec<Vec<u64>>,
    slots: Option<Vec<i64>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let py = facts.py();
    let v = to_wire(facts, "facts").map_err(|e| in_handoff_metadata(py, e))?;
    let metas = disagg_core::refticket::prefill_metas(&v, &blocks, slots.as_deref()).py()?;
    metas.iter().map(|m| wire_to_py(py, m)).collect()
}

/// A push's destinations from the decode ranks' metadata: ``{"kv": ..., "ssm": [(kind,
/// meta), ...]}``; ``slot`` (the SSM slot cached for the final ``block``) adds the SSM kinds.
#[pyfunction]
#[pyo3(signature = (request_id, decode_metas, slot=None, block=0))]
pub fn reference_push_metas<'py>(
    request_id: u64,
    decode_metas: &Bound<'py, PyAny>,
    slot: Option<i64>,
    block: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let py = decode_metas.py();
    let v = to_wire(decode_metas, "decode_metas").map_err(|e| in_handoff_metadata(py, e))?;
    let out = disagg_core::refticket::push_metas(request_id, &v, slot, block).py()?;
    wire_to_py(py, &out)
}
