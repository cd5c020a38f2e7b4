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

/// What an import looks up and reserves first, ``(lookup, continuation)``: how many of its
/// ``num_blocks`` hashes to look up in the prefix cache (none on a push transport) and the
/// blocks beyond its ``prompt_length`` tokens for its ``resume_tokens``.
#[pyfunction]
pub fn reference_import_sizes(
    is_push: bool,
    num_blocks: Int,
    prompt_length: Int,
    resume_tokens: Int,
    block_size: Int,
) -> PyResult<(u64, u64)> {
    conv!(num_blocks: U64, prompt_length: U64, resume_tokens: U64, block_size: U64);
    refdecode::import_sizes(is_push, num_blocks, prompt_length, resume_tokens, block_size).py()
}

/// The reusable prefix of an import: the cached block of each looked-up hash (None: not
/// cached), as far as they run unbroken from the first block.
#[pyfunction]
pub fn reference_cached_prefix(found: Vec<Option<u64>>) -> Vec<u64> {
    refdecode::cached_prefix(&found)
}

/// The request after the handed-off ``first`` token (``generated`` tokens now): ``(limit,
/// done)``, its token limit (a termination token or a stop word ends it there) and whether
/// it has generated them all.
#[pyfunction]
#[pyo3(signature = (limit, generated, first, termination_id, stop_hit))]
pub fn reference_first_token(
    limit: Int,
    generated: Int,
    first: Int,
    termination_id: Option<Int>,
    stop_hit: bool,
) -> PyResult<(i64, bool)> {
    conv!(limit: I64, generated: U64, first: I64);
    let termination_id = termination_id.map(|t| I64::conv("termination_id", t)).transpose()?;
    let t = refdecode::first_token(limit, generated, first, termination_id, stop_hit);
    Ok((t.limit, t.done))
}

/// Where a finished request's record goes: ``"coordinator"`` (this rank coordinates its
/// model-parallel group), ``"caller"`` (no coordinator) or ``"elsewhere"`` (another rank
/// sends it).
#[pyfunction]
pub fn reference_record_sink(use_coordinator: bool, is_mp_coordinator: bool) -> &'static str {
    refdecode::record_sink(use_coordinator, is_mp_coordinator).name()
}

/// The live SSM slot reserved for an import (``allocate_slot``'s answer; None:
/// ``HandoffStateError``, the capacity changed after the check).
#[pyfunction]
pub fn reference_live_slot(slot: Option<Int>) -> PyResult<u64> {
    let slot = slot.map(|s| U64::conv("slot", s)).transpose()?;
    refdecode::live_slot(slot).py()
}
