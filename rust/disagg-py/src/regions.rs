//! Region tables of per-layer caches (`disagg_core::RegionTable`): `rows_by_region` and the
//! row-array argument `split_descriptors` uses.

use disagg_core::wire::peer::Region;
use disagg_core::{RegionTable, RowForm};
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::args::{describe, err, type_err, Kind, Text};
use crate::error::IntoPyResult;

/// A caller's `[n, 3]` C-contiguous `uint64` row array, read in place.
pub(crate) struct RowsArg<'py> {
    arr: PyReadonlyArray2<'py, u64>,
    field: &'static str,
}

pub(crate) fn rows_arg<'py>(
    obj: &Bound<'py, PyAny>,
    field: &'static str,
) -> PyResult<RowsArg<'py>> {
    let arr = obj.extract::<PyReadonlyArray2<'py, u64>>().map_err(|_| {
        type_err(
            field,
            format!("{field} must be a numpy uint64 array [n, 3], got {}", describe(obj)),
        )
    })?;
    if arr.shape()[1] != 3 || !arr.is_c_contiguous() {
        return Err(err(
            Kind::Argument,
            field,
            format!("{field} must be C-contiguous with shape [n, 3], got {:?}", arr.shape()),
        ));
    }
    Ok(RowsArg { arr, field })
}

impl RowsArg<'_> {
    /// The rows, borrowed.
    pub(crate) fn rows(&self) -> PyResult<&[[u64; 3]]> {
        let flat =
            self.arr.as_slice().map_err(|e| err(Kind::Argument, self.field, e.to_string()))?;
        Ok(flat.as_chunks::<3>().0)
    }
}

/// `[(addr, nbytes), ...]` as a validated table (`MetadataError` naming `regions`).
fn table(regions: &Bound<'_, PyAny>) -> PyResult<RegionTable> {
    let pairs: Vec<[u64; 2]> = regions.extract().map_err(|_| {
        let got = describe(regions);
        type_err("regions", format!("regions must be a list of (addr, nbytes) pairs, got {got}"))
    })?;
    let regions = pairs.into_iter().map(|[addr, nbytes]| Region { addr, nbytes }).collect();
    RegionTable::new("regions", regions).py()
}

/// `RegionTable::group` of gather or scatter rows: `[(region_index, rows), ...]`; with one
/// region the rows come back as they are (checked).
#[pyfunction]
pub fn rows_by_region<'py>(
    py: Python<'py>,
    rows: Bound<'py, PyAny>,
    form: Text,
    regions: &Bound<'py, PyAny>,
) -> PyResult<Vec<(usize, Bound<'py, PyAny>)>> {
    let form = RowForm::parse(form.get("form")?).py()?;
    let t = table(regions)?;
    let groups = {
        let r = rows_arg(&rows, "rows")?;
        let view = r.rows()?;
        py.detach(|| t.group(view, form)).py()?
    };
    let Some(groups) = groups else { return Ok(vec![(0, rows)]) };
    let part = |(i, g)| Ok((i, crate::compile::rows_to_numpy(py, g)?.into_any()));
    groups.into_iter().map(part).collect()
}
