//! KV compilation: validation against the geometries, then the plane sets.

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
use crate::geometry::KvGeometry;
use crate::layout::KvShardLayout;
use crate::reshard::plan_kv_reshard;

use super::cost::{choose_mode, TransferMode};
use super::program::{SourceProgram, TransferProgram};
use super::request::{source_geometry, KvTransferRequest};
use super::verify::Expected;
use super::walk::{segments, KvPlaneSet, KvWork, Work};

/// One source rank's KV transfer as a block-id-free table a device kernel walks itself.
///
/// Token `t < n_tok` of plane row `p` (one per transfer, kv and layer, in packed order) is
/// `row_bytes` contiguous bytes on every side:
/// - source: `src_plane + src_ids[t / tpb] * src_block_stride + (t % tpb) * src_token_stride`;
/// - destination: `dst_plane + dst_ids[t / tpb] * dst_block_stride + (t % tpb) *
///   dst_token_stride` (zero when the program has no destination);
/// - packed: `packed_coef * n_tok + t * row_bytes` (the canonical packed order).
///
/// It depends on the two geometries and the reshard plan only: a transport caches it per
/// (source, destination) pair and hands a kernel only the block ids of each handoff. Plane
/// addresses are absolute, as in the geometries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvDevicePlan {
    /// Rows `[src_plane, dst_plane, packed_coef, row_bytes]`.
    pub planes: Vec<[u64; 4]>,
    /// Tokens per block, the same on both sides.
    pub tokens_per_block: u64,
    /// Source byte stride between blocks.
    pub src_block_stride: u64,
    /// Source byte stride between tokens of a block.
    pub src_token_stride: u64,
    /// Destination byte stride between blocks (0 without destination).
    pub dst_block_stride: u64,
    /// Destination byte stride between tokens of a block (0 without destination).
    pub dst_token_stride: u64,
}

impl KvWork {
    /// The plan, or `None` when the transfer does not have its shape: a first moved token that
    /// is not 0, different `tokens_per_block` on the two sides, or the heads of one token not
    /// contiguous on a side (HND caches).
    pub(super) fn device_plan(&self) -> Option<KvDevicePlan> {
        if self.token_start != 0 {
            return None;
        }
        let s = self.src.spec();
        let row = self.src.row_bytes();
        let (d_bs, d_ts, d_hs) = match &self.dst {
            Some(d) => {
                let ds = d.spec();
                if ds.tokens_per_block != s.tokens_per_block {
                    return None;
                }
                (ds.block_stride, ds.token_stride, Some(ds.head_stride))
            }
            None => (0, 0, None),
        };
        let mut planes = Vec::new();
        let mut coef = 0u64;
        for set in &self.sets {
            let nh = set.num_heads;
            if nh > 1 && (s.head_stride != row || d_hs.is_some_and(|h| h != row)) {
                return None;
            }
            let tok_bytes = nh * row;
            for kv in 0..s.num_kv {
                for l in 0..set.num_layers {
                    let sp = self.src.plane_base(kv, set.src_l0 + l) + set.src_h0 * s.head_stride;
                    let dp = self.dst.as_ref().map_or(0, |d| {
                        d.plane_base(kv, set.dst_l0 + l) + set.dst_h0 * d.spec().head_stride
                    });
                    planes.push([sp, dp, coef, tok_bytes]);
                    coef += tok_bytes;
                }
            }
        }
        Some(KvDevicePlan {
            planes,
            tokens_per_block: u64::from(s.tokens_per_block),
            src_block_stride: s.block_stride,
            src_token_stride: s.token_stride,
            dst_block_stride: d_bs,
            dst_token_stride: d_ts,
        })
    }
}

pub(super) fn geometry_eq<T: PartialEq + std::fmt::Debug>(
    field: &str,
    a: &T,
    b: &T,
    who: &str,
) -> DisaggResult<()> {
    if a == b {
        Ok(())
    } else {
        Err(DisaggError::geometry(field, format!("{who}: {field}={a:?} != {field}={b:?}")))
    }
}

pub(super) fn check_kv_geometry(l: &KvShardLayout, g: &KvGeometry, side: &str) -> DisaggResult<()> {
    let s = g.spec();
    let who = format!("{side} rank {} geometry vs layout", l.ranks.global_rank);
    geometry_eq("num_layers", &s.num_layers, &l.layers.len(), &who)?;
    geometry_eq("num_heads", &s.num_heads, &l.heads.len(), &who)
}

pub(super) fn check_same_kv(a: &KvGeometry, b: &KvGeometry, who: &str) -> DisaggResult<()> {
    let (x, y) = (a.spec(), b.spec());
    geometry_eq("head_dim", &x.head_dim, &y.head_dim, who)?;
    geometry_eq("element_size", &x.element_size, &y.element_size, who)?;
    geometry_eq("num_kv", &x.num_kv, &y.num_kv, who)?;
    if let (Some(p), Some(q)) = (&x.dtype, &y.dtype) {
        geometry_eq("dtype", p, q, who)?;
    }
    Ok(())
}

/// Block list for `[0, num_tokens)`: right length, every id `< num_blocks` (the range scan
/// only when `scan`: ids that `check_transfer` accepted are not scanned twice).
pub(super) fn check_blocks(
    field: &str,
    who: &str,
    ids: &[u32],
    num_tokens: u64,
    g: &KvGeometry,
    scan: bool,
) -> DisaggResult<()> {
    let s = g.spec();
    let tpb = u64::from(s.tokens_per_block);
    let need = num_tokens.div_ceil(tpb);
    if ids.len() as u64 != need {
        return Err(DisaggError::block(
            field,
            format!(
                "{who}: len({field})={} but num_tokens={num_tokens} with tokens_per_block={tpb} needs {need} blocks",
                ids.len()
            ),
        ));
    }
    if !scan {
        return Ok(());
    }
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= s.num_blocks) {
        return Err(DisaggError::block(
            field,
            format!("{who}: {field}[{i}]={id} must be < num_blocks={}", s.num_blocks),
        ));
    }
    Ok(())
}

pub(super) fn reject_duplicates(field: &str, ids: &[u32]) -> DisaggResult<()> {
    let mut seen: Vec<(u32, usize)> = ids.iter().copied().zip(0..).collect();
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(DisaggError::block(
            field,
            format!(
                "{field}[{}]={} and {field}[{}]={} name the same block; destination blocks must be distinct",
                w[0].1, w[0].0, w[1].1, w[1].0
            ),
        ));
    }
    Ok(())
}

pub(super) fn overflow(what: &str) -> DisaggError {
    DisaggError::overflow(format!("{what} exceeds u64"))
}

/// Compile the KV transfer of one destination rank. Validates everything (layouts against
/// geometries, `head_dim`, element size, dtype, block list lengths and ranges, duplicate
/// destination blocks, address overflow) before building anything.
pub fn compile_kv_transfer(req: &KvTransferRequest) -> DisaggResult<TransferProgram> {
    crate::wire::peer::count_block_check();
    compile_kv(req, true, true)
}

/// [`compile_kv_transfer`] of source block ids that `check_transfer` already validated, with
/// the destination's too when `dst_checked` (the ranges and repeats of a checked list are not
/// scanned again; every length still is).
pub fn compile_kv_transfer_checked(
    req: &KvTransferRequest,
    dst_checked: bool,
) -> DisaggResult<TransferProgram> {
    compile_kv(req, false, !dst_checked)
}

// Validation is one checklist read top to bottom; splitting it would scatter the order in
// which errors are reported.
#[allow(clippy::too_many_lines)]
fn compile_kv(
    req: &KvTransferRequest,
    scan_src: bool,
    scan_dst: bool,
) -> DisaggResult<TransferProgram> {
    let dst_l = &req.dst_layout;
    let dst_g = req.dst_geometry.as_ref();
    let has_destination = dst_g.is_some() && req.moved.dst_block_ids.is_some();
    req.check_sides(has_destination, dst_g, check_kv_geometry)?;
    if let Some(d) = dst_g {
        for (l, g) in &req.srcs {
            let who = format!(
                "source rank {} vs destination rank {}",
                l.ranks.global_rank, dst_l.ranks.global_rank
            );
            check_same_kv(g, d, &who)?;
        }
    }
    if let Some((first, rest)) = req.srcs.split_first() {
        for (l, g) in rest {
            check_same_kv(
                &first.1,
                g,
                &format!(
                    "source rank {} vs source rank {}",
                    first.0.ranks.global_rank, l.ranks.global_rank
                ),
            )?;
        }
    }
    if req.moved.token_start > req.moved.num_tokens {
        return Err(DisaggError::block(
            "token_start",
            format!(
                "token_start={} must be <= num_tokens={}",
                req.moved.token_start, req.moved.num_tokens
            ),
        ));
    }
    let layouts: Vec<KvShardLayout> = req.srcs.iter().map(|(l, _)| *l).collect();
    let plan = plan_kv_reshard(&layouts, std::slice::from_ref(dst_l))?;
    if let (Some(ids), Some(g)) = (&req.moved.dst_block_ids, dst_g) {
        check_blocks(
            "dst_block_ids",
            &format!("destination rank {}", dst_l.ranks.global_rank),
            ids,
            req.moved.num_tokens,
            g,
            scan_dst,
        )?;
        if scan_dst {
            reject_duplicates("dst_block_ids", ids)?;
        }
    }
    let n_tok = req.moved.num_tokens - req.moved.token_start;
    let mut by_src: BTreeMap<u32, Vec<KvPlaneSet>> = BTreeMap::new();
    for t in &plan.transfers {
        let g =
            source_geometry(req.srcs.iter().map(|(l, g)| (l.ranks.global_rank, g)), t.src_rank)?;
        let sets = by_src.entry(t.src_rank).or_default();
        let region = u64::from(g.spec().num_kv)
            .checked_mul(u64::from(t.layers.len()))
            .and_then(|x| x.checked_mul(n_tok))
            .and_then(|x| x.checked_mul(u64::from(t.heads.len())))
            .and_then(|x| x.checked_mul(g.row_bytes()))
            .ok_or_else(|| overflow("packed region size"))?;
        let packed_off = sets.last().map_or(Some(0), |p: &KvPlaneSet| {
            let prev = u64::from(g.spec().num_kv)
                * u64::from(p.num_layers)
                * n_tok
                * p.num_heads
                * g.row_bytes();
            p.packed_off.checked_add(prev)
        });
        let packed_off = packed_off.ok_or_else(|| overflow("packed offset"))?;
        packed_off.checked_add(region).ok_or_else(|| overflow("packed offset"))?;
        sets.push(KvPlaneSet {
            src_l0: t.src_local_layers().lo,
            dst_l0: t.dst_local_layers().lo,
            num_layers: t.layers.len(),
            src_h0: u64::from(t.src_local_heads().lo),
            dst_h0: u64::from(t.dst_local_heads().lo),
            num_heads: u64::from(t.heads.len()),
            packed_off,
        });
    }
    let mut sources = Vec::with_capacity(by_src.len());
    for (src_rank, sets) in by_src {
        let Some((_, g)) = req.srcs.iter().find(|(l, _)| l.ranks.global_rank == src_rank) else {
            continue;
        };
        let ids = req.moved.src_block_ids.for_rank(src_rank, "src_block_ids")?;
        let who = format!("source rank {src_rank}");
        check_blocks("src_block_ids", &who, ids, req.moved.num_tokens, g, scan_src)?;
        let src_side = Some((u64::from(g.spec().tokens_per_block), ids));
        let dst_side = match (dst_g, &req.moved.dst_block_ids) {
            (Some(d), Some(ids)) if has_destination => {
                Some((u64::from(d.spec().tokens_per_block), ids.as_slice()))
            }
            _ => None,
        };
        let packed_bytes = sets.last().map_or(0, |p| {
            p.packed_off
                + u64::from(g.spec().num_kv)
                    * u64::from(p.num_layers)
                    * n_tok
                    * p.num_heads
                    * g.row_bytes()
        });
        let work = KvWork {
            src: g.clone(),
            dst: if has_destination { dst_g.cloned() } else { None },
            sets,
            seg_direct: if dst_side.is_some() {
                segments(req.moved.token_start, req.moved.num_tokens, src_side, dst_side)
            } else {
                Vec::new()
            },
            seg_src: segments(req.moved.token_start, req.moved.num_tokens, src_side, None),
            seg_dst: if dst_side.is_some() {
                segments(req.moved.token_start, req.moved.num_tokens, None, dst_side)
            } else {
                Vec::new()
            },
            token_start: req.moved.token_start,
            num_tokens: req.moved.num_tokens,
        };
        let mut sp = SourceProgram {
            src_rank,
            src_device: g.spec().device_id,
            mode: TransferMode::Staged,
            packed_bytes,
            work: Work::Kv(Box::new(work)),
        };
        sp.mode = choose_mode(req.mode, &req.cost, &sp);
        sources.push(sp);
    }
    let expected = match (dst_g, &req.moved.dst_block_ids) {
        (Some(d), Some(ids)) => Expected::Kv {
            geometry: d.clone(),
            block_ids: ids.clone(),
            lo: req.moved.token_start,
            hi: req.moved.num_tokens,
        },
        _ => Expected::None,
    };
    Ok(TransferProgram {
        dst_rank: dst_l.ranks.global_rank,
        dst_device: dst_g.map_or(0, |d| d.spec().device_id),
        sources,
        has_destination,
        device_plans: true,
        expected,
    })
}
