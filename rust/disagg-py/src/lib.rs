//! `PyO3` bindings of disagg-core: the private extension module `disagg_rs._core`.
//!
//! Bindings only: argument conversion, GIL release around heavy work, and the one mapping of
//! core errors to `disagg_rs.exceptions`. No decisions live here.

// PyO3 extracts #[pyfunction] arguments by value; a reference is not an option there.
#![allow(clippy::needless_pass_by_value)]

mod args;
mod compile;
mod control;
mod driver;
mod error;
mod geometry;
mod layout;
mod ledger;
mod peer_records;
mod pool;
mod regions;
mod reshard;
mod rows;
mod staging;
mod tags;
mod wire;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(error::_error_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(error::_raise_sample_error, m)?)?;
    m.add_function(wrap_pyfunction!(control::decode_control_message, m)?)?;
    m.add_class::<control::LinkLiveness>()?;
    m.add_function(wrap_pyfunction!(tags::two_sided_tag, m)?)?;
    m.add_function(wrap_pyfunction!(tags::two_sided_tag_owner, m)?)?;
    m.add("MAX_TWO_SIDED_REQUEST_ID", disagg_core::tags::MAX_TWO_SIDED_REQUEST_ID)?;
    m.add_class::<layout::PyKvShardLayout>()?;
    m.add_class::<layout::PySsmStateDims>()?;
    m.add_class::<layout::PySsmShardLayout>()?;
    m.add_class::<reshard::PyKvReshardTransfer>()?;
    m.add_class::<reshard::PyKvReshardPlan>()?;
    m.add_class::<reshard::PySsmReshardTransfer>()?;
    m.add_class::<reshard::PySsmReshardPlan>()?;
    m.add_function(wrap_pyfunction!(regions::rows_by_region, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::py_plan_kv_reshard, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::py_plan_ssm_reshard, m)?)?;
    m.add_function(wrap_pyfunction!(peer_records::transfer_peer_records, m)?)?;
    m.add_function(wrap_pyfunction!(peer_records::transfer_block_count, m)?)?;
    m.add_function(wrap_pyfunction!(peer_records::drop_transfer_prefix_blocks, m)?)?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<pool::PySlotPool>()?;
    m.add_class::<staging::PyStagingRanges>()?;
    m.add_function(wrap_pyfunction!(staging::write_pull_ids, m)?)?;
    m.add_function(wrap_pyfunction!(staging::pull_ids_len, m)?)?;
    m.add_class::<ledger::PyLedgerAction>()?;
    m.add_class::<ledger::PyImportLedger>()?;
    m.add_class::<ledger::PyPinLedger>()?;
    m.add_class::<ledger::PyCompletionQuorum>()?;
    m.add_class::<geometry::PyKvGeometry>()?;
    m.add_class::<geometry::PySsmGeometry>()?;
    m.add_class::<compile::PyTransferProgram>()?;
    m.add_function(wrap_pyfunction!(compile::py_compile_kv_transfer, m)?)?;
    m.add_function(wrap_pyfunction!(compile::py_compile_ssm_transfer, m)?)?;
    m.add_class::<wire::PyPeer>()?;
    m.add_class::<wire::PyPeerTable>()?;
    m.add_function(wrap_pyfunction!(wire::plan_peer_transfer, m)?)?;
    m.add_function(wrap_pyfunction!(wire::check_peer_transfer, m)?)?;
    m.add_function(wrap_pyfunction!(wire::compile_peer_transfer, m)?)?;
    m.add_function(wrap_pyfunction!(wire::parse_peer_meta, m)?)?;
    m.add_function(wrap_pyfunction!(wire::check_staging_tickets_of, m)?)?;
    m.add_function(wrap_pyfunction!(wire::check_handoff_ticket, m)?)?;
    m.add_function(wrap_pyfunction!(wire::check_reference_ticket, m)?)?;
    m.add_function(wrap_pyfunction!(wire::check_reference_prefill, m)?)?;
    m.add_function(wrap_pyfunction!(wire::py_compat_hash, m)?)?;
    m.add_function(wrap_pyfunction!(wire::peer_meta_parses, m)?)?;
    m.add_function(wrap_pyfunction!(wire::block_id_checks, m)?)?;
    m.add_class::<driver::PyEngineDriverState>()?;
    Ok(())
}
