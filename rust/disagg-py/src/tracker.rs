//! Bindings of the model-parallel coordinator's report book
//! (`disagg_core::completion_tracker`).

use std::sync::Mutex;

use disagg_core::completion_tracker::CompletionTracker;
use pyo3::prelude::*;

use crate::args::{Raw, U32, U64};
use crate::error::IntoPyResult;
use crate::pool::{core_methods, lock_with};

/// `disagg_core::completion_tracker::CompletionTracker`: every rank's terminal reports.
#[pyclass(name = "CompletionTracker", module = "disagg_rs", frozen)]
pub struct PyCompletionTracker(Mutex<CompletionTracker>);

core_methods!(PyCompletionTracker, lock_with, 0,
ctors {
    #[new]
    fn new(world_size: U32) = CompletionTracker::new(world_size).py()?.into();
}
calls {
    /// Record one rank's report (``HandoffStateError`` when it contradicts its own earlier one).
    fn record(request_id: U64, rank: U32, failed: Raw<bool>) -> ()
        = record(request_id, rank, failed);
    /// Decisions since the last drain, ``(request_id, failed)`` in decision order.
    fn drain() -> Vec<(u64, bool)> = drain();
    fn open_ids() -> Vec<u64> = open_ids();
    fn forget(request_id: U64) -> () = forget(request_id);
    fn reset() -> () = reset();
    #[getter] fn world_size() -> u32 = world_size();
    #[getter] fn num_open() -> usize = num_open();
}
methods {});
