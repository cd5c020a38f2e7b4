//! Bindings of a device plan's packed item order (`disagg_core::packed_items`).

use disagg_core::packed_items::{CopySide, PackedItems};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// One launch: ``(k_lo, k_hi, nbytes, (bias0, cut1, bias1, cut2, bias2))``.
type LaunchTuple = (u64, u64, u64, [i64; 5]);

/// One side of a copy as Python gives it: ``(kind, ids or window bytes, bias, set stride)``.
type SideTuple = (String, Option<u64>, u64, u64);

fn side(s: &SideTuple) -> PyResult<CopySide> {
    CopySide::parse(&s.0, s.1, s.2, s.3).py()
}

/// The plane rows of a device plan, ``(packed coefficient, row bytes per token)`` each, and
/// its block size: where each item of a packed copy starts, the checks of a copy by plan, and
/// where one launch puts up to three consecutive item ranges and the chunks a stream cuts it
/// into.
#[pyclass(name = "PackedRows", module = "disagg_rs", frozen)]
pub struct PyPackedRows {
    rows: Vec<(u64, u64)>,
    tokens_per_block: u64,
}

impl PyPackedRows {
    fn items(&self, n_tok: u64) -> PyResult<PackedItems<'_>> {
        PackedItems::new(&self.rows, self.tokens_per_block, n_tok).py()
    }
}

#[pymethods]
impl PyPackedRows {
    #[new]
    fn new(rows: Vec<(u64, u64)>, tokens_per_block: u64) -> PyResult<Self> {
        PackedItems::new(&rows, tokens_per_block, 0).py()?;
        Ok(Self { rows, tokens_per_block })
    }

    /// Packed byte offset where item ``k`` of an ``n_tok``-token copy starts (past the
    /// last item: the copy's size).
    fn offset(&self, k: u64, n_tok: u64) -> PyResult<u64> {
        self.items(n_tok)?.offset(k).py()
    }

    /// ``(k_lo, k_hi, byte_lo, byte_hi)`` of every chunk of an ``n_tok``-token copy, each
    /// whole items of at most ``max_bytes`` (one item at least).
    fn chunks(&self, n_tok: u64, max_bytes: u64) -> PyResult<Vec<(u64, u64, u64, u64)>> {
        let cut = self.items(n_tok)?.chunks(max_bytes).py()?;
        Ok(cut.into_iter().map(|[a, b, x, y]| (a, b, x, y)).collect())
    }

    /// Check a copy of items ``items`` (``None``: all) of an ``n_tok``-token handoff from
    /// side ``a`` to side ``b`` (``(kind, block ids or, packed, window bytes, bias, set
    /// stride)`` each) of a plan with ``sets`` id sets; ``(k_lo, k_hi, byte_lo, byte_hi)``.
    #[pyo3(signature = (n_tok, items, a, b, sets, paged_only))]
    fn check_copy(
        &self,
        n_tok: u64,
        items: Option<(u64, u64)>,
        a: SideTuple,
        b: SideTuple,
        sets: u64,
        paged_only: bool,
    ) -> PyResult<[u64; 4]> {
        self.items(n_tok)?.check_copy(items, [side(&a)?, side(&b)?], sets, paged_only).py()
    }

    /// Check one launch of ``parts`` (``(byte offset, first item, end item)`` each,
    /// consecutive) into a packed window of ``window`` bytes (``None``: a paged destination,
    /// one range at 0) with ``unit``-byte kernel units, and the block ids it reads: ``ids``
    /// is ``(source ids, source set stride, id sets, destination ids or None)``;
    /// ``ArgumentError`` naming the field.
    fn launch(
        &self,
        n_tok: u64,
        parts: Vec<(u64, u64, u64)>,
        window: Option<u64>,
        unit: u64,
        ids: (u64, u64, u64, Option<u64>),
    ) -> PyResult<LaunchTuple> {
        let items = self.items(n_tok)?;
        items.check_ids(ids.0, ids.1, ids.2, ids.3).py()?;
        let l = items.launch(&parts, window, unit).py()?;
        Ok((l.k_lo, l.k_hi, l.nbytes, l.placement))
    }
}
