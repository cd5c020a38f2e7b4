//! Bindings of a device plan's table (`disagg_core::packed_items`).

use disagg_core::packed_items::{CopySpec, KernelSides, PlaneTable, SideArgs, SideKind};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// One launch: ``(k_lo, k_hi, nbytes, (bias0, cut1, bias1, cut2, bias2))``.
type LaunchTuple = (u64, u64, u64, [i64; 5]);

/// One side of a copy as Python gives it: ``(kind, block ids or None, buffer bytes, bias,
/// set stride, buffer address)``.
type SideTuple = (String, Option<u64>, u64, u64, u64, u64);

/// A launch's ``(unit, a side, b side)``, each side ``(plane column, block stride, token
/// stride, packed)`` in bytes.
type SidesTuple = (u64, (u64, u64, u64, bool), (u64, u64, u64, bool));

fn kind(name: &str) -> PyResult<SideKind> {
    SideKind::parse(name).py()
}

fn spec(s: &SideTuple) -> PyResult<CopySpec> {
    let kind = kind(&s.0)?;
    Ok(CopySpec { kind, ids: s.1, nbytes: s.2, bias: s.3, set_stride: s.4, addr: s.5 })
}

fn sides(s: KernelSides) -> SidesTuple {
    let args = |a: SideArgs| (a.col, a.block_stride, a.token_stride, a.packed);
    (s.unit, args(s.a), args(s.b))
}

/// A device plan's table (`disagg_core::packed_items::PlaneTable`): plane rows ``(src offset,
/// dst offset, packed coefficient, row bytes)``, block size and strides ``(src block, src
/// token, dst block, dst token)``.
#[pyclass(name = "PackedRows", module = "disagg_rs", frozen)]
pub struct PyPackedRows {
    pub table: PlaneTable,
}

#[pymethods]
impl PyPackedRows {
    #[new]
    fn new(planes: Vec<[i64; 4]>, tokens_per_block: u64, strides: [u64; 4]) -> PyResult<Self> {
        Ok(Self { table: PlaneTable::new(&planes, tokens_per_block, strides).py()? })
    }

    /// Packed byte offset where item ``k`` of an ``n_tok``-token copy starts.
    fn offset(&self, k: u64, n_tok: u64) -> PyResult<u64> {
        self.table.items(n_tok).py()?.offset(k).py()
    }

    /// Largest power of two <= 16 dividing every plane offset, row, stride and address.
    fn unit(&self, addresses: Vec<u64>) -> u64 {
        self.table.unit(&addresses)
    }

    /// One past the last byte a paged side (``"src"`` / ``"dst"``) can touch with block
    /// ids below ``num_blocks``.
    fn paged_end(&self, kind_name: &str, num_blocks: u64) -> PyResult<i64> {
        self.table.paged_end(kind(kind_name)?, num_blocks).py()
    }

    /// A copy from the paged buffer ``a`` (``(kind, address)``) into ``b`` (``(kind,
    /// address, bytes)``), prepared once: ``((unit, a side, b side), packed window or None)``.
    fn prepare(
        &self,
        a: (String, u64),
        b: (String, u64, u64),
    ) -> PyResult<(SidesTuple, Option<u64>)> {
        let (s, window) = self.table.prepare(kind(&a.0)?, kind(&b.0)?, a.1, b.1, b.2).py()?;
        Ok((sides(s), window))
    }

    /// ``(k_lo, k_hi, byte_lo, byte_hi)`` of every chunk of an ``n_tok``-token copy, each
    /// whole items of at most ``max_bytes`` (one item at least).
    fn chunks(&self, n_tok: u64, max_bytes: u64) -> PyResult<Vec<(u64, u64, u64, u64)>> {
        let cut = self.table.items(n_tok).py()?.chunks(max_bytes).py()?;
        Ok(cut.into_iter().map(|[a, b, x, y]| (a, b, x, y)).collect())
    }

    /// Check a copy of items ``items`` (``None``: all) of an ``n_tok``-token handoff from
    /// side ``a`` to side ``b`` (``(kind, block ids or None, buffer bytes, bias, set stride,
    /// buffer address)`` each; a packed side's window is its buffer) of a plan with ``sets`` id sets: ``((k_lo, k_hi,
    /// byte_lo, byte_hi), (unit, a side, b side))``.
    #[pyo3(signature = (n_tok, items, a, b, sets, paged_only))]
    fn check_copy(
        &self,
        n_tok: u64,
        items: Option<(u64, u64)>,
        a: SideTuple,
        b: SideTuple,
        sets: u64,
        paged_only: bool,
    ) -> PyResult<([u64; 4], SidesTuple)> {
        let (span, s) =
            self.table.check_copy(n_tok, items, &spec(&a)?, &spec(&b)?, sets, paged_only).py()?;
        Ok((span, sides(s)))
    }

    /// Check one launch of ``parts`` (``(byte offset, first item, end item)`` each,
    /// consecutive) into a packed window of ``window`` bytes (``None``: a paged destination,
    /// one range at 0) with ``unit``-byte kernel units, and the block ids it reads: ``ids``
    /// is ``(source ids, source set stride, id sets, destination ids)`` (a packed window
    /// reads no destination ids); ``ArgumentError`` naming the field.
    fn launch(
        &self,
        n_tok: u64,
        parts: Vec<(u64, u64, u64)>,
        window: Option<u64>,
        unit: u64,
        ids: [u64; 4],
    ) -> PyResult<LaunchTuple> {
        let l = self.table.items(n_tok).py()?.checked_launch(&parts, window, unit, ids).py()?;
        Ok((l.k_lo, l.k_hi, l.nbytes, l.placement))
    }
}
