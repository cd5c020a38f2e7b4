//! Python classes `KVShardLayout`, `SSMStateDims`, `SSMShardLayout`: the reference design's
//! constructor order and keywords (ours as aliases) and its `__dataclass_fields__`.

use disagg_core::args::Given;
use disagg_core::wire::layout::{dims_call, ssm_layout_call, KvLayoutCall, SsmCallArg};
use disagg_core::{
    DisaggError, KvLayoutSpec, SsmBand, SsmLayoutSpec, SsmShardLayout, SsmStateDims,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict, PyList};
use pyo3::PyClass;

use crate::args::{describe, int_of, type_err, Int, Text, Typed};
use crate::error::{py_methods, record_class, to_pyerr, IntoPyResult};

/// A Python class around one core value, its `inner`.
pub trait Wraps: PyClass {
    /// The core value.
    type Core: Clone + Send + Sync;
    /// A copy of the core value.
    fn core(&self) -> Self::Core;
}

/// `Wraps` of classes whose `inner` is the core value.
macro_rules! wraps {
    ($($ty:ty => $core:ty),*) => {$(
        impl $crate::layout::Wraps for $ty {
            type Core = $core;
            fn core(&self) -> $core {
                self.inner.clone()
            }
        }
    )*};
}
pub(crate) use wraps;

wraps!(PyKvShardLayout => disagg_core::KvShardLayout, PySsmShardLayout => SsmShardLayout);

/// A list argument of `T` objects as their core values (`ArgumentTypeError` naming `field`).
pub fn cores<T: Wraps>(v: Typed<Vec<PyRef<'_, T>>>, field: &str) -> PyResult<Vec<T::Core>> {
    let list = v.get(field, &format!("a list of {}", T::NAME))?;
    Ok(list.iter().map(|x| x.core()).collect())
}

/// Half-open range as a Python tuple.
pub type PyRange = (u32, u32);

/// The core's argument of an optional one.
fn core(v: Option<Int>) -> Option<disagg_core::args::Int> {
    v.map(|a| a.0)
}

/// `__dataclass_fields__` of a frozen `dataclasses.make_dataclass(name, fields)`.
fn dataclass_fields(py: Python<'_>, name: &str, fields: &[&str]) -> PyResult<Py<PyAny>> {
    let make = py.import("dataclasses")?.getattr("make_dataclass")?;
    let frozen = [("frozen", true)].into_py_dict(py)?;
    let cls = make.call((name, PyList::new(py, fields)?), Some(&frozen))?;
    Ok(cls.getattr("__dataclass_fields__")?.unbind())
}

record_class!(
    /// The KV cache slice one rank holds: a PP layer window and a KV head range (half-open).
    "KVShardLayout" PyKvShardLayout(disagg_core::KvShardLayout), from_py_object
);

py_methods!(wire PyKvShardLayout => disagg_core::KvShardLayout,
get {
    /// Layers of the whole model.
    num_layers: u32 = (num_layers);
    /// KV heads of the whole model (`num_kv_heads` is an alias).
    num_heads: u32 = (num_kv_heads);
    num_kv_heads: u32 = (num_kv_heads);
    layer_start: u32 = (layers.lo);
    layer_end: u32 = (layers.hi);
    num_local_layers: u32 = (layers.len());
    head_start: u32 = (heads.lo);
    head_end: u32 = (heads.hi);
    /// KV heads held by this rank.
    heads_per_partition: u32 = (heads.len());
    /// Ranks holding the same KV head (GQA replication factor; 1 when `tp_size` <= heads).
    gqa_replication: u32 = (gqa_replication());
    /// Whether the layer window differs from the even split of the model's layers.
    explicit_window: bool = (explicit_window);
}
fields {
    /// Expert-parallel size (a replica dimension, like `etp_size`).
    ep_size, etp_size
}
ranks { tp_size, tp_rank, pp_size, pp_rank, global_rank, ep_rank, etp_rank }
span {
    /// Global layers held, `[lo, hi)`.
    layers = (layers);
    /// Global KV heads held, `[lo, hi)`.
    heads = (heads);
}
range {
    /// Global layers held (the reference design's method).
    layer_range = (layers);
    /// Global KV heads held (the reference design's method).
    head_range = (heads);
}
methods {
    #[new]
    #[pyo3(signature = (
        num_layers, num_heads=None, tp_size=Int::of(1), tp_rank=Int::of(0), pp_size=Int::of(1),
        pp_rank=Int::of(0), global_rank=None, ep_size=Int::of(1), ep_rank=Int::of(0),
        etp_size=Int::of(1), etp_rank=Int::of(0), layer_start=None, num_local_layers=None,
        *, num_kv_heads=None
    ), text_signature = "(num_layers, num_heads=None, tp_size=1, tp_rank=0, pp_size=1, \
        pp_rank=0, global_rank=None, ep_size=1, ep_rank=0, etp_size=1, etp_rank=0, \
        layer_start=None, num_local_layers=None, *, num_kv_heads=None)")]
    fn new(num_layers: Int, num_heads: Option<Int>, tp_size: Int, tp_rank: Int, pp_size: Int,
        pp_rank: Int, global_rank: Option<Int>, ep_size: Int, ep_rank: Int, etp_size: Int,
        etp_rank: Int, layer_start: Option<Int>, num_local_layers: Option<Int>,
        num_kv_heads: Option<Int>) -> PyResult<Self> {
        let parallel = [tp_size, tp_rank, pp_size, pp_rank, ep_size, ep_rank, etp_size, etp_rank];
        let call = KvLayoutCall {
            num_layers: num_layers.0,
            num_heads: core(num_heads),
            num_kv_heads: core(num_kv_heads),
            parallel: parallel.map(|a| a.0),
            global_rank: core(global_rank),
            layer_start: core(layer_start),
            num_local_layers: core(num_local_layers),
        };
        Ok(Self { inner: call.layout().py()? })
    }

    #[classattr]
    fn __dataclass_fields__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        dataclass_fields(py, "KVShardLayout", &KvLayoutSpec::WIRE_KEYS[..13])
    }
    fn local_num_layers(&self) -> u32 {
        self.inner.layers.len()
    }
    fn local_num_heads(&self) -> u32 {
        self.inner.heads.len()
    }
    /// The attention shard held, `(tp_rank, pp_rank)`: ranks sharing it are EP/ETP replicas.
    fn kv_shard_key(&self) -> (u32, u32) {
        self.inner.kv_shard_key()
    }
});

record_class!(
    /// Global dimensions of one Mamba2-style SSM layer.
    "SSMStateDims" PySsmStateDims(SsmStateDims)
);

/// The reference design's dataclass fields of `SSMStateDims`, in its order.
const DIMS_FIELDS: [&str; 5] = ["nheads", "headdim", "d_state", "ngroups", "d_conv"];

py_methods!(wire PySsmStateDims => SsmStateDims,
get {
    /// SSM heads of the whole model (`num_heads` is an alias).
    nheads: u32 = (num_heads);
    num_heads: u32 = (num_heads);
    /// Channels per head (`head_dim` is an alias).
    headdim: u32 = (head_dim);
    head_dim: u32 = (head_dim);
    d_state: u32 = (d_state);
    /// B/C groups of the whole model (`n_groups` is an alias).
    ngroups: u32 = (n_groups);
    n_groups: u32 = (n_groups);
    d_conv: u32 = (d_conv);
}
span {}
range {}
methods {
    #[new]
    #[pyo3(signature = (
        nheads=None, headdim=None, d_state=None, ngroups=None, d_conv=Int::of(4),
        *, num_heads=None, head_dim=None, n_groups=None
    ), text_signature = "(nheads=None, headdim=None, d_state=None, ngroups=None, d_conv=4, *, \
        num_heads=None, head_dim=None, n_groups=None)")]
    fn new(nheads: Option<Int>, headdim: Option<Int>, d_state: Option<Int>, ngroups: Option<Int>,
        d_conv: Int, num_heads: Option<Int>, head_dim: Option<Int>, n_groups: Option<Int>)
        -> PyResult<Self> {
        let (heads, dim) = ([core(nheads), core(num_heads)], [core(headdim), core(head_dim)]);
        let groups = [core(ngroups), core(n_groups)];
        let inner = dims_call(heads, dim, groups, core(d_state), &d_conv.0).py()?;
        Ok(Self { inner })
    }
    #[classattr]
    fn __dataclass_fields__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        dataclass_fields(py, "SSMStateDims", &DIMS_FIELDS)
    }
    /// Global conv channels `num_heads*head_dim + 2*n_groups*d_state`.
    #[getter]
    fn conv_channels(&self) -> PyResult<u32> {
        self.inner.conv_channels().py()
    }
});

impl PySsmStateDims {
    /// An `SSMStateDims` argument, or the dict `dataclasses.asdict` made of one.
    fn coerce(v: &Bound<'_, PyAny>) -> PyResult<SsmStateDims> {
        if let Ok(dims) = v.cast::<PySsmStateDims>() {
            return Ok(dims.get().inner);
        }
        if let Ok(d) = v.cast::<PyDict>() {
            return Ok(Self::from_wire(d)?.inner);
        }
        let kind = v.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        Err(type_err("dims", format!("dims must be an SSMStateDims or a dict, got a {kind}")))
    }
}

/// An `SSMShardLayout(...)` argument, read as the core's call rules ask.
#[derive(FromPyObject)]
struct CallArg<'py>(Bound<'py, PyAny>);

impl SsmCallArg for CallArg<'_> {
    type Error = PyErr;
    fn error(e: DisaggError) -> PyErr {
        to_pyerr(e)
    }
    fn call_error(message: String) -> PyErr {
        PyTypeError::new_err(message)
    }
    fn is_dims(&self) -> bool {
        self.0.cast::<PySsmStateDims>().is_ok() || self.0.cast::<PyDict>().is_ok()
    }
    fn int(&self) -> Given<i128> {
        Given(int_of(&self.0))
    }
    fn flag(&self) -> Given<bool> {
        Given(self.0.extract().map_err(|_| describe(&self.0)))
    }
    fn dims(&self) -> PyResult<SsmStateDims> {
        PySsmStateDims::coerce(&self.0)
    }
}

record_class!(
    /// The SSM state one rank holds: layer window, head range (x band, recurrent) and group
    /// range (B, C bands). Local conv channels are packed `[x | B | C]`.
    "SSMShardLayout" PySsmShardLayout(SsmShardLayout), from_py_object
);

py_methods!(wire PySsmShardLayout => SsmShardLayout,
get {
    /// SSM layers held by this rank (the reference design's field; see `total_layers`).
    num_layers: u32 = (layers.len());
    /// SSM layers of the whole model, `None` when the layout was built from its window alone.
    total_layers: Option<u32> = (num_layers);
    /// Whether B/C groups may be replicated across TP ranks (`tp_size > ngroups`).
    replicate_groups: bool = (replicate_groups);
    layer_start: u32 = (layers.lo);
    layer_end: u32 = (layers.hi);
    num_local_layers: u32 = (layers.len());
    /// Global inner dimension `nheads * headdim`.
    d_inner: u32 = (band_extent(SsmBand::X).0);
    /// SSM heads held by this rank.
    nheads_local: u32 = (heads.len());
    /// Inner channels (x band) held by this rank.
    d_inner_local: u32 = (band_extent(SsmBand::X).1);
    /// B/C groups held by this rank.
    ngroups_local: u32 = (groups.len());
    /// Local conv channels `[x_local | B_local | C_local]` (`conv_dim_local` is an alias).
    local_conv_channels: u32 = (local_conv_channels());
    conv_dim_local: u32 = (local_conv_channels());
}
ranks { tp_size, tp_rank, pp_size, pp_rank, global_rank, ep_rank, etp_rank }
span {
    /// Global SSM layers held, `[lo, hi)`.
    layers = (layers);
    /// Global SSM heads held, `[lo, hi)`.
    heads = (heads);
    /// Global B/C groups held, `[lo, hi)`.
    groups = (groups);
}
range {
    /// Global SSM layers held (the reference design's method).
    layer_range = (layers);
}
methods {
    /// The reference design's call form or ours (both documented in `_core.pyi`).
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn new(args: Vec<Option<CallArg<'_>>>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let keywords = kwargs.map_or(Ok(Vec::new()), |d| d.items().extract())?;
        Ok(Self { inner: ssm_layout_call(args, keywords)? })
    }
    #[classattr]
    fn __dataclass_fields__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        dataclass_fields(py, "SSMShardLayout", &SsmLayoutSpec::DATACLASS_FIELDS)
    }
    /// The conv-state bands in packing order.
    #[classattr]
    fn conv_bands() -> (&'static str, &'static str, &'static str) {
        ("x", "B", "C")
    }
    #[getter]
    fn dims(&self) -> PySsmStateDims {
        PySsmStateDims { inner: self.inner.dims }
    }
    /// `{global layer: local layer}` for the layers held.
    #[getter]
    fn layer_map<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.inner.layers.local_map().into_py_dict(py)
    }
    /// The SSM shard held, `(tp_rank, layer_start)`: ranks sharing it hold identical state.
    fn shard_key(&self) -> (u32, u32) {
        self.inner.shard_key()
    }
    /// The reference design's `(global_total, local_size, local_offset)` of a band.
    fn band(&self, name: Text) -> PyResult<(u32, u32, u32)> {
        Ok(self.inner.band_extent(SsmBand::parse(name.get("name")?).py()?))
    }
    /// `(global [lo, hi), local [lo, hi))` of a band.
    fn band_span(&self, name: Text) -> PyResult<(PyRange, PyRange)> {
        let b = self.inner.band(SsmBand::parse(name.get("name")?).py()?);
        Ok(((b.global.lo, b.global.hi), (b.local.lo, b.local.hi)))
    }
});
