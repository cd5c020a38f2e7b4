//! Bindings of a reference-design engine's handoff steps (`disagg_core::refdecode`) and its
//! ticket metadata (`disagg_core::refticket`).

use disagg_core::{refdecode, reference, refticket};
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::args::{conv, Opt, Raw, I64, U64};
use crate::peer_records::Node;
use crate::pool::core_fns;
use crate::wire::HandoffWire;

type Items<'py> = Vec<Bound<'py, PyAny>>;

/// ``refdecode::hash_registration``: ``(blocks, hashes, parent_hashes, precomputed)``.
#[pyfunction]
pub fn reference_hash_registration<'py>(
    py: Python<'py>,
    local_blocks: Items<'py>,
    hashes: Items<'py>,
    cached: usize,
) -> (Items<'py>, Items<'py>, Items<'py>, Option<Items<'py>>) {
    refdecode::hash_registration(&local_blocks, &hashes, PyInt::new(py, 0).into_any(), cached)
}

/// ``reference::check_ticket_blocks``: the ticket's source block count.
#[pyfunction]
pub fn reference_ticket_blocks(
    facts: Py<PyAny>,
    kv_meta: Bound<'_, PyAny>,
    src_block_ids: Bound<'_, PyAny>,
) -> PyResult<usize> {
    conv!(facts: HandoffWire);
    reference::check_ticket_blocks(facts, &Node(kv_meta), &Node(src_block_ids))
}

core_fns! {
    /// ``refdecode::setup_plan``: ``(pinning, kv_heads)``.
    fn reference_setup(facts: HandoffWire) -> (bool, u64)
        = refdecode::setup_plan(&facts).map(|p| (p.pinning, p.kv_heads));
    /// ``refdecode::import_sizes``: ``(lookup, continuation)``.
    fn reference_import_sizes(is_push: Raw<bool>, num_blocks: U64, prompt_length: U64,
        resume_tokens: U64, block_size: U64) -> (u64, u64)
        = refdecode::import_sizes(is_push, num_blocks, prompt_length, resume_tokens, block_size);
    /// ``refdecode::cached_prefix``.
    fn reference_cached_prefix(found: Raw<Vec<Option<u64>>>) -> Vec<u64>
        = refdecode::cached_prefix(&found);
    /// ``refdecode::first_token``: ``(limit, done)``.
    fn reference_first_token(limit: I64, generated: U64, first: I64, termination_id: Opt<I64>,
        stop_hit: Raw<bool>) -> (i64, bool) = {
            let t = refdecode::first_token(limit, generated, first, termination_id, stop_hit);
            (t.limit, t.done)
        };
    /// ``refdecode::record_sink``, by name.
    fn reference_record_sink(use_coordinator: Raw<bool>, is_mp_coordinator: Raw<bool>)
        -> &'static str = refdecode::record_sink(use_coordinator, is_mp_coordinator).name();
    /// ``refdecode::live_slot``.
    fn reference_live_slot(slot: Opt<U64>) -> u64 = refdecode::live_slot(slot);
    /// `refticket::prefill_metas` (`blocks`: the prompt blocks, kept out of `facts`; `slots`:
    /// per request, the SSM slot of a hybrid engine).
    #[pyo3(signature = (facts, blocks, slots=None))]
    fn reference_prefill_metas(facts: HandoffWire, blocks: Raw<Vec<Vec<u64>>>,
        slots: Raw<Option<Vec<i64>>>) -> Vec<Py<PyAny>>
        = refticket::prefill_metas(&facts, &blocks, slots.as_deref());
    /// `refticket::push_metas`: `{"kv": ..., "ssm": [(kind, meta), ...]}`.
    #[pyo3(signature = (request_id, decode_metas, slot=None, block=0))]
    fn reference_push_metas(request_id: Raw<u64>, decode_metas: HandoffWire,
        slot: Raw<Option<i64>>, block: Raw<u64>) -> Py<PyAny>
        = refticket::push_metas(request_id, &decode_metas, slot, block);
}
