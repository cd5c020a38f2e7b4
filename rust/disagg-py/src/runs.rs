//! Bindings of the row-list copies (`disagg_core::runs`): the copy kernel's run tables and
//! the torch path's row copies.

use disagg_core::runs::{self, ListForm};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// A row copy: row width, units of both sides, scattered-side rows, packed-side rows (or none),
/// bytes.
type RowCopy<'py> =
    (u64, (u64, u64), Bound<'py, PyArray1<i64>>, Option<Bound<'py, PyArray1<i64>>>, u64);

/// A run table: the host array the kernel reads and its sizes.
type Table<'py> = (Bound<'py, PyArray1<i64>>, usize, u64, u64, u64, u64, u32);

/// A compiler row list as Python passes it: `(rows, form name, base, (scattered-side limit,
/// packed-side limit))`, the scattered side's addresses relative to `base`.
#[derive(FromPyObject)]
pub struct RowList<'py>(PyReadonlyArray2<'py, u64>, String, u64, (u64, u64));

impl RowList<'_> {
    /// The list's values (row-major), its column count and its form.
    fn parts(&self) -> PyResult<(&[u64], usize, ListForm)> {
        Ok((self.0.as_slice()?, self.0.shape()[1], ListForm::from_name(&self.1).py()?))
    }
}

/// `runs::run_table` of a row list: `(host, n_runs, unit, total_bytes, other_end_bytes,
/// min_run_units, div_bits)`, or `None`.
#[pyfunction]
pub fn run_table(list: RowList<'_>, align: Vec<u64>) -> PyResult<Option<Table<'_>>> {
    let py = list.0.py();
    let ((flat, cols, form), base, (other, packed)) = (list.parts()?, list.2, list.3);
    let table =
        py.detach(|| runs::run_table(flat, cols, form, base, other, packed, &align)).py()?;
    Ok(table.map(|t| {
        let host = t.host.into_pyarray(py);
        (host, t.n_runs, t.unit, t.total_bytes, t.other_end_bytes, t.min_run_units, t.div_bits)
    }))
}

/// `runs::row_copy_units` of a `gather` or `scatter` list between byte views at `offsets`:
/// `(row_bytes, units, side_rows, packed_rows or None, total_bytes)`.
#[pyfunction]
pub fn row_copy(list: RowList<'_>, offsets: (u64, u64)) -> PyResult<RowCopy<'_>> {
    let py = list.0.py();
    let ((flat, cols, form), base, limits) = (list.parts()?, list.2, list.3);
    let (rc, units) =
        py.detach(|| runs::row_copy_units(flat, cols, (form, base), limits, offsets)).py()?;
    let packed = rc.packed_rows.map(|v| v.into_pyarray(py));
    Ok((rc.row_bytes, units, rc.side_rows.into_pyarray(py), packed, rc.total))
}
