//! Descriptor arrays whose memory is recycled: a [`RowBuffer`] owns an array's rows and
//! returns them to the process-wide `disagg_core::row_pool::RowPool` when Python drops it.

use std::sync::Mutex;

use numpy::ndarray::{Array2, ArrayView2};
use numpy::PyArray2;
use pyo3::prelude::*;

use disagg_core::row_pool::RowPool;
use disagg_core::DisaggResult;

use crate::error::IntoPyResult;

static POOL: Mutex<RowPool> = Mutex::new(RowPool::new());

/// `RowPool::take` of the process-wide pool (a fresh buffer if its lock is poisoned).
fn take(n: usize) -> Vec<u64> {
    POOL.lock().map_or_else(|_| vec![0; n], |mut pool| pool.take(n))
}

/// Owner of one array's rows; returns them to the pool when Python drops the array.
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct RowBuffer {
    rows: Array2<u64>,
}

impl Drop for RowBuffer {
    fn drop(&mut self) {
        let rows = std::mem::replace(&mut self.rows, Array2::zeros((0, 3)));
        let (v, _) = rows.into_raw_vec_and_offset();
        if let Ok(mut pool) = POOL.lock() {
            pool.give_back(v);
        }
    }
}

/// Two `[n, 3]` `uint64` arrays (source and destination descriptor rows).
pub type RowPair<'py> = (Bound<'py, PyArray2<u64>>, Bound<'py, PyArray2<u64>>);

/// Two `[n, 3]` row lists filled by `fill` (it returns the rows written) as numpy arrays.
pub fn pair_with(
    py: Python<'_>,
    n: usize,
    fill: impl FnOnce(&mut [[u64; 3]], &mut [[u64; 3]]) -> DisaggResult<usize> + Send,
) -> PyResult<RowPair<'_>> {
    let (mut a, mut b) = (take(3 * n), take(3 * n));
    let written = py
        .detach(|| {
            let (ra, _) = a.as_chunks_mut::<3>();
            let (rb, _) = b.as_chunks_mut::<3>();
            fill(ra, rb)
        })
        .py()?;
    let m = written.min(n);
    a.truncate(3 * m);
    b.truncate(3 * m);
    Ok((to_numpy(py, a, m)?, to_numpy(py, b, m)?))
}

/// `rows` rows of `v` (three values each) as an `[n, 3]` array whose memory is recycled.
pub fn to_numpy(py: Python<'_>, v: Vec<u64>, rows: usize) -> PyResult<Bound<'_, PyArray2<u64>>> {
    let rows = Array2::from_shape_vec((rows, 3), v)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
    let owner = Bound::new(py, RowBuffer { rows })?;
    let view: ArrayView2<'_, u64> = owner.get().rows.view();
    // SAFETY: the array's data is the heap buffer of `owner.rows`, which `owner` (the array's
    // base object, kept alive by numpy for the array's whole life) never reallocates or
    // touches again until its `Drop`, which runs only once the array has released it.
    Ok(unsafe { PyArray2::borrow_from_array(&view, owner.clone().into_any()) })
}
