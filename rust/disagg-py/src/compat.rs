//! Bindings of a reference-design engine's handoff steps (`disagg_core::refdecode`).

use disagg_core::refdecode;
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::args::{conv, Conv, Int, I64, U64};
use crate::error::{in_handoff_metadata, IntoPyResult};
use crate::wire::to_wire;

/// ``setup_kv_transfer`` on a reference-design engine: its check (``HandoffStateError``
/// naming the field) and plan, ``(pinning, kv_heads)``.
#[pyfunction]
pub fn reference_setup(facts: &Bound<'_, PyAny>) -> PyResult<(bool, u64)> {
    let v = to_wire(facts, "facts").map_err(|e| in_handoff_metadata(facts.py(), e))?;
    let plan = refdecode::setup_plan(&v).py()?;
    Ok((plan.pinning, plan.kv_heads))
}

type Items<'py> = Vec<Bound<'py, PyAny>>;

/// What an admitted import registers in the prefix cache, ``(blocks, hashes, parent_hashes,
/// precomputed)``.
#[pyfunction]
pub fn reference_hash_registration<'py>(
    py: Python<'py>,
    local_blocks: Items<'py>,
    hashes: Items<'py>,
    cached: usize,
) -> (Items<'py>, Items<'py>, Items<'py>, Option<Items<'py>>) {
    let span = refdecode::hash_span(local_blocks.len(), hashes.len(), cached);
    let (start, end) = (span.start, span.end);
    let zero = PyInt::new(py, 0).into_any();
    let parents = std::iter::once(zero).chain(hashes.iter().cloned());
    let parents = parents.skip(start).take(end - start).collect();
    let precomputed = span.precomputed.then(|| hashes[..end].to_vec());
    (local_blocks[start..end].to_vec(), hashes[start..end].to_vec(), parents, precomputed)
}

/// The request's token limit once the handed-off ``first`` token was appended.
#[pyfunction]
#[pyo3(signature = (limit, generated, first, termination_id, stop_hit))]
pub fn reference_first_token_limit(
    limit: Int,
    generated: Int,
    first: Int,
    termination_id: Option<Int>,
    stop_hit: bool,
) -> PyResult<i64> {
    conv!(limit: I64, generated: U64, first: I64);
    let termination_id = termination_id.map(|t| I64::conv("termination_id", t)).transpose()?;
    Ok(refdecode::first_token_limit(limit, generated, first, termination_id, stop_hit))
}

/// The live SSM slot reserved for an import (``allocate_slot``'s answer; None:
/// ``HandoffStateError``, the capacity changed after the check).
#[pyfunction]
pub fn reference_live_slot(slot: Option<Int>) -> PyResult<u64> {
    let slot = slot.map(|s| U64::conv("slot", s)).transpose()?;
    refdecode::live_slot(slot).py()
}
