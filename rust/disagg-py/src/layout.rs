//! Python classes for the shard layouts: `KVShardLayout`, `SSMStateDims`, `SSMShardLayout`.

use disagg_core::{
    KvLayoutSpec, KvShardLayout, SsmBand, SsmLayoutSpec, SsmShardLayout, SsmStateDims,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use crate::args::{Int, Text, Typed};
use crate::error::{reject_unknown_keys, u32_field, wire_dict, wire_err, IntoPyResult};

/// Half-open range as a Python tuple.
pub type PyRange = (u32, u32);

/// Required integer field of a wire dict.
pub fn dict_u32(d: &Bound<'_, PyDict>, key: &str) -> PyResult<u32> {
    let v = d.get_item(key)?.ok_or_else(|| wire_err(key, "missing required field".into()))?;
    let n: i64 = v.extract().map_err(|_| wire_err(key, format!("expected an int, got {v}")))?;
    u32::try_from(n).map_err(|_| wire_err(key, format!("{key}={n} must be in [0, 2**32)")))
}

/// Optional integer field of a wire dict (absent or None).
pub fn dict_opt_u32(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<u32>> {
    match d.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(_) => dict_u32(d, key).map(Some),
    }
}

fn opt_u32(field: &str, v: Option<Int>) -> PyResult<Option<u32>> {
    v.map(|x| u32_field(field, x)).transpose()
}

/// The KV cache slice one rank holds: a PP layer window and a KV head range (half-open).
#[pyclass(name = "KVShardLayout", module = "disagg_rs", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyKvShardLayout {
    /// The validated core layout.
    pub inner: KvShardLayout,
}

const KV_KEYS: [&str; 11] = [
    "num_layers",
    "num_kv_heads",
    "tp_size",
    "tp_rank",
    "pp_size",
    "pp_rank",
    "global_rank",
    "ep_rank",
    "etp_rank",
    "layer_start",
    "num_local_layers",
];

#[pymethods]
impl PyKvShardLayout {
    #[new]
    #[pyo3(signature = (
        num_layers, num_kv_heads, tp_size=Int::of(1), tp_rank=Int::of(0), pp_size=Int::of(1), pp_rank=Int::of(0), global_rank=None,
        *, ep_rank=Int::of(0), etp_rank=Int::of(0), layer_start=None, num_local_layers=None
    ),
    text_signature = "(num_layers, num_kv_heads, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, global_rank=None, *, ep_rank=0, etp_rank=0, layer_start=None, num_local_layers=None)")]
    fn new(
        num_layers: Int,
        num_kv_heads: Int,
        tp_size: Int,
        tp_rank: Int,
        pp_size: Int,
        pp_rank: Int,
        global_rank: Option<Int>,
        ep_rank: Int,
        etp_rank: Int,
        layer_start: Option<Int>,
        num_local_layers: Option<Int>,
    ) -> PyResult<Self> {
        let tp_size_u = u32_field("tp_size", tp_size)?;
        let tp_rank_u = u32_field("tp_rank", tp_rank)?;
        let pp_rank_u = u32_field("pp_rank", pp_rank)?;
        let default_rank = i128::from(pp_rank_u) * i128::from(tp_size_u) + i128::from(tp_rank_u);
        let spec = KvLayoutSpec {
            num_layers: u32_field("num_layers", num_layers)?,
            num_kv_heads: u32_field("num_kv_heads", num_kv_heads)?,
            tp_size: tp_size_u,
            tp_rank: tp_rank_u,
            pp_size: u32_field("pp_size", pp_size)?,
            pp_rank: pp_rank_u,
            global_rank: u32_field(
                "global_rank",
                global_rank.unwrap_or_else(|| default_rank.into()),
            )?,
            ep_rank: u32_field("ep_rank", ep_rank)?,
            etp_rank: u32_field("etp_rank", etp_rank)?,
            layer_start: opt_u32("layer_start", layer_start)?,
            num_local_layers: opt_u32("num_local_layers", num_local_layers)?,
        };
        Ok(Self { inner: KvShardLayout::new(spec).py()? })
    }

    /// Layers of the whole model.
    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers
    }
    /// KV heads of the whole model.
    #[getter]
    fn num_kv_heads(&self) -> u32 {
        self.inner.num_kv_heads
    }
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.tp_size
    }
    #[getter]
    fn tp_rank(&self) -> u32 {
        self.inner.tp_rank
    }
    #[getter]
    fn pp_size(&self) -> u32 {
        self.inner.pp_size
    }
    #[getter]
    fn pp_rank(&self) -> u32 {
        self.inner.pp_rank
    }
    #[getter]
    fn global_rank(&self) -> u32 {
        self.inner.global_rank
    }
    #[getter]
    fn ep_rank(&self) -> u32 {
        self.inner.ep_rank
    }
    #[getter]
    fn etp_rank(&self) -> u32 {
        self.inner.etp_rank
    }
    /// First global layer held.
    #[getter]
    fn layer_start(&self) -> u32 {
        self.inner.layers.lo
    }
    /// One past the last global layer held.
    #[getter]
    fn layer_end(&self) -> u32 {
        self.inner.layers.hi
    }
    #[getter]
    fn num_local_layers(&self) -> u32 {
        self.inner.layers.len()
    }
    /// First global KV head held.
    #[getter]
    fn head_start(&self) -> u32 {
        self.inner.heads.lo
    }
    /// One past the last global KV head held.
    #[getter]
    fn head_end(&self) -> u32 {
        self.inner.heads.hi
    }
    /// KV heads held by this rank (the reference design's `heads_per_partition`).
    #[getter]
    fn heads_per_partition(&self) -> u32 {
        self.inner.heads.len()
    }
    /// Global layers held, `[lo, hi)`.
    #[getter]
    fn layers(&self) -> PyRange {
        (self.inner.layers.lo, self.inner.layers.hi)
    }
    /// Global KV heads held, `[lo, hi)`.
    #[getter]
    fn heads(&self) -> PyRange {
        (self.inner.heads.lo, self.inner.heads.hi)
    }
    /// Ranks holding the same KV head (GQA replication factor; 1 when `tp_size` <= heads).
    #[getter]
    fn gqa_replication(&self) -> u32 {
        self.inner.gqa_replication()
    }
    /// Whether the layer window was given explicitly.
    #[getter]
    fn explicit_window(&self) -> bool {
        self.inner.explicit_window
    }

    /// Plain dict for the wire (JSON/msgpack safe); `from_dict(to_dict())` round-trips.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.spec();
        let d = PyDict::new(py);
        d.set_item("num_layers", s.num_layers)?;
        d.set_item("num_kv_heads", s.num_kv_heads)?;
        d.set_item("tp_size", s.tp_size)?;
        d.set_item("tp_rank", s.tp_rank)?;
        d.set_item("pp_size", s.pp_size)?;
        d.set_item("pp_rank", s.pp_rank)?;
        d.set_item("global_rank", s.global_rank)?;
        d.set_item("ep_rank", s.ep_rank)?;
        d.set_item("etp_rank", s.etp_rank)?;
        d.set_item("layer_start", s.layer_start)?;
        d.set_item("num_local_layers", s.num_local_layers)?;
        Ok(d)
    }

    /// Rebuild from `to_dict()` output; raises `MetadataError` on a missing, unknown or
    /// mistyped field and `LayoutError` on an invalid combination.
    #[classmethod]
    fn from_dict(_cls: &Bound<'_, PyType>, d: &Bound<'_, PyAny>) -> PyResult<Self> {
        let d = wire_dict(d, "<dict>")?;
        Self::from_wire(d)
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let from_dict = slf.get_type().getattr("from_dict")?;
        Ok((from_dict, (slf.get().to_dict(slf.py())?,)))
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "KVShardLayout(global_rank={}, tp={}/{}, pp={}/{}, layers=[{}, {}) of {}, \
             heads=[{}, {}) of {}{})",
            l.global_rank,
            l.tp_rank,
            l.tp_size,
            l.pp_rank,
            l.pp_size,
            l.layers.lo,
            l.layers.hi,
            l.num_layers,
            l.heads.lo,
            l.heads.hi,
            l.num_kv_heads,
            if l.ep_rank != 0 || l.etp_rank != 0 {
                format!(", ep_rank={}, etp_rank={}", l.ep_rank, l.etp_rank)
            } else {
                String::new()
            }
        )
    }
}

impl PyKvShardLayout {
    /// Decode a wire dict.
    pub fn from_wire(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        reject_unknown_keys(d, &KV_KEYS, "KVShardLayout")?;
        let spec = KvLayoutSpec {
            num_layers: dict_u32(d, "num_layers")?,
            num_kv_heads: dict_u32(d, "num_kv_heads")?,
            tp_size: dict_u32(d, "tp_size")?,
            tp_rank: dict_u32(d, "tp_rank")?,
            pp_size: dict_u32(d, "pp_size")?,
            pp_rank: dict_u32(d, "pp_rank")?,
            global_rank: dict_u32(d, "global_rank")?,
            ep_rank: dict_opt_u32(d, "ep_rank")?.unwrap_or(0),
            etp_rank: dict_opt_u32(d, "etp_rank")?.unwrap_or(0),
            layer_start: dict_opt_u32(d, "layer_start")?,
            num_local_layers: dict_opt_u32(d, "num_local_layers")?,
        };
        Ok(Self { inner: KvShardLayout::new(spec).py()? })
    }
}

/// Global dimensions of one Mamba2-style SSM layer.
#[pyclass(name = "SSMStateDims", module = "disagg_rs", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PySsmStateDims {
    /// The validated core dims.
    pub inner: SsmStateDims,
}

const DIMS_KEYS: [&str; 5] = ["num_heads", "head_dim", "d_state", "n_groups", "d_conv"];

#[pymethods]
impl PySsmStateDims {
    #[new]
    #[pyo3(signature = (num_heads, head_dim, d_state, n_groups=Int::of(1), d_conv=Int::of(4)),
    text_signature = "(num_heads, head_dim, d_state, n_groups=1, d_conv=4)")]
    fn new(
        num_heads: Int,
        head_dim: Int,
        d_state: Int,
        n_groups: Int,
        d_conv: Int,
    ) -> PyResult<Self> {
        let inner = SsmStateDims::new(
            u32_field("num_heads", num_heads)?,
            u32_field("head_dim", head_dim)?,
            u32_field("d_state", d_state)?,
            u32_field("n_groups", n_groups)?,
            u32_field("d_conv", d_conv)?,
        )
        .py()?;
        Ok(Self { inner })
    }
    #[getter]
    fn num_heads(&self) -> u32 {
        self.inner.num_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    #[getter]
    fn d_state(&self) -> u32 {
        self.inner.d_state
    }
    #[getter]
    fn n_groups(&self) -> u32 {
        self.inner.n_groups
    }
    #[getter]
    fn d_conv(&self) -> u32 {
        self.inner.d_conv
    }
    /// Global conv channels `num_heads*head_dim + 2*n_groups*d_state`.
    #[getter]
    fn conv_channels(&self) -> PyResult<u32> {
        self.inner.conv_channels().py()
    }
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("num_heads", self.inner.num_heads)?;
        d.set_item("head_dim", self.inner.head_dim)?;
        d.set_item("d_state", self.inner.d_state)?;
        d.set_item("n_groups", self.inner.n_groups)?;
        d.set_item("d_conv", self.inner.d_conv)?;
        Ok(d)
    }
    #[classmethod]
    fn from_dict(_cls: &Bound<'_, PyType>, d: &Bound<'_, PyAny>) -> PyResult<Self> {
        let d = wire_dict(d, "<dict>")?;
        Self::from_wire(d)
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let from_dict = slf.get_type().getattr("from_dict")?;
        Ok((from_dict, (slf.get().to_dict(slf.py())?,)))
    }
    fn __repr__(&self) -> String {
        let d = &self.inner;
        format!(
            "SSMStateDims(num_heads={}, head_dim={}, d_state={}, n_groups={}, d_conv={})",
            d.num_heads, d.head_dim, d.d_state, d.n_groups, d.d_conv
        )
    }
}

impl PySsmStateDims {
    /// Decode a wire dict.
    pub fn from_wire(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        reject_unknown_keys(d, &DIMS_KEYS, "SSMStateDims")?;
        let inner = SsmStateDims::new(
            dict_u32(d, "num_heads")?,
            dict_u32(d, "head_dim")?,
            dict_u32(d, "d_state")?,
            dict_u32(d, "n_groups")?,
            dict_u32(d, "d_conv")?,
        )
        .py()?;
        Ok(Self { inner })
    }
}

/// The SSM state one rank holds: layer window, head range (x band, recurrent) and group range
/// (B, C bands). Local conv channels are packed `[x | B | C]`.
#[pyclass(name = "SSMShardLayout", module = "disagg_rs", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PySsmShardLayout {
    /// The validated core layout.
    pub inner: SsmShardLayout,
}

const SSM_KEYS: [&str; 11] = [
    "num_layers",
    "dims",
    "tp_size",
    "tp_rank",
    "pp_size",
    "pp_rank",
    "global_rank",
    "ep_rank",
    "etp_rank",
    "layer_start",
    "num_local_layers",
];

#[pymethods]
impl PySsmShardLayout {
    #[new]
    #[pyo3(signature = (
        num_layers, dims, tp_size=Int::of(1), tp_rank=Int::of(0), pp_size=Int::of(1), pp_rank=Int::of(0), global_rank=None,
        *, ep_rank=Int::of(0), etp_rank=Int::of(0), layer_start=None, num_local_layers=None
    ),
    text_signature = "(num_layers, dims, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, global_rank=None, *, ep_rank=0, etp_rank=0, layer_start=None, num_local_layers=None)")]
    fn new(
        num_layers: Int,
        dims: Typed<PyRef<'_, PySsmStateDims>>,
        tp_size: Int,
        tp_rank: Int,
        pp_size: Int,
        pp_rank: Int,
        global_rank: Option<Int>,
        ep_rank: Int,
        etp_rank: Int,
        layer_start: Option<Int>,
        num_local_layers: Option<Int>,
    ) -> PyResult<Self> {
        let tp_size_u = u32_field("tp_size", tp_size)?;
        let tp_rank_u = u32_field("tp_rank", tp_rank)?;
        let pp_rank_u = u32_field("pp_rank", pp_rank)?;
        let default_rank = i128::from(pp_rank_u) * i128::from(tp_size_u) + i128::from(tp_rank_u);
        let spec = SsmLayoutSpec {
            num_layers: u32_field("num_layers", num_layers)?,
            dims: dims.get("dims", "an SSMStateDims")?.inner,
            tp_size: tp_size_u,
            tp_rank: tp_rank_u,
            pp_size: u32_field("pp_size", pp_size)?,
            pp_rank: pp_rank_u,
            global_rank: u32_field(
                "global_rank",
                global_rank.unwrap_or_else(|| default_rank.into()),
            )?,
            ep_rank: u32_field("ep_rank", ep_rank)?,
            etp_rank: u32_field("etp_rank", etp_rank)?,
            layer_start: opt_u32("layer_start", layer_start)?,
            num_local_layers: opt_u32("num_local_layers", num_local_layers)?,
        };
        Ok(Self { inner: SsmShardLayout::new(spec).py()? })
    }
    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers
    }
    #[getter]
    fn dims(&self) -> PySsmStateDims {
        PySsmStateDims { inner: self.inner.dims }
    }
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.tp_size
    }
    #[getter]
    fn tp_rank(&self) -> u32 {
        self.inner.tp_rank
    }
    #[getter]
    fn pp_size(&self) -> u32 {
        self.inner.pp_size
    }
    #[getter]
    fn pp_rank(&self) -> u32 {
        self.inner.pp_rank
    }
    #[getter]
    fn global_rank(&self) -> u32 {
        self.inner.global_rank
    }
    #[getter]
    fn ep_rank(&self) -> u32 {
        self.inner.ep_rank
    }
    #[getter]
    fn etp_rank(&self) -> u32 {
        self.inner.etp_rank
    }
    /// Global SSM layers held, `[lo, hi)`.
    #[getter]
    fn layers(&self) -> PyRange {
        (self.inner.layers.lo, self.inner.layers.hi)
    }
    #[getter]
    fn layer_start(&self) -> u32 {
        self.inner.layers.lo
    }
    #[getter]
    fn layer_end(&self) -> u32 {
        self.inner.layers.hi
    }
    #[getter]
    fn num_local_layers(&self) -> u32 {
        self.inner.layers.len()
    }
    /// Global SSM heads held, `[lo, hi)`.
    #[getter]
    fn heads(&self) -> PyRange {
        (self.inner.heads.lo, self.inner.heads.hi)
    }
    /// Global B/C groups held, `[lo, hi)`.
    #[getter]
    fn groups(&self) -> PyRange {
        (self.inner.groups.lo, self.inner.groups.hi)
    }
    /// Local conv channels `[x_local | B_local | C_local]`.
    #[getter]
    fn local_conv_channels(&self) -> u32 {
        self.inner.local_conv_channels()
    }
    /// `(global [lo, hi), local [lo, hi))` of a band: channels for "x", "B", "C", heads for
    /// "recurrent".
    fn band(&self, name: Text) -> PyResult<(PyRange, PyRange)> {
        let b = self.inner.band(SsmBand::parse(name.get("name")?).py()?);
        Ok(((b.global.lo, b.global.hi), (b.local.lo, b.local.hi)))
    }
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.spec();
        let d = PyDict::new(py);
        d.set_item("num_layers", s.num_layers)?;
        d.set_item("dims", self.dims().to_dict(py)?)?;
        d.set_item("tp_size", s.tp_size)?;
        d.set_item("tp_rank", s.tp_rank)?;
        d.set_item("pp_size", s.pp_size)?;
        d.set_item("pp_rank", s.pp_rank)?;
        d.set_item("global_rank", s.global_rank)?;
        d.set_item("ep_rank", s.ep_rank)?;
        d.set_item("etp_rank", s.etp_rank)?;
        d.set_item("layer_start", s.layer_start)?;
        d.set_item("num_local_layers", s.num_local_layers)?;
        Ok(d)
    }
    #[classmethod]
    fn from_dict(_cls: &Bound<'_, PyType>, d: &Bound<'_, PyAny>) -> PyResult<Self> {
        let d = wire_dict(d, "<dict>")?;
        Self::from_wire(d)
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let from_dict = slf.get_type().getattr("from_dict")?;
        Ok((from_dict, (slf.get().to_dict(slf.py())?,)))
    }
    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "SSMShardLayout(global_rank={}, tp={}/{}, pp={}/{}, layers=[{}, {}) of {}, \
             heads=[{}, {}), groups=[{}, {}), dims={})",
            l.global_rank,
            l.tp_rank,
            l.tp_size,
            l.pp_rank,
            l.pp_size,
            l.layers.lo,
            l.layers.hi,
            l.num_layers,
            l.heads.lo,
            l.heads.hi,
            l.groups.lo,
            l.groups.hi,
            self.dims().__repr__()
        )
    }
}

impl PySsmShardLayout {
    /// Decode a wire dict.
    pub fn from_wire(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        reject_unknown_keys(d, &SSM_KEYS, "SSMShardLayout")?;
        let dims_obj =
            d.get_item("dims")?.ok_or_else(|| wire_err("dims", "missing required field".into()))?;
        let dims_dict = dims_obj
            .cast::<PyDict>()
            .map_err(|_| wire_err("dims", format!("expected a dict, got {dims_obj}")))?;
        let spec = SsmLayoutSpec {
            num_layers: dict_u32(d, "num_layers")?,
            dims: PySsmStateDims::from_wire(dims_dict)?.inner,
            tp_size: dict_u32(d, "tp_size")?,
            tp_rank: dict_u32(d, "tp_rank")?,
            pp_size: dict_u32(d, "pp_size")?,
            pp_rank: dict_u32(d, "pp_rank")?,
            global_rank: dict_u32(d, "global_rank")?,
            ep_rank: dict_opt_u32(d, "ep_rank")?.unwrap_or(0),
            etp_rank: dict_opt_u32(d, "etp_rank")?.unwrap_or(0),
            layer_start: dict_opt_u32(d, "layer_start")?,
            num_local_layers: dict_opt_u32(d, "num_local_layers")?,
        };
        Ok(Self { inner: SsmShardLayout::new(spec).py()? })
    }
}
