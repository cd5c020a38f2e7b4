//! Bindings of a device plan's packed item order (`disagg_core::packed_items`).

use disagg_core::packed_items::{CopySide, PackedItems};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// One launch: ``(k_lo, k_hi, nbytes, (bias0, cut1, bias1, cut2, bias2))``.
type LaunchTuple = (u64, u64, u64, [i64; 5]);

/// One side of a copy as Python gives it: ``(kind, ids or window bytes, bias, set stride)``.
type SideTuple = (String, Option<u64>, u64, u64);

fn side(s: &SideTuple) -> CopySide {
    match s.0.as_str() {
        "packed" => CopySide::Packed { bias: s.2, nbytes: s.1.unwrap_or(0) },
        "src" => CopySide::Paged { kind: "src", ids: s.1, set_stride: s.3 },
        _ => CopySide::Paged { kind: "dst", ids: s.1, set_stride: s.3 },
    }
}

/// A device plan's packed item order (`disagg_core::packed_items`): item offsets, the checks
/// of a copy and where one launch puts up to three item ranges.
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

    /// Packed byte offset where item ``k`` of an ``n_tok``-token copy starts.
    fn offset(&self, k: u64, n_tok: u64) -> PyResult<u64> {
        self.items(n_tok)?.offset(k).py()
    }

    /// Check a copy of ``items`` (``None``: all) from side ``a`` to side ``b``; ``(k_lo, k_hi,
    /// byte_lo, byte_hi)``.
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
        self.items(n_tok)?.check_copy(items, [side(&a), side(&b)], sets, paged_only).py()
    }

    /// Check one launch of ``parts`` into a packed window of ``window`` bytes and the block ids
    /// it reads; ``ArgumentError`` naming the field.
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
