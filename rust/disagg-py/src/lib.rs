//! `PyO3` bindings of disagg-core: the private extension module `disagg_rs._core`.
//!
//! Bindings only: argument conversion, GIL release around heavy work, and the one mapping of
//! core errors to `disagg_rs.exceptions`. No decisions live here.

// PyO3 extracts #[pyfunction] arguments by value; a reference is not an option there.
#![allow(clippy::needless_pass_by_value)]

mod args;
mod backend_rules;
mod compat;
mod compile;
mod control;
mod control_step;
mod driver;
mod error;
mod geometry;
mod handoff;
mod integrity_tables;
mod layout;
mod ledger;
mod nixl_route;
mod packed_items;
mod peer_records;
mod pool;
mod regions;
mod reshard;
mod rows;
mod runs;
mod staging;
mod stream;
mod tags;
mod tracker;
mod wire;

use pyo3::prelude::*;

/// Register `classes` and `functions` on the module `m`.
macro_rules! export {
    ($m:ident, classes: [$($c:ty),* $(,)?], functions: [$($f:path),* $(,)?]) => {
        $($m.add_class::<$c>()?;)*
        $($m.add_function(wrap_pyfunction!($f, $m)?)?;)*
    };
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_TWO_SIDED_REQUEST_ID", disagg_core::tags::MAX_TWO_SIDED_REQUEST_ID)?;
    m.add("P2P_HEADER_BYTES", disagg_core::p2p_header::HEADER_BYTES)?;
    m.add("PACK_PARTS", disagg_core::packed_items::MAX_PARTS)?;
    m.add("REFERENCE_LAYOUT_FIELDS", disagg_core::refmeta::REFERENCE_LAYOUT_FIELDS.to_vec())?;
    m.add("REFERENCE_ADDRESS_FIELDS", disagg_core::refmeta::REFERENCE_ADDRESS_FIELDS.to_vec())?;
    #[rustfmt::skip]
    export!(
        m,
        classes: [
            control::LinkLiveness, control::ClientDeadlines, control_step::CoordinatorCore, control_step::FaultPlan, layout::PyKvShardLayout, layout::PySsmStateDims,
            layout::PySsmShardLayout, reshard::PyKvReshardTransfer, reshard::PyKvReshardPlan,
            reshard::PySsmReshardTransfer, reshard::PySsmReshardPlan, pool::PyBlockPool,
            pool::PySlotPool, staging::PyStagingRanges, staging::PyPullParts, ledger::PyLedgerAction,
            ledger::PyImportLedger, ledger::PyPinLedger, ledger::PyCompletionQuorum,
            geometry::PyKvGeometry, geometry::PySsmGeometry, compile::PyTransferProgram,
            wire::PyPeer, wire::PyPeerTable, backend_rules::PyPeerResolver, driver::PyEngineDriverState,
            ledger::PyReferenceImports, stream::PyStreamSource, stream::PyStreamSink,
            stream::PyStreamMailboxes, tags::PyPeerSteps, tracker::PyCompletionTracker,
            nixl_route::PyNixlAgentPeers, packed_items::PyPackedRows
        ],
        functions: [
            handoff::ticket_import, handoff::import_failure, handoff::import_pulls, handoff::push_sends, handoff::handoff_peer_plan, handoff::import_local_outcomes, handoff::fold_import_reports, handoff::settle_quiet_quarantines,
            handoff::refuse_reset_while_pinned, handoff::refuse_close_in_flight, handoff::gathered_integrity_pieces,
            error::_sample_errors, control::decode_control_message, control_step::timeout_seconds, control_step::curve_mode,
            tags::two_sided_tag, tags::two_sided_tag_owner, tags::chunk_schedule, tags::p2p_matching, runs::run_table, runs::row_copy, regions::rows_by_region,
            reshard::plan_kv_reshard, reshard::plan_ssm_reshard,
            peer_records::transfer_peer_records, peer_records::transfer_block_count,
            peer_records::drop_transfer_prefix_blocks, peer_records::meta_from_reference, peer_records::kv_layout_from_reference, staging::write_pull_ids, staging::pull_ids_len,
            compile::py_compile_kv_transfer, geometry::plan_buffer,
            compile::py_compile_ssm_transfer, wire::check_peer_transfer,
            wire::compile_peer_transfer, wire::parse_peer_meta, wire::check_staging_tickets_of,
            wire::check_handoff_ticket, wire::check_reference, wire::check_integrity_wire, wire::digest_plan, wire::py_compat_hash, wire::peer_meta_parses, wire::peer_meta_lookups,
            wire::block_id_checks,
            stream::stream_abort_msgs,
            stream::staging_release,
            compat::reference_prefill_metas, compat::reference_push_metas, compat::reference_ticket_blocks,
            integrity_tables::integrity_merge, integrity_tables::integrity_shapes, integrity_tables::integrity_conv_bands,
            integrity_tables::integrity_first_mismatch, integrity_tables::integrity_mismatch_text,
            backend_rules::group_layouts, backend_rules::chunkable, backend_rules::staging_slots,
            backend_rules::check_chunk_blocks,
            backend_rules::packed_window, backend_rules::pipeline_launches,
            backend_rules::staging_path, backend_rules::ipc_same_host,
            backend_rules::ipc_reader_gpu, backend_rules::backend_peer_records,
            backend_rules::no_blocks, backend_rules::p2p_outcome, backend_rules::p2p_receives,
            backend_rules::p2p_sends, backend_rules::poll_verdict,
            backend_rules::buffer_tensors,
            nixl_route::ucx_tls_allows_cuda, nixl_route::nixl_cuda_major_mismatch,
            nixl_route::backend_supports_vram, nixl_route::nixl_setup,
            nixl_route::nixl_source_packs, nixl_route::nixl_source_stages,
            nixl_route::check_nixl_cuda_support, nixl_route::nixl_source_read, nixl_route::nixl_pull_route,
            nixl_route::slice_reads, nixl_route::ipc_bounds_hold, nixl_route::check_matched_slices,
            nixl_route::check_xfer_posted,
            compat::reference_setup, compat::reference_hash_registration,
            compat::reference_first_token, compat::reference_live_slot,
            compat::reference_import_sizes, compat::reference_cached_prefix,
            compat::reference_record_sink
        ]
    );
    Ok(())
}
