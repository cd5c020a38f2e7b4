//! Bindings of the integrity digest tables (`disagg_core::integrity_tables`): assembling the
//! full tables from every rank's pieces and finding the first cell a rank disagrees with.

use disagg_core::integrity_tables::{describe, first_mismatch, merge, Mismatch, Piece};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::error::IntoPyResult;
use crate::layout::{PyKvShardLayout, PySsmShardLayout};

/// The digest table shapes of a model given any rank's layouts (and the KV chunk count):
/// ``{"kv": ..., "conv": ..., "recurrent": ...}`` for the parts the model has.
#[pyfunction]
#[pyo3(signature = (kv_layout, ssm_layout, num_chunks=1))]
pub fn integrity_shapes(
    kv_layout: Option<PyRef<'_, PyKvShardLayout>>,
    ssm_layout: Option<PyRef<'_, PySsmShardLayout>>,
    num_chunks: u64,
) -> PyResult<Vec<(String, Vec<u64>)>> {
    let kv = kv_layout.as_ref().map(|l| &l.inner);
    let ssm = ssm_layout.as_ref().map(|l| &l.inner);
    disagg_core::integrity_tables::shapes(kv, ssm, num_chunks).py()
}

/// A conv band: `(band, global units [lo, hi), local channels [lo, hi))`.
type Band = (&'static str, (u32, u32), (u32, u32));

/// One rank's part of the conv table per band, bands `x`, `B`, `C` in order.
#[pyfunction]
pub fn integrity_conv_bands(layout: PyRef<'_, PySsmShardLayout>) -> Vec<Band> {
    let bands = disagg_core::integrity_tables::conv_bands(&layout.inner);
    bands.into_iter().map(|(b, u, c)| (b, (u.lo, u.hi), (c.lo, c.hi))).collect()
}

/// A piece as given: table name, first layer, first unit, entries (`uint64`, any shape).
type PieceArg<'py> = (String, u64, u64, PyReadonlyArrayDyn<'py, u64>);

/// Shapes and row-major entries of the pieces, owned for the core's borrowed view.
fn owned(pieces: &[PieceArg<'_>]) -> Vec<(Vec<u64>, Vec<u64>)> {
    pieces
        .iter()
        .map(|(_, _, _, a)| {
            let shape = a.shape().iter().map(|&d| d as u64).collect();
            (shape, a.as_array().iter().copied().collect())
        })
        .collect()
}

fn views<'a>(pieces: &'a [PieceArg<'_>], data: &'a [(Vec<u64>, Vec<u64>)]) -> Vec<Piece<'a>> {
    pieces
        .iter()
        .zip(data)
        .map(|((table, layer_start, unit_start, _), (shape, entries))| Piece {
            table,
            layer_start: *layer_start,
            unit_start: *unit_start,
            shape,
            entries,
        })
        .collect()
}

/// The full tables, per name of ``shapes``, flat and row-major, from every rank's
/// ``pieces`` ``(table, layer_start, unit_start, entries)``: the first holder of a cell wins;
/// ``ArgumentError`` for an unknown table, a piece that overruns its table, or a cell no piece
/// holds.
#[pyfunction]
pub fn integrity_merge<'py>(
    py: Python<'py>,
    shapes: Vec<(String, Vec<u64>)>,
    pieces: Vec<PieceArg<'py>>,
) -> PyResult<Vec<Bound<'py, PyArray1<u64>>>> {
    let data = owned(&pieces);
    let tables = merge(&shapes, &views(&pieces, &data)).py()?;
    Ok(tables.into_iter().map(|t| t.into_pyarray(py)).collect())
}

/// The first cell of ``pieces`` whose entry differs from ``tables`` (flat, per name of
/// ``shapes``), KV chunks before ``first_chunk`` skipped: ``(piece index, table, layer, unit,
/// expected, got, kv, tokens)``, or ``None``.
#[pyfunction]
#[pyo3(signature = (shapes, tables, pieces, first_chunk=0, chunk_tokens=None))]
#[allow(clippy::type_complexity)]
pub fn integrity_first_mismatch(
    shapes: Vec<(String, Vec<u64>)>,
    tables: Vec<PyReadonlyArrayDyn<'_, u64>>,
    pieces: Vec<PieceArg<'_>>,
    first_chunk: u64,
    chunk_tokens: Option<u64>,
) -> PyResult<Option<(usize, String, u64, u64, u64, u64, Option<String>, Option<(u64, u64)>)>> {
    let flat: Vec<Vec<u64>> =
        tables.iter().map(|t| t.as_array().iter().copied().collect()).collect();
    let refs: Vec<&[u64]> = flat.iter().map(Vec::as_slice).collect();
    let data = owned(&pieces);
    let found =
        first_mismatch(&shapes, &refs, &views(&pieces, &data), first_chunk, chunk_tokens).py()?;
    Ok(found.map(|m| (m.piece, m.table, m.layer, m.unit, m.expected, m.got, m.kv, m.tokens)))
}

/// A one-line description of a mismatching cell naming it and both values.
#[pyfunction]
#[pyo3(signature = (table, layer, unit, expected, got, kv=None, band=None, tokens=None))]
#[allow(clippy::too_many_arguments)]
pub fn integrity_mismatch_text(
    table: String,
    layer: u64,
    unit: u64,
    expected: u64,
    got: u64,
    kv: Option<String>,
    band: Option<String>,
    tokens: Option<(u64, u64)>,
) -> String {
    let m = Mismatch { piece: 0, table, layer, unit, expected, got, kv, tokens };
    describe(&m, band.as_deref())
}
