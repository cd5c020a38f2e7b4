//! Reshard planners: which source rank sends which rectangle of (layer x head) KV cells, or of
//! (layer x channel) SSM cells, to which destination rank.
//!
//! One generic rectangle planner serves both: the layer axis and the unit axis (heads or groups)
//! are cut at every boundary of every layout into elementary intervals; each elementary cell is
//! sourced from the holder with the smallest global rank (one representative per replica set:
//! EP/ETP replicas, GQA copies), and cells are merged back into maximal rectangles per
//! (source, destination). Plans are deterministic and independent of the order of the layout
//! lists: destinations are visited by global rank, rectangles by (layer, unit).
//! All ranges are half-open `[lo, hi)`.

use std::collections::HashMap;
use std::fmt;

use crate::error::{DisaggError, DisaggResult};
use crate::layout::{KvShardLayout, Span, SsmBand, SsmShardLayout};

/// One rank's holding in the generic planner: rows are layers, columns are heads or groups.
#[derive(Debug, Clone, Copy)]
struct Holding {
    rank: u32,
    rows: Span,
    cols: Span,
}

/// One planned rectangle: `src` sends `rows x cols` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rect {
    src: u32,
    dst: u32,
    rows: Span,
    cols: Span,
}

/// Sorted, deduplicated cut points of a set of spans.
fn cuts(spans: impl Iterator<Item = Span>) -> Vec<u32> {
    let mut points: Vec<u32> = spans.flat_map(|s| [s.lo, s.hi]).collect();
    points.sort_unstable();
    points.dedup();
    points
}

/// Index range of the elementary intervals covered by `span` (both endpoints are cut points).
fn interval_indices(points: &[u32], span: Span) -> std::ops::Range<usize> {
    let lo = points.partition_point(|&p| p < span.lo);
    let hi = points.partition_point(|&p| p < span.hi);
    lo..hi
}

fn reject_duplicate_ranks(side: &str, ranks: impl Iterator<Item = u32>) -> DisaggResult<()> {
    let mut seen: Vec<u32> = ranks.collect();
    seen.sort_unstable();
    if let Some(&[dup, _]) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(DisaggError::layout(
            "global_rank",
            format!("global_rank={dup} appears twice among the {side} layouts"),
        ));
    }
    Ok(())
}

/// The generic planner. `what` names the cells for error messages ("head", "group").
fn plan_rects(srcs: &[Holding], dsts: &[Holding], what: &str) -> DisaggResult<Vec<Rect>> {
    if srcs.is_empty() {
        return Err(DisaggError::layout("srcs", "no source layouts given (srcs=[])"));
    }
    if dsts.is_empty() {
        return Err(DisaggError::layout("dsts", "no destination layouts given (dsts=[])"));
    }
    reject_duplicate_ranks("source", srcs.iter().map(|h| h.rank))?;
    reject_duplicate_ranks("destination", dsts.iter().map(|h| h.rank))?;

    let all = || srcs.iter().chain(dsts.iter());
    let row_pts = cuts(all().map(|h| h.rows));
    let col_pts = cuts(all().map(|h| h.cols));
    let n_rows = row_pts.len().saturating_sub(1);
    let n_cols = col_pts.len().saturating_sub(1);

    // owner[i * n_cols + j]: the representative source of elementary cell (i, j).
    let mut owner: Vec<Option<u32>> = vec![None; n_rows * n_cols];
    let mut by_rank: Vec<&Holding> = srcs.iter().collect();
    by_rank.sort_by_key(|h| h.rank);
    for h in by_rank {
        for i in interval_indices(&row_pts, h.rows) {
            for j in interval_indices(&col_pts, h.cols) {
                owner[i * n_cols + j].get_or_insert(h.rank);
            }
        }
    }

    let mut dst_order: Vec<&Holding> = dsts.iter().collect();
    dst_order.sort_by_key(|h| h.rank);
    let mut rects: Vec<Rect> = Vec::new();
    for d in dst_order {
        let first = rects.len();
        // (src, cols) -> index of the rectangle that ends at the current row, for merging rows.
        let mut open: HashMap<(u32, Span), usize> = HashMap::new();
        for i in interval_indices(&row_pts, d.rows) {
            let rows = Span::new(row_pts[i], row_pts[i + 1]);
            let mut runs: Vec<(u32, Span)> = Vec::new();
            for j in interval_indices(&col_pts, d.cols) {
                let cols = Span::new(col_pts[j], col_pts[j + 1]);
                let src = owner[i * n_cols + j].ok_or_else(|| DisaggError::Coverage {
                    detail: format!(
                        "no source holds layer {} {what} {} needed by destination rank {}",
                        rows.lo, cols.lo, d.rank
                    ),
                })?;
                match runs.last_mut() {
                    Some((s, span)) if *s == src && span.hi == cols.lo => span.hi = cols.hi,
                    _ => runs.push((src, cols)),
                }
            }
            for (src, cols) in runs {
                match open.get(&(src, cols)) {
                    Some(&k) if rects[k].rows.hi == rows.lo => rects[k].rows.hi = rows.hi,
                    _ => {
                        open.insert((src, cols), rects.len());
                        rects.push(Rect { src, dst: d.rank, rows, cols });
                    }
                }
            }
        }
        rects[first..].sort_by_key(|r| (r.rows.lo, r.cols.lo, r.src));
    }
    Ok(rects)
}

/// Exact-once check of planned rectangles against the holdings, independent of the planner:
/// every rectangle lies inside its source's and destination's holding, and every destination
/// cell is written exactly once.
fn verify_rects(
    rects: &[Rect],
    srcs: &[Holding],
    dsts: &[Holding],
    what: &str,
) -> DisaggResult<()> {
    let src_of: HashMap<u32, &Holding> = srcs.iter().map(|h| (h.rank, h)).collect();
    let dst_of: HashMap<u32, &Holding> = dsts.iter().map(|h| (h.rank, h)).collect();
    let mut per_dst: HashMap<u32, Vec<&Rect>> = HashMap::new();
    for r in rects {
        let s = src_of.get(&r.src).ok_or_else(|| DisaggError::Coverage {
            detail: format!("transfer names source rank {} which is not a source", r.src),
        })?;
        let d = dst_of.get(&r.dst).ok_or_else(|| DisaggError::Coverage {
            detail: format!("transfer names destination rank {} which is not a destination", r.dst),
        })?;
        if r.rows.is_empty() || r.cols.is_empty() {
            return Err(DisaggError::Coverage {
                detail: format!("empty transfer {} -> {}", r.src, r.dst),
            });
        }
        for (h, side) in [(s, "source"), (d, "destination")] {
            if !h.rows.contains_span(r.rows) || !h.cols.contains_span(r.cols) {
                return Err(DisaggError::Coverage {
                    detail: format!(
                        "transfer {} -> {} layers [{}, {}) {what}s [{}, {}) lies outside {side} rank {}",
                        r.src, r.dst, r.rows.lo, r.rows.hi, r.cols.lo, r.cols.hi, h.rank
                    ),
                });
            }
        }
        per_dst.entry(r.dst).or_default().push(r);
    }
    for d in dsts {
        let mine = per_dst.remove(&d.rank).unwrap_or_default();
        let cols = d.cols.len() as usize;
        let mut count = vec![0u32; d.rows.len() as usize * cols];
        for r in &mine {
            for row in r.rows.lo..r.rows.hi {
                for col in r.cols.lo..r.cols.hi {
                    count[(row - d.rows.lo) as usize * cols + (col - d.cols.lo) as usize] += 1;
                }
            }
        }
        if let Some(k) = count.iter().position(|&c| c != 1) {
            let row = d.rows.lo + (k / cols) as u32;
            let col = d.cols.lo + (k % cols) as u32;
            let issue = if count[k] == 0 { "never written" } else { "written more than once" };
            return Err(DisaggError::Coverage {
                detail: format!(
                    "destination rank {} layer {row} {what} {col} is {issue} ({} writers)",
                    d.rank, count[k]
                ),
            });
        }
    }
    Ok(())
}

/// The layouts of one side must agree on the model they describe.
fn same_model<T: Copy + PartialEq + std::fmt::Display>(
    field: &str,
    values: impl Iterator<Item = T>,
) -> DisaggResult<()> {
    let mut first: Option<T> = None;
    for v in values {
        match first {
            None => first = Some(v),
            Some(f) if f != v => {
                return Err(DisaggError::layout(
                    field,
                    format!("layouts disagree: {field}={f} and {field}={v}"),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// One KV transfer: `src_rank` sends global layers `layers` x KV heads `heads` to `dst_rank`,
/// for every token of the handoff. Ranges are global and `[lo, hi)`; `*_start` fields turn them
/// into each side's local indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvReshardTransfer {
    /// Global rank of the source.
    pub src_rank: u32,
    /// Global rank of the destination.
    pub dst_rank: u32,
    /// Global layers moved.
    pub layers: Span,
    /// Global KV heads moved.
    pub heads: Span,
    /// First global layer of the source's window.
    pub src_layer_start: u32,
    /// First global head held by the source.
    pub src_head_start: u32,
    /// First global layer of the destination's window.
    pub dst_layer_start: u32,
    /// First global head held by the destination.
    pub dst_head_start: u32,
}

/// `range` (global) in the local indexing of a layout that holds `held`; a layout that does not
/// hold the whole range (the wrong side's layout, or another rank's) is a layout error.
pub fn local_range(range: Span, held: Span, field: &str, rank: u32) -> DisaggResult<Span> {
    if !held.contains_span(range) {
        return Err(DisaggError::layout(
            field,
            format!(
                "the layout of global_rank={rank} holds {field} [{}, {}) but the transfer moves \
                 [{}, {})",
                held.lo, held.hi, range.lo, range.hi
            ),
        ));
    }
    Ok(range.relative_to(held.lo))
}

impl KvReshardTransfer {
    /// Layers in the source's local indexing.
    pub fn src_local_layers(&self) -> Span {
        self.layers.relative_to(self.src_layer_start)
    }
    /// Heads in the source's local indexing.
    pub fn src_local_heads(&self) -> Span {
        self.heads.relative_to(self.src_head_start)
    }
    /// Layers in the destination's local indexing.
    pub fn dst_local_layers(&self) -> Span {
        self.layers.relative_to(self.dst_layer_start)
    }
    /// Heads in the destination's local indexing.
    pub fn dst_local_heads(&self) -> Span {
        self.heads.relative_to(self.dst_head_start)
    }
    /// Every span by name: global `layers` and `heads`, then the local ones of each side.
    pub fn named_spans(&self) -> [(&'static str, Span); 6] {
        [
            ("layers", self.layers),
            ("heads", self.heads),
            ("src_local_layers", self.src_local_layers()),
            ("src_local_heads", self.src_local_heads()),
            ("dst_local_layers", self.dst_local_layers()),
            ("dst_local_heads", self.dst_local_heads()),
        ]
    }
    /// Bytes this transfer moves per token (K and V); `AddressOverflow` past `u64`.
    pub fn bytes_per_token(&self, head_dim: u64, element_size: u64) -> DisaggResult<u64> {
        [u64::from(self.layers.len()), u64::from(self.heads.len()), head_dim, element_size]
            .into_iter()
            .try_fold(2u64, u64::checked_mul)
            .ok_or_else(|| {
                DisaggError::overflow(format!(
                    "bytes per token = 2 x {} layers x {} heads x head_dim {head_dim} x \
                     element_size {element_size}",
                    self.layers.len(),
                    self.heads.len()
                ))
            })
    }
}

/// A transfer from one global rank to another.
pub trait RankPair: Copy {
    /// `(src_rank, dst_rank)`.
    fn ranks(&self) -> (u32, u32);
}

impl RankPair for KvReshardTransfer {
    fn ranks(&self) -> (u32, u32) {
        (self.src_rank, self.dst_rank)
    }
}

impl RankPair for SsmReshardTransfer {
    fn ranks(&self) -> (u32, u32) {
        (self.src_rank, self.dst_rank)
    }
}

/// A sequence index as Python resolves it against `len` (a negative one counts from the
/// end), or `None` when it is out of range.
pub fn seq_index(index: isize, len: usize) -> Option<usize> {
    let i =
        if index < 0 { len.checked_sub(index.unsigned_abs()) } else { Some(index.unsigned_abs()) };
    i.filter(|&i| i < len)
}

/// The transfers of `ts` that `rank` sends (`src`) or receives (`!src`), in their order.
pub fn of_rank<T: RankPair>(ts: &[T], src: bool, rank: u32) -> Vec<T> {
    ts.iter()
        .filter(|t| if src { t.ranks().0 == rank } else { t.ranks().1 == rank })
        .copied()
        .collect()
}

/// A reshard plan: transfers `T` between layouts `L`, in plan order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardPlan<L, T> {
    /// The transfers, in plan order.
    pub transfers: Vec<T>,
    srcs: Vec<L>,
    dsts: Vec<L>,
}

impl<L, T> Default for ReshardPlan<L, T> {
    fn default() -> Self {
        Self { transfers: Vec::new(), srcs: Vec::new(), dsts: Vec::new() }
    }
}

impl<L, T: RankPair> ReshardPlan<L, T> {
    /// The source layouts the plan was made from.
    pub fn srcs(&self) -> &[L] {
        &self.srcs
    }
    /// The destination layouts the plan was made from.
    pub fn dsts(&self) -> &[L] {
        &self.dsts
    }
    /// The transfers a given source rank sends, in plan order.
    pub fn for_src(&self, rank: u32) -> Vec<T> {
        of_rank(&self.transfers, true, rank)
    }
    /// The transfers a given destination rank receives, in plan order.
    pub fn for_dst(&self, rank: u32) -> Vec<T> {
        of_rank(&self.transfers, false, rank)
    }
}

/// A KV reshard plan: transfers ordered by destination rank, then layer, then head.
pub type KvReshardPlan = ReshardPlan<KvShardLayout, KvReshardTransfer>;

fn kv_holding(l: &KvShardLayout) -> Holding {
    Holding { rank: l.ranks.global_rank, rows: l.layers, cols: l.heads }
}

/// Plan the KV reshard from `srcs` to `dsts` (any TP ratio either way, PP mismatch with uneven
/// windows, EP/ETP and GQA replicas). Errors on a model mismatch between the lists, duplicate
/// ranks, or a destination cell that no source holds.
pub fn plan_kv_reshard(
    srcs: &[KvShardLayout],
    dsts: &[KvShardLayout],
) -> DisaggResult<KvReshardPlan> {
    same_model("num_layers", srcs.iter().chain(dsts).map(|l| l.num_layers))?;
    same_model("num_kv_heads", srcs.iter().chain(dsts).map(|l| l.num_kv_heads))?;
    let s: Vec<Holding> = srcs.iter().map(kv_holding).collect();
    let d: Vec<Holding> = dsts.iter().map(kv_holding).collect();
    let rects = plan_rects(&s, &d, "head")?;
    let src_of: HashMap<u32, &KvShardLayout> =
        srcs.iter().map(|l| (l.ranks.global_rank, l)).collect();
    let dst_of: HashMap<u32, &KvShardLayout> =
        dsts.iter().map(|l| (l.ranks.global_rank, l)).collect();
    let transfers = rects
        .iter()
        .filter_map(|r| {
            let (sl, dl) = (src_of.get(&r.src)?, dst_of.get(&r.dst)?);
            Some(KvReshardTransfer {
                src_rank: r.src,
                dst_rank: r.dst,
                layers: r.rows,
                heads: r.cols,
                src_layer_start: sl.layers.lo,
                src_head_start: sl.heads.lo,
                dst_layer_start: dl.layers.lo,
                dst_head_start: dl.heads.lo,
            })
        })
        .collect();
    let plan = KvReshardPlan { transfers, srcs: srcs.to_vec(), dsts: dsts.to_vec() };
    // Debug builds check every plan; release builds leave it to `verify()` on demand.
    #[cfg(debug_assertions)]
    plan.verify()?;
    Ok(plan)
}

impl KvReshardPlan {
    /// Bytes per token over the whole plan (K and V).
    pub fn bytes_per_token(&self, head_dim: u64, element_size: u64) -> DisaggResult<u64> {
        self.transfers.iter().try_fold(0u64, |acc, t| {
            acc.checked_add(t.bytes_per_token(head_dim, element_size)?)
                .ok_or_else(|| DisaggError::overflow("bytes per token summed over the plan"))
        })
    }
    /// Check that every destination (layer, head) cell is written exactly once, by a source
    /// that holds it. Names the first gap or overlap.
    pub fn verify(&self) -> DisaggResult<()> {
        let s: Vec<Holding> = self.srcs.iter().map(kv_holding).collect();
        let d: Vec<Holding> = self.dsts.iter().map(kv_holding).collect();
        let rects: Vec<Rect> = self
            .transfers
            .iter()
            .map(|t| Rect { src: t.src_rank, dst: t.dst_rank, rows: t.layers, cols: t.heads })
            .collect();
        verify_rects(&rects, &s, &d, "head")
    }
}

/// One SSM transfer: `src_rank` sends global SSM layers `layers` of one band to `dst_rank`.
/// For conv bands the ranges are channels; for the recurrent band they are heads. `src_local`
/// and `dst_local` are the same range in each side's local packing (`[x | B | C]` for conv).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SsmReshardTransfer {
    /// Global rank of the source.
    pub src_rank: u32,
    /// Global rank of the destination.
    pub dst_rank: u32,
    /// Global SSM layers moved.
    pub layers: Span,
    /// Which band.
    pub band: SsmBand,
    /// Global channels (conv bands) or heads (recurrent).
    pub global: Span,
    /// The same range in the source's local channels or heads.
    pub src_local: Span,
    /// The same range in the destination's local channels or heads.
    pub dst_local: Span,
    /// First global layer of the source's window.
    pub src_layer_start: u32,
    /// First global layer of the destination's window.
    pub dst_layer_start: u32,
}

impl SsmReshardTransfer {
    /// The transfer cut into one transfer per layer (the reference design's granularity), in
    /// layer order.
    pub fn per_layer(&self) -> impl Iterator<Item = SsmReshardTransfer> + '_ {
        (self.layers.lo..self.layers.hi)
            .map(|l| SsmReshardTransfer { layers: Span::new(l, l + 1), ..*self })
    }
    /// Layers in the source's local indexing.
    pub fn src_local_layers(&self) -> Span {
        self.layers.relative_to(self.src_layer_start)
    }
    /// Layers in the destination's local indexing.
    pub fn dst_local_layers(&self) -> Span {
        self.layers.relative_to(self.dst_layer_start)
    }

    /// The one global layer moved (the reference design's per-layer records); `LayoutError`
    /// naming `field` on a transfer spanning several layers.
    pub fn single_layer(&self, field: &str) -> DisaggResult<u32> {
        let l = self.layers;
        if l.len() == 1 {
            return Ok(l.lo);
        }
        Err(DisaggError::layout(
            field,
            format!(
                "{field} is defined for single-layer transfers (iterating an SSMReshardPlan \
                 gives those); this one spans layers [{}, {})",
                l.lo, l.hi
            ),
        ))
    }

    /// The one layer moved, in the source's local indexing.
    pub fn src_layer(&self) -> DisaggResult<u32> {
        Ok(self.single_layer("src_layer")? - self.src_layer_start)
    }

    /// The one layer moved, in the destination's local indexing.
    pub fn dst_layer(&self) -> DisaggResult<u32> {
        Ok(self.single_layer("dst_layer")? - self.dst_layer_start)
    }

    /// "conv" for the bands x, B, C, "recurrent" for the recurrent state.
    pub fn state_kind(&self) -> &'static str {
        if self.band.is_conv() {
            "conv"
        } else {
            "recurrent"
        }
    }
}

impl fmt::Display for SsmReshardTransfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SSMReshardTransfer(src_rank={} -> dst_rank={}, layers=[{}, {}), band={}, \
             global=[{}, {}), src_local=[{}, {}), dst_local=[{}, {}))",
            self.src_rank,
            self.dst_rank,
            self.layers.lo,
            self.layers.hi,
            self.band.name(),
            self.global.lo,
            self.global.hi,
            self.src_local.lo,
            self.src_local.hi,
            self.dst_local.lo,
            self.dst_local.hi
        )
    }
}

/// `KVReshardPlan(3 transfers, 2 sources -> 1 destinations)`.
impl fmt::Display for KvReshardPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (n, s, d) = (self.transfers.len(), self.srcs.len(), self.dsts.len());
        write!(f, "KVReshardPlan({n} transfers, {s} sources -> {d} destinations)")
    }
}

/// `SSMReshardPlan(12 single-layer transfers in 4 ranges, 2 sources -> 1 destinations)`.
impl fmt::Display for SsmReshardPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cut: u64 = self.transfers.iter().map(|t| u64::from(t.layers.len())).sum();
        let (n, s, d) = (self.transfers.len(), self.srcs.len(), self.dsts.len());
        write!(f, "SSMReshardPlan({cut} single-layer transfers in {n} ranges, ")?;
        write!(f, "{s} sources -> {d} destinations)")
    }
}

impl fmt::Display for KvReshardTransfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KVReshardTransfer(src_rank={} -> dst_rank={}, layers=[{}, {}), heads=[{}, {}))",
            self.src_rank,
            self.dst_rank,
            self.layers.lo,
            self.layers.hi,
            self.heads.lo,
            self.heads.hi
        )
    }
}

impl KvReshardTransfer {
    /// The moved layers in `layout`'s local layer axis; `LayoutError` if it does not hold
    /// them.
    pub fn layers_in(&self, layout: &KvShardLayout) -> DisaggResult<Span> {
        local_range(self.layers, layout.layers, "layers", layout.ranks.global_rank)
    }

    /// The moved heads in `layout`'s local head axis; `LayoutError` if it does not hold them.
    pub fn heads_in(&self, layout: &KvShardLayout) -> DisaggResult<Span> {
        local_range(self.heads, layout.heads, "heads", layout.ranks.global_rank)
    }
}

/// An SSM reshard plan, ordered by destination rank, layer, band, then global offset.
pub type SsmReshardPlan = ReshardPlan<SsmShardLayout, SsmReshardTransfer>;

fn ssm_holdings(ls: &[SsmShardLayout], by_groups: bool) -> Vec<Holding> {
    ls.iter()
        .map(|l| Holding {
            rank: l.ranks.global_rank,
            rows: l.layers,
            cols: if by_groups { l.groups } else { l.heads },
        })
        .collect()
}

/// Place a unit range (heads or groups) of `band` into global and local coordinates of `l`.
fn band_ranges(l: &SsmShardLayout, band: SsmBand, units: Span) -> (Span, Span) {
    let unit_width = match band {
        SsmBand::X => l.dims.head_dim,
        SsmBand::B | SsmBand::C => l.dims.d_state,
        SsmBand::Recurrent => 1,
    };
    let own = match band {
        SsmBand::X | SsmBand::Recurrent => l.heads,
        SsmBand::B | SsmBand::C => l.groups,
    };
    let b = l.band(band);
    let global_base = b.global.lo - own.lo * unit_width;
    let global =
        Span::new(global_base + units.lo * unit_width, global_base + units.hi * unit_width);
    let local = Span::new(
        b.local.lo + (units.lo - own.lo) * unit_width,
        b.local.lo + (units.hi - own.lo) * unit_width,
    );
    (global, local)
}

/// Plan the SSM reshard: conv bands x, B, C and the recurrent state, each from its
/// representative source. Errors like [`plan_kv_reshard`].
pub fn plan_ssm_reshard(
    srcs: &[SsmShardLayout],
    dsts: &[SsmShardLayout],
) -> DisaggResult<SsmReshardPlan> {
    // Layouts built from a stage window alone do not know the model's total; the exact-once
    // coverage check still catches a destination layer that no source holds.
    same_model("num_layers", srcs.iter().chain(dsts).filter_map(|l| l.num_layers))?;
    let all = || srcs.iter().chain(dsts);
    same_model("num_heads", all().map(|l| l.dims.num_heads))?;
    same_model("head_dim", all().map(|l| l.dims.head_dim))?;
    same_model("d_state", all().map(|l| l.dims.d_state))?;
    same_model("n_groups", all().map(|l| l.dims.n_groups))?;
    same_model("d_conv", all().map(|l| l.dims.d_conv))?;
    let head_rects = plan_rects(&ssm_holdings(srcs, false), &ssm_holdings(dsts, false), "head")?;
    let group_rects = plan_rects(&ssm_holdings(srcs, true), &ssm_holdings(dsts, true), "group")?;
    let src_of: HashMap<u32, &SsmShardLayout> =
        srcs.iter().map(|l| (l.ranks.global_rank, l)).collect();
    let dst_of: HashMap<u32, &SsmShardLayout> =
        dsts.iter().map(|l| (l.ranks.global_rank, l)).collect();
    let mut transfers = Vec::new();
    for (band, rects) in [
        (SsmBand::X, &head_rects),
        (SsmBand::B, &group_rects),
        (SsmBand::C, &group_rects),
        (SsmBand::Recurrent, &head_rects),
    ] {
        for r in rects {
            let (Some(sl), Some(dl)) = (src_of.get(&r.src), dst_of.get(&r.dst)) else {
                continue;
            };
            let (global, src_local) = band_ranges(sl, band, r.cols);
            let (_, dst_local) = band_ranges(dl, band, r.cols);
            transfers.push(SsmReshardTransfer {
                src_rank: r.src,
                dst_rank: r.dst,
                layers: r.rows,
                band,
                global,
                src_local,
                dst_local,
                src_layer_start: sl.layers.lo,
                dst_layer_start: dl.layers.lo,
            });
        }
    }
    transfers.sort_by_key(|t| (t.dst_rank, t.layers.lo, t.band, t.global.lo, t.src_rank));
    let plan = SsmReshardPlan { transfers, srcs: srcs.to_vec(), dsts: dsts.to_vec() };
    #[cfg(debug_assertions)]
    plan.verify()?;
    Ok(plan)
}

impl SsmReshardPlan {
    /// The plan with every transfer cut into single layers (the reference design's records),
    /// ordered like the plan: by destination rank, layer, band, global offset, source rank.
    pub fn per_layer(&self) -> Vec<SsmReshardTransfer> {
        let mut cut: Vec<SsmReshardTransfer> =
            self.transfers.iter().flat_map(SsmReshardTransfer::per_layer).collect();
        cut.sort_by_key(|t| (t.dst_rank, t.layers.lo, t.band, t.global.lo, t.src_rank));
        cut
    }
    /// Check exact-once coverage of every destination (layer, channel) conv cell and every
    /// (layer, head) recurrent cell, and that local ranges agree with the global ones.
    pub fn verify(&self) -> DisaggResult<()> {
        let dst_of: HashMap<u32, &SsmShardLayout> =
            self.dsts.iter().map(|l| (l.ranks.global_rank, l)).collect();
        let src_of: HashMap<u32, &SsmShardLayout> =
            self.srcs.iter().map(|l| (l.ranks.global_rank, l)).collect();
        // Conv channels as the unit axis: holdings are the union of the three bands, so a
        // transfer is checked band by band against the band's own global range.
        for band in SsmBand::ALL {
            let hold = |l: &SsmShardLayout| Holding {
                rank: l.ranks.global_rank,
                rows: l.layers,
                cols: l.band(band).global,
            };
            let s: Vec<Holding> = self.srcs.iter().map(hold).collect();
            let d: Vec<Holding> = self.dsts.iter().map(hold).collect();
            let mut rects = Vec::new();
            for t in self.transfers.iter().filter(|t| t.band == band) {
                for (side, rank, local, map) in [
                    ("source", t.src_rank, t.src_local, &src_of),
                    ("destination", t.dst_rank, t.dst_local, &dst_of),
                ] {
                    if let Some(l) = map.get(&rank) {
                        let b = l.band(band);
                        let expect = t.global.lo.checked_sub(b.global.lo).map(|o| b.local.lo + o);
                        if expect != Some(local.lo) || local.len() != t.global.len() {
                            return Err(DisaggError::Coverage {
                                detail: format!(
                                    "{} band transfer {} -> {}: {side} local [{}, {}) does not \
                                     match global [{}, {})",
                                    band.name(),
                                    t.src_rank,
                                    t.dst_rank,
                                    local.lo,
                                    local.hi,
                                    t.global.lo,
                                    t.global.hi
                                ),
                            });
                        }
                    }
                }
                rects.push(Rect {
                    src: t.src_rank,
                    dst: t.dst_rank,
                    rows: t.layers,
                    cols: t.global,
                });
            }
            let what = if band.is_conv() { "channel" } else { "head" };
            verify_rects(&rects, &s, &d, &format!("{} {what}", band.name()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_index_resolves_like_a_python_sequence_index() {
        assert_eq!(seq_index(0, 3), Some(0));
        assert_eq!(seq_index(-1, 3), Some(2));
        assert_eq!(seq_index(-3, 3), Some(0));
        assert_eq!(seq_index(-4, 3), None);
        assert_eq!(seq_index(3, 3), None);
        assert_eq!(seq_index(0, 0), None);
    }

    fn kv_side(tp: u32, pp: u32, layers: u32, heads: u32, rank0: u32) -> Vec<KvShardLayout> {
        KvShardLayout::engine(layers, heads, tp, pp, rank0).unwrap()
    }

    #[test]
    fn matched_layouts_give_one_transfer_per_rank() {
        let p = plan_kv_reshard(&kv_side(2, 1, 4, 8, 0), &kv_side(2, 1, 4, 8, 0)).unwrap();
        assert_eq!(p.transfers.len(), 2);
        assert_eq!(p.to_string(), "KVReshardPlan(2 transfers, 2 sources -> 2 destinations)");
        let spans = p.transfers[1].named_spans();
        assert_eq!(spans[1], ("heads", Span::new(4, 8)));
        assert_eq!(spans[3], ("src_local_heads", Span::new(0, 4)));
        assert_eq!(spans[5].0, "dst_local_heads");
        assert_eq!(p.transfers[0].heads, Span::new(0, 4));
        p.verify().unwrap();
    }

    #[test]
    fn tp8_to_tp4_pp2_splits_layers_and_merges_heads() {
        let p = plan_kv_reshard(&kv_side(8, 1, 80, 8, 0), &kv_side(4, 2, 80, 8, 0)).unwrap();
        p.verify().unwrap();
        // Each of 8 destinations gets 2 heads from 2 sources.
        assert_eq!(p.transfers.len(), 16);
        assert!(p.transfers.iter().all(|t| t.layers.len() == 40 && t.heads.len() == 1));
    }

    #[test]
    fn gqa_replicas_are_read_from_the_smallest_rank() {
        let p = plan_kv_reshard(&kv_side(8, 1, 2, 4, 0), &kv_side(1, 1, 2, 4, 100)).unwrap();
        p.verify().unwrap();
        let srcs: Vec<u32> = p.transfers.iter().map(|t| t.src_rank).collect();
        assert_eq!(srcs, vec![0, 2, 4, 6]);
    }

    #[test]
    fn missing_stage_is_a_coverage_error() {
        let mut srcs = kv_side(1, 2, 4, 2, 0);
        srcs.pop();
        let e = plan_kv_reshard(&srcs, &kv_side(1, 1, 4, 2, 10)).unwrap_err();
        assert_eq!(e.kind(), "Coverage");
        assert!(e.to_string().contains("layer 2"), "{e}");
    }

    #[test]
    fn local_ranges_need_a_layout_that_holds_the_range() {
        let p = plan_kv_reshard(&kv_side(2, 1, 4, 4, 0), &kv_side(1, 1, 4, 4, 9)).unwrap();
        let t = p.transfers[1];
        assert_eq!(local_range(t.heads, Span::new(2, 4), "heads", 1).unwrap(), Span::new(0, 2));
        let e = local_range(t.heads, Span::new(0, 2), "heads", 0).unwrap_err();
        assert!(e.to_string().contains("holds heads [0, 2)"), "{e}");
    }

    #[test]
    fn ssm_per_layer_cuts_every_transfer_into_single_layers() {
        let dims = crate::layout::SsmStateDims::new(4, 2, 3, 2, 4).unwrap();
        let side = |tp: u32, rank0: u32| -> Vec<SsmShardLayout> {
            (0..tp)
                .map(|t| {
                    SsmShardLayout::new(crate::layout::SsmLayoutSpec {
                        ranks: crate::RankCoords::grid(tp, t, 1, 0, rank0 + t),
                        ..crate::layout::SsmLayoutSpec::single_rank(3, dims)
                    })
                    .unwrap()
                })
                .collect()
        };
        let p = plan_ssm_reshard(&side(2, 0), &side(1, 5)).unwrap();
        let cut = p.per_layer();
        assert_eq!(cut.len(), 3 * p.transfers.len());
        let shown = format!(
            "SSMReshardPlan({} single-layer transfers in {} ranges, 2 sources -> 1 destinations)",
            cut.len(),
            p.transfers.len()
        );
        assert_eq!(p.to_string(), shown);
        assert!(cut.iter().all(|t| t.layers.len() == 1));
        assert_eq!(cut[0].layers, Span::new(0, 1));
        assert_eq!(cut.last().unwrap().layers, Span::new(2, 3));
        assert!(cut.windows(2).all(|w| w[0].layers.lo <= w[1].layers.lo));
    }

    #[test]
    fn single_layer_fields_hold_only_for_single_layer_transfers() {
        let t = SsmReshardTransfer {
            src_rank: 1,
            dst_rank: 4,
            layers: Span::new(2, 4),
            band: SsmBand::B,
            global: Span::new(8, 12),
            src_local: Span::new(0, 4),
            dst_local: Span::new(4, 8),
            src_layer_start: 2,
            dst_layer_start: 0,
        };
        let e = t.src_layer().unwrap_err();
        assert_eq!(e.kind(), "Layout");
        assert!(e.to_string().contains("src_layer"), "{e}");
        assert!(e.to_string().contains("spans layers [2, 4)"), "{e}");
        let one: Vec<_> = t.per_layer().collect();
        assert_eq!(
            (one[1].single_layer("global_layer").unwrap(), one[1].src_layer().unwrap()),
            (3, 1)
        );
        assert_eq!(one[1].dst_layer().unwrap(), 3);
        assert_eq!(t.state_kind(), "conv");
        assert_eq!(
            t.to_string(),
            "SSMReshardTransfer(src_rank=1 -> dst_rank=4, layers=[2, 4), band=B, global=[8, 12), \
             src_local=[0, 4), dst_local=[4, 8))"
        );
    }

    #[test]
    fn kv_transfer_local_axes_come_from_the_layout_given() {
        let p = plan_kv_reshard(&kv_side(2, 1, 4, 4, 0), &kv_side(1, 1, 4, 4, 9)).unwrap();
        let t = p.transfers[1];
        let (src, dst) = (&kv_side(2, 1, 4, 4, 0)[1], &kv_side(1, 1, 4, 4, 9)[0]);
        assert_eq!(t.heads_in(src).unwrap(), Span::new(0, 2));
        assert_eq!(t.heads_in(dst).unwrap(), Span::new(2, 4));
        assert_eq!(t.layers_in(dst).unwrap(), Span::new(0, 4));
        assert!(t.heads_in(&kv_side(2, 1, 4, 4, 0)[0]).is_err());
        assert_eq!(
            t.to_string(),
            "KVReshardTransfer(src_rank=1 -> dst_rank=9, layers=[0, 4), heads=[2, 4))"
        );
    }

    #[test]
    fn verify_catches_a_dropped_and_a_doubled_transfer() {
        let mut p = plan_kv_reshard(&kv_side(2, 1, 4, 4, 0), &kv_side(1, 1, 4, 4, 9)).unwrap();
        let t = p.transfers.pop().unwrap();
        assert!(p.verify().unwrap_err().to_string().contains("never written"));
        p.transfers.push(t);
        p.transfers.push(t);
        assert!(p.verify().unwrap_err().to_string().contains("more than once"));
    }
}
