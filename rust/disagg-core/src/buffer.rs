//! What a transfer backend decides about the buffer it registers, before any I/O.
//!
//! A backend wraps one state buffer of one rank: a paged KV cache (one tensor or one tensor per
//! layer), a matched-layout buffer `[outer..., B, inner...]` moved in whole slices, or an SSM
//! conv or recurrent state buffer. From the facts the bindings read off the tensor (shape,
//! strides, element size, device) and the constructor's arguments, [`plan_buffer`] infers the
//! state kind, the axis names, the KV layout, the compiler's geometry and the reference
//! design's description of the same buffer ([`RefGeometry`]), or fails with one typed error
//! naming the field and both values. [`reference_geometry`] is the reference design's
//! `compute_buffer_geometry` alone. Nothing here touches memory.

use crate::args::{Int, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{
    u32_of, KvGeometry, KvGeometrySpec, LayerTensors, SsmGeometry, SsmStateKind, SsmStatePart,
    TensorView,
};
use crate::layout::{KvLayoutSpec, KvShardLayout, RankCoords, SsmShardLayout};
use crate::wire::value::WireValue;

/// Default axes of one KV cache tensor: Megatron's `[2, L, B, T, H, d]`.
pub const KV_AXES: &str = "kv layer block token head dim";
/// Default axes of each per-layer KV tensor: NHD `[2, B, T, H, d]`.
pub const LAYER_KV_AXES: &str = "kv block token head dim";
/// Axis names of a matched-layout buffer.
pub const MATCHED_AXES: &str = "outer block slice";

/// The KV layout arguments of a backend constructor, as given (`None`: not given). Values are
/// Python ints, so any sign and size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutArgs {
    /// Tensor-parallel size.
    pub tp_size: Option<i128>,
    /// Tensor-parallel rank.
    pub tp_rank: Option<i128>,
    /// KV heads of the whole model.
    pub num_kv_heads_global: Option<i128>,
    /// KV heads of this rank.
    pub heads_per_partition: Option<i128>,
    /// Elements per head row.
    pub head_dim: Option<i128>,
    /// Tokens per block.
    pub tokens_per_block: Option<i128>,
    /// Rank in the engine's world.
    pub global_rank: Option<i128>,
    /// Pipeline-parallel size.
    pub pp_size: Option<i128>,
    /// Pipeline-parallel rank.
    pub pp_rank: Option<i128>,
    /// Layers of the whole model.
    pub num_layers_global: Option<i128>,
    /// First global layer of this stage.
    pub layer_start: Option<i128>,
    /// One past the last global layer of this stage.
    pub layer_end: Option<i128>,
}

/// Everything [`plan_buffer`] needs: the facts of the first registered tensor and the
/// constructor's arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BufferArgs {
    /// The backend's class name, for messages.
    pub backend: String,
    /// The (first) registered tensor.
    pub view: TensorView,
    /// Whether every registered tensor is contiguous.
    pub contiguous: bool,
    /// Whether the buffer was given as a per-layer list of tensors.
    pub per_layer: bool,
    /// Blocks (KV) or slots (SSM) the buffer must hold.
    pub expected_num_blocks: i128,
    /// The KV layout arguments.
    pub kv: LayoutArgs,
    /// The SSM layout of an SSM state buffer.
    pub ssm_layout: Option<SsmShardLayout>,
    /// `"conv"` or `"recurrent"` for an SSM state buffer.
    pub ssm_state_kind: Option<String>,
    /// Axis names given by the caller.
    pub axes: Option<String>,
    /// The blocks axis named by the caller (the reference design's extension).
    pub blocks_axis: Option<i128>,
}

/// The reference design's description of a registered buffer `[outer..., B, inner...]`: each
/// `(outer, block)` pair is one contiguous slice of `bytes_per_slice` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefGeometry {
    /// Address of the buffer.
    pub buf_ptr: u64,
    /// Bytes per element.
    pub element_size: u32,
    /// Device index (0 off the GPU).
    pub device_id: u64,
    /// Index of the blocks (slots) axis.
    pub blocks_axis: usize,
    /// Extent of the blocks axis.
    pub num_blocks: u64,
    /// Product of the axes before the blocks axis.
    pub num_outer: u64,
    /// Bytes of one `(outer, block)` slice.
    pub bytes_per_slice: u64,
    /// Bytes between consecutive outer indices.
    pub outer_stride_bytes: u64,
    /// KV heads of this rank, when known.
    pub heads_per_partition: Option<i128>,
    /// Elements per head row, when known.
    pub head_dim: Option<i128>,
    /// Tokens per block, when known.
    pub tokens_per_block: Option<i128>,
    /// The KV layout, when the buffer is a KV cache with one.
    pub layout: Option<KvShardLayout>,
}

/// The layout of a registered buffer.
#[derive(Debug, Clone, PartialEq)]
pub enum StateLayout {
    /// A KV cache's.
    Kv(KvShardLayout),
    /// SSM state's.
    Ssm(SsmShardLayout),
}

/// What [`register`] answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Registration {
    /// The reference design's geometry alone.
    Reference(RefGeometry),
    /// Everything a backend registers.
    Plan(BufferPlan),
}

/// What a backend registers: see [`plan_buffer`].
#[derive(Debug, Clone, PartialEq)]
pub struct BufferPlan {
    /// `"kv"`, `"conv"` or `"recurrent"`.
    pub state_kind: &'static str,
    /// The axis names (`"outer block slice"` for a matched-layout buffer).
    pub axes: String,
    /// The layout: the KV layout inferred, or the caller's SSM layout.
    pub layout: StateLayout,
    /// Elements per head row (a matched-layout buffer: elements per slice).
    pub head_dim: u64,
    /// Tokens per block (`None` for SSM state).
    pub tokens_per_block: Option<u64>,
    /// The reference design's description of the buffer.
    pub reference: RefGeometry,
    /// The descriptor compiler's geometry dict (`KVGeometry` or `SSMGeometry`).
    pub geometry: WireValue,
}

fn opt_int(v: Option<i128>) -> WireValue {
    v.map_or(WireValue::Null, WireValue::Int)
}

impl RefGeometry {
    /// The fields as a wire dict, `layout` left out (the bindings hand out the layout object).
    pub fn to_wire(&self) -> WireValue {
        let int = |v: u64| WireValue::Int(i128::from(v));
        WireValue::Map(
            [
                ("buf_ptr", int(self.buf_ptr)),
                ("element_size", int(self.element_size.into())),
                ("device_id", int(self.device_id)),
                ("blocks_axis", int(self.blocks_axis as u64)),
                ("num_blocks", int(self.num_blocks)),
                ("num_outer", int(self.num_outer)),
                ("bytes_per_slice", int(self.bytes_per_slice)),
                ("outer_stride_bytes", int(self.outer_stride_bytes)),
                ("heads_per_partition", opt_int(self.heads_per_partition)),
                ("head_dim", opt_int(self.head_dim)),
                ("tokens_per_block", opt_int(self.tokens_per_block)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        )
    }
}

impl BufferPlan {
    /// The plan as a wire dict, the layouts left out (the bindings hand out the objects).
    pub fn to_wire(&self) -> WireValue {
        WireValue::Map(vec![
            ("state_kind".into(), WireValue::Str(self.state_kind.into())),
            ("axes".into(), WireValue::Str(self.axes.clone())),
            ("head_dim".into(), WireValue::Int(self.head_dim.into())),
            ("tokens_per_block".into(), opt_int(self.tokens_per_block.map(i128::from))),
            ("geometry".into(), self.geometry.clone()),
            ("reference".into(), self.reference.to_wire()),
        ])
    }
}

fn mismatch(field: &str, detail: String) -> DisaggError {
    DisaggError::geometry(field, detail)
}

/// A value in `[0, 2**32)`, else a `Layout` error naming `field`.
fn layout_u32(field: &str, v: i128) -> DisaggResult<u32> {
    Int::from(v).to_u32(Kind::Layout, field)
}

/// Python's repr of an optional string.
fn repr_opt(v: Option<&str>) -> String {
    v.map_or_else(|| "None".to_owned(), |s| format!("'{s}'"))
}

fn repr_layout(l: Option<&SsmShardLayout>) -> String {
    l.map_or_else(|| "None".to_owned(), ToString::to_string)
}

/// `axes or default`: an absent or empty name list takes the default.
fn axes_or(axes: Option<&str>, default: &str) -> String {
    axes.filter(|a| !a.is_empty()).unwrap_or(default).to_owned()
}

fn product(dims: &[u64]) -> DisaggResult<u64> {
    dims.iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| DisaggError::overflow("buffer extent exceeds u64"))
}

/// A KV layout with an explicit layer window `[layer_start, layer_end)`: the reference
/// design's nine layout fields.
pub fn kv_layout_with_window(a: &LayoutArgs) -> DisaggResult<KvShardLayout> {
    let need = |field: &str, v: Option<i128>| {
        v.ok_or_else(|| DisaggError::layout(field, format!("{field} is required")))
    };
    let (start, end) = (need("layer_start", a.layer_start)?, need("layer_end", a.layer_end)?);
    KvShardLayout::new(KvLayoutSpec {
        num_layers: layout_u32("num_layers", need("num_layers_global", a.num_layers_global)?)?,
        num_kv_heads: layout_u32(
            "num_kv_heads",
            need("num_kv_heads_global", a.num_kv_heads_global)?,
        )?,
        ranks: RankCoords::grid(
            layout_u32("tp_size", need("tp_size", a.tp_size)?)?,
            layout_u32("tp_rank", need("tp_rank", a.tp_rank)?)?,
            layout_u32("pp_size", need("pp_size", a.pp_size)?)?,
            layout_u32("pp_rank", need("pp_rank", a.pp_rank)?)?,
            layout_u32("global_rank", need("global_rank", a.global_rank)?)?,
        ),
        layer_start: Some(layout_u32("layer_start", start)?),
        num_local_layers: Some(layout_u32("num_local_layers", end - start)?),
        ..KvLayoutSpec::default()
    })
}

/// The blocks axis of the buffer: `blocks_axis`, else axis 1 of SSM state, else the one axis
/// of size `expected_num_blocks`.
fn blocks_axis_of(a: &BufferArgs) -> DisaggResult<usize> {
    let name = &a.backend;
    let shape = &a.view.shape;
    let expected = a.expected_num_blocks;
    let blocks_axis = match (a.blocks_axis, a.ssm_layout.is_some()) {
        (Some(axis), _) => axis,
        (None, true) => 1,
        (None, false) => {
            let hits: Vec<usize> =
                (0..shape.len()).filter(|&i| i128::from(shape[i]) == expected).collect();
            match hits[..] {
                [axis] => axis as i128,
                _ => {
                    return Err(mismatch(
                        "expected_num_blocks",
                        format!(
                            "{name}: {} axes of memory_buffer shape {shape:?} have \
                             expected_num_blocks={expected} entries (need exactly one); pass \
                             axes=... to name them",
                            hits.len()
                        ),
                    ))
                }
            }
        }
    };
    let axis = usize::try_from(blocks_axis)
        .ok()
        .filter(|&i| i < shape.len() && i128::from(shape[i]) == expected)
        .ok_or_else(|| {
            mismatch(
                "expected_num_blocks",
                format!(
                    "{name}: memory_buffer shape {shape:?} has no {expected}-entry blocks axis at \
                     {blocks_axis}"
                ),
            )
        })?;
    Ok(axis)
}

/// The KV layout of the reference design's full layout fields, checked against a
/// `[2, L, B, T, H, d]` buffer with its blocks on `axis` and `num_outer` outer slices.
fn checked_full_layout(a: &BufferArgs, axis: usize, num_outer: u64) -> DisaggResult<KvShardLayout> {
    let (name, shape, k) = (&a.backend, &a.view.shape, &a.kv);
    let l = kv_layout_with_window(k)?;
    if axis != 2 || shape.len() != 6 {
        return Err(mismatch(
            "memory_buffer",
            format!(
                "{name}: a KV cache with a layout is [2, L, B, T, H, d]; shape {shape:?} has \
                 its blocks on axis {axis}"
            ),
        ));
    }
    let hpp = i128::from(l.heads.len());
    if Some(hpp) != k.heads_per_partition {
        return Err(mismatch(
            "heads_per_partition",
            format!(
                "{name}: heads_per_partition={} but the KV layout gives {hpp}",
                k.heads_per_partition.unwrap_or_default()
            ),
        ));
    }
    let local = u64::from(l.layers.len());
    if local == 0 || !num_outer.is_multiple_of(local) {
        return Err(mismatch(
            "memory_buffer",
            format!(
                "{name}: {num_outer} outer slices are not a multiple of the {local} local \
                 layers"
            ),
        ));
    }
    Ok(l)
}

/// The reference design's `compute_buffer_geometry`: locate the blocks axis (`blocks_axis`,
/// else axis 1 of SSM state, else the one axis of size `expected_num_blocks`) and derive the
/// slice strides; with every KV layout field given, build the layout and check it against a
/// `[2, L, B, T, H, d]` buffer.
pub fn reference_geometry(a: &BufferArgs) -> DisaggResult<RefGeometry> {
    let name = &a.backend;
    let kind = a.ssm_state_kind.as_deref();
    if !matches!(kind, None | Some("conv" | "recurrent")) {
        return Err(DisaggError::layout(
            "ssm_state_kind",
            format!("{name}: ssm_state_kind must be 'conv' or 'recurrent', got {}", repr_opt(kind)),
        ));
    }
    if a.ssm_layout.is_none() != kind.is_none() {
        return Err(DisaggError::layout(
            "ssm_state_kind",
            format!(
                "{name}: ssm_layout and ssm_state_kind go together (got layout={}, kind={})",
                repr_layout(a.ssm_layout.as_ref()),
                repr_opt(kind)
            ),
        ));
    }
    let axis = blocks_axis_of(a)?;
    let shape = &a.view.shape;
    let num_blocks = shape[axis];
    let es = u64::from(a.view.element_size);
    let num_outer = product(&shape[..axis])?;
    let bytes_per_slice = product(&shape[axis + 1..])?
        .checked_mul(es)
        .ok_or_else(|| DisaggError::overflow("bytes per slice exceed u64"))?;
    let k = &a.kv;
    let full = [
        k.global_rank,
        k.tp_size,
        k.tp_rank,
        k.pp_size,
        k.pp_rank,
        k.num_layers_global,
        k.num_kv_heads_global,
        k.heads_per_partition,
        k.head_dim,
        k.tokens_per_block,
        k.layer_start,
        k.layer_end,
    ]
    .iter()
    .all(Option::is_some);
    let layout = if a.ssm_layout.is_none() && full {
        Some(checked_full_layout(a, axis, num_outer)?)
    } else {
        None
    };
    Ok(RefGeometry {
        buf_ptr: a.view.ptr,
        element_size: a.view.element_size,
        device_id: a.view.device.unwrap_or(0),
        blocks_axis: axis,
        num_blocks,
        num_outer,
        bytes_per_slice,
        outer_stride_bytes: num_blocks
            .checked_mul(bytes_per_slice)
            .ok_or_else(|| DisaggError::overflow("outer stride exceeds u64"))?,
        heads_per_partition: k.heads_per_partition,
        head_dim: k.head_dim,
        tokens_per_block: k.tokens_per_block,
        layout,
    })
}

/// The checks [`plan_buffer`] makes before the per-layer geometry is read: every tensor is
/// contiguous, and SSM state is one tensor per kind.
pub fn check_buffer_args(a: &BufferArgs) -> DisaggResult<()> {
    if !a.contiguous {
        return Err(mismatch(
            "memory_buffer",
            "memory_buffer must be contiguous (register the whole cache, not a view)".into(),
        ));
    }
    if a.per_layer && (a.ssm_layout.is_some() || a.ssm_state_kind.is_some()) {
        return Err(DisaggError::layout(
            "memory_buffer",
            "SSM state is one [L, slots, ...] tensor per kind, not a per-layer list",
        ));
    }
    Ok(())
}

/// The axes a per-layer list is read with (the caller's, else NHD).
pub fn layer_axes(a: &BufferArgs) -> String {
    axes_or(a.axes.as_deref(), LAYER_KV_AXES)
}

/// The geometry of a matched-layout buffer: `num_outer` one-token, one-head planes of
/// `bytes_per_slice` bytes per block.
pub fn matched_geometry(r: &RefGeometry, dtype: Option<String>) -> DisaggResult<KvGeometry> {
    let es = u64::from(r.element_size.max(1));
    let outer = u32_of("num_layers", r.num_outer)?;
    let plane_bases = (0..r.num_outer)
        .map(|i| i.checked_mul(r.outer_stride_bytes).and_then(|o| o.checked_add(r.buf_ptr)))
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| DisaggError::overflow("matched-layout plane base exceeds u64"))?;
    KvGeometry::new(KvGeometrySpec {
        num_kv: 1,
        num_layers: outer,
        num_blocks: u32_of("num_blocks", r.num_blocks)?,
        tokens_per_block: 1,
        num_heads: 1,
        head_dim: u32_of("head_dim", r.bytes_per_slice / es)?,
        element_size: r.element_size,
        block_stride: r.bytes_per_slice,
        token_stride: r.bytes_per_slice,
        head_stride: r.bytes_per_slice,
        plane_bases,
        device_id: r.device_id,
        dtype,
    })
}

/// A backend's buffer: with `reference_only` the reference design's geometry alone
/// ([`reference_geometry`]), else the [`check_buffer_args`] checks, then the per-layer list
/// `layers` read with [`layer_axes`] and [`plan_buffer`].
pub fn register(
    a: &BufferArgs,
    layers: Option<&[LayerTensors]>,
    reference_only: bool,
) -> DisaggResult<Registration> {
    if reference_only {
        return reference_geometry(a).map(Registration::Reference);
    }
    check_buffer_args(a)?;
    let axes = layer_axes(a);
    let layer = layers.map(|l| KvGeometrySpec::from_layers(l, &axes, a.view.device)).transpose()?;
    plan_buffer(a, layer.as_ref()).map(Registration::Plan)
}

/// Infer everything a backend registers about its buffer, in the order the checks are
/// documented: SSM state (shape from `ssm_layout`), a matched-layout buffer (no `axes` and not
/// six axes), or a KV cache whose named axes give the layout (arguments that disagree with the
/// buffer fail naming the argument). `layer` is the per-layer list's geometry.
pub fn plan_buffer(a: &BufferArgs, layer: Option<&KvGeometrySpec>) -> DisaggResult<BufferPlan> {
    check_buffer_args(a)?;
    let given_axes = if a.per_layer { Some(layer_axes(a)) } else { a.axes.clone() };
    if a.ssm_layout.is_some() || a.ssm_state_kind.is_some() {
        return plan_ssm(a, given_axes.as_deref());
    }
    if given_axes.is_none() && a.view.shape.len() != 6 {
        return plan_matched(a);
    }
    plan_kv(a, &axes_or(given_axes.as_deref(), KV_AXES), layer)
}

/// SSM state: one `[L, slots, ...]` tensor whose shape the SSM layout gives.
fn plan_ssm(a: &BufferArgs, given_axes: Option<&str>) -> DisaggResult<BufferPlan> {
    let (layout, kind) = match (a.ssm_layout.as_ref(), a.ssm_state_kind.as_deref()) {
        (Some(l), Some("conv")) => (l, SsmStateKind::Conv),
        (Some(l), Some("recurrent")) => (l, SsmStateKind::Recurrent),
        (l, k) => {
            return Err(DisaggError::layout(
                "ssm_state_kind",
                format!(
                    "SSM state needs both ssm_layout and ssm_state_kind in ('conv', \
                     'recurrent'); got layout={}, kind={}",
                    repr_layout(l),
                    repr_opt(k)
                ),
            ))
        }
    };
    let n = a.expected_num_blocks;
    let want: Vec<i128> = match kind {
        SsmStateKind::Conv => vec![
            layout.layers.len().into(),
            n,
            layout.local_conv_channels().into(),
            layout.dims.d_conv.into(),
        ],
        SsmStateKind::Recurrent => vec![
            layout.layers.len().into(),
            n,
            layout.heads.len().into(),
            layout.dims.head_dim.into(),
            layout.dims.d_state.into(),
        ],
    };
    let got: Vec<i128> = a.view.shape.iter().map(|&d| i128::from(d)).collect();
    if got != want {
        return Err(mismatch(
            "memory_buffer",
            format!("{} buffer shape {got:?} != {want:?} expected from ssm_layout", kind.name()),
        ));
    }
    let mut reference = reference_geometry(&BufferArgs {
        blocks_axis: Some(1),
        kv: LayoutArgs { head_dim: None, ..a.kv.clone() },
        ..a.clone()
    })?;
    reference.layout = None;
    let ndim = got.len();
    let part = SsmStatePart::from_tensor(&a.view, kind, ndim)?;
    let (conv, rec) = match kind {
        SsmStateKind::Conv => (Some(part), None),
        SsmStateKind::Recurrent => (None, Some(part)),
    };
    let geometry = SsmGeometry::new(conv, rec, a.view.device.unwrap_or(0))?.to_wire();
    Ok(BufferPlan {
        state_kind: kind.name(),
        axes: axes_or(given_axes, ssm_axes(kind)),
        layout: StateLayout::Ssm(*layout),
        head_dim: layout.dims.head_dim.into(),
        tokens_per_block: None,
        reference,
        geometry,
    })
}

/// The reference design's matched layout: whole `(outer, block)` slices.
fn plan_matched(a: &BufferArgs) -> DisaggResult<BufferPlan> {
    let dtype = a.view.dtype.clone();
    // The reference design's matched layout: whole (outer, block) slices.
    let reference = reference_geometry(&BufferArgs {
        kv: LayoutArgs::default(),
        blocks_axis: None,
        ..a.clone()
    })?;
    if reference.bytes_per_slice == 0 || reference.num_outer == 0 {
        return Err(mismatch(
            "memory_buffer",
            format!("memory_buffer shape {:?} holds no bytes per block", a.view.shape),
        ));
    }
    let head_dim = reference.bytes_per_slice / u64::from(a.view.element_size.max(1));
    let layout = KvShardLayout::new(KvLayoutSpec {
        num_layers: layout_u32("num_layers", i128::from(reference.num_outer))?,
        num_kv_heads: 1,
        ranks: RankCoords {
            global_rank: layout_u32("global_rank", a.kv.global_rank.unwrap_or(0))?,
            ..RankCoords::single()
        },
        ..KvLayoutSpec::default()
    })?;
    let reference = RefGeometry {
        heads_per_partition: a.kv.heads_per_partition,
        head_dim: a.kv.head_dim,
        tokens_per_block: a.kv.tokens_per_block,
        layout: None,
        ..reference
    };
    let geometry = matched_geometry(&reference, dtype)?.to_wire();
    Ok(BufferPlan {
        state_kind: "kv",
        axes: MATCHED_AXES.to_owned(),
        layout: StateLayout::Kv(layout),
        head_dim,
        tokens_per_block: Some(1),
        reference,
        geometry,
    })
}

/// A KV cache whose named axes (`axes`) give the layout; `layer`: the per-layer geometry.
fn plan_kv(a: &BufferArgs, axes: &str, layer: Option<&KvGeometrySpec>) -> DisaggResult<BufferPlan> {
    let sizes = AxisSizes { axes, view: &a.view, layer };
    let (local, blocks, tokens, heads, dim) = (
        sizes.get("layer")?,
        sizes.get("block")?,
        sizes.get("token")?,
        sizes.get("head")?,
        sizes.get("dim")?,
    );
    let k = &a.kv;
    for (field, given, actual) in [
        ("expected_num_blocks", Some(a.expected_num_blocks), blocks),
        ("heads_per_partition", k.heads_per_partition, heads),
        ("head_dim", k.head_dim, dim),
        ("tokens_per_block", k.tokens_per_block, tokens),
    ] {
        if let Some(g) = given.filter(|&g| g != i128::from(actual)) {
            return Err(mismatch(
                field,
                format!("{field}={g} but memory_buffer axis holds {actual}"),
            ));
        }
    }
    if let (Some(s), Some(e)) = (k.layer_start, k.layer_end) {
        if e - s != i128::from(local) {
            return Err(mismatch(
                "layer_end",
                format!("layer window [{s}, {e}) != {local} buffer layers"),
            ));
        }
    }
    let nonzero_or = |v: Option<i128>, d: i128| v.filter(|&x| x != 0).unwrap_or(d);
    let (tp, pp) = (nonzero_or(k.tp_size, 1), nonzero_or(k.pp_size, 1));
    let tp_u = layout_u32("tp_size", tp)?;
    let tp_rank = layout_u32("tp_rank", nonzero_or(k.tp_rank, 0))?;
    let pp_rank = layout_u32("pp_rank", nonzero_or(k.pp_rank, 0))?;
    let default_rank = i128::from(pp_rank) * tp + i128::from(tp_rank);
    let layout = KvShardLayout::new(KvLayoutSpec {
        num_layers: layout_u32(
            "num_layers",
            k.num_layers_global.unwrap_or(i128::from(local) * pp),
        )?,
        num_kv_heads: layout_u32(
            "num_kv_heads",
            k.num_kv_heads_global.unwrap_or(i128::from(heads) * tp),
        )?,
        ranks: RankCoords::grid(
            tp_u,
            tp_rank,
            layout_u32("pp_size", pp)?,
            pp_rank,
            layout_u32("global_rank", k.global_rank.unwrap_or(default_rank))?,
        ),
        layer_start: k.layer_start.map(|s| layout_u32("layer_start", s)).transpose()?,
        num_local_layers: k
            .layer_start
            .map(|_| layout_u32("num_local_layers", i128::from(local)))
            .transpose()?,
        ..KvLayoutSpec::default()
    })?;
    let (hpp, nll) = (layout.heads.len(), layout.layers.len());
    if u64::from(hpp) != heads || u64::from(nll) != local {
        return Err(mismatch(
            "memory_buffer",
            format!(
                "layout holds {hpp} heads x {nll} layers but memory_buffer holds {heads} x {local}"
            ),
        ));
    }
    let names: Vec<&str> = axes.split_whitespace().collect();
    let reference = reference_geometry(&BufferArgs {
        kv: LayoutArgs {
            heads_per_partition: k.heads_per_partition,
            head_dim: k.head_dim,
            tokens_per_block: k.tokens_per_block,
            ..LayoutArgs::default()
        },
        blocks_axis: names.iter().position(|n| *n == "block").map(|i| i as i128),
        ..a.clone()
    })?;
    let reference = RefGeometry {
        heads_per_partition: Some(hpp.into()),
        head_dim: Some(dim.into()),
        tokens_per_block: Some(tokens.into()),
        layout: Some(layout),
        ..reference
    };
    let geometry = match layer {
        Some(spec) => KvGeometry::new(spec.clone())?,
        None => KvGeometry::new(KvGeometrySpec::from_tensor(&a.view, axes, a.view.device)?)?,
    }
    .to_wire();
    Ok(BufferPlan {
        state_kind: "kv",
        axes: axes.to_owned(),
        layout: StateLayout::Kv(layout),
        head_dim: dim,
        tokens_per_block: Some(tokens),
        reference,
        geometry,
    })
}

/// Axis names of an SSM state buffer.
pub fn ssm_axes(kind: SsmStateKind) -> &'static str {
    match kind {
        SsmStateKind::Conv => "layer slot channel conv",
        SsmStateKind::Recurrent => "layer slot head p n",
    }
}

/// Axis sizes of a KV buffer by name: off the per-layer geometry, else off the named axes.
struct AxisSizes<'a> {
    axes: &'a str,
    view: &'a TensorView,
    layer: Option<&'a KvGeometrySpec>,
}

impl AxisSizes<'_> {
    fn get(&self, name: &str) -> DisaggResult<u64> {
        if let Some(g) = self.layer {
            return Ok(u64::from(match name {
                "layer" => g.num_layers,
                "block" => g.num_blocks,
                "token" => g.tokens_per_block,
                "head" => g.num_heads,
                _ => g.head_dim,
            }));
        }
        let (axes, shape) = (self.axes, &self.view.shape);
        let names: Vec<&str> = axes.split_whitespace().collect();
        if names.len() != shape.len() {
            return Err(mismatch(
                "axes",
                format!(
                    "axes '{axes}' name {} axes but memory_buffer has {}",
                    names.len(),
                    shape.len()
                ),
            ));
        }
        let i = names
            .iter()
            .position(|n| *n == name)
            .ok_or_else(|| mismatch("axes", format!("axes '{axes}' lack axis '{name}'")))?;
        Ok(shape[i])
    }
}

#[cfg(test)]
#[path = "buffer_tests.rs"]
mod tests;
