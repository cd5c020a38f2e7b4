//! Python classes for reshard plans: `KVReshardTransfer`, `KVReshardPlan`, `plan_kv_reshard`,
//! and their SSM counterparts. Planning runs with the GIL released.

use disagg_core::{
    plan_kv_reshard, plan_ssm_reshard, KvReshardPlan, KvReshardTransfer, KvShardLayout,
    SsmReshardPlan, SsmReshardTransfer, SsmShardLayout,
};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{Int, Kind, Typed};
use crate::error::IntoPyResult;

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

fn wrap_ssm(ts: Vec<SsmReshardTransfer>) -> Vec<PySsmReshardTransfer> {
    ts.into_iter().map(|inner| PySsmReshardTransfer { inner }).collect()
}

/// An SSM reshard plan: a read-only sequence of `SSMReshardTransfer`.
#[pyclass(name = "SSMReshardPlan", module = "disagg_rs", frozen, sequence)]
pub struct PySsmReshardPlan {
    /// The core plan.
    pub inner: SsmReshardPlan,
}

#[pymethods]
impl PySsmReshardPlan {
    fn __len__(&self) -> usize {
        self.inner.transfers.len()
    }
    fn __getitem__(&self, index: isize) -> PyResult<PySsmReshardTransfer> {
        Ok(PySsmReshardTransfer {
            inner: self.inner.transfers[seq_index(index, self.inner.transfers.len())?],
        })
    }
    #[getter]
    fn transfers(&self) -> Vec<PySsmReshardTransfer> {
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
    fn for_src(&self, global_rank: Int) -> PyResult<Vec<PySsmReshardTransfer>> {
        let global_rank = global_rank.to_u32(Kind::Argument, "global_rank")?;
        Ok(wrap_ssm(self.inner.for_src(global_rank)))
    }
    fn for_dst(&self, global_rank: Int) -> PyResult<Vec<PySsmReshardTransfer>> {
        let global_rank = global_rank.to_u32(Kind::Argument, "global_rank")?;
        Ok(wrap_ssm(self.inner.for_dst(global_rank)))
    }
    /// Check exact-once coverage of every destination conv channel and recurrent head.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.verify()).py()
    }
    fn __repr__(&self) -> String {
        format!(
            "SSMReshardPlan({} transfers, {} sources -> {} destinations)",
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
    srcs: Typed<Vec<PyRef<'_, PySsmShardLayout>>>,
    dsts: Typed<Vec<PyRef<'_, PySsmShardLayout>>>,
) -> PyResult<PySsmReshardPlan> {
    let srcs = srcs.get("srcs", "a list of SSMShardLayout")?;
    let dsts = dsts.get("dsts", "a list of SSMShardLayout")?;
    let s: Vec<SsmShardLayout> = srcs.iter().map(|l| l.inner).collect();
    let d: Vec<SsmShardLayout> = dsts.iter().map(|l| l.inner).collect();
    let inner = py.detach(|| plan_ssm_reshard(&s, &d)).py()?;
    Ok(PySsmReshardPlan { inner })
}
