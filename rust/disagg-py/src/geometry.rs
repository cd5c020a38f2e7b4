//! Python classes `KVGeometry` and `SSMGeometry`; tensors are read through the attributes
//! torch and numpy expose (`data_ptr()` or `__array_interface__`), without importing torch.

use disagg_core::buffer::{self, BufferArgs, LayoutArgs};
use disagg_core::geometry::TensorView;
use disagg_core::tensor_args::{any_int, state_device, RawTensor};
use disagg_core::wire::value::{Obj, WireValue};
use disagg_core::{
    DisaggError, KvGeometry, KvGeometrySpec, KvShardLayout, SsmGeometry, SsmStateKind, SsmStatePart,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};

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

/// Read a torch tensor or a numpy array; anything else is a `GeometryMismatchError` (`tensor`).
fn tensor_view(t: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let typed = || type_err("tensor", format!("{TENSOR}, got {}", describe(t)));
    tensor_view_of(t).map_err(|e| retype(t.py(), e, typed))
}

fn tensor_view_of(t: &Bound<'_, PyAny>) -> PyResult<TensorView> {
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
    fn from_tensor(_cls: &Bound<'_, PyType>, tensor: &Bound<'_, PyAny>, axes: Text,
        device_id: Option<Int>) -> PyResult<Self> {
        let v = tensor_view(tensor)?;
        conv!(axes: Str, device_id: Opt<U64>);
        let spec = KvGeometrySpec::from_tensor(&v, &axes, device_id).py()?;
        Ok(Self { inner: KvGeometry::new(spec).py()? })
    }

    /// The MLA latent cache `[L, B, T, d]`: `from_tensor(tensor, "layer block token dim")`.
    #[classmethod]
    #[pyo3(signature = (tensor, device_id=None))]
    fn from_mla_tensor(cls: &Bound<'_, PyType>, tensor: &Bound<'_, PyAny>, device_id: Option<Int>)
        -> PyResult<Self> {
        Self::from_tensor(cls, tensor, Text::of("layer block token dim"), device_id)
    }

    /// From one tensor per local layer, or one `(K, V)` tuple per layer (axes without `kv`):
    /// `KvGeometrySpec::from_layer_tensors` and `from_kv_layer_tensors`.
    #[classmethod]
    #[pyo3(signature = (tensors, axes=Text::of("kv block token head dim"), device_id=None),
        text_signature = "(tensors, axes='kv block token head dim', device_id=None)")]
    fn from_layer_tensors(_cls: &Bound<'_, PyType>, tensors: &Bound<'_, PyAny>, axes: Text,
        device_id: Option<Int>) -> PyResult<Self> {
        conv!(axes: Str, device_id: Opt<U64>);
        Ok(Self { inner: KvGeometry::new(layer_spec(tensors, &axes, device_id)?).py()? })
    }

});

/// Where one rank's SSM conv and recurrent state live.
#[pyclass(name = "SSMGeometry", module = "disagg_rs", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct PySsmGeometry {
    /// The validated core geometry.
    pub inner: SsmGeometry,
}

/// One SSM state tensor: its part, and the device it names.
fn part_from_tensor(
    t: &Bound<'_, PyAny>,
    kind: SsmStateKind,
    ndim: usize,
) -> PyResult<(SsmStatePart, Option<u64>)> {
    let v = tensor_view(t)?;
    Ok((SsmStatePart::from_tensor(&v, kind, ndim).py()?, v.device))
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
    fn from_tensors(_cls: &Bound<'_, PyType>, conv: Option<Bound<'_, PyAny>>,
        recurrent: Option<Bound<'_, PyAny>>, device_id: Option<Int>) -> PyResult<Self> {
        conv!(device_id: Opt<U64>);
        let c = conv.map(|t| part_from_tensor(&t, SsmStateKind::Conv, 4)).transpose()?;
        let r = recurrent.map(|t| part_from_tensor(&t, SsmStateKind::Recurrent, 5)).transpose()?;
        let named = [c.as_ref().and_then(|p| p.1), r.as_ref().and_then(|p| p.1)];
        let dev = state_device(device_id, named);
        let inner = SsmGeometry::new(c.map(|p| p.0), r.map(|p| p.0), dev).py()?;
        Ok(Self { inner })
    }

    /// Alias of `from_tensors` (the name `KVGeometry` uses).
    #[classmethod]
    #[pyo3(signature = (conv=None, recurrent=None, device_id=None))]
    fn from_tensor(cls: &Bound<'_, PyType>, conv: Option<Bound<'_, PyAny>>,
        recurrent: Option<Bound<'_, PyAny>>, device_id: Option<Int>) -> PyResult<Self> {
        Self::from_tensors(cls, conv, recurrent, device_id)
    }

});

/// A `(K, V)` tuple of one layer's separate key and value tensors, if `t` is one.
fn kv_pair<'a, 'py>(t: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyTuple>> {
    t.cast::<PyTuple>().ok().filter(|p| p.len() == 2)
}

/// The geometry spec of a per-layer list of tensors or of `(K, V)` pairs.
fn layer_spec(
    tensors: &Bound<'_, PyAny>,
    axes: &str,
    device_id: Option<u64>,
) -> PyResult<KvGeometrySpec> {
    let not_a_list =
        || geo_err("tensors", format!("expected a list of tensors, got {}", describe(tensors)));
    let items = tensors
        .try_iter()
        .map_err(|e| retype(tensors.py(), e, not_a_list))?
        .map(|t| t.map_err(|e| retype(tensors.py(), e, not_a_list)))
        .collect::<PyResult<Vec<_>>>()?;
    // `(K, V)` pairs per layer: separate key and value tensors.
    if items.first().is_some_and(|t| kv_pair(t).is_some()) {
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (i, t) in items.iter().enumerate() {
            let p = kv_pair(t).ok_or_else(|| {
                geo_err(
                    "tensors",
                    format!("tensors[{i}] is {}, not a (K, V) pair like tensors[0]", describe(t)),
                )
            })?;
            keys.push(tensor_view(&p.get_item(0)?)?);
            values.push(tensor_view(&p.get_item(1)?)?);
        }
        KvGeometrySpec::from_kv_layer_tensors(&keys, &values, axes, device_id).py()
    } else {
        let views = items.iter().map(tensor_view).collect::<PyResult<Vec<_>>>()?;
        KvGeometrySpec::from_layer_tensors(&views, axes, device_id).py()
    }
}

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

/// `disagg_core::buffer::plan_buffer` of a registered buffer (`tensor`: the first tensor,
/// `layers`: the per-layer list, `layout`: KV layout arguments by name); with
/// `reference_only`, `buffer::reference_geometry`.
#[pyfunction]
#[pyo3(signature = (tensor, layers, ssm_layout, *, backend, contiguous, expected_num_blocks,
    ssm_state_kind=None, axes=None, blocks_axis=None, reference_only=false, **layout))]
pub fn plan_buffer<'py>(
    tensor: &Bound<'py, PyAny>,
    layers: Option<Bound<'py, PyAny>>,
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
    let py = tensor.py();
    let ssm = ssm_layout.as_ref().map(|l| {
        let what = || format!("expected an SSMShardLayout, got {}", describe(l));
        let l = l.cast::<PySsmShardLayout>();
        l.map(|l| l.get().inner).map_err(|_| to_pyerr(DisaggError::layout("ssm_layout", what())))
    });
    let a = BufferArgs {
        backend: backend.get("backend")?.to_owned(),
        view: tensor_view(tensor)?,
        contiguous,
        per_layer: layers.is_some(),
        expected_num_blocks: AnyInt::conv("expected_num_blocks", expected_num_blocks)?,
        kv: layout_args(layout)?,
        ssm_layout: ssm.transpose()?,
        ssm_state_kind: Opt::<Str>::conv("ssm_state_kind", ssm_state_kind)?,
        axes: Opt::<Str>::conv("axes", axes)?,
        blocks_axis: LayoutInt::conv("blocks_axis", blocks_axis)?,
    };
    let kv_obj = |l: Option<KvShardLayout>| -> PyResult<Option<Py<PyAny>>> {
        l.map(|inner| Py::new(py, PyKvShardLayout { inner }).map(Py::into_any)).transpose()
    };
    if reference_only {
        let r = buffer::reference_geometry(&a).py()?;
        let d = wire_dict_to_py(py, &r.to_wire())?;
        d.set_item("layout", kv_obj(r.layout)?)?;
        return Ok(d);
    }
    buffer::check_buffer_args(&a).py()?;
    let axes = buffer::layer_axes(&a);
    let layer = layers.as_ref().map(|l| layer_spec(l, &axes, a.view.device)).transpose()?;
    let p = buffer::plan_buffer(&a, layer.as_ref()).py()?;
    let out = wire_dict_to_py(py, &p.to_wire())?;
    let reference = wire_dict_to_py(py, &p.reference.to_wire())?;
    reference.set_item("layout", kv_obj(p.reference.layout)?)?;
    out.set_item("reference", reference)?;
    match p.kv_layout {
        Some(l) => out.set_item("layout", kv_obj(Some(l))?)?,
        None => out.set_item("layout", ssm_layout)?,
    }
    Ok(out)
}
