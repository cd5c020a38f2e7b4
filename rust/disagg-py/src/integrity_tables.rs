//! Bindings of the integrity digest tables (`disagg_core::integrity_tables`): assembling the
//! full tables from every rank's pieces and finding the first cell a rank disagrees with.

use disagg_core::integrity_tables::{
    conv_bands, describe, first_mismatch, merge, shapes, Mismatch, Piece,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::args::Raw;
use crate::error::IntoPyResult;
use crate::layout::{PyKvShardLayout, PySsmShardLayout};
use crate::pool::core_fns;

/// A conv band: `(band, global units [lo, hi), local channels [lo, hi))`.
type Band = (&'static str, (u32, u32), (u32, u32));

core_fns! {
    /// `integrity_tables::shapes`: `[(table, shape)]` of the parts the model has.
    #[pyo3(signature = (kv_layout, ssm_layout, num_chunks=1))]
    fn integrity_shapes(kv_layout: Raw<Option<PyKvShardLayout>>,
        ssm_layout: Raw<Option<PySsmShardLayout>>, num_chunks: Raw<u64>) -> Vec<(String, Vec<u64>)>
        = shapes(kv_layout.map(|l| l.inner).as_ref(), ssm_layout.map(|l| l.inner).as_ref(),
            num_chunks);
    /// `integrity_tables::conv_bands` of one rank, bands `x`, `B`, `C` in order.
    fn integrity_conv_bands(layout: Raw<PySsmShardLayout>) -> Vec<Band>
        = conv_bands(&layout.inner).into_iter().map(|(b, u, c)| (b, (u.lo, u.hi), (c.lo, c.hi)))
            .collect::<Vec<_>>();
    /// `integrity_tables::describe` of a mismatching cell.
    #[pyo3(signature = (table, layer, unit, expected, got, kv=None, band=None, tokens=None))]
    fn integrity_mismatch_text(table: Raw<String>, layer: Raw<u64>, unit: Raw<u64>,
        expected: Raw<u64>, got: Raw<u64>, kv: Raw<Option<String>>, band: Raw<Option<String>>,
        tokens: Raw<Option<(u64, u64)>>) -> String
        = describe(&Mismatch { piece: 0, table, layer, unit, expected, got, kv, tokens },
            band.as_deref());
}

/// A piece as given: table name, first layer, first unit, entries (`uint64`, any shape),
/// read into the entries' shape and row-major values.
#[derive(FromPyObject)]
pub struct PieceArg(String, u64, u64, #[pyo3(from_py_with = owned)] (Vec<u64>, Vec<u64>));

/// The shape and row-major entries of a `uint64` array.
fn owned(a: &Bound<'_, PyAny>) -> PyResult<(Vec<u64>, Vec<u64>)> {
    let a = a.extract::<PyReadonlyArrayDyn<'_, u64>>()?;
    Ok((a.shape().iter().map(|&d| d as u64).collect(), a.as_array().iter().copied().collect()))
}

/// The core's borrowed view of the pieces.
fn views(pieces: &[PieceArg]) -> Vec<Piece<'_>> {
    pieces
        .iter()
        .map(|PieceArg(table, layer_start, unit_start, (shape, entries))| Piece {
            table,
            layer_start: *layer_start,
            unit_start: *unit_start,
            shape,
            entries,
        })
        .collect()
}

/// `integrity_tables::merge`: the full tables, flat, per name of ``shapes``.
#[pyfunction]
pub fn integrity_merge(
    py: Python<'_>,
    shapes: Vec<(String, Vec<u64>)>,
    pieces: Vec<PieceArg>,
) -> PyResult<Vec<Bound<'_, PyArray1<u64>>>> {
    let tables = merge(&shapes, &views(&pieces)).py()?;
    Ok(tables.into_iter().map(|t| t.into_pyarray(py)).collect())
}

/// `integrity_tables::first_mismatch` as a tuple of the `Mismatch` fields, or ``None``.
#[pyfunction]
#[pyo3(signature = (shapes, tables, pieces, first_chunk=0, chunk_tokens=None))]
#[allow(clippy::type_complexity)]
pub fn integrity_first_mismatch(
    shapes: Vec<(String, Vec<u64>)>,
    tables: Vec<PyReadonlyArrayDyn<'_, u64>>,
    pieces: Vec<PieceArg>,
    first_chunk: u64,
    chunk_tokens: Option<u64>,
) -> PyResult<Option<(usize, String, u64, u64, u64, u64, Option<String>, Option<(u64, u64)>)>> {
    let flat: Vec<Vec<u64>> =
        tables.iter().map(|t| t.as_array().iter().copied().collect()).collect();
    let refs: Vec<&[u64]> = flat.iter().map(Vec::as_slice).collect();
    let found = first_mismatch(&shapes, &refs, &views(&pieces), first_chunk, chunk_tokens).py()?;
    Ok(found.map(|m| (m.piece, m.table, m.layer, m.unit, m.expected, m.got, m.kv, m.tokens)))
}
