//! Bindings of a device plan's table (`disagg_core::packed_items`).

use disagg_core::packed_items::{CopySpec, KernelSides, PlaneTable, SideArgs, SideKind};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// One launch: `Launch`'s ``(k_lo, k_hi, nbytes, placement)``.
type LaunchTuple = (u64, u64, u64, [i64; 5]);

/// One side of a copy: `CopySpec`'s fields, the kind by name.
type SideTuple = (String, Option<u64>, u64, u64, u64, u64);

/// `KernelSides` as ``(unit, a side, b side)``, each side `SideArgs`'s fields.
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

/// `disagg_core::packed_items::PlaneTable`: a device plan's table.
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

    /// `PackedItems::offset` of an ``n_tok``-token copy.
    fn offset(&self, k: u64, n_tok: u64) -> PyResult<u64> {
        self.table.items(n_tok).py()?.offset(k).py()
    }

    /// `PlaneTable::unit`.
    fn unit(&self, addresses: Vec<u64>) -> u64 {
        self.table.unit(&addresses)
    }

    /// `PlaneTable::paged_end` of side ``"src"`` or ``"dst"``.
    fn paged_end(&self, kind_name: &str, num_blocks: u64) -> PyResult<i64> {
        self.table.paged_end(kind(kind_name)?, num_blocks).py()
    }

    /// `PlaneTable::prepare` of ``a`` ``(kind, address)`` and ``b`` ``(kind, address, bytes)``.
    fn prepare(
        &self,
        a: (String, u64),
        b: (String, u64, u64),
    ) -> PyResult<(SidesTuple, Option<u64>)> {
        let (s, window) = self.table.prepare(kind(&a.0)?, kind(&b.0)?, a.1, b.1, b.2).py()?;
        Ok((sides(s), window))
    }

    /// `PackedItems::chunks` of an ``n_tok``-token copy.
    fn chunks(&self, n_tok: u64, max_bytes: u64) -> PyResult<Vec<(u64, u64, u64, u64)>> {
        let cut = self.table.items(n_tok).py()?.chunks(max_bytes).py()?;
        Ok(cut.into_iter().map(|[a, b, x, y]| (a, b, x, y)).collect())
    }

    /// `PlaneTable::check_copy`.
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

    /// `PackedItems::checked_launch` of an ``n_tok``-token copy.
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
