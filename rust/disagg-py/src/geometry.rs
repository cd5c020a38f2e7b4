//! Python classes `KVGeometry` and `SSMGeometry`; tensors are read through the attributes
//! torch and numpy expose (`data_ptr()` or `__array_interface__`), without importing torch.

use disagg_core::buffer::{self, BufferArgs, LayoutArgs, RefGeometry, Registration, StateLayout};
use disagg_core::geometry::{LayerTensors, TensorView};
use disagg_core::tensor_args::{any_int, RawTensor};
use disagg_core::wire::value::{Obj, WireValue};
use disagg_core::{DisaggError, KvGeometry, KvGeometrySpec, SsmGeometry, SsmStatePart};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::IntoPyObjectExt;

use crate::args::{
    conv, convs, describe, retype, type_err, wire_dict_to_py, Conv, Int, IntList, Kind, Opt, Str,
    Text, U64s, U32, U64,
};
use crate::error::{py_methods, to_pyerr, IntoPyResult};
use crate::layout::{wraps, PyKvShardLayout, PySsmShardLayout};
use crate::wire::to_wire;

wraps!(PyKvGeometry => KvGeometry, PySsmGeometry => SsmGeometry);

fn geo_err(field: &str, detail: String) -> PyErr {
    to_pyerr(DisaggError::geometry(field, detail))
}

/// What a tensor argument must be.
const TENSOR: &str = "expected a torch tensor or numpy array (data_ptr() or __array_interface__)";

/// A torch tensor or numpy array argument; anything else is a `GeometryMismatchError`
/// (`tensor`).
pub struct Tensor(TensorView);

impl<'a, 'py> FromPyObject<'a, 'py> for Tensor {
    type Error = PyErr;
    fn extract(t: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let t = t.to_owned();
        let typed = || type_err("tensor", format!("{TENSOR}, got {}", describe(&t)));
        tensor_view(&t).map(Self).map_err(|e| retype(t.py(), e, typed))
    }
}

fn tensor_view(t: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let dtype = t.getattr("dtype").ok().map(|d| d.str().map(|s| s.to_string())).transpose()?;
    let shape: Vec<i64> = t.getattr("shape")?.extract()?;
    let raw = if t.hasattr("data_ptr")? {
        let index = |d: Bound<'_, PyAny>| d.getattr("index").ok()?.extract::<Option<u64>>().ok();
        RawTensor {
            ptr: t.call_method0("data_ptr")?.extract()?,
            shape,
            strides: t.call_method0("stride")?.extract()?,
            strides_in_elements: true,
            element_size: t.call_method0("element_size")?.extract()?,
            dtype,
            device: t.getattr("device").ok().and_then(index).flatten(),
        }
    } else if t.hasattr("__array_interface__")? {
        RawTensor {
            ptr: t.getattr("__array_interface__")?.get_item("data")?.get_item(0)?.extract()?,
            shape,
            strides: t.getattr("strides")?.extract()?,
            strides_in_elements: false,
            element_size: t.getattr("itemsize")?.extract()?,
            dtype,
            device: None,
        }
    } else {
        return Err(geo_err("tensor", format!("{TENSOR}, got {}", t.get_type().name()?)));
    };
    TensorView::from_raw(&raw).py()
}

/// A per-layer list of tensors or of `(K, V)` tuples (`KvGeometrySpec::from_layers`).
pub struct Layers(Vec<LayerTensors>);

impl<'a, 'py> FromPyObject<'a, 'py> for Layers {
    type Error = PyErr;
    fn extract(ts: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let not_a_list = |e| {
            let what = format!("expected a list of tensors, got {}", describe(&ts));
            retype(ts.py(), e, || geo_err("tensors", what))
        };
        let layer = |t: Bound<'py, PyAny>| match t.cast::<PyTuple>() {
            Ok(p) if p.len() == 2 => Ok(LayerTensors::Pair(
                p.get_item(0)?.extract::<Tensor>()?.0,
                p.get_item(1)?.extract::<Tensor>()?.0,
            )),
            _ => Ok(LayerTensors::One(t.extract::<Tensor>()?.0)),
        };
        ts.try_iter()
            .map_err(not_a_list)?
            .map(|t| layer(t.map_err(not_a_list)?))
            .collect::<PyResult<_>>()
            .map(Self)
    }
}

/// Where each byte `(kv, layer, block, token, head, dim)` of one rank's paged KV cache lives.
#[pyclass(name = "KVGeometry", module = "disagg_rs", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct PyKvGeometry {
    /// The validated core geometry.
    pub inner: KvGeometry,
}

py_methods!(wire PyKvGeometry => KvGeometry,
get {
    /// 2 (K and V) or 1 (MLA latent).
    num_kv: u32 = (spec().num_kv);
    /// Local layers.
    num_layers: u32 = (spec().num_layers);
    num_blocks: u32 = (spec().num_blocks);
    tokens_per_block: u32 = (spec().tokens_per_block);
    /// Local KV heads.
    num_heads: u32 = (spec().num_heads);
    head_dim: u32 = (spec().head_dim);
    element_size: u32 = (spec().element_size);
    /// Plane base addresses, index `kv * num_layers + layer`.
    plane_bases: Vec<u64> = (spec().plane_bases.clone());
    device_id: u64 = (spec().device_id);
    dtype: Option<String> = (spec().dtype.clone());
}
span {}
range {}
methods {
    /// Byte strides `(block, token, head)`.
    #[getter]
    fn strides(&self) -> (u64, u64, u64) {
        let s = self.inner.spec();
        (s.block_stride, s.token_stride, s.head_stride)
    }
    /// Explicit fields; every stride is in bytes and `plane_bases[kv * num_layers + layer]`.
    #[new]
    #[pyo3(signature = (
        *, num_layers, num_blocks, tokens_per_block, num_heads, head_dim, element_size,
        block_stride, token_stride, head_stride, plane_bases, num_kv=Int::of(2),
        device_id=Int::of(0), dtype=None
    ), text_signature = "(*, num_layers, num_blocks, tokens_per_block, num_heads, head_dim, \
        element_size, block_stride, token_stride, head_stride, plane_bases, num_kv=2, \
        device_id=0, dtype=None)")]
    fn new(num_layers: Int, num_blocks: Int, tokens_per_block: Int, num_heads: Int,
        head_dim: Int, element_size: Int, block_stride: Int, token_stride: Int, head_stride: Int,
        plane_bases: IntList, num_kv: Int, device_id: Int, dtype: Option<Text>) -> PyResult<Self> {
        conv!(num_kv: U32, num_layers: U32, num_blocks: U32, tokens_per_block: U32);
        conv!(num_heads: U32, head_dim: U32, element_size: U32, block_stride: U64);
        conv!(token_stride: U64, head_stride: U64, plane_bases: U64s, device_id: U64);
        conv!(dtype: Opt<Str>);
        let spec = KvGeometrySpec {
            num_kv, num_layers, num_blocks, tokens_per_block, num_heads, head_dim, element_size,
            block_stride, token_stride, head_stride, plane_bases, device_id, dtype,
        };
        Ok(Self { inner: KvGeometry::new(spec).py()? })
    }

    /// `KvGeometrySpec::from_tensor` of one tensor whose axes `axes` names.
    #[classmethod]
    #[pyo3(signature = (tensor, axes=Text::of("kv layer block token head dim"), device_id=None),
        text_signature = "(tensor, axes='kv layer block token head dim', device_id=None)")]
    fn from_tensor(_cls: &Bound<'_, PyType>, tensor: Tensor, axes: Text, device_id: Option<Int>)
        -> PyResult<Self> {
        conv!(axes: Str, device_id: Opt<U64>);
        let spec = KvGeometrySpec::from_tensor(&tensor.0, &axes, device_id).py()?;
        Ok(Self { inner: KvGeometry::new(spec).py()? })
    }

    /// The MLA latent cache `[L, B, T, d]`: `from_tensor(tensor, "layer block token dim")`.
    #[classmethod]
    #[pyo3(signature = (tensor, device_id=None))]
    fn from_mla_tensor(cls: &Bound<'_, PyType>, tensor: Tensor, device_id: Option<Int>)
        -> PyResult<Self> {
        Self::from_tensor(cls, tensor, Text::of("layer block token dim"), device_id)
    }

    /// From one tensor per local layer, or one `(K, V)` tuple per layer (axes without `kv`):
    /// `KvGeometrySpec::from_layers`.
    #[classmethod]
    #[pyo3(signature = (tensors, axes=Text::of("kv block token head dim"), device_id=None),
        text_signature = "(tensors, axes='kv block token head dim', device_id=None)")]
    fn from_layer_tensors(_cls: &Bound<'_, PyType>, tensors: Layers, axes: Text,
        device_id: Option<Int>) -> PyResult<Self> {
        conv!(axes: Str, device_id: Opt<U64>);
        let spec = KvGeometrySpec::from_layers(&tensors.0, &axes, device_id).py()?;
        Ok(Self { inner: KvGeometry::new(spec).py()? })
    }
});

/// Where one rank's SSM conv and recurrent state live.
#[pyclass(name = "SSMGeometry", module = "disagg_rs", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct PySsmGeometry {
    /// The validated core geometry.
    pub inner: SsmGeometry,
}

/// An SSM state part argument: a dict with the keys of `to_dict()["conv"]`, or `None`.
fn part_arg(v: Option<Bound<'_, PyAny>>, key: &str) -> PyResult<Option<SsmStatePart>> {
    let Some(v) = v else { return Ok(None) };
    let map = WireValue::Map(vec![(key.to_owned(), to_wire(&v, key)?)]);
    SsmStatePart::from_wire(&Obj::of(&map, "").py()?, key).py()
}

py_methods!(wire PySsmGeometry => SsmGeometry,
get {
    /// Local SSM layers.
    num_layers: usize = (num_layers());
    /// Slots per layer.
    num_slots: u32 = (num_slots());
    device_id: u64 = (device_id);
    has_conv: bool = (conv.is_some());
    has_recurrent: bool = (recurrent.is_some());
}
span {}
range {}
methods {
    /// Explicit parts as dicts with the keys of `to_dict()["conv"]`.
    #[new]
    #[pyo3(signature = (*, conv=None, recurrent=None, device_id=Int::of(0)),
        text_signature = "(*, conv=None, recurrent=None, device_id=0)")]
    fn new(conv: Option<Bound<'_, PyAny>>, recurrent: Option<Bound<'_, PyAny>>, device_id: Int)
        -> PyResult<Self> {
        conv!(device_id: U64);
        let (conv, recurrent) = (part_arg(conv, "conv")?, part_arg(recurrent, "recurrent")?);
        Ok(Self { inner: SsmGeometry::new(conv, recurrent, device_id).py()? })
    }

    /// From the conv state `[L, slots, C, d_conv]` and/or the recurrent state
    /// `[L, slots, H, p, n]` (either may be None; at least one is needed).
    #[classmethod]
    #[pyo3(signature = (conv=None, recurrent=None, device_id=None))]
    fn from_tensors(_cls: &Bound<'_, PyType>, conv: Option<Tensor>, recurrent: Option<Tensor>,
        device_id: Option<Int>) -> PyResult<Self> {
        conv!(device_id: Opt<U64>);
        let (c, r) = (conv.as_ref().map(|t| &t.0), recurrent.as_ref().map(|t| &t.0));
        Ok(Self { inner: SsmGeometry::from_tensors(c, r, device_id).py()? })
    }

    /// Alias of `from_tensors` (the name `KVGeometry` uses).
    #[classmethod]
    #[pyo3(signature = (conv=None, recurrent=None, device_id=None))]
    fn from_tensor(cls: &Bound<'_, PyType>, conv: Option<Tensor>, recurrent: Option<Tensor>,
        device_id: Option<Int>) -> PyResult<Self> {
        Self::from_tensors(cls, conv, recurrent, device_id)
    }
});

/// `LayoutArgs` from the layout keyword arguments (`tp_size=...`).
fn layout_args(layout: Option<&Bound<'_, PyDict>>) -> PyResult<LayoutArgs> {
    let named: Vec<(String, Option<Int>)> =
        layout.map_or(Ok(Vec::new()), |d| d.items().extract())?;
    let named: Vec<_> = named.iter().map(|(k, v)| (k.as_str(), v.as_ref().map(|x| &x.0))).collect();
    LayoutArgs::from_named(&named).py()
}

convs! {
    /// An integer of any size (`ArgumentError` beyond 128 bits).
    AnyInt: Int => i128 = |f, v| v.in_range(Kind::Argument, f, i128::MIN, i128::MAX, "2**127");
    /// An optional layout integer of any size (`tensor_args::any_int`).
    LayoutInt: Option<Int> => Option<i128> = |f, v| any_int(v.as_ref().map(|x| &x.0), f).py();
}

/// The reference design's geometry as a dict, its layout a `KVShardLayout` or `None`.
fn reference_dict(py: Python<'_>, r: RefGeometry) -> PyResult<Bound<'_, PyDict>> {
    let d = wire_dict_to_py(py, &r.to_wire())?;
    d.set_item("layout", r.layout.map(|inner| PyKvShardLayout { inner }))?;
    Ok(d)
}

/// `disagg_core::buffer::register` of a backend's buffer (`tensor`: the first tensor, `layers`:
/// the per-layer list, `layout`: KV layout arguments by name), as a dict.
#[pyfunction]
#[pyo3(signature = (tensor, layers, ssm_layout, *, backend, contiguous, expected_num_blocks,
    ssm_state_kind=None, axes=None, blocks_axis=None, reference_only=false, **layout))]
pub fn plan_buffer<'py>(
    py: Python<'py>,
    tensor: Tensor,
    layers: Option<Layers>,
    ssm_layout: Option<Bound<'py, PyAny>>,
    backend: Text,
    contiguous: bool,
    expected_num_blocks: Int,
    ssm_state_kind: Option<Text>,
    axes: Option<Text>,
    blocks_axis: Option<Int>,
    reference_only: bool,
    layout: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let ssm_layout = ssm_layout.map(|l| match l.cast::<PySsmShardLayout>() {
        Ok(l) => Ok(l.get().inner),
        Err(_) => Err(to_pyerr(DisaggError::layout(
            "ssm_layout",
            format!("expected an SSMShardLayout, got {}", describe(&l)),
        ))),
    });
    let a = BufferArgs {
        backend: backend.get("backend")?.to_owned(),
        view: tensor.0,
        contiguous,
        per_layer: layers.is_some(),
        expected_num_blocks: AnyInt::conv("expected_num_blocks", expected_num_blocks)?,
        kv: layout_args(layout)?,
        ssm_layout: ssm_layout.transpose()?,
        ssm_state_kind: Opt::<Str>::conv("ssm_state_kind", ssm_state_kind)?,
        axes: Opt::<Str>::conv("axes", axes)?,
        blocks_axis: LayoutInt::conv("blocks_axis", blocks_axis)?,
    };
    let layers = layers.as_ref().map(|l| l.0.as_slice());
    let p = match buffer::register(&a, layers, reference_only).py()? {
        Registration::Reference(r) => return reference_dict(py, r),
        Registration::Plan(p) => p,
    };
    let out = wire_dict_to_py(py, &p.to_wire())?;
    out.set_item("reference", reference_dict(py, p.reference)?)?;
    let layout = match p.layout {
        StateLayout::Kv(inner) => PyKvShardLayout { inner }.into_py_any(py)?,
        StateLayout::Ssm(inner) => PySsmShardLayout { inner }.into_py_any(py)?,
    };
    out.set_item("layout", layout)?;
    Ok(out)
}
