//! Python classes for reshard plans: `KVReshardTransfer`, `KVReshardPlan`, `plan_kv_reshard`,
//! and their SSM counterparts. Planning runs with the GIL released.

use disagg_core::{
    local_range, plan_kv_reshard, plan_ssm_reshard, DisaggError, KvReshardPlan, KvReshardTransfer,
    KvShardLayout, Span, SsmReshardPlan, SsmReshardTransfer, SsmShardLayout,
};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice};

use crate::args::{Int, Kind, Typed};
use crate::error::{to_pyerr, IntoPyResult};

/// A Python `slice(lo, hi)` (step None, like the reference design's helpers return).
fn py_slice(py: Python<'_>, s: Span) -> PyResult<Bound<'_, PyAny>> {
    py.get_type::<PySlice>().call1((s.lo, s.hi))
}

/// Resolve a Python sequence index (negative counts from the end) against `len`.
fn seq_index(index: isize, len: usize) -> PyResult<usize> {
    let resolved =
        if index < 0 { len.checked_sub(index.unsigned_abs()) } else { Some(index.unsigned_abs()) };
    resolved.filter(|&i| i < len).ok_or_else(|| {
        PyIndexError::new_err(format!("plan index {index} out of range for {len} transfers"))
    })
}
use crate::layout::{PyKvShardLayout, PyRange, PySsmShardLayout};

/// One KV transfer: `src_rank` sends global `layers` x `heads` (half-open) to `dst_rank` for
/// every token of the handoff.
#[pyclass(name = "KVReshardTransfer", module = "disagg_rs", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyKvReshardTransfer {
    /// The core record.
    pub inner: KvReshardTransfer,
}

impl PyKvReshardTransfer {
    /// The moved layers (or heads) as a slice of `layout`'s local axis: one implementation for
    /// the source and destination helpers, which differ only in which layout they are given.
    fn layer_slice<'py>(
        &self,
        py: Python<'py>,
        layout: &PyKvShardLayout,
    ) -> PyResult<Bound<'py, PyAny>> {
        let l = &layout.inner;
        py_slice(py, local_range(self.inner.layers, l.layers, "layers", l.global_rank).py()?)
    }
    fn head_slice<'py>(
        &self,
        py: Python<'py>,
        layout: &PyKvShardLayout,
    ) -> PyResult<Bound<'py, PyAny>> {
        let l = &layout.inner;
        py_slice(py, local_range(self.inner.heads, l.heads, "heads", l.global_rank).py()?)
    }
}

#[pymethods]
impl PyKvReshardTransfer {
    /// Global rank of the source.
    #[getter]
    fn src_rank(&self) -> u32 {
        self.inner.src_rank
    }
    /// Global rank of the destination.
    #[getter]
    fn dst_rank(&self) -> u32 {
        self.inner.dst_rank
    }
    /// Global layers moved, `[lo, hi)`.
    #[getter]
    fn layers(&self) -> PyRange {
        (self.inner.layers.lo, self.inner.layers.hi)
    }
    /// Global KV heads moved, `[lo, hi)`.
    #[getter]
    fn heads(&self) -> PyRange {
        (self.inner.heads.lo, self.inner.heads.hi)
    }
    /// First global layer moved (the reference design's field).
    #[getter]
    fn global_layer_lo(&self) -> u32 {
        self.inner.layers.lo
    }
    /// One past the last global layer moved (the reference design's field).
    #[getter]
    fn global_layer_hi(&self) -> u32 {
        self.inner.layers.hi
    }
    /// First global KV head moved (the reference design's field).
    #[getter]
    fn global_head_lo(&self) -> u32 {
        self.inner.heads.lo
    }
    /// One past the last global KV head moved (the reference design's field).
    #[getter]
    fn global_head_hi(&self) -> u32 {
        self.inner.heads.hi
    }
    /// The moved layers as a slice of `src`'s local layer axis; `LayoutError` if `src` does
    /// not hold them.
    fn src_layer_slice<'py>(
        &self,
        py: Python<'py>,
        src: PyRef<'py, PyKvShardLayout>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.layer_slice(py, &src)
    }
    /// The moved heads as a slice of `src`'s local head axis; `LayoutError` if `src` does not
    /// hold them.
    fn src_head_slice<'py>(
        &self,
        py: Python<'py>,
        src: PyRef<'py, PyKvShardLayout>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.head_slice(py, &src)
    }
    /// The moved layers as a slice of `dst`'s local layer axis; `LayoutError` if `dst` does
    /// not hold them.
    fn dst_layer_slice<'py>(
        &self,
        py: Python<'py>,
        dst: PyRef<'py, PyKvShardLayout>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.layer_slice(py, &dst)
    }
    /// The moved heads as a slice of `dst`'s local head axis; `LayoutError` if `dst` does not
    /// hold them.
    fn dst_head_slice<'py>(
        &self,
        py: Python<'py>,
        dst: PyRef<'py, PyKvShardLayout>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.head_slice(py, &dst)
    }
    /// Number of layers moved.
    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.layers.len()
    }
    /// Number of heads moved.
    #[getter]
    fn num_heads(&self) -> u32 {
        self.inner.heads.len()
    }
    /// Layers in the source's local indexing, `[lo, hi)`.
    fn src_local_layers(&self) -> PyRange {
        let s = self.inner.src_local_layers();
        (s.lo, s.hi)
    }
    /// Heads in the source's local indexing, `[lo, hi)`.
    fn src_local_heads(&self) -> PyRange {
        let s = self.inner.src_local_heads();
        (s.lo, s.hi)
    }
    /// Layers in the destination's local indexing, `[lo, hi)`.
    fn dst_local_layers(&self) -> PyRange {
        let s = self.inner.dst_local_layers();
        (s.lo, s.hi)
    }
    /// Heads in the destination's local indexing, `[lo, hi)`.
    fn dst_local_heads(&self) -> PyRange {
        let s = self.inner.dst_local_heads();
        (s.lo, s.hi)
    }
    /// Bytes moved per token, K and V.
    #[pyo3(signature = (head_dim, element_size=Int::of(2)),
        text_signature = "($self, head_dim, element_size=2)")]
    fn bytes_per_token(&self, head_dim: Int, element_size: Int) -> PyResult<u64> {
        let (h, e) = (
            head_dim.to_u64(Kind::Argument, "head_dim")?,
            element_size.to_u64(Kind::Argument, "element_size")?,
        );
        self.inner.bytes_per_token(h, e).py()
    }
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.inner;
        let d = PyDict::new(py);
        d.set_item("src_rank", t.src_rank)?;
        d.set_item("dst_rank", t.dst_rank)?;
        d.set_item("layers", self.layers())?;
        d.set_item("heads", self.heads())?;
        d.set_item("src_local_layers", self.src_local_layers())?;
        d.set_item("src_local_heads", self.src_local_heads())?;
        d.set_item("dst_local_layers", self.dst_local_layers())?;
        d.set_item("dst_local_heads", self.dst_local_heads())?;
        Ok(d)
    }
    fn __repr__(&self) -> String {
        let t = &self.inner;
        format!(
            "KVReshardTransfer(src_rank={} -> dst_rank={}, layers=[{}, {}), heads=[{}, {}))",
            t.src_rank, t.dst_rank, t.layers.lo, t.layers.hi, t.heads.lo, t.heads.hi
        )
    }
}

fn wrap_kv(ts: Vec<KvReshardTransfer>) -> Vec<PyKvReshardTransfer> {
    ts.into_iter().map(|inner| PyKvReshardTransfer { inner }).collect()
}

/// A KV reshard plan: a read-only sequence of `KVReshardTransfer` ordered by destination rank,
/// layer, head. Both sides compute the same plan from the same layouts.
#[pyclass(name = "KVReshardPlan", module = "disagg_rs", frozen, sequence)]
pub struct PyKvReshardPlan {
    /// The core plan.
    pub inner: KvReshardPlan,
}

#[pymethods]
impl PyKvReshardPlan {
    fn __len__(&self) -> usize {
        self.inner.transfers.len()
    }
    fn __getitem__(&self, index: isize) -> PyResult<PyKvReshardTransfer> {
        Ok(PyKvReshardTransfer {
            inner: self.inner.transfers[seq_index(index, self.inner.transfers.len())?],
        })
    }
    /// All transfers as a list.
    #[getter]
    fn transfers(&self) -> Vec<PyKvReshardTransfer> {
        wrap_kv(self.inner.transfers.clone())
    }
    /// Source layouts the plan was made from.
    #[getter]
    fn srcs(&self) -> Vec<PyKvShardLayout> {
        self.inner.srcs().iter().map(|&inner| PyKvShardLayout { inner }).collect()
    }
    /// Destination layouts the plan was made from.
    #[getter]
    fn dsts(&self) -> Vec<PyKvShardLayout> {
        self.inner.dsts().iter().map(|&inner| PyKvShardLayout { inner }).collect()
    }
    /// Transfers sent by one source rank, in plan order.
    fn for_src(&self, global_rank: Int) -> PyResult<Vec<PyKvReshardTransfer>> {
        let global_rank = global_rank.to_u32(Kind::Argument, "global_rank")?;
        Ok(wrap_kv(self.inner.for_src(global_rank)))
    }
    /// Transfers received by one destination rank, in plan order.
    fn for_dst(&self, global_rank: Int) -> PyResult<Vec<PyKvReshardTransfer>> {
        let global_rank = global_rank.to_u32(Kind::Argument, "global_rank")?;
        Ok(wrap_kv(self.inner.for_dst(global_rank)))
    }
    /// Bytes moved per token over the whole plan, K and V.
    #[pyo3(signature = (head_dim, element_size=Int::of(2)),
        text_signature = "($self, head_dim, element_size=2)")]
    fn bytes_per_token(&self, head_dim: Int, element_size: Int) -> PyResult<u64> {
        let (h, e) = (
            head_dim.to_u64(Kind::Argument, "head_dim")?,
            element_size.to_u64(Kind::Argument, "element_size")?,
        );
        self.inner.bytes_per_token(h, e).py()
    }
    /// Check that every destination (layer, head) cell is written exactly once by a source
    /// holding it; raises `PlanCoverageError` naming the first gap or overlap.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.verify()).py()
    }
    fn __repr__(&self) -> String {
        format!(
            "KVReshardPlan({} transfers, {} sources -> {} destinations)",
            self.inner.transfers.len(),
            self.inner.srcs().len(),
            self.inner.dsts().len()
        )
    }
}

fn kv_layouts(ls: &[PyRef<'_, PyKvShardLayout>]) -> Vec<KvShardLayout> {
    ls.iter().map(|l| l.inner).collect()
}

/// Plan the KV reshard between two layout lists (any TP ratio, PP mismatch including uneven
/// windows, EP/ETP and GQA replicas; each cell read from the replica with the smallest global
/// rank). Deterministic and independent of list order.
#[pyfunction(name = "plan_kv_reshard")]
pub fn py_plan_kv_reshard(
    py: Python<'_>,
    srcs: Typed<Vec<PyRef<'_, PyKvShardLayout>>>,
    dsts: Typed<Vec<PyRef<'_, PyKvShardLayout>>>,
) -> PyResult<PyKvReshardPlan> {
    let srcs = srcs.get("srcs", "a list of KVShardLayout")?;
    let dsts = dsts.get("dsts", "a list of KVShardLayout")?;
    let (s, d) = (kv_layouts(&srcs), kv_layouts(&dsts));
    let inner = py.detach(|| plan_kv_reshard(&s, &d)).py()?;
    Ok(PyKvReshardPlan { inner })
}

/// One SSM transfer of one band over a layer range. `global`, `src_local`, `dst_local` are
/// channels (conv bands "x", "B", "C") or heads ("recurrent"), all `[lo, hi)`.
#[pyclass(name = "SSMReshardTransfer", module = "disagg_rs", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PySsmReshardTransfer {
    /// The core record.
    pub inner: SsmReshardTransfer,
}

#[pymethods]
impl PySsmReshardTransfer {
    #[getter]
    fn src_rank(&self) -> u32 {
        self.inner.src_rank
    }
    #[getter]
    fn dst_rank(&self) -> u32 {
        self.inner.dst_rank
    }
    /// Global SSM layers moved, `[lo, hi)`.
    #[getter]
    fn layers(&self) -> PyRange {
        (self.inner.layers.lo, self.inner.layers.hi)
    }
    /// "x", "B", "C" or "recurrent".
    #[getter]
    fn band(&self) -> &'static str {
        self.inner.band.name()
    }
    /// Whether the transfer moves conv state (bands x, B, C) rather than recurrent state.
    #[getter]
    fn is_conv(&self) -> bool {
        self.inner.band.is_conv()
    }
    /// The one global layer moved (the reference design's per-layer field); `LayoutError` on
    /// a transfer spanning several layers (from `SSMReshardPlan.ranges`).
    #[getter]
    fn global_layer(&self) -> PyResult<u32> {
        self.single_layer("global_layer").map(|s| s.lo)
    }
    /// The one layer moved, in the source's local indexing.
    #[getter]
    fn src_layer(&self) -> PyResult<u32> {
        self.single_layer("src_layer").map(|s| s.lo - self.inner.src_layer_start)
    }
    /// The one layer moved, in the destination's local indexing.
    #[getter]
    fn dst_layer(&self) -> PyResult<u32> {
        self.single_layer("dst_layer").map(|s| s.lo - self.inner.dst_layer_start)
    }
    /// First local channel (conv) or head (recurrent) read on the source.
    #[getter]
    fn src_lo(&self) -> u32 {
        self.inner.src_local.lo
    }
    /// One past the last local channel or head read on the source.
    #[getter]
    fn src_hi(&self) -> u32 {
        self.inner.src_local.hi
    }
    /// First local channel (conv) or head (recurrent) written on the destination.
    #[getter]
    fn dst_lo(&self) -> u32 {
        self.inner.dst_local.lo
    }
    /// One past the last local channel or head written on the destination.
    #[getter]
    fn dst_hi(&self) -> u32 {
        self.inner.dst_local.hi
    }
    /// "conv" for x/B/C, "recurrent" for the recurrent state.
    #[getter]
    fn state_kind(&self) -> &'static str {
        if self.inner.band.is_conv() {
            "conv"
        } else {
            "recurrent"
        }
    }
    /// Global channels or heads, `[lo, hi)`.
    #[getter]
    fn global_range(&self) -> PyRange {
        (self.inner.global.lo, self.inner.global.hi)
    }
    /// The source's local channels or heads, `[lo, hi)`.
    #[getter]
    fn src_local(&self) -> PyRange {
        (self.inner.src_local.lo, self.inner.src_local.hi)
    }
    /// The destination's local channels or heads, `[lo, hi)`.
    #[getter]
    fn dst_local(&self) -> PyRange {
        (self.inner.dst_local.lo, self.inner.dst_local.hi)
    }
    /// Layers in the source's local indexing.
    fn src_local_layers(&self) -> PyRange {
        let s = self.inner.src_local_layers();
        (s.lo, s.hi)
    }
    /// Layers in the destination's local indexing.
    fn dst_local_layers(&self) -> PyRange {
        let s = self.inner.dst_local_layers();
        (s.lo, s.hi)
    }
    fn __repr__(&self) -> String {
        let t = &self.inner;
        format!(
            "SSMReshardTransfer(src_rank={} -> dst_rank={}, layers=[{}, {}), band={}, \
             global=[{}, {}), src_local=[{}, {}), dst_local=[{}, {}))",
            t.src_rank,
            t.dst_rank,
            t.layers.lo,
            t.layers.hi,
            t.band.name(),
            t.global.lo,
            t.global.hi,
            t.src_local.lo,
            t.src_local.hi,
            t.dst_local.lo,
            t.dst_local.hi
        )
    }
}

impl PySsmReshardTransfer {
    fn single_layer(&self, field: &str) -> PyResult<Span> {
        let l = self.inner.layers;
        if l.len() == 1 {
            return Ok(l);
        }
        Err(to_pyerr(DisaggError::layout(
            field,
            format!(
                "{field} is defined for single-layer transfers (iterating an SSMReshardPlan \
                 gives those); this one spans layers [{}, {})",
                l.lo, l.hi
            ),
        )))
    }
}

fn wrap_ssm(ts: Vec<SsmReshardTransfer>) -> Vec<PySsmReshardTransfer> {
    ts.into_iter().map(|inner| PySsmReshardTransfer { inner }).collect()
}

/// An SSM reshard plan: a read-only sequence of single-layer `SSMReshardTransfer` records (the
/// reference design's granularity); `ranges` holds the same moves merged over layer ranges.
#[pyclass(name = "SSMReshardPlan", module = "disagg_rs", frozen, sequence)]
pub struct PySsmReshardPlan {
    /// The core plan (layer-range transfers).
    pub inner: SsmReshardPlan,
    /// The same transfers cut into single layers, in plan order.
    per_layer: Vec<SsmReshardTransfer>,
}

#[pymethods]
impl PySsmReshardPlan {
    fn __len__(&self) -> usize {
        self.per_layer.len()
    }
    fn __getitem__(&self, index: isize) -> PyResult<PySsmReshardTransfer> {
        Ok(PySsmReshardTransfer { inner: self.per_layer[seq_index(index, self.per_layer.len())?] })
    }
    /// All single-layer transfers as a list.
    #[getter]
    fn transfers(&self) -> Vec<PySsmReshardTransfer> {
        wrap_ssm(self.per_layer.clone())
    }
    /// The transfers merged over layer ranges (fewer records; `layers` spans several layers).
    #[getter]
    fn ranges(&self) -> Vec<PySsmReshardTransfer> {
        wrap_ssm(self.inner.transfers.clone())
    }
    #[getter]
    fn srcs(&self) -> Vec<PySsmShardLayout> {
        self.inner.srcs().iter().map(|&inner| PySsmShardLayout { inner }).collect()
    }
    #[getter]
    fn dsts(&self) -> Vec<PySsmShardLayout> {
        self.inner.dsts().iter().map(|&inner| PySsmShardLayout { inner }).collect()
    }
    /// Single-layer transfers sent by one source rank, in plan order.
    fn for_src(&self, global_rank: Int) -> PyResult<Vec<PySsmReshardTransfer>> {
        let global_rank = global_rank.to_u32(Kind::Argument, "global_rank")?;
        Ok(wrap_ssm(self.per_layer.iter().filter(|t| t.src_rank == global_rank).copied().collect()))
    }
    /// Single-layer transfers received by one destination rank, in plan order.
    fn for_dst(&self, global_rank: Int) -> PyResult<Vec<PySsmReshardTransfer>> {
        let global_rank = global_rank.to_u32(Kind::Argument, "global_rank")?;
        Ok(wrap_ssm(self.per_layer.iter().filter(|t| t.dst_rank == global_rank).copied().collect()))
    }
    /// Check exact-once coverage of every destination conv channel and recurrent head.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.verify()).py()
    }
    fn __repr__(&self) -> String {
        format!(
            "SSMReshardPlan({} single-layer transfers in {} ranges, {} sources -> {} destinations)",
            self.per_layer.len(),
            self.inner.transfers.len(),
            self.inner.srcs().len(),
            self.inner.dsts().len()
        )
    }
}

/// Plan the SSM reshard (conv bands x, B, C and the recurrent state) between layout lists.
#[pyfunction(name = "plan_ssm_reshard")]
pub fn py_plan_ssm_reshard(
    py: Python<'_>,
    src_layouts: Typed<Vec<PyRef<'_, PySsmShardLayout>>>,
    dst_layouts: Typed<Vec<PyRef<'_, PySsmShardLayout>>>,
) -> PyResult<PySsmReshardPlan> {
    let src_layouts = src_layouts.get("src_layouts", "a list of SSMShardLayout")?;
    let dst_layouts = dst_layouts.get("dst_layouts", "a list of SSMShardLayout")?;
    let s: Vec<SsmShardLayout> = src_layouts.iter().map(|l| l.inner).collect();
    let d: Vec<SsmShardLayout> = dst_layouts.iter().map(|l| l.inner).collect();
    let (inner, per_layer) = py
        .detach(|| plan_ssm_reshard(&s, &d).map(|p| (p.per_layer(), p)))
        .map(|(cut, p)| (p, cut))
        .py()?;
    Ok(PySsmReshardPlan { inner, per_layer })
}
