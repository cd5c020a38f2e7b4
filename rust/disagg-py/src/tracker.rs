//! Bindings of the model-parallel coordinator's report book
//! (`disagg_core::completion_tracker`).

use std::sync::Mutex;

use disagg_core::completion_tracker::CompletionTracker;
use pyo3::prelude::*;

use crate::args::Int;
use crate::error::IntoPyResult;
use crate::pool::{lock, u32_arg, u64_arg};

/// Terminal transfer reports of every model-parallel rank, decided by the completion quorum
/// (all ok, or the first failure); a request decided as failed absorbs later reports.
#[pyclass(name = "CompletionTracker", module = "disagg_rs", frozen)]
pub struct PyCompletionTracker(Mutex<CompletionTracker>);

#[pymethods]
impl PyCompletionTracker {
    #[new]
    fn new(world_size: Int) -> PyResult<Self> {
        Ok(Self(Mutex::new(CompletionTracker::new(u32_arg("world_size", world_size)?).py()?)))
    }

    /// Record one rank's report (``HandoffStateError`` when it contradicts its own earlier one).
    fn record(&self, request_id: Int, rank: Int, failed: bool) -> PyResult<()> {
        let (r, k) = (u64_arg("request_id", request_id)?, u32_arg("rank", rank)?);
        lock(&self.0)?.record(r, k, failed).py()
    }

    /// Decisions since the last drain, ``(request_id, failed)`` in decision order.
    fn drain(&self) -> PyResult<Vec<(u64, bool)>> {
        Ok(lock(&self.0)?.drain())
    }

    /// Requests with reports and no decision yet, ascending.
    fn open_ids(&self) -> PyResult<Vec<u64>> {
        Ok(lock(&self.0)?.open_ids())
    }

    /// Drop everything known about a request that ended.
    fn forget(&self, request_id: Int) -> PyResult<()> {
        lock(&self.0)?.forget(u64_arg("request_id", request_id)?);
        Ok(())
    }

    /// Drop every open report and undrained decision; failed requests stay closed.
    fn reset(&self) -> PyResult<()> {
        lock(&self.0)?.reset();
        Ok(())
    }

    #[getter]
    fn world_size(&self) -> PyResult<u32> {
        Ok(lock(&self.0)?.world_size())
    }

    #[getter]
    fn num_open(&self) -> PyResult<usize> {
        Ok(lock(&self.0)?.num_open())
    }
}
