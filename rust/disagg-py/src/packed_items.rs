//! Bindings of a device plan's table (`disagg_core::packed_items`).

use disagg_core::packed_items::{CopySpec, KernelSides, Launch, PlaneTable, SideArgs, SideKind};
use pyo3::prelude::*;

use crate::args::{convs, Raw};
use crate::error::IntoPyResult;
use crate::pool::{core_methods, outs};

/// One side of a copy: `CopySpec`'s fields, the kind by name.
type SideTuple = (String, Option<u64>, u64, u64, u64, u64);

/// `KernelSides` as ``(unit, a side, b side)``, each side `SideArgs`'s fields.
type SidesTuple = (u64, (u64, u64, u64, bool), (u64, u64, u64, bool));

convs! {
    /// A side's kind by name (``"src"``, ``"dst"``, ``"packed"``).
    SideName: String => SideKind = |_f, v| SideKind::parse(&v).py();
    /// A side of a copy.
    Spec: SideTuple => CopySpec = |_f, s| Ok(CopySpec { kind: SideKind::parse(&s.0).py()?,
        ids: s.1, nbytes: s.2, bias: s.3, set_stride: s.4, addr: s.5 });
}

outs! {
    KernelSides => SidesTuple = |s| {
        let args = |a: SideArgs| (a.col, a.block_stride, a.token_stride, a.packed);
        (s.unit, args(s.a), args(s.b))
    };
    (KernelSides, Option<u64>) => (SidesTuple, Option<u64>) = |v| (v.0.out()?, v.1);
    ([u64; 4], KernelSides) => ([u64; 4], SidesTuple) = |v| (v.0, v.1.out()?);
    Launch => (u64, u64, u64, [i64; 5]) = |l| (l.k_lo, l.k_hi, l.nbytes, l.placement);
    Vec<(u64, u64, u64, u64)> => Vec<(u64, u64, u64, u64)> = |v| v;
}

/// The table itself (it is never mutated), for [`core_methods`].
#[allow(clippy::unnecessary_wraps)]
fn plain<T, R>(t: &T, f: impl FnOnce(&T) -> R) -> PyResult<R> {
    Ok(f(t))
}

/// `disagg_core::packed_items::PlaneTable`: a device plan's table.
#[pyclass(name = "PackedRows", module = "disagg_rs", frozen)]
pub struct PyPackedRows {
    pub table: PlaneTable,
}

core_methods!(PyPackedRows, plain, table,
ctors {
    #[new]
    fn new(planes: Raw<Vec<[i64; 4]>>, tokens_per_block: Raw<u64>, strides: Raw<[u64; 4]>)
        = PlaneTable::new(&planes, tokens_per_block, strides).py()?;
}
calls {
    /// `PackedItems::offset` of an ``n_tok``-token copy.
    fn offset(k: Raw<u64>, n_tok: Raw<u64>) -> u64 = items(n_tok).and_then(|i| i.offset(k));
    /// `PlaneTable::unit`.
    fn unit(addresses: Raw<Vec<u64>>) -> u64 = unit(&addresses);
    /// `PlaneTable::paged_end` of side ``"src"`` or ``"dst"``.
    fn paged_end(kind_name: SideName, num_blocks: Raw<u64>) -> i64 = paged_end(kind_name, num_blocks);
    /// `PlaneTable::prepare` of ``a`` ``(kind, address)`` and ``b`` ``(kind, address, bytes)``.
    fn prepare(a: Raw<(String, u64)>, b: Raw<(String, u64, u64)>) -> (SidesTuple, Option<u64>)
        = prepare(SideKind::parse(&a.0)?, SideKind::parse(&b.0)?, a.1, b.1, b.2);
    /// `PackedItems::chunks` of an ``n_tok``-token copy.
    fn chunks(n_tok: Raw<u64>, max_bytes: Raw<u64>) -> Vec<(u64, u64, u64, u64)>
        = items(n_tok).and_then(|i| i.chunks(max_bytes))
            .map(|c| c.into_iter().map(|[a, b, x, y]| (a, b, x, y)).collect::<Vec<_>>());
    /// `PlaneTable::check_copy`.
    #[pyo3(signature = (n_tok, items, a, b, sets, paged_only))]
    fn check_copy(n_tok: Raw<u64>, items: Raw<Option<(u64, u64)>>, a: Spec, b: Spec,
        sets: Raw<u64>, paged_only: Raw<bool>) -> ([u64; 4], SidesTuple)
        = check_copy(n_tok, items, &a, &b, sets, paged_only);
    /// `PackedItems::checked_launch` of an ``n_tok``-token copy.
    fn launch(n_tok: Raw<u64>, parts: Raw<Vec<(u64, u64, u64)>>, window: Raw<Option<u64>>,
        unit: Raw<u64>, ids: Raw<[u64; 4]>) -> (u64, u64, u64, [i64; 5])
        = items(n_tok).and_then(|i| i.checked_launch(&parts, window, unit, ids));
}
methods {});
