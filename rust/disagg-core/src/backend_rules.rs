//! Host-side rules of the transfer backends (`disagg_rs.transfer_backends`): which sibling
//! layouts a source may infer for its model-parallel group, when a two-sided handoff moves in
//! chunks, how a staging pool is cut, the packed windows a kernel launch or a pipelined
//! handoff covers, and whether two CUDA IPC exports share a host. Pure functions; the
//! backends carry the answers out. Ranges are half-open `[lo, hi)`.

use crate::wire::peer::{PeerGeometry, PeerMeta, StateKind};
use crate::wire::value::{Obj, WireValue};
use crate::{DisaggError, DisaggResult, KvShardLayout, SsmShardLayout};

#[path = "backend_peers.rs"]
pub mod peers;

/// A shard layout whose model-parallel siblings can be inferred from it: the KV layout and
/// the SSM state layout.
pub trait GroupLayout: Sized {
    /// `(tp_size, pp_size, tp_rank, pp_rank, global_rank)`.
    fn group(&self) -> (u32, u32, u32, u32, u32);
    /// Whether the stage's layer window was given explicitly (it may be uneven).
    fn explicit_window(&self) -> bool;
    /// `(local layers, heads)` of the shard.
    fn shard_shape(&self) -> (u32, u32);
    /// The same layout at another place of the group.
    fn sibling(&self, tp_rank: u32, pp_rank: u32, global_rank: u32) -> DisaggResult<Self>;
}

macro_rules! group_layout {
    ($layout:ty, $spec:ident) => {
        impl GroupLayout for $layout {
            fn group(&self) -> (u32, u32, u32, u32, u32) {
                let r = self.ranks;
                (r.tp_size, r.pp_size, r.tp_rank, r.pp_rank, r.global_rank)
            }
            fn explicit_window(&self) -> bool {
                self.explicit_window
            }
            fn shard_shape(&self) -> (u32, u32) {
                (self.layers.len(), self.heads.len())
            }
            fn sibling(&self, tp_rank: u32, pp_rank: u32, global_rank: u32) -> DisaggResult<Self> {
                let ranks = crate::RankCoords { tp_rank, pp_rank, global_rank, ..self.ranks };
                Self::new(crate::$spec { ranks, ..self.spec() })
            }
        }
    };
}
group_layout!(KvShardLayout, KvLayoutSpec);
group_layout!(SsmShardLayout, SsmLayoutSpec);

/// The layouts of `layout`'s model-parallel group: every `(pp stage, tp rank)` in Megatron
/// order (TP fastest), numbered from the group's first global rank, `None` at `layout`'s own
/// place. Refused (`Wire` on `src_metas`, naming the first sibling that cannot be inferred)
/// under PP with an explicit layer window, for a group starting below rank 0, or where a
/// sibling would hold another number of layers or heads.
pub fn group_siblings<L: GroupLayout>(layout: &L) -> DisaggResult<Vec<Option<L>>> {
    let (tp_size, pp_size, tp_rank, pp_rank, global_rank) = layout.group();
    let tp = i64::from(tp_size);
    let first = i64::from(global_rank) - (i64::from(pp_rank) * tp + i64::from(tp_rank));
    let mut out = Vec::new();
    for stage in 0..pp_size {
        for rank in 0..tp_size {
            if (stage, rank) == (pp_rank, tp_rank) {
                out.push(None);
                continue;
            }
            let refuse = || {
                DisaggError::wire(
                    "src_metas",
                    format!(
                        "cannot infer the layout of source (tp_rank={rank}, pp_rank={stage}) \
                         from this rank's; pass src_metas=[every source rank's metadata]"
                    ),
                )
            };
            if first < 0 || (pp_size > 1 && layout.explicit_window()) {
                return Err(refuse());
            }
            let global = first + i64::from(stage) * tp + i64::from(rank);
            let global = u32::try_from(global).map_err(|_| refuse())?;
            let sib = layout.sibling(rank, stage, global).map_err(|_| refuse())?;
            if sib.shard_shape() != layout.shard_shape() {
                return Err(refuse());
            }
            out.push(Some(sib));
        }
    }
    Ok(out)
}

/// What decides whether one rank's buffer can take part in a chunked two-sided handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkFacts {
    /// The buffer holds KV state.
    pub kv: bool,
    /// Registered regions (per-layer tensors: more than one).
    pub regions: usize,
    /// The compiler geometry's `(tokens_per_block, num_heads, head_stride, head_dim,
    /// element_size)`, `None` when the metadata carries none.
    pub geometry: Option<[u64; 5]>,
}

/// Whether a handoff between these ranks (sources and destination) moves in chunks: KV
/// state with a geometry everywhere, one registered buffer each (a device plan addresses
/// one), one block size everywhere, and the heads of a token contiguous in every cache.
/// No ranks: `false`.
pub fn chunkable(ranks: &[ChunkFacts]) -> bool {
    let Some(geoms) = ranks
        .iter()
        .map(|r| if r.kv && r.regions <= 1 { r.geometry } else { None })
        .collect::<Option<Vec<_>>>()
    else {
        return false;
    };
    let Some(&[tpb, ..]) = geoms.first() else { return false };
    geoms.iter().all(|&[t, heads, head_stride, head_dim, elem]| {
        t == tpb
            && (heads == 1 || u128::from(head_stride) == u128::from(head_dim) * u128::from(elem))
    })
}

impl ChunkFacts {
    /// The facts of one rank's metadata dict: `state_kind`, the length of `buffer.regions`
    /// and the `geometry` fields (a geometry missing one, or not an int: `Wire`).
    pub fn of_meta(meta: &WireValue) -> DisaggResult<Self> {
        let meta = Obj::of(meta, "")?;
        let kv = matches!(meta.some("state_kind"), Some(WireValue::Str(k)) if k == "kv");
        let regions = match meta.some("buffer") {
            Some(b @ WireValue::Map(_)) => match Obj::of(b, "buffer")?.some("regions") {
                Some(WireValue::List(r)) => r.len(),
                Some(WireValue::Map(r)) => r.len(),
                _ => 0,
            },
            _ => 0,
        };
        let geometry = match meta.some("geometry") {
            Some(g) => {
                let g = Obj::of(g, "geometry")?;
                let keys =
                    ["tokens_per_block", "num_heads", "head_stride", "head_dim", "element_size"];
                let mut out = [0u64; 5];
                for (slot, key) in out.iter_mut().zip(keys) {
                    *slot = g.u64(key)?;
                }
                Some(out)
            }
            None => None,
        };
        Ok(Self { kv, regions, geometry })
    }

    /// The facts of one parsed peer, as [`ChunkFacts::of_meta`] reads them from its metadata
    /// (a peer that exported one buffer has that one region): no metadata is read again.
    pub fn of_peer(peer: &PeerMeta) -> Self {
        let geometry = match &peer.geometry {
            Some(PeerGeometry::Kv(g)) => {
                let s = g.spec();
                let head = (u64::from(s.head_dim), u64::from(s.element_size));
                Some([s.tokens_per_block.into(), s.num_heads.into(), s.head_stride, head.0, head.1])
            }
            _ => None,
        };
        let kv = peer.state_kind == StateKind::Kv;
        Self { kv, regions: peer.buffer.regions.regions().len(), geometry }
    }
}

/// Check the tensors a per-layer buffer argument flattens into (`items`: `None` for a tensor,
/// else the element's type name): at least one, every one a tensor (`Geometry` on
/// `memory_buffer`, naming `given`, the argument's type).
pub fn check_buffer_tensors(items: &[Option<String>], given: &str) -> DisaggResult<()> {
    if items.is_empty() || items.iter().any(Option::is_some) {
        return Err(DisaggError::geometry(
            "memory_buffer",
            format!(
                "memory_buffer must be a tensor or a non-empty list of per-layer tensors (or \
                 of (K, V) tensor pairs), got {given}"
            ),
        ));
    }
    Ok(())
}

/// `(slots, slot_bytes)` of a staging pool of `pool_bytes` cut in `chunk_bytes` slots (at
/// least one slot; `None`: the `(pool, chunk)` `defaults`). `chunk_bytes` must be a positive
/// multiple of 256 (`Argument`).
pub fn staging_slots(
    pool_bytes: Option<i64>,
    chunk_bytes: Option<i64>,
    defaults: (i64, i64),
) -> DisaggResult<(u64, u64)> {
    let (pool_bytes, chunk_bytes) =
        (pool_bytes.unwrap_or(defaults.0), chunk_bytes.unwrap_or(defaults.1));
    let chunk = u64::try_from(chunk_bytes).ok().filter(|c| *c >= 256 && c.is_multiple_of(256));
    let chunk = chunk.ok_or_else(|| {
        DisaggError::argument(
            "chunk_bytes",
            format!("chunk_bytes={chunk_bytes} must be a positive multiple of 256"),
        )
    })?;
    let slots = u64::try_from(pool_bytes).map_or(0, |p| p / chunk).max(1);
    Ok((slots, chunk))
}

/// Refuse a chunked transfer one of whose items (one block of one plane, `items` bytes each)
/// does not fit a staging slot of `slot_bytes` (`Capacity` on `chunk_bytes`).
pub fn check_slot_capacity(items: &[u64], slot_bytes: u64) -> DisaggResult<()> {
    match items.iter().find(|&&item| item > slot_bytes) {
        Some(item) => Err(DisaggError::Capacity {
            resource: "chunk_bytes".into(),
            detail: format!(
                "one block of one plane is {item} bytes but staging slots hold \
                 chunk_bytes={slot_bytes}"
            ),
        }),
        None => Ok(()),
    }
}

/// Refuse a chunked transfer whose block ids (`held` of them, `field`) are not the count its
/// device plans need for `num_tokens` tokens (the first of `needs`; none: zero).
pub fn check_chunk_blocks(
    field: &str,
    held: u64,
    num_tokens: u64,
    needs: &[u64],
) -> DisaggResult<()> {
    let need = needs.first().copied().unwrap_or(0);
    if held == need {
        return Ok(());
    }
    Err(DisaggError::block(
        field,
        format!("{field} holds {held} blocks, {num_tokens} tokens need {need}"),
    ))
}

/// One kernel launch over packed bytes `[lo, hi)` (`hi` `None`: the table's `total`) of a run
/// table `(total, unit)` in `unit`-byte units: `(lo, hi)` in units and the programs of `chunk_units` units
/// each. The range must lie in `[0, total)` and on unit bounds (`Argument`).
pub fn packed_window(
    (lo, hi): (i64, Option<i64>),
    (total, unit): (u64, u64),
    chunk_units: u64,
) -> DisaggResult<(u64, u64, u64)> {
    let hi = hi.unwrap_or(i64::try_from(total).unwrap_or(i64::MAX));
    let inside = 0 <= lo && lo <= hi && u64::try_from(hi).is_ok_and(|h| h <= total);
    if !inside {
        return Err(DisaggError::argument(
            "packed_lo",
            format!("packed range [{lo}, {hi}) is not inside [0, {total})"),
        ));
    }
    // Both bounds are in [0, total] now.
    let (lo, hi) = (lo.unsigned_abs(), hi.unsigned_abs());
    if unit == 0 || !lo.is_multiple_of(unit) || !hi.is_multiple_of(unit) {
        return Err(DisaggError::argument(
            "packed_lo",
            format!("packed range [{lo}, {hi}) is not in {unit}-byte units"),
        ));
    }
    let (lo_u, hi_u) = (lo / unit, hi / unit);
    Ok((lo_u, hi_u, (hi_u - lo_u).div_ceil(chunk_units.max(1))))
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The packed windows `[lo, hi)` of a pipelined handoff between a gather and a scatter table,
/// each `(total bytes, unit)`: both must describe the same packed total (`Argument` otherwise); windows are `chunk_bytes` rounded
/// down to both tables' units (at least one unit; a negative `chunk_bytes` counts as 0) and
/// cover the total in order.
pub fn pipeline_windows(
    gather: (u64, u64),
    scatter: (u64, u64),
    chunk_bytes: i64,
) -> DisaggResult<Vec<(u64, u64)>> {
    let chunk_bytes = u64::try_from(chunk_bytes).unwrap_or(0);
    let ((total, g), (scatter_total, s)) = (gather, scatter);
    if total != scatter_total {
        return Err(DisaggError::argument(
            "scatter_table",
            format!("gather packs {total} bytes but scatter expects {scatter_total}"),
        ));
    }
    let (g, s) = (g.max(1), s.max(1));
    let unit = g / gcd(g, s) * s;
    let step = (chunk_bytes / unit).max(1) * unit;
    let starts = (0..total).step_by(usize::try_from(step).unwrap_or(usize::MAX));
    Ok(starts.map(|lo| (lo, (lo + step).min(total))).collect())
}

/// One launch of the copy kernel: `(lo, hi, programs)` in its table's units
/// ([`packed_window`]).
pub type Launch = (u64, u64, u64);

/// One window `[lo, hi)` of a pipelined handoff with its gather and scatter launches.
pub type WindowLaunches = ((u64, u64), Launch, Launch);

/// The launches of a pipelined handoff: per [`pipeline_windows`] window `[lo, hi)` of packed
/// bytes, the gather table's and the scatter table's [`packed_window`] (at most `chunk_units`
/// units per program). Errors: theirs.
pub fn pipeline_launches(
    gather: (u64, u64),
    scatter: (u64, u64),
    chunk_bytes: i64,
    chunk_units: u64,
) -> DisaggResult<Vec<WindowLaunches>> {
    let at = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
    pipeline_windows(gather, scatter, chunk_bytes)?
        .into_iter()
        .map(|(lo, hi)| {
            let range = (at(lo), Some(at(hi)));
            let launch = |table| packed_window(range, table, chunk_units);
            Ok(((lo, hi), launch(gather)?, launch(scatter)?))
        })
        .collect()
}

/// Which implementation copies fragments of a tensor: `forced` (`DISAGG_STAGING_KERNEL`)
/// `"torch"` or `"triton"` wins; otherwise Triton exactly when the tensor is on CUDA and
/// Triton imports (`cuda_with_triton`).
pub fn staging_path(forced: &str, cuda_with_triton: bool) -> &'static str {
    match forced {
        "torch" => "torch",
        "triton" => "triton",
        _ if cuda_with_triton => "triton",
        _ => "torch",
    }
}

/// The host identity of a CUDA IPC export: host name and boot id.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct IpcHost {
    /// The export's host name.
    pub hostname: Option<String>,
    /// The export's boot id.
    pub boot_id: Option<String>,
}

/// Whether two CUDA IPC exports come from one host (both given, host name and boot id agree).
pub fn same_host(mine: Option<&IpcHost>, theirs: Option<&IpcHost>) -> bool {
    matches!((mine, theirs), (Some(a), Some(b)) if a == b)
}

impl IpcHost {
    /// The host identity of an export dict (`hostname`, `boot_id`); `None` (or an empty
    /// export): none.
    pub fn of_export(export: &WireValue) -> Option<Self> {
        let WireValue::Map(entries) = export else { return None };
        let text = |key: &str| {
            let v = entries.iter().find(|(k, _)| k == key).map(|(_, v)| v);
            v.filter(|v| !matches!(v, WireValue::Null)).map(|v| match v {
                WireValue::Str(s) => s.clone(),
                other => other.canonical_json(),
            })
        };
        (!entries.is_empty()).then(|| Self { hostname: text("hostname"), boot_id: text("boot_id") })
    }
}

/// [`same_host`] of two export dicts ([`IpcHost::of_export`]).
pub fn same_host_exports(mine: Option<&WireValue>, theirs: Option<&WireValue>) -> bool {
    let host = |e: Option<&WireValue>| e.and_then(IpcHost::of_export);
    same_host(host(mine).as_ref(), host(theirs).as_ref())
}

/// The widest element (8, 4, 2 or 1 bytes) dividing both a row of `row_bytes` and a
/// storage offset of `offset` bytes: the unit a host row copy views its rows in.
pub fn row_unit(row_bytes: u64, offset: u64) -> u64 {
    [8, 4, 2]
        .into_iter()
        .find(|&u| row_bytes.is_multiple_of(u) && offset.is_multiple_of(u))
        .unwrap_or(1)
}

/// The GPU whose kernels read a peer's buffer mapped through CUDA IPC: the local device where
/// one is given on CUDA (`local`: its type and index; `unset` when it names no index), else
/// the buffer's own GPU `home`.
pub fn reader_gpu(home: u32, local: Option<(&str, Option<u32>)>, unset: u32) -> u32 {
    match local {
        Some(("cuda", index)) => index.unwrap_or(unset),
        _ => home,
    }
}

#[cfg(test)]
#[path = "backend_rules_tests.rs"]
mod tests;
