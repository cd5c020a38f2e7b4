//! Bindings of the row-list copies (`disagg_core::runs`): the copy kernel's run tables and
//! the torch path's row copies.

use disagg_core::runs::{self, ListForm};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// A row copy: row width, scattered-side rows, packed-side rows (or none), bytes.
type RowCopy<'py> = (u64, Bound<'py, PyArray1<i64>>, Option<Bound<'py, PyArray1<i64>>>, u64);

/// A run table: the host array the kernel reads and its sizes.
type Table<'py> = (Bound<'py, PyArray1<i64>>, usize, u64, u64, u64, u64, u32);

/// A row list's values (row-major), its column count and its form.
fn list<'a>(
    rows: &'a PyReadonlyArray2<'_, u64>,
    form: &str,
) -> PyResult<(&'a [u64], usize, ListForm)> {
    Ok((rows.as_slice()?, rows.shape()[1], ListForm::from_name(form).py()?))
}

/// `runs::run_table` of a compiler row list as `(host, n_runs, unit, total_bytes,
/// other_end_bytes, min_run_units, div_bits)`, or `None`.
#[pyfunction]
pub fn run_table<'py>(
    py: Python<'py>,
    rows: PyReadonlyArray2<'py, u64>,
    form: &str,
    other_base: u64,
    other_limit: u64,
    packed_limit: u64,
    align: Vec<u64>,
) -> PyResult<Option<Table<'py>>> {
    let (flat, cols, form) = list(&rows, form)?;
    let table = py
        .detach(|| runs::run_table(flat, cols, form, other_base, other_limit, packed_limit, &align))
        .py()?;
    Ok(table.map(|t| {
        let host = t.host.into_pyarray(py);
        (host, t.n_runs, t.unit, t.total_bytes, t.other_end_bytes, t.min_run_units, t.div_bits)
    }))
}

/// `runs::row_copy` of a `gather` or `scatter` list as `(row_bytes, side_rows, packed_rows or
/// None, total_bytes)`.
#[pyfunction]
pub fn row_copy<'py>(
    py: Python<'py>,
    rows: PyReadonlyArray2<'py, u64>,
    form: &str,
    base: u64,
    limits: (u64, u64),
) -> PyResult<RowCopy<'py>> {
    let (flat, cols, form) = list(&rows, form)?;
    let rc = py.detach(|| runs::row_copy(flat, cols, form, base, limits.0, limits.1)).py()?;
    let packed = rc.packed_rows.map(|v| v.into_pyarray(py));
    Ok((rc.row_bytes, rc.side_rows.into_pyarray(py), packed, rc.total))
}
