//! Region tables of per-layer caches (`disagg_core::RegionTable`): `rows_by_region` and the
//! row-array argument `split_descriptors` uses.

use disagg_core::wire::peer::Region;
use disagg_core::{RegionTable, RowForm};
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::args::{describe, err, type_err, Int, Kind, Text};
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

/// What a region table argument must be.
const PAIRS: &str = "regions must be a list of (addr, nbytes) pairs";

/// `[(addr, nbytes), ...]` as a validated table (`MetadataError` naming `regions`).
fn table(regions: &Bound<'_, PyAny>) -> PyResult<RegionTable> {
    let not_pairs = || type_err("regions", format!("{PAIRS}, got {}", describe(regions)));
    let pairs: Vec<[Int; 2]> = regions.extract().map_err(|_| not_pairs())?;
    let region = |[addr, nbytes]: [Int; 2]| -> PyResult<Region> {
        let (addr, nbytes) =
            (addr.to_u64(Kind::Argument, "regions")?, nbytes.to_u64(Kind::Argument, "regions")?);
        Ok(Region { addr, nbytes })
    };
    RegionTable::new("regions", pairs.into_iter().map(region).collect::<PyResult<_>>()?).py()
}

/// `RegionTable::group` of gather or scatter rows: `[(region_index, rows), ...]`; with one
/// region the rows come back as they are (checked).
#[pyfunction]
pub fn rows_by_region<'py>(
    py: Python<'py>,
    rows: Bound<'py, PyAny>,
    form: Text,
    regions: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let form = RowForm::parse(form.get("form")?).py()?;
    let t = table(regions)?;
    let groups = {
        let r = rows_arg(&rows, "rows")?;
        let view = r.rows()?;
        py.detach(|| t.group(view, form)).py()?
    };
    let out = PyList::empty(py);
    match groups {
        None => out.append((0usize, rows))?,
        Some(groups) => {
            for (i, g) in groups {
                out.append((i, crate::compile::rows_to_numpy(py, g)?))?;
            }
        }
    }
    Ok(out)
}
