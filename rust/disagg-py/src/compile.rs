//! `compile_kv_transfer`, `compile_ssm_transfer` and `TransferProgram`, whose lists come back
//! as `uint64` numpy arrays built with the GIL released (no Python object per descriptor).

use disagg_core::args::Given;
use disagg_core::{
    compile_kv_transfer, compile_ssm_transfer, CostModel, DisaggError, DisaggResult, KvTokens,
    ListKind, ModeChoice, SourceStats, SrcBlockIds, SrcSlots, SsmSlots, TransferProgram,
    TransferRequest,
};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict, PyMapping, PySlice};

use crate::args::{
    conv, describe, err, type_err, Arg, Conv, Id, Ids, Int, IntList, Kind, Opt, Real, Text, Typed,
    U32, U64,
};
use crate::error::{py_methods, to_pyerr, IntoPyResult};
use crate::geometry::{PyKvGeometry, PySsmGeometry};
use crate::layout::{PyKvShardLayout, PySsmShardLayout, Wraps};

/// A per-rank argument as the core's `given` reads it: one value for every rank, or a mapping
/// `{rank: value}`.
type PerRank<T> = (Option<Given<T>>, Vec<(Given<i128>, Given<T>)>);

fn per_rank<'py, T>(obj: &Bound<'py, PyAny>) -> PyResult<PerRank<T>>
where
    Arg<T>: for<'a> FromPyObject<'a, 'py, Error = PyErr>,
{
    let Ok(m) = obj.cast::<PyMapping>() else {
        return Ok((Some(obj.extract::<Arg<T>>()?.0), vec![]));
    };
    let items: Vec<(Int, Arg<T>)> = m.items()?.extract()?;
    Ok((None, items.into_iter().map(|(k, v)| (k.0, v.0)).collect()))
}

/// `[n, N]` `uint64` rows as a numpy array.
pub(crate) fn rows_to_numpy<const N: usize>(
    py: Python<'_>,
    rows: Vec<[u64; N]>,
) -> PyResult<Bound<'_, PyArray2<u64>>> {
    let n = rows.len();
    let arr = Array2::from_shape_vec((n, N), rows.into_flattened())
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
    Ok(arr.into_pyarray(py))
}

/// What an out array must be.
const OUT: &str = "out arrays must be numpy uint64 arrays of shape [m, 3]";

/// A caller's `[m, 3]` C-contiguous writable `uint64` array, borrowed to write rows into.
struct Out<'py>(Bound<'py, PyArray2<u64>>, PyReadwriteArray2<'py, u64>);

impl<'py> Out<'py> {
    fn of(arr: &Bound<'py, PyAny>) -> PyResult<Self> {
        let bad = |_| type_err("out", format!("{OUT}, got {}", describe(arr)));
        let a = arr.cast::<PyArray2<u64>>().map_err(bad)?;
        disagg_core::args::out_rows(a.shape(), a.is_c_contiguous()).py()?;
        let not_writable =
            |e| err(Kind::Argument, "out", format!("out array is not writable: {e}"));
        Ok(Self(a.clone(), a.try_readwrite().map_err(not_writable)?))
    }

    /// The array's `[m, 3]` rows.
    fn rows(&mut self) -> PyResult<&mut [[u64; 3]]> {
        let flat = self.1.as_slice_mut().map_err(|e| err(Kind::Argument, "out", e.to_string()))?;
        Ok(flat.as_chunks_mut::<3>().0)
    }

    /// `arr[:n]`, a view, once the borrow is released.
    fn head(self, n: usize) -> PyResult<Bound<'py, PyAny>> {
        let Self(arr, rw) = self;
        drop(rw);
        let n = isize::try_from(n).map_err(|_| err(Kind::Argument, "out", format!("{n} rows")))?;
        arr.as_any().get_item(PySlice::new(arr.py(), 0, n, 1))
    }
}

/// Fill one caller array with the GIL released.
fn fill_one<'py>(
    py: Python<'py>,
    out: &Bound<'py, PyAny>,
    f: impl FnOnce(&mut [[u64; 3]]) -> Result<usize, DisaggError> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    let mut o = Out::of(out)?;
    let rows = o.rows()?;
    let n = py.detach(|| f(rows)).py()?;
    o.head(n)
}

/// The compiled transfer of one destination rank: per source rank, its mode and lists
/// (`disagg_core::TransferProgram`).
#[pyclass(name = "TransferProgram", module = "disagg_rs", frozen)]
pub struct PyTransferProgram {
    pub(crate) inner: TransferProgram,
}

/// Set `figures` in `d`, in order.
fn put(d: &Bound<'_, PyDict>, figures: &[(&str, u64)]) -> PyResult<()> {
    figures.iter().try_for_each(|(k, v)| d.set_item(k, v))
}

type Rows2<'py> = Bound<'py, PyArray2<u64>>;
type DescPair<'py> = (Rows2<'py>, Rows2<'py>);
type Any<'py> = Bound<'py, PyAny>;

impl PyTransferProgram {
    /// `gather` and `scatter` (`scatter` picks the list): one implementation.
    fn packed<'py>(
        &self,
        py: Python<'py>,
        src: Int,
        out: Option<Any<'py>>,
        scatter: bool,
    ) -> PyResult<Any<'py>> {
        let (p, src) = (&self.inner, U32::conv("src_rank", src)?);
        match out {
            Some(o) => fill_one(py, &o, |rows| p.packed_into(src, scatter, rows)),
            None => Ok(rows_to_numpy(py, py.detach(|| p.packed(src, scatter)).py()?)?.into_any()),
        }
    }

    /// `gather_runs` and `scatter_runs`: one implementation.
    fn runs<'py>(
        &self,
        py: Python<'py>,
        src: Int,
        scatter: bool,
    ) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let src = U32::conv("src_rank", src)?;
        rows_to_numpy(py, py.detach(|| self.inner.packed_runs(src, scatter)).py()?)
    }
}

py_methods!(PyTransferProgram,
get {
    dst_rank: u32 = (dst_rank);
    /// Source ranks that send something, ascending.
    src_ranks: Vec<u32> = (src_ranks());
}
span {}
range {}
methods {
    /// `"direct"` or `"staged"`.
    fn mode(&self, src_rank: Int) -> PyResult<&'static str> {
        Ok(self.inner.source(U32::conv("src_rank", src_rank)?).py()?.mode.name())
    }
    /// Bytes of the packed region `[0, packed_bytes)` of this (source, destination) pair.
    fn packed_bytes(&self, src_rank: Int) -> PyResult<u64> {
        Ok(self.inner.source(U32::conv("src_rank", src_rank)?).py()?.packed_bytes)
    }
    /// `(src, dst)` Nx3 `uint64` arrays `(addr, len, device_id)`; with `out=(src_arr, dst_arr)`
    /// the rows are written there and views of the first rows come back.
    #[pyo3(signature = (src_rank, src_staging=Int::of(0), dst_staging=Int::of(0), *, out=None),
        text_signature = "($self, src_rank, src_staging=0, dst_staging=0, *, out=None)")]
    fn descriptors<'py>(&self, py: Python<'py>, src_rank: Int, src_staging: Int,
        dst_staging: Int, out: Option<Typed<(Any<'py>, Any<'py>)>>)
        -> PyResult<(Any<'py>, Any<'py>)> {
        conv!(src_rank: U32, src_staging: U64, dst_staging: U64);
        let (p, (src, dst)) = (&self.inner, (src_staging, dst_staging));
        let Some(out) = out else {
            let (s, d) = py.detach(|| p.descriptors(src_rank, src, dst)).py()?;
            return Ok((rows_to_numpy(py, s)?.into_any(), rows_to_numpy(py, d)?.into_any()));
        };
        let (src_o, dst_o) = out.get("out", "a pair of numpy arrays")?;
        let mut so = Out::of(&src_o)?;
        disagg_core::args::distinct_outs(so.0.is(&dst_o)).py()?;
        let mut dout = Out::of(&dst_o)?;
        let (srows, drows) = (so.rows()?, dout.rows()?);
        let n = py.detach(|| p.descriptors_into(src_rank, src, dst, srows, drows)).py()?;
        Ok((so.head(n)?, dout.head(n)?))
    }
    /// Exact rows of one list: `which` is "descriptors", "gather" or "scatter" (to size `out`).
    fn row_count(&self, py: Python<'_>, src_rank: Int, which: Text) -> PyResult<u64> {
        conv!(src_rank: U32);
        let kind = ListKind::parse(which.get("which")?).py()?;
        py.detach(|| self.inner.row_count(src_rank, kind)).py()
    }
    /// The merged direct pairs of a source, whatever its mode (`TransferProgram::fill_direct`).
    fn direct_descriptors<'py>(&self, py: Python<'py>, src_rank: Int) -> PyResult<DescPair<'py>> {
        conv!(src_rank: U32);
        let fill = |s: &mut [[u64; 3]], d: &mut [[u64; 3]]| {
            self.inner.direct_descriptors_into(src_rank, s, d)
        };
        let pair = |n| crate::rows::pair_with(py, n, fill);
        self.inner.fill_direct(src_rank, to_pyerr, |count| py.detach(count), pair)
    }
    /// Mx3 `uint64` `(src_addr, len, packed_offset)`; needs no destination blocks.
    #[pyo3(signature = (src_rank, *, out=None))]
    fn gather<'py>(&self, py: Python<'py>, src_rank: Int, out: Option<Any<'py>>)
        -> PyResult<Any<'py>> {
        self.packed(py, src_rank, out, false)
    }
    /// Mx3 `uint64` `(packed_offset, dst_addr, len)`.
    #[pyo3(signature = (src_rank, *, out=None))]
    fn scatter<'py>(&self, py: Python<'py>, src_rank: Int, out: Option<Any<'py>>)
        -> PyResult<Any<'py>> {
        self.packed(py, src_rank, out, true)
    }
    /// Nx6 `uint64` strided gather runs `(src_addr, packed_offset, len, count, src_stride,
    /// packed_stride)`.
    fn gather_runs<'py>(&self, py: Python<'py>, src_rank: Int) -> PyResult<Rows2<'py>> {
        self.runs(py, src_rank, false)
    }
    /// Nx6 `uint64` strided scatter runs `(packed_offset, dst_addr, len, count,
    /// packed_stride, dst_stride)`.
    fn scatter_runs<'py>(&self, py: Python<'py>, src_rank: Int) -> PyResult<Rows2<'py>> {
        self.runs(py, src_rank, true)
    }
    /// `TransferProgram::device_plan` as a dict (`planes` a `[p, 4]` `uint64` array), or `None`.
    fn device_plan<'py>(&self, py: Python<'py>, src_rank: u32)
        -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(plan) = self.inner.device_plan(src_rank).py()? else { return Ok(None) };
        let d = [("planes", rows_to_numpy(py, plan.planes)?)].into_py_dict(py)?;
        d.set_item("tokens_per_block", plan.tokens_per_block)?;
        d.set_item("src_block_stride", plan.src_block_stride)?;
        d.set_item("src_token_stride", plan.src_token_stride)?;
        d.set_item("dst_block_stride", plan.dst_block_stride)?;
        d.set_item("dst_token_stride", plan.dst_token_stride)?;
        Ok(Some(d))
    }
    /// Figures: totals plus `sources[src_rank]` = mode, descriptors, fragments, bytes.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = py.detach(|| self.inner.stats());
        let (per, d) = (PyDict::new(py), [("dst_rank", self.inner.dst_rank)].into_py_dict(py)?);
        for s in &stats {
            let e = [("mode", s.mode.name())].into_py_dict(py)?;
            put(&e, &s.figures())?;
            per.set_item(s.src_rank, e)?;
        }
        put(&d, &SourceStats::total_figures(&stats))?;
        d.set_item("sources", per)?;
        Ok(d)
    }
    /// Check exact-once byte coverage of the destination (raises `PlanCoverageError`).
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.verify()).py()
    }
    fn __repr__(&self) -> String {
        self.inner.to_string()
    }
});

/// A list argument of `(layout, geometry)` pairs, and a `(layout, geometry or None)` one.
type Srcs<'py, L, G> = Typed<Vec<(PyRef<'py, L>, PyRef<'py, G>)>>;
type Dst<'py, L, G> = Typed<(PyRef<'py, L>, Option<PyRef<'py, G>>)>;
/// The core request made from them.
type Request<L, G, M> = TransferRequest<<L as Wraps>::Core, <G as Wraps>::Core, M>;

/// The request of either compiler from its arguments (`moved` read after the others), compiled
/// by `compile` with the GIL released.
fn compile_with<L: Wraps, G: Wraps, M: Sync>(
    py: Python<'_>,
    (src, dst): (Srcs<'_, L, G>, Dst<'_, L, G>),
    moved: impl FnOnce() -> PyResult<M>,
    mode: &Text,
    [per, link, gather]: [Real; 3],
    compile: fn(&Request<L, G, M>) -> DisaggResult<TransferProgram>,
) -> PyResult<PyTransferProgram> {
    let (l, g) = (L::NAME, G::NAME);
    let src = src.get("src", &format!("a list of ({l}, {g}) pairs"))?;
    let dst = dst.get("dst", &format!("a ({l}, {g} or None) pair"))?;
    let mode = mode.get("mode")?;
    let cost = CostModel {
        per_descriptor_s: per.positive("per_descriptor_s")?,
        link_bytes_per_s: link.positive("link_bytes_per_s")?,
        gather_bytes_per_s: gather.positive("gather_bytes_per_s")?,
    };
    let mode = ModeChoice::parse(mode).py()?;
    let srcs = src.iter().map(|(l, g)| (l.core(), g.core())).collect();
    let (dst_layout, dst_geometry) = (dst.0.core(), dst.1.as_ref().map(|g| g.core()));
    let req = TransferRequest { srcs, dst_layout, dst_geometry, moved: moved()?, mode, cost };
    Ok(PyTransferProgram { inner: py.detach(|| compile(&req)).py()? })
}

/// A compiler `#[pyfunction]`: `src`, `dst`, the `moved` arguments, `mode`, the `keywords`,
/// then the cost model; `moved` is read by `read` after the others, then compiled by `$compile`.
macro_rules! compiler {
    ($(#[$m:meta])* fn $name:ident($l:ty, $g:ty, moved($($a:ident: $at:ty),*),
        keywords($($k:ident: $kt:ty),*)) = $compile:path, read $read:block) => {
        $(#[$m])*
        pub fn $name(py: Python<'_>, src: Srcs<'_, $l, $g>, dst: Dst<'_, $l, $g>, $($a: $at,)*
            mode: Text, $($k: $kt,)* per_descriptor_s: Real, link_bytes_per_s: Real,
            gather_bytes_per_s: Real) -> PyResult<PyTransferProgram> {
            let cost = [per_descriptor_s, link_bytes_per_s, gather_bytes_per_s];
            compile_with(py, (src, dst), || $read, &mode, cost, $compile)
        }
    };
}

compiler! {
    /// `disagg_core::compile_kv_transfer` of ONE destination rank from its source ranks.
    #[pyfunction(name = "compile_kv_transfer")]
    #[pyo3(signature = (
        src, dst, src_block_ids, dst_block_ids, num_tokens, mode=Text::of("auto"), *,
        token_start=Int::of(0), per_descriptor_s=Real::of(8e-6),
        link_bytes_per_s=Real::of(388e9), gather_bytes_per_s=Real::of(1.6e12)
    ), text_signature = "(src, dst, src_block_ids, dst_block_ids, num_tokens, mode='auto', *, \
    token_start=0, per_descriptor_s=8e-06, link_bytes_per_s=388000000000.0, \
    gather_bytes_per_s=1600000000000.0)")]
    fn py_compile_kv_transfer(PyKvShardLayout, PyKvGeometry,
        moved(src_block_ids: &Bound<'_, PyAny>, dst_block_ids: Option<IntList>, num_tokens: Int),
        keywords(token_start: Int)) = compile_kv_transfer, read {
        conv!(num_tokens: U64, token_start: U64, dst_block_ids: Opt<Ids>);
        let (shared, ranks) = per_rank(src_block_ids)?;
        let src_block_ids = SrcBlockIds::given(shared.as_ref(), &ranks).py()?;
        Ok(KvTokens { src_block_ids, dst_block_ids, num_tokens, token_start })
    }
}

compiler! {
    /// `disagg_core::compile_ssm_transfer` of ONE destination rank.
    #[pyfunction(name = "compile_ssm_transfer")]
    #[pyo3(signature = (
        src, dst, src_slot, dst_slot, mode=Text::of("auto"), *,
        per_descriptor_s=Real::of(8e-6), link_bytes_per_s=Real::of(388e9),
        gather_bytes_per_s=Real::of(1.6e12)
    ), text_signature = "(src, dst, src_slot, dst_slot, mode='auto', *, per_descriptor_s=8e-06, \
    link_bytes_per_s=388000000000.0, gather_bytes_per_s=1600000000000.0)")]
    fn py_compile_ssm_transfer(PySsmShardLayout, PySsmGeometry,
        moved(src_slot: &Bound<'_, PyAny>, dst_slot: Option<Int>), keywords())
        = compile_ssm_transfer, read {
        conv!(dst_slot: Opt<Id>);
        let (shared, ranks) = per_rank(src_slot)?;
        Ok(SsmSlots { src_slots: SrcSlots::given(shared.as_ref(), &ranks).py()?, dst_slot })
    }
}
