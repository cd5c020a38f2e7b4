//! Bindings of the reference-design engine's ticket metadata (`disagg_core::refticket`).

use pyo3::prelude::*;

use crate::args::Raw;
use crate::pool::core_fns;
use crate::wire::HandoffWire;

core_fns! {
    /// `disagg_core::refticket::prefill_metas` (`blocks`: the prompt blocks, kept out of
    /// `facts`; `slots`: per request, the SSM slot of a hybrid engine).
    #[pyo3(signature = (facts, blocks, slots=None))]
    fn reference_prefill_metas(facts: HandoffWire, blocks: Raw<Vec<Vec<u64>>>,
        slots: Raw<Option<Vec<i64>>>) -> Vec<Py<PyAny>>
        = disagg_core::refticket::prefill_metas(&facts, &blocks, slots.as_deref());
    /// `disagg_core::refticket::push_metas`: `{"kv": ..., "ssm": [(kind, meta), ...]}`.
    #[pyo3(signature = (request_id, decode_metas, slot=None, block=0))]
    fn reference_push_metas(request_id: Raw<u64>, decode_metas: HandoffWire,
        slot: Raw<Option<i64>>, block: Raw<u64>) -> Py<PyAny>
        = disagg_core::refticket::push_metas(request_id, &decode_metas, slot, block);
}
