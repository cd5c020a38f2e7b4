//! Peer metadata exported by the reference design (Megatron-LM's disaggregation package),
//! read as this library's schema.
//!
//! The reference exports address fields (`base_addr`, `outer_stride_bytes`, `num_outer`,
//! `bytes_per_slice`, `blocks_axis`, `num_blocks`), optionally the nine KV layout fields, and
//! its transport's own field; no version, dtype, incarnation or memory type. A peer with the
//! KV layout fields is a `[2, L, B, T, H, d]` cache; without them it is a matched-layout buffer
//! moved in whole slices. [`meta_from_reference`] checks every field once and writes the dict
//! the peer parser reads.

use crate::args::{Int, Kind};
use crate::buffer::{kv_layout_with_window, LayoutArgs};
use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{u32_of, KvGeometry, KvGeometrySpec};
use crate::layout::{KvLayoutSpec, KvShardLayout, RankCoords};
use crate::wire::peer::compat_hash;
use crate::wire::value::{Obj, WireValue};

/// The reference design's KV layout fields.
pub const REFERENCE_LAYOUT_FIELDS: [&str; 9] = [
    "global_rank",
    "tp_size",
    "tp_rank",
    "pp_size",
    "pp_rank",
    "num_layers_global",
    "num_kv_heads_global",
    "layer_start",
    "layer_end",
];

/// The reference design's address fields every exported buffer carries.
pub const REFERENCE_ADDRESS_FIELDS: [&str; 6] = [
    "base_addr",
    "outer_stride_bytes",
    "num_outer",
    "bytes_per_slice",
    "blocks_axis",
    "num_blocks",
];

/// What the reading rank knows: its backend, state kind and element type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFacts {
    /// `"nixl"` or `"nccl"`.
    pub backend: String,
    /// This rank's state kind (`"kv"`, `"conv"`, `"recurrent"`).
    pub state_kind: String,
    /// This rank's bytes per element.
    pub element_size: u64,
    /// This rank's dtype name as torch prints it (`"torch.bfloat16"`).
    pub dtype: String,
}

fn missing(fields: &[&str], meta: &Obj<'_>) -> Vec<String> {
    fields.iter().filter(|k| meta.some(k).is_none()).map(|k| (*k).to_owned()).collect()
}

fn int(v: u64) -> WireValue {
    WireValue::Int(i128::from(v))
}

/// `map[key] = value`, in place when the key is there (a Python dict update).
fn set(map: &mut Vec<(String, WireValue)>, key: &str, value: WireValue) {
    match map.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => map.push((key.to_owned(), value)),
    }
}

/// The KV layout of the reference design's nine layout fields (all required, non-negative
/// ints; the window `[layer_start, layer_end)`).
pub fn kv_layout_from_reference(meta: &Obj<'_>) -> DisaggResult<KvShardLayout> {
    let lacking = missing(&REFERENCE_LAYOUT_FIELDS, meta);
    if let Some(first) = lacking.first() {
        return Err(DisaggError::wire(
            first.as_str(),
            format!("peer metadata lacks KV layout fields {lacking:?}"),
        ));
    }
    let get = |k: &str| meta.u64(k).map(|v| Some(i128::from(v)));
    kv_layout_with_window(&LayoutArgs {
        tp_size: get("tp_size")?,
        tp_rank: get("tp_rank")?,
        num_kv_heads_global: get("num_kv_heads_global")?,
        global_rank: get("global_rank")?,
        pp_size: get("pp_size")?,
        pp_rank: get("pp_rank")?,
        num_layers_global: get("num_layers_global")?,
        layer_start: get("layer_start")?,
        layer_end: get("layer_end")?,
        ..LayoutArgs::default()
    })
}

/// The compiler's geometry of a buffer the reference design describes: with a KV layout a
/// `[2, L, B, T, H, d]` cache (checked against the address fields), without one `num_outer`
/// one-token planes of `bytes_per_slice` bytes per block.
fn reference_geometry(
    meta: &Obj<'_>,
    layout: Option<&KvShardLayout>,
    es: u64,
    dtype: &str,
) -> DisaggResult<KvGeometry> {
    let (bps, outer) = (meta.u64("bytes_per_slice")?, meta.u64("num_outer")?);
    let stride = meta.u64("outer_stride_bytes")?;
    let base = meta.u64("base_addr")?;
    let plane_bases = (0..outer)
        .map(|i| i.checked_mul(stride).and_then(|o| o.checked_add(base)))
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| DisaggError::overflow("reference plane base exceeds u64"))?;
    let spec = KvGeometrySpec {
        num_kv: 1,
        num_layers: u32_of("num_layers", outer)?,
        num_blocks: meta.u32("num_blocks")?,
        tokens_per_block: 1,
        num_heads: 1,
        head_dim: u32_of("head_dim", bps / es.max(1))?,
        element_size: u32_of("element_size", es)?,
        block_stride: bps,
        token_stride: bps,
        head_stride: bps,
        plane_bases,
        device_id: meta.opt_u64("device_id")?.unwrap_or(0),
        dtype: Some(dtype.strip_prefix("torch.").unwrap_or(dtype).to_owned()),
    };
    let Some(layout) = layout else { return KvGeometry::new(spec) };
    let agent = repr(meta.get("agent_name"));
    let (heads, dim) = (meta.u64("heads_per_partition")?, meta.u64("head_dim")?);
    let tokens = meta.u64("tokens_per_block")?;
    let local = layout.layers.len();
    if meta.u64("blocks_axis")? != 2 || outer != 2 * u64::from(local) {
        return Err(DisaggError::geometry(
            "num_outer",
            format!(
                "peer {agent}: blocks_axis={} and num_outer={outer} do not describe [2, {local}, \
                 B, T, H, d]",
                meta.u64("blocks_axis")?
            ),
        ));
    }
    let want = tokens.saturating_mul(heads).saturating_mul(dim).saturating_mul(es);
    if bps != want {
        return Err(DisaggError::geometry(
            "bytes_per_slice",
            format!(
                "peer {agent}: bytes_per_slice={bps} != tokens_per_block x heads_per_partition \
                 x head_dim x element_size = {want}"
            ),
        ));
    }
    KvGeometry::new(KvGeometrySpec {
        num_kv: 2,
        num_layers: local,
        tokens_per_block: u32_of("tokens_per_block", tokens)?,
        num_heads: u32_of("heads_per_partition", heads)?,
        head_dim: u32_of("head_dim", dim)?,
        token_stride: heads * dim * es,
        head_stride: dim * es,
        ..spec
    })
}

/// The fields a backend adds to a reference peer: NIXL's agent blob, NCCL's rank.
fn backend_fields(meta: &Obj<'_>, backend: &str) -> DisaggResult<Vec<(String, WireValue)>> {
    let agent = repr(meta.get("agent_name"));
    let lacks =
        |field: &str| DisaggError::wire(field, format!("peer metadata for {agent} lacks {field}"));
    match backend {
        "nixl" => {
            let blob = meta
                .some("agent_metadata_b64")
                .filter(|v| !matches!(v, WireValue::Str(s) if s.is_empty()))
                .filter(|v| !matches!(v, WireValue::Bytes(b) if b.is_empty()))
                .ok_or_else(|| lacks("agent_metadata_b64"))?;
            Ok(vec![
                ("agent_metadata".to_owned(), blob.clone()),
                ("staging".to_owned(), WireValue::Null),
            ])
        }
        "nccl" => {
            let rank = meta.some("nccl_rank").ok_or_else(|| lacks("nccl_rank"))?;
            Ok(vec![("dist_rank".to_owned(), rank.clone())])
        }
        _ => Ok(Vec::new()),
    }
}

/// The address fields are all there and every int field is a non-negative int; the peer uses
/// this backend's transport and holds KV cache.
fn check_reference_fields(o: &Obj<'_>, local: &LocalFacts) -> DisaggResult<()> {
    let lacking = missing(&REFERENCE_ADDRESS_FIELDS, o);
    if let Some(first) = lacking.first() {
        return Err(DisaggError::wire(
            first.as_str(),
            format!(
                "peer metadata has no 'version' and lacks the reference design's fields {lacking:?}"
            ),
        ));
    }
    for key in REFERENCE_ADDRESS_FIELDS.iter().chain(&["device_id", "element_size"]) {
        o.opt_u64(key)?;
    }
    let transport = match o.get("transport") {
        None => Some(local.backend.as_str()),
        Some(WireValue::Str(s)) => Some(s.as_str()),
        Some(_) => None,
    };
    if transport != Some(local.backend.as_str()) {
        return Err(DisaggError::wire(
            "transport",
            format!(
                "peer transport {} != this backend '{}'",
                repr(o.get("transport")),
                local.backend
            ),
        ));
    }
    if o.some("ssm_layout").is_some() || local.state_kind != "kv" {
        return Err(DisaggError::wire(
            "ssm_layout",
            "SSM state metadata must be exported by this library (it has a 'version'); the \
             reference design's SSM fields alone are not read",
        ));
    }
    Ok(())
}

/// The `buffer` field of a reference peer.
fn buffer_dict(o: &Obj<'_>, es: u64) -> DisaggResult<WireValue> {
    let nbytes = o.u64("num_outer")?.saturating_mul(o.u64("outer_stride_bytes")?);
    Ok(WireValue::Map(vec![
        ("addr".to_owned(), int(o.u64("base_addr")?)),
        ("nbytes".to_owned(), int(nbytes)),
        ("device_id".to_owned(), int(o.opt_u64("device_id")?.unwrap_or(0))),
        (
            "mem_type".to_owned(),
            match o.some("mem_type") {
                Some(WireValue::Str(s)) if !s.is_empty() => WireValue::Str(s.clone()),
                _ => WireValue::Str("VRAM".into()),
            },
        ),
        ("shape".to_owned(), WireValue::List(Vec::new())),
        ("strides".to_owned(), WireValue::List(Vec::new())),
        ("element_size".to_owned(), int(es)),
        ("axes".to_owned(), WireValue::Str("reference".into())),
    ]))
}

/// This library's schema for a peer that exports the reference design's fields only: every
/// field checked once (a `Wire` error names a missing or mistyped one; layout and geometry
/// errors as their constructors raise them). The dtype is the reader's when the element sizes
/// agree; the memory type is VRAM unless given (the reference registers GPU memory only).
pub fn meta_from_reference(meta: &WireValue, local: &LocalFacts) -> DisaggResult<WireValue> {
    let o = Obj::of(meta, "")?;
    check_reference_fields(&o, local)?;
    let es = o.opt_u64("element_size")?.filter(|&e| e != 0).unwrap_or(local.element_size);
    let dtype =
        if es == local.element_size { local.dtype.clone() } else { format!("{es}-byte elements") };
    let has_layout = REFERENCE_LAYOUT_FIELDS.iter().any(|k| o.some(k).is_some());
    let layout = if has_layout {
        kv_layout_from_reference(&o)?
    } else {
        let rank = o.opt_u64("global_rank")?.unwrap_or(0);
        KvShardLayout::new(KvLayoutSpec {
            num_layers: o.u32("num_outer")?,
            num_kv_heads: 1,
            ranks: RankCoords {
                global_rank: Int::from(rank).to_u32(Kind::Layout, "global_rank")?,
                ..RankCoords::single()
            },
            ..KvLayoutSpec::default()
        })?
    };
    let geometry = reference_geometry(&o, has_layout.then_some(&layout), es, &dtype)?;
    let g = geometry.spec();
    let facts = WireValue::Map(vec![
        ("version".into(), int(1)),
        ("state_kind".into(), WireValue::Str("kv".into())),
        ("dtype".into(), WireValue::Str(dtype.clone())),
        ("head_dim".into(), int(g.head_dim.into())),
        ("num_layers".into(), int(layout.num_layers.into())),
        ("num_kv_heads".into(), int(layout.num_kv_heads.into())),
    ]);
    let extra = backend_fields(&o, &local.backend)?;
    let name = match o.some("agent_name") {
        Some(WireValue::Str(s)) if !s.is_empty() => s.clone(),
        _ => format!("rank{}", layout.ranks.global_rank),
    };
    let mut out = match meta {
        WireValue::Map(entries) => entries.clone(),
        _ => Vec::new(),
    };
    let layout_dict = layout
        .spec()
        .wire_fields()
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.map_or(WireValue::Null, |x| int(x.into()))))
        .collect();
    let buffer = buffer_dict(&o, es)?;
    let fields = [
        ("element_size", int(es)),
        ("dtype", WireValue::Str(dtype)),
        ("version", int(1)),
        ("backend", WireValue::Str(local.backend.clone())),
        ("agent_name", WireValue::Str(name)),
        ("incarnation", int(0)),
        ("compat_hash", WireValue::Str(compat_hash(&facts))),
        ("state_kind", WireValue::Str("kv".into())),
        ("layout", WireValue::Map(layout_dict)),
        ("num_blocks", int(o.u64("num_blocks")?)),
        ("tokens_per_block", int(g.tokens_per_block.into())),
        ("head_dim", int(g.head_dim.into())),
        ("buffer", buffer),
        ("geometry", geometry.to_wire()),
        ("reference_only", WireValue::Bool(true)),
    ];
    for (k, v) in fields.into_iter().chain(extra.iter().map(|(k, v)| (k.as_str(), v.clone()))) {
        set(&mut out, k, v);
    }
    Ok(WireValue::Map(out))
}

/// Python's repr of a metadata value in messages (`'name'`, `None`).
fn repr(v: Option<&WireValue>) -> String {
    match v {
        None | Some(WireValue::Null) => "None".to_owned(),
        Some(WireValue::Str(s)) => format!("'{s}'"),
        Some(other) => other.canonical_json(),
    }
}

#[cfg(test)]
#[path = "refmeta_tests.rs"]
mod tests;
