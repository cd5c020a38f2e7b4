//! Memory geometry: where each byte of one rank's KV cache or SSM state lives.
//!
//! A geometry is plain data that peers exchange once: base addresses, strides in bytes,
//! element size, device id and the extent of every axis. The compiler (`compile/`) combines
//! two geometries with a reshard plan and block lists into byte ranges; it never touches the
//! memory. Constructors validate every field and check, with checked arithmetic, that the last
//! byte of every plane is addressable, so the compiler's address arithmetic cannot overflow
//! once a geometry exists. All index ranges are half-open `[lo, hi)`.

use std::fmt;

use crate::args::{named, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::tensor_args::state_device;
use crate::wire::value::{join, Obj, WireValue};

/// Everything needed to build a [`KvGeometry`]; see the field docs there.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KvGeometrySpec {
    /// 2 for separate K and V planes, 1 for a single latent plane (MLA).
    pub num_kv: u32,
    /// Local layers of this rank (its pipeline window).
    pub num_layers: u32,
    /// Blocks in the paged cache.
    pub num_blocks: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Local KV heads of this rank (1 for MLA).
    pub num_heads: u32,
    /// Elements per head row.
    pub head_dim: u32,
    /// Bytes per element.
    pub element_size: u32,
    /// Byte stride between consecutive blocks.
    pub block_stride: u64,
    /// Byte stride between consecutive tokens of one block.
    pub token_stride: u64,
    /// Byte stride between consecutive heads.
    pub head_stride: u64,
    /// Base address of plane `(kv, layer)` at index `kv * num_layers + layer`.
    pub plane_bases: Vec<u64>,
    /// Device the memory lives on (NIXL's `device_id` column).
    pub device_id: u64,
    /// Element type name (`"bfloat16"`), compared between peers when both know it.
    pub dtype: Option<String>,
}

/// Where byte `(kv, layer, block, token, head, dim)` of one rank's paged KV cache lives:
/// `plane_bases[kv * num_layers + layer] + block * block_stride + token * token_stride +
/// head * head_stride + dim * element_size`.
///
/// One list of plane bases covers every cache layout of docs/architecture.md §4: one Megatron tensor
/// `[2, L, B, T, H, d]` (bases on a regular grid), per-layer tensors `[2, B, T, H, d]` (NHD) or
/// `[2, B, H, T, d]` (HND) at unrelated addresses, separate K and V tensors, and the MLA latent
/// `[L, B, T, d]` (`num_kv = 1`, `num_heads = 1`). The head row (`head_dim` elements) must be
/// contiguous: it is the smallest unit the compiler moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGeometry {
    spec: KvGeometrySpec,
}

/// Last byte offset (exclusive) of an axis walk `sum (count - 1) * stride + row`, checked.
fn extent(axes: &[(u32, u64)], row: u64, what: &str) -> DisaggResult<u64> {
    let mut end = row;
    for &(count, stride) in axes {
        let span = u64::from(count.saturating_sub(1))
            .checked_mul(stride)
            .and_then(|s| end.checked_add(s))
            .ok_or_else(|| DisaggError::overflow(format!("{what}: extent exceeds u64")))?;
        end = span;
    }
    Ok(end)
}

/// Every base plus `extent` must stay addressable.
fn check_bases(bases: &[u64], extent: u64, what: &str) -> DisaggResult<()> {
    for (i, &b) in bases.iter().enumerate() {
        if b.checked_add(extent).is_none() {
            return Err(DisaggError::overflow(format!(
                "{what} plane {i}: base {b:#x} + extent {extent} exceeds u64"
            )));
        }
    }
    Ok(())
}

impl KvGeometry {
    /// Validate `spec` and build the geometry.
    pub fn new(spec: KvGeometrySpec) -> DisaggResult<Self> {
        if !(1..=2).contains(&spec.num_kv) {
            return Err(DisaggError::geometry(
                "num_kv",
                format!("num_kv={} must be 1 (MLA latent) or 2 (K and V)", spec.num_kv),
            ));
        }
        Kind::Geometry.at_least_one(&named!(spec;
            num_layers, num_blocks, tokens_per_block, num_heads, head_dim, element_size
        ))?;
        let planes = u64::from(spec.num_kv) * u64::from(spec.num_layers);
        if spec.plane_bases.len() as u64 != planes {
            return Err(DisaggError::geometry(
                "plane_bases",
                format!(
                    "len(plane_bases)={} must equal num_kv={} * num_layers={}",
                    spec.plane_bases.len(),
                    spec.num_kv,
                    spec.num_layers
                ),
            ));
        }
        let row = u64::from(spec.head_dim)
            .checked_mul(u64::from(spec.element_size))
            .ok_or_else(|| DisaggError::overflow("head_dim * element_size exceeds u64"))?;
        let ext = extent(
            &[
                (spec.num_blocks, spec.block_stride),
                (spec.tokens_per_block, spec.token_stride),
                (spec.num_heads, spec.head_stride),
            ],
            row,
            "KV plane",
        )?;
        check_bases(&spec.plane_bases, ext, "KV")?;
        Ok(Self { spec })
    }

    /// The validated fields (`KvGeometry::new(g.spec().clone()) == g`).
    pub fn spec(&self) -> &KvGeometrySpec {
        &self.spec
    }

    /// Bytes of one head row: `head_dim * element_size` (cannot overflow: checked in `new`).
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.spec.head_dim) * u64::from(self.spec.element_size)
    }

    /// Whether heads are outer to tokens inside a block (HND), which decides the canonical
    /// packed order of a staged transfer from this rank.
    pub fn heads_outer(&self) -> bool {
        self.spec.num_heads > 1 && self.spec.head_stride > self.spec.token_stride
    }

    /// Base address of plane `(kv, layer)` (local layer index).
    pub fn plane_base(&self, kv: u32, layer: u32) -> u64 {
        self.spec.plane_bases[(kv * self.spec.num_layers + layer) as usize]
    }
}

/// Which of the two SSM state tensors a part describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SsmStateKind {
    /// The convolution state `[L, slots, C, d_conv]`; units are channels.
    Conv,
    /// The recurrent state `[L, slots, H, p, n]`; units are heads.
    Recurrent,
}

impl SsmStateKind {
    /// The Python and wire name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Conv => "conv",
            Self::Recurrent => "recurrent",
        }
    }
}

/// One SSM state tensor of one rank: byte `(layer, slot, unit, inner)` lives at
/// `layer_bases[layer] + slot * slot_stride + unit * unit_stride + inner`, where a unit is a
/// conv channel (`d_conv` contiguous elements) or a recurrent head (`p * n` contiguous
/// elements) and `inner < unit_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SsmStatePart {
    /// Base address of each local layer.
    pub layer_bases: Vec<u64>,
    /// Slots (live request states) per layer.
    pub num_slots: u32,
    /// Byte stride between slots.
    pub slot_stride: u64,
    /// Local channels (conv) or heads (recurrent).
    pub num_units: u32,
    /// Byte stride between units.
    pub unit_stride: u64,
    /// Contiguous bytes of one unit: `d_conv * element_size` or `p * n * element_size`.
    pub unit_bytes: u64,
    /// Bytes per element.
    pub element_size: u32,
    /// Element type name, compared between peers when both know it.
    pub dtype: Option<String>,
}

/// Where one rank's SSM state lives: the conv part and/or the recurrent part, on one device.
/// A part that is absent cannot be transferred (its bands are rejected by the compiler).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsmGeometry {
    /// The conv state, if this rank registers it.
    pub conv: Option<SsmStatePart>,
    /// The recurrent state, if this rank registers it.
    pub recurrent: Option<SsmStatePart>,
    /// Device the memory lives on.
    pub device_id: u64,
}

impl SsmGeometry {
    /// Validate both parts and build the geometry.
    pub fn new(
        conv: Option<SsmStatePart>,
        recurrent: Option<SsmStatePart>,
        device_id: u64,
    ) -> DisaggResult<Self> {
        if conv.is_none() && recurrent.is_none() {
            return Err(DisaggError::geometry(
                "conv",
                "an SSM geometry needs a conv part, a recurrent part or both (got neither)",
            ));
        }
        for (part, kind) in [(&conv, SsmStateKind::Conv), (&recurrent, SsmStateKind::Recurrent)] {
            if let Some(p) = part {
                let n = kind.name();
                if p.layer_bases.is_empty() {
                    return Err(DisaggError::geometry(
                        format!("{n}.layer_bases"),
                        "len(layer_bases)=0 must be >= 1",
                    ));
                }
                Kind::Geometry.at_least_one(&[
                    (&format!("{n}.num_slots"), p.num_slots),
                    (&format!("{n}.num_units"), p.num_units),
                    (&format!("{n}.element_size"), p.element_size),
                ])?;
                if p.unit_bytes == 0 || p.unit_bytes % u64::from(p.element_size) != 0 {
                    return Err(DisaggError::geometry(
                        format!("{n}.unit_bytes"),
                        format!(
                            "unit_bytes={} must be a positive multiple of element_size={}",
                            p.unit_bytes, p.element_size
                        ),
                    ));
                }
                let ext = extent(
                    &[(p.num_slots, p.slot_stride), (p.num_units, p.unit_stride)],
                    p.unit_bytes,
                    n,
                )?;
                check_bases(&p.layer_bases, ext, n)?;
            }
        }
        if let (Some(c), Some(r)) = (&conv, &recurrent) {
            let ((cl, cs), (rl, rs)) =
                ((c.layer_bases.len(), c.num_slots), (r.layer_bases.len(), r.num_slots));
            if (cl, cs) != (rl, rs) {
                return Err(DisaggError::geometry(
                    "num_layers",
                    format!(
                        "conv has {cl} layers x {cs} slots but recurrent has {rl} layers x \
                         {rs} slots"
                    ),
                ));
            }
        }
        Ok(Self { conv, recurrent, device_id })
    }

    /// The part of `kind`, if present.
    pub fn part(&self, kind: SsmStateKind) -> Option<&SsmStatePart> {
        match kind {
            SsmStateKind::Conv => self.conv.as_ref(),
            SsmStateKind::Recurrent => self.recurrent.as_ref(),
        }
    }

    /// Local SSM layers (both parts agree, checked in `new`).
    pub fn num_layers(&self) -> usize {
        self.conv.as_ref().or(self.recurrent.as_ref()).map_or(0, |p| p.layer_bases.len())
    }

    /// Slots per layer.
    pub fn num_slots(&self) -> u32 {
        self.conv.as_ref().or(self.recurrent.as_ref()).map_or(0, |p| p.num_slots)
    }
}

/// What a geometry needs of one tensor, read by the bindings from torch or numpy: address,
/// shape, byte strides, element size, dtype name and device index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TensorView {
    /// Address of element 0.
    pub ptr: u64,
    /// Extent of each axis.
    pub shape: Vec<u64>,
    /// Byte stride of each axis.
    pub strides: Vec<u64>,
    /// Bytes per element.
    pub element_size: u32,
    /// Element type name (`"bfloat16"`), if known.
    pub dtype: Option<String>,
    /// Device index, if the tensor says.
    pub device: Option<u64>,
}

const AXES: [&str; 6] = ["kv", "layer", "block", "token", "head", "dim"];

/// Size and byte stride of each named axis (absent axes: size 1, stride 0).
struct Axes {
    size: [u64; 6],
    stride: [u64; 6],
}

fn parse_axes(axes: &str, v: &TensorView, allowed: &[&str]) -> DisaggResult<Axes> {
    let names: Vec<&str> = axes.split_whitespace().collect();
    if names.len() != v.shape.len() {
        return Err(DisaggError::geometry(
            "axes",
            format!(
                "axes={axes:?} names {} axes but the tensor has shape {:?}",
                names.len(),
                v.shape
            ),
        ));
    }
    let mut a = Axes { size: [1; 6], stride: [0; 6] };
    let mut seen = [false; 6];
    for (i, n) in names.iter().enumerate() {
        let k =
            AXES.iter().position(|x| x == n).filter(|_| allowed.contains(n)).ok_or_else(|| {
                DisaggError::geometry(
                    "axes",
                    format!("axis {n:?} in axes={axes:?} is not one of {allowed:?}"),
                )
            })?;
        if seen[k] {
            return Err(DisaggError::geometry(
                "axes",
                format!("axis {n:?} appears twice in axes={axes:?}"),
            ));
        }
        seen[k] = true;
        a.size[k] = v.shape[i];
        a.stride[k] = v.strides[i];
    }
    for need in ["block", "token", "dim"] {
        if !names.contains(&need) {
            return Err(DisaggError::geometry(
                "axes",
                format!("axes={axes:?} lacks the {need:?} axis"),
            ));
        }
    }
    if a.size[5] > 1 && a.stride[5] != u64::from(v.element_size) {
        return Err(DisaggError::geometry(
            "dim",
            format!(
                "the dim axis must be contiguous: stride {} bytes != element_size={}",
                a.stride[5], v.element_size
            ),
        ));
    }
    Ok(a)
}

/// A size in `[0, 2**32)`, else a `Geometry` error naming `field`.
pub(crate) fn u32_of(field: &str, v: u64) -> DisaggResult<u32> {
    u32::try_from(v)
        .map_err(|_| DisaggError::geometry(field, format!("{field}={v} must be < 2**32")))
}

fn plane_addr(base: u64, kv: u64, kv_stride: u64, l: u64, layer_stride: u64) -> DisaggResult<u64> {
    kv.checked_mul(kv_stride)
        .and_then(|x| x.checked_add(base))
        .and_then(|x| l.checked_mul(layer_stride).and_then(|y| x.checked_add(y)))
        .ok_or_else(|| DisaggError::overflow("plane base address exceeds u64"))
}

fn spec_from_axes(
    a: &Axes,
    v: &TensorView,
    plane_bases: Vec<u64>,
    num_layers: u64,
    device_id: Option<u64>,
) -> DisaggResult<KvGeometrySpec> {
    Ok(KvGeometrySpec {
        num_kv: u32_of("num_kv", a.size[0])?,
        num_layers: u32_of("num_layers", num_layers)?,
        num_blocks: u32_of("num_blocks", a.size[2])?,
        tokens_per_block: u32_of("tokens_per_block", a.size[3])?,
        num_heads: u32_of("num_heads", a.size[4])?,
        head_dim: u32_of("head_dim", a.size[5])?,
        element_size: v.element_size,
        block_stride: a.stride[2],
        token_stride: a.stride[3],
        head_stride: a.stride[4],
        plane_bases,
        device_id: device_id.or(v.device).unwrap_or(0),
        dtype: v.dtype.clone(),
    })
}

impl KvGeometrySpec {
    /// One tensor whose axes are named by `axes` (any order of `kv layer block token head
    /// dim`; `kv`, `layer` and `head` may be absent). `device_id` overrides the tensor's.
    pub fn from_tensor(v: &TensorView, axes: &str, device_id: Option<u64>) -> DisaggResult<Self> {
        let a = parse_axes(axes, v, &AXES)?;
        let mut bases = Vec::new();
        for kv in 0..a.size[0] {
            for l in 0..a.size[1] {
                bases.push(plane_addr(v.ptr, kv, a.stride[0], l, a.stride[1])?);
            }
        }
        spec_from_axes(&a, v, bases, a.size[1], device_id)
    }

    /// One tensor per local layer, all of one shape, strides and element size, with the axes
    /// `axes` (no `layer` axis).
    pub fn from_layer_tensors(
        views: &[TensorView],
        axes: &str,
        device_id: Option<u64>,
    ) -> DisaggResult<Self> {
        let Some(first) = views.first() else {
            return Err(DisaggError::geometry("tensors", "tensors=[] has no layer"));
        };
        let a = parse_axes(axes, first, &["kv", "block", "token", "head", "dim"])?;
        if let Some((i, v)) = views.iter().enumerate().find(|(_, v)| {
            v.shape != first.shape
                || v.strides != first.strides
                || v.element_size != first.element_size
                || v.dtype != first.dtype
                || v.device != first.device
        }) {
            return Err(DisaggError::geometry(
                "tensors",
                format!(
                    "layer {i} has shape {:?} strides {:?} dtype {:?} device {:?} but layer 0 has \
                     shape {:?} strides {:?} dtype {:?} device {:?}",
                    v.shape,
                    v.strides,
                    v.dtype,
                    v.device,
                    first.shape,
                    first.strides,
                    first.dtype,
                    first.device
                ),
            ));
        }
        let mut bases = Vec::new();
        for kv in 0..a.size[0] {
            for v in views {
                bases.push(plane_addr(v.ptr, kv, a.stride[0], 0, 0)?);
            }
        }
        spec_from_axes(&a, first, bases, views.len() as u64, device_id)
    }

    /// Separate key and value tensors per local layer (`keys[l]`, `values[l]`, all of one
    /// shape, strides and element size, axes `axes` without `kv` and `layer`): two planes
    /// per layer, as engines that allocate K and V apart hold them.
    pub fn from_kv_layer_tensors(
        keys: &[TensorView],
        values: &[TensorView],
        axes: &str,
        device_id: Option<u64>,
    ) -> DisaggResult<Self> {
        if keys.len() != values.len() {
            return Err(DisaggError::geometry(
                "tensors",
                format!("{} key tensors but {} value tensors", keys.len(), values.len()),
            ));
        }
        if axes.split_whitespace().any(|a| a == "kv") {
            return Err(DisaggError::geometry(
                "axes",
                format!("axes={axes:?} of separate K and V tensors must not name a kv axis"),
            ));
        }
        let all: Vec<TensorView> = keys.iter().chain(values).cloned().collect();
        let mut spec = Self::from_layer_tensors(&all, axes, device_id)?;
        // Planes kv * num_layers + layer: keys first, then values, as concatenated.
        spec.num_kv = 2;
        spec.num_layers = u32_of("num_layers", keys.len() as u64)?;
        Ok(spec)
    }
}

/// One entry of a per-layer list of KV tensors: one tensor, or a `(K, V)` pair of separate key
/// and value tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerTensors {
    /// The layer's tensor.
    One(TensorView),
    /// The layer's key and value tensors.
    Pair(TensorView, TensorView),
}

impl KvGeometrySpec {
    /// The spec of a per-layer list: one `(K, V)` pair per layer when the first entry is one
    /// ([`KvGeometrySpec::from_kv_layer_tensors`]), else one tensor per layer
    /// ([`KvGeometrySpec::from_layer_tensors`]); an entry unlike the first fails naming it.
    pub fn from_layers(
        layers: &[LayerTensors],
        axes: &str,
        device_id: Option<u64>,
    ) -> DisaggResult<Self> {
        let pairs = matches!(layers.first(), Some(LayerTensors::Pair(..)));
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (i, layer) in layers.iter().enumerate() {
            match (layer, pairs) {
                (LayerTensors::Pair(k, v), true) => {
                    keys.push(k.clone());
                    values.push(v.clone());
                }
                (LayerTensors::One(t), false) => keys.push(t.clone()),
                (_, true) => {
                    let detail =
                        format!("tensors[{i}] is a tensor, not a (K, V) pair like tensors[0]");
                    return Err(DisaggError::geometry("tensors", detail));
                }
                (_, false) => {
                    let detail =
                        format!("tensors[{i}] is a (K, V) pair, not a tensor like tensors[0]");
                    return Err(DisaggError::geometry("tensors", detail));
                }
            }
        }
        if pairs {
            Self::from_kv_layer_tensors(&keys, &values, axes, device_id)
        } else {
            Self::from_layer_tensors(&keys, axes, device_id)
        }
    }
}

impl SsmGeometry {
    /// From the conv state `[L, slots, C, d_conv]` and/or the recurrent state `[L, slots, H,
    /// p, n]` tensors; on `device_id`, else the device the first of them names, else 0.
    pub fn from_tensors(
        conv: Option<&TensorView>,
        recurrent: Option<&TensorView>,
        device_id: Option<u64>,
    ) -> DisaggResult<Self> {
        let part = |v: Option<&TensorView>, kind, ndim| {
            v.map(|v| SsmStatePart::from_tensor(v, kind, ndim)).transpose()
        };
        let c = part(conv, SsmStateKind::Conv, 4)?;
        let r = part(recurrent, SsmStateKind::Recurrent, 5)?;
        let device = state_device(device_id, [conv, recurrent].map(|v| v.and_then(|v| v.device)));
        Self::new(c, r, device)
    }
}

impl SsmStatePart {
    /// One state tensor `[L, slots, units, inner...]` of `ndim` axes (conv 4, recurrent 5)
    /// whose inner axes form one dense row.
    pub fn from_tensor(v: &TensorView, kind: SsmStateKind, ndim: usize) -> DisaggResult<Self> {
        let field = kind.name();
        if v.shape.len() != ndim {
            return Err(DisaggError::geometry(
                field,
                format!("{field} tensor must have {ndim} axes, got shape {:?}", v.shape),
            ));
        }
        let mut expect = u64::from(v.element_size);
        for i in (3..ndim).rev() {
            if v.shape[i] > 1 && v.strides[i] != expect {
                return Err(DisaggError::geometry(
                    field,
                    format!(
                        "{field} axis {i} must be contiguous: stride {} != {expect}",
                        v.strides[i]
                    ),
                ));
            }
            expect = expect.saturating_mul(v.shape[i]);
        }
        let mut layer_bases = Vec::new();
        for l in 0..v.shape[0] {
            layer_bases.push(plane_addr(v.ptr, 0, 0, l, v.strides[0])?);
        }
        Ok(Self {
            layer_bases,
            num_slots: u32_of("num_slots", v.shape[1])?,
            slot_stride: v.strides[1],
            num_units: u32_of("num_units", v.shape[2])?,
            unit_stride: v.strides[2],
            unit_bytes: expect,
            element_size: v.element_size,
            dtype: v.dtype.clone(),
        })
    }
}

/// How one geometry field is read from and written to its wire dict.
trait WireField: Sized {
    fn read(o: &Obj<'_>, key: &str) -> DisaggResult<Self>;
    fn write(&self) -> WireValue;
}

impl WireField for u32 {
    fn read(o: &Obj<'_>, key: &str) -> DisaggResult<Self> {
        o.u32(key)
    }
    fn write(&self) -> WireValue {
        WireValue::Int(i128::from(*self))
    }
}

impl WireField for u64 {
    fn read(o: &Obj<'_>, key: &str) -> DisaggResult<Self> {
        o.u64(key)
    }
    fn write(&self) -> WireValue {
        WireValue::Int(i128::from(*self))
    }
}

/// Base addresses.
impl WireField for Vec<u64> {
    fn read(o: &Obj<'_>, key: &str) -> DisaggResult<Self> {
        o.uints(key, u64::MAX)
    }
    fn write(&self) -> WireValue {
        WireValue::List(self.iter().map(WireField::write).collect())
    }
}

/// The dtype name, `None` when unknown.
impl WireField for Option<String> {
    fn read(o: &Obj<'_>, key: &str) -> DisaggResult<Self> {
        Ok(o.opt_name(key)?.map(str::to_owned))
    }
    fn write(&self) -> WireValue {
        self.as_ref().map_or(WireValue::Null, |s| WireValue::Str(s.clone()))
    }
}

/// A record's wire keys (`$keys`: the `$lead` keys, then one per field, in field order) and
/// its field-wise `read_fields` / `write_fields`, from one list of its fields.
macro_rules! wire_record {
    ($(#[$doc:meta])* $ty:ty, $keys:ident, [$($lead:literal),*], $($field:ident),+ $(,)?) => {
        $(#[$doc])*
        pub const $keys: [&str; [$($lead,)* $(stringify!($field)),+].len()] =
            [$($lead,)* $(stringify!($field)),+];

        impl $ty {
            /// Every field, read from `o` under its own name.
            fn read_fields(o: &Obj<'_>) -> DisaggResult<Self> {
                Ok(Self { $($field: WireField::read(o, stringify!($field))?),+ })
            }

            /// Every field's wire value, in field order.
            fn write_fields(&self) -> impl Iterator<Item = WireValue> {
                [$(self.$field.write()),+].into_iter()
            }
        }
    };
}

wire_record!(
    /// Keys of a KV geometry's wire dict, in `to_wire` order.
    KvGeometrySpec, KV_GEOMETRY_KEYS, ["kind"],
    num_kv, num_layers, num_blocks, tokens_per_block, num_heads, head_dim, element_size,
    block_stride, token_stride, head_stride, plane_bases, device_id, dtype,
);

wire_record!(
    /// Keys of one SSM state part's wire dict, in `to_wire` order.
    SsmStatePart, SSM_PART_KEYS, [],
    layer_bases, num_slots, slot_stride, num_units, unit_stride, unit_bytes, element_size, dtype,
);

/// Keys of an SSM geometry's wire dict.
pub const SSM_GEOMETRY_KEYS: [&str; 4] = ["kind", "conv", "recurrent", "device_id"];

/// The wire map of `keys` and `values`, paired in order.
fn w_map(keys: &[&str], values: impl IntoIterator<Item = WireValue>) -> WireValue {
    WireValue::Map(keys.iter().map(|k| (*k).to_owned()).zip(values).collect())
}

/// The `kind` of a geometry dict, which must be `want`.
fn check_kind(o: &Obj<'_>, want: &str) -> DisaggResult<()> {
    match o.name("kind")? {
        k if k == want => Ok(()),
        k => {
            Err(DisaggError::wire(join(o.path(), "kind"), format!("kind={k:?}, expected '{want}'")))
        }
    }
}

impl KvGeometry {
    /// Decode the dict [`Self::to_wire`] writes: a `Wire` error names a missing, unknown or
    /// mistyped field; invalid values fail as in [`Self::new`].
    pub fn from_wire(o: &Obj<'_>) -> DisaggResult<Self> {
        o.only(&KV_GEOMETRY_KEYS, "KVGeometry dict")?;
        check_kind(o, "kv")?;
        Self::new(KvGeometrySpec::read_fields(o)?)
    }

    /// The wire dict (every key of [`KV_GEOMETRY_KEYS`]).
    pub fn to_wire(&self) -> WireValue {
        let kind = WireValue::Str("kv".to_owned());
        w_map(&KV_GEOMETRY_KEYS, std::iter::once(kind).chain(self.spec.write_fields()))
    }
}

impl SsmStatePart {
    /// The part under `key` of an SSM geometry dict (`None` when absent or `None`).
    pub fn from_wire(o: &Obj<'_>, key: &str) -> DisaggResult<Option<Self>> {
        let Some(v) = o.some(key) else { return Ok(None) };
        let path = join(o.path(), key);
        let p = Obj::of(v, &path)?;
        p.only(&SSM_PART_KEYS, &path)?;
        Self::read_fields(&p).map(Some)
    }

    /// The wire dict (every key of [`SSM_PART_KEYS`]).
    pub fn to_wire(&self) -> WireValue {
        w_map(&SSM_PART_KEYS, self.write_fields())
    }
}

impl SsmGeometry {
    /// Decode the dict [`Self::to_wire`] writes (errors as [`KvGeometry::from_wire`]).
    pub fn from_wire(o: &Obj<'_>) -> DisaggResult<Self> {
        o.only(&SSM_GEOMETRY_KEYS, "SSMGeometry dict")?;
        check_kind(o, "ssm")?;
        let conv = SsmStatePart::from_wire(o, "conv")?;
        Self::new(conv, SsmStatePart::from_wire(o, "recurrent")?, o.u64("device_id")?)
    }

    /// The wire dict (an absent part is `None`).
    pub fn to_wire(&self) -> WireValue {
        let part = |p: Option<&SsmStatePart>| p.map_or(WireValue::Null, SsmStatePart::to_wire);
        w_map(
            &SSM_GEOMETRY_KEYS,
            [
                WireValue::Str("ssm".to_owned()),
                part(self.conv.as_ref()),
                part(self.recurrent.as_ref()),
                self.device_id.write(),
            ],
        )
    }
}

impl fmt::Display for KvGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.spec();
        write!(
            f,
            "KVGeometry(num_kv={}, layers={}, blocks={}x{} tokens, heads={}, head_dim={}, \
             element_size={}, strides(block, token, head)=({}, {}, {}), device_id={}, dtype=",
            s.num_kv,
            s.num_layers,
            s.num_blocks,
            s.tokens_per_block,
            s.num_heads,
            s.head_dim,
            s.element_size,
            s.block_stride,
            s.token_stride,
            s.head_stride,
            s.device_id,
        )?;
        match &s.dtype {
            Some(t) => write!(f, "'{t}')"),
            None => f.write_str("None)"),
        }
    }
}

impl fmt::Display for SsmGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SSMGeometry(layers={}", self.num_layers())?;
        for (name, part) in [("conv", &self.conv), ("recurrent", &self.recurrent)] {
            match part {
                Some(p) => write!(
                    f,
                    ", {name}={} slots x {} units x {} bytes",
                    p.num_slots, p.num_units, p.unit_bytes
                )?,
                None => write!(f, ", {name}=None")?,
            }
        }
        write!(f, ", device_id={})", self.device_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn megatron(base: u64) -> KvGeometrySpec {
        // [2, L=2, B=4, T=8, H=2, d=4] of 2-byte elements.
        let (row, heads, tpb, blocks, layers) = (4u64 * 2, 2u64, 8u64, 4u64, 2u64);
        let plane = blocks * tpb * heads * row;
        KvGeometrySpec {
            num_kv: 2,
            num_layers: 2,
            num_blocks: 4,
            tokens_per_block: 8,
            num_heads: 2,
            head_dim: 4,
            element_size: 2,
            block_stride: tpb * heads * row,
            token_stride: heads * row,
            head_stride: row,
            plane_bases: (0..2 * layers).map(|i| base + i * plane).collect(),
            device_id: 0,
            dtype: Some("bfloat16".into()),
        }
    }

    fn view(shape: &[u64], ptr: u64) -> TensorView {
        // Row-major strides of 2-byte elements.
        let mut strides = vec![2u64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        TensorView {
            ptr,
            shape: shape.to_vec(),
            strides,
            element_size: 2,
            dtype: Some("bfloat16".into()),
            device: Some(1),
        }
    }

    #[test]
    fn a_named_axes_tensor_gives_the_per_layer_geometry() {
        let s = KvGeometrySpec::from_tensor(
            &view(&[2, 2, 4, 8, 2, 4], 0x1000),
            "kv layer block token head dim",
            None,
        )
        .unwrap();
        assert_eq!(s, KvGeometrySpec { device_id: 1, ..megatron(0x1000) });
        let e = KvGeometrySpec::from_tensor(&view(&[4, 8, 4], 0), "block token head", None)
            .unwrap_err();
        assert!(e.to_string().contains("lacks the \"dim\" axis"), "{e}");
        let e =
            KvGeometrySpec::from_tensor(&view(&[4, 8, 4], 0), "block block dim", None).unwrap_err();
        assert!(e.to_string().contains("appears twice"), "{e}");
        let e =
            KvGeometrySpec::from_tensor(&view(&[4, 8], 0), "block token dim", None).unwrap_err();
        assert!(e.to_string().contains("names 3 axes"), "{e}");
    }

    #[test]
    fn per_layer_tensors_must_agree_and_give_one_base_per_kv_and_layer() {
        let layers = [view(&[2, 4, 8, 2, 4], 0x1000), view(&[2, 4, 8, 2, 4], 0x9000)];
        let s = KvGeometrySpec::from_layer_tensors(&layers, "kv block token head dim", Some(5))
            .unwrap();
        let plane = 4 * 8 * 2 * 4 * 2;
        assert_eq!(s.plane_bases, vec![0x1000, 0x9000, 0x1000 + plane, 0x9000 + plane]);
        assert_eq!((s.num_layers, s.device_id), (2, 5));
        let e =
            KvGeometrySpec::from_layer_tensors(&[], "kv block token head dim", None).unwrap_err();
        assert!(e.to_string().contains("no layer"), "{e}");
        let odd = [layers[0].clone(), view(&[2, 4, 8, 1, 4], 0)];
        let e =
            KvGeometrySpec::from_layer_tensors(&odd, "kv block token head dim", None).unwrap_err();
        assert!(e.to_string().contains("layer 1 has shape"), "{e}");
    }

    #[test]
    fn an_ssm_state_tensor_needs_dense_inner_axes() {
        let p =
            SsmStatePart::from_tensor(&view(&[3, 4, 8, 16, 2], 0x100), SsmStateKind::Recurrent, 5)
                .unwrap();
        assert_eq!((p.num_slots, p.num_units, p.unit_bytes), (4, 8, 64));
        assert_eq!(p.layer_bases, vec![0x100, 0x100 + 4 * 8 * 64, 0x100 + 2 * 4 * 8 * 64]);
        let mut v = view(&[3, 4, 8, 4], 0);
        v.strides[3] = 4;
        let e = SsmStatePart::from_tensor(&v, SsmStateKind::Conv, 4).unwrap_err();
        assert!(e.to_string().contains("conv axis 3 must be contiguous"), "{e}");
        let e = SsmStatePart::from_tensor(&view(&[3, 4, 8], 0), SsmStateKind::Conv, 4).unwrap_err();
        assert!(e.to_string().contains("must have 4 axes"), "{e}");
    }

    /// Two layers of 4 slots x 8 units x 32 bytes.
    fn recurrent_part(dtype: Option<&str>) -> SsmStatePart {
        SsmStatePart {
            layer_bases: vec![0x1000, 0x9000],
            num_slots: 4,
            slot_stride: 256,
            num_units: 8,
            unit_stride: 32,
            unit_bytes: 32,
            element_size: 2,
            dtype: dtype.map(str::to_owned),
        }
    }

    #[test]
    fn conv_and_recurrent_parts_must_agree_on_layers_and_slots() {
        let mut conv = recurrent_part(None);
        assert!(SsmGeometry::new(Some(conv.clone()), Some(recurrent_part(None)), 0).is_ok());
        conv.num_slots = 3;
        let e = SsmGeometry::new(Some(conv), Some(recurrent_part(None)), 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "geometry mismatch on `num_layers`: conv has 2 layers x 3 slots but recurrent has 2 \
             layers x 4 slots"
        );
    }

    #[test]
    fn wire_keys_follow_the_record_fields() {
        assert_eq!(KV_GEOMETRY_KEYS[..2], ["kind", "num_kv"]);
        assert_eq!(KV_GEOMETRY_KEYS[13], "dtype");
        assert_eq!((SSM_PART_KEYS.len(), SSM_PART_KEYS[0]), (8, "layer_bases"));
        let w = recurrent_part(Some("float16")).to_wire();
        let WireValue::Map(pairs) = &w else { panic!("not a map: {w:?}") };
        assert_eq!(pairs[1], ("num_slots".to_owned(), WireValue::Int(4)));
        assert_eq!(pairs[7], ("dtype".to_owned(), WireValue::Str("float16".into())));
    }

    #[test]
    fn reprs_name_every_dimension_and_the_dtype() {
        let mut s = megatron(0x1000);
        let g = KvGeometry::new(s.clone()).unwrap();
        assert_eq!(
            g.to_string(),
            "KVGeometry(num_kv=2, layers=2, blocks=4x8 tokens, heads=2, head_dim=4, \
             element_size=2, strides(block, token, head)=(128, 16, 8), device_id=0, \
             dtype='bfloat16')"
        );
        s.dtype = None;
        assert!(KvGeometry::new(s).unwrap().to_string().ends_with("device_id=0, dtype=None)"));
        let g = SsmGeometry::new(None, Some(recurrent_part(None)), 3).unwrap();
        assert_eq!(
            g.to_string(),
            "SSMGeometry(layers=2, conv=None, recurrent=4 slots x 8 units x 32 bytes, device_id=3)"
        );
    }

    #[test]
    fn a_valid_spec_round_trips() {
        let g = KvGeometry::new(megatron(4096)).unwrap();
        assert_eq!(KvGeometry::new(g.spec().clone()).unwrap(), g);
        assert_eq!(g.row_bytes(), 8);
        assert!(!g.heads_outer());
    }

    #[test]
    fn a_plane_that_ends_past_u64_is_an_overflow_error() {
        let mut s = megatron(0);
        s.plane_bases[3] = u64::MAX - 100;
        let e = KvGeometry::new(s).unwrap_err();
        assert_eq!(e.kind(), "AddressOverflow");
    }

    #[test]
    fn plane_count_must_match_kv_times_layers() {
        let mut s = megatron(0);
        s.plane_bases.pop();
        let e = KvGeometry::new(s).unwrap_err();
        assert!(e.to_string().contains("num_layers=2"), "{e}");
    }

    fn wire_field(v: &WireValue, f: impl Fn(&Obj<'_>) -> DisaggResult<()>) -> String {
        match f(&Obj::of(v, "").unwrap()).unwrap_err() {
            DisaggError::Wire { field, .. } => field,
            other => panic!("not a wire error: {other}"),
        }
    }

    fn set(v: &mut WireValue, path: &[&str], new: WireValue) {
        let WireValue::Map(entries) = v else { panic!("not a map") };
        let (key, rest) = path.split_first().unwrap();
        match entries.iter_mut().find(|(k, _)| k == key) {
            Some((_, slot)) if rest.is_empty() => *slot = new,
            Some((_, slot)) => set(slot, rest, new),
            None => entries.push(((*key).to_owned(), new)),
        }
    }

    #[test]
    fn geometries_round_trip_through_their_wire_dicts_and_name_a_bad_field() {
        let g = KvGeometry::new(megatron(4096)).unwrap();
        let v = g.to_wire();
        assert_eq!(KvGeometry::from_wire(&Obj::of(&v, "").unwrap()).unwrap(), g);
        let ssm = SsmGeometry::new(None, Some(recurrent_part(Some("float32"))), 3).unwrap();
        let sv = ssm.to_wire();
        assert_eq!(SsmGeometry::from_wire(&Obj::of(&sv, "").unwrap()).unwrap(), ssm);
        let kv = |o: &Obj<'_>| KvGeometry::from_wire(o).map(drop);
        let sm = |o: &Obj<'_>| SsmGeometry::from_wire(o).map(drop);
        for (path, new, field) in [
            (&["typo"][..], WireValue::Int(1), "typo"),
            (&["kind"][..], WireValue::Str("ssm".into()), "kind"),
            (&["num_blocks"][..], WireValue::Int(-1), "num_blocks"),
            (&["plane_bases"][..], WireValue::List(vec![WireValue::Bool(true)]), "plane_bases[0]"),
        ] {
            let mut bad = v.clone();
            set(&mut bad, path, new);
            assert_eq!(wire_field(&bad, kv), field);
        }
        for (path, new, field) in [
            (&["kind"][..], WireValue::Str("kv".into()), "kind"),
            (&["recurrent", "typo"][..], WireValue::Int(1), "recurrent.typo"),
            (&["recurrent", "num_slots"][..], WireValue::Null, "recurrent.num_slots"),
            (&["conv"][..], WireValue::Int(3), "conv"),
        ] {
            let mut bad = sv.clone();
            set(&mut bad, path, new);
            assert_eq!(wire_field(&bad, sm), field);
        }
    }
}
