//! Descriptor compiler: reshard plan x geometries x block lists -> transfer program.
//!
//! A program is compiled for ONE destination rank and covers every source rank that sends to
//! it. For each source rank it says how the bytes move:
//!
//! - **direct**: pairs of byte ranges (source address, destination address, length), where
//!   ranges that are contiguous on both sides are merged, so a matched layout with contiguous
//!   block runs needs one descriptor per (plane, run), not per block;
//! - **staged**: a gather list (source address -> packed offset) that packs the source's bytes
//!   into one contiguous packed region, one large descriptor that moves that region, and a
//!   scatter list (packed offset -> destination address) that unpacks it.
//!
//! **Canonical packed order.** The packed region of one (source rank, destination rank) pair
//! is `[0, packed_bytes)` and is a function of the plan, the source geometry, `num_tokens` and
//! `token_start` only (not of any block id and not of the destination geometry), so a prefill
//! rank can pack before it knows the decode's blocks, and both sides compute identical offsets.
//! The region holds the pair's reshard transfers in plan order; each transfer is a dense array
//! `[kv][layer][token][head][dim]` (or `[kv][layer][head][token][dim]` when the source
//! geometry stores heads outside tokens, HND), over the transfer's layers and heads and the
//! moved token positions `[token_start, num_tokens)`. An SSM region holds the conv pieces,
//! then the recurrent ones, each ordered by source-local layer, then band (x, B, C), then
//! channel; a piece is its dense `[unit][inner]` bytes.
//!
//! Block-size mismatch: source and destination may use different `tokens_per_block`; the
//! compiler maps token positions, cutting at every block boundary of either side, including a
//! partial tail block. All ranges are half-open `[lo, hi)`.
//!
//! Address arithmetic: geometry constructors check that every addressable byte fits `u64`,
//! block ids are checked against `num_blocks`, token offsets against `tokens_per_block` and
//! packed sizes with checked arithmetic here, so the expansion loops cannot overflow.

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{KvGeometry, SsmGeometry, SsmStateKind};
use crate::layout::{KvShardLayout, SsmBand, SsmShardLayout};
use crate::reshard::{plan_kv_reshard, plan_ssm_reshard};

/// How one source rank's bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferMode {
    /// One descriptor pair per byte range contiguous on both sides.
    Direct,
    /// Gather into a packed region, move it with one descriptor, scatter at the destination.
    Staged,
}

impl TransferMode {
    /// The Python name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Staged => "staged",
        }
    }
}

/// The mode asked of the compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModeChoice {
    /// Direct for every source rank.
    Direct,
    /// Staged for every source rank.
    Staged,
    /// Per source rank, whichever the [`CostModel`] says is faster.
    Auto,
}

impl ModeChoice {
    /// Parse `"direct"`, `"staged"` or `"auto"`.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "direct" => Ok(Self::Direct),
            "staged" => Ok(Self::Staged),
            "auto" => Ok(Self::Auto),
            other => Err(DisaggError::argument(
                "mode",
                format!("mode={other:?} is not one of 'direct', 'staged', 'auto'"),
            )),
        }
    }
}

/// docs/architecture.md §4 cost model: direct costs `n_desc * per_descriptor_s + bytes / link_bytes_per_s`,
/// staged costs `2 * bytes / gather_bytes_per_s + bytes / link_bytes_per_s` plus one
/// descriptor. Defaults are the H200 measurements of docs/architecture.md §4.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Seconds one extra descriptor costs the transport (measured: about 8 us).
    pub per_descriptor_s: f64,
    /// Bytes per second of the link for large descriptors (measured: 388 GB/s over `NVLink`).
    pub link_bytes_per_s: f64,
    /// Bytes per second of the pack or unpack kernel (measured: about 1.6 TB/s).
    pub gather_bytes_per_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self { per_descriptor_s: 8e-6, link_bytes_per_s: 388e9, gather_bytes_per_s: 1.6e12 }
    }
}

impl CostModel {
    /// The largest direct descriptor count for which direct is not slower than staged.
    // Costs are estimates; f64 precision is plenty and the result saturates into u64.
    #[allow(clippy::cast_precision_loss, clippy::cast_sign_loss)]
    pub fn max_direct_descriptors(&self, bytes: u64) -> u64 {
        let pack = 2.0 * bytes as f64 / self.gather_bytes_per_s;
        let n = (pack / self.per_descriptor_s).floor() + 1.0;
        if n.is_finite() && n > 0.0 {
            n as u64
        } else {
            u64::MAX
        }
    }
}

/// Source block ids: one list for every source rank, or one list per source global rank
/// (pipeline stages allocate independently).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SrcBlockIds {
    /// The same ids on every source rank.
    Shared(Vec<u32>),
    /// Ids per source global rank.
    PerRank(BTreeMap<u32, Vec<u32>>),
}

impl SrcBlockIds {
    fn for_rank(&self, rank: u32, field: &str) -> DisaggResult<&[u32]> {
        match self {
            Self::Shared(v) => Ok(v),
            Self::PerRank(m) => m.get(&rank).map(Vec::as_slice).ok_or_else(|| {
                DisaggError::block(
                    field,
                    format!("no list for source global_rank={rank}; given ranks {:?}", m.keys()),
                )
            }),
        }
    }
}

/// Everything `compile_kv_transfer` needs; see the module docs for the packed order.
#[derive(Debug, Clone)]
pub struct KvTransferRequest {
    /// Source ranks with their geometries (any order; ranks that send nothing are ignored).
    pub srcs: Vec<(KvShardLayout, KvGeometry)>,
    /// The destination rank this program is for.
    pub dst_layout: KvShardLayout,
    /// Its geometry; `None` allows only the gather side (what a prefill needs to pack).
    pub dst_geometry: Option<KvGeometry>,
    /// Source block ids covering token positions `[0, num_tokens)`.
    pub src_block_ids: SrcBlockIds,
    /// Destination block ids covering `[0, num_tokens)`; `None` allows only the gather side.
    pub dst_block_ids: Option<Vec<u32>>,
    /// Tokens of the prompt state.
    pub num_tokens: u64,
    /// First token position moved (a cached prefix on the destination is skipped).
    pub token_start: u64,
    /// Direct, staged or auto.
    pub mode: ModeChoice,
    /// Constants of the auto decision.
    pub cost: CostModel,
}

/// Everything `compile_ssm_transfer` needs.
#[derive(Debug, Clone)]
pub struct SsmTransferRequest {
    /// Source ranks with their geometries.
    pub srcs: Vec<(SsmShardLayout, SsmGeometry)>,
    /// The destination rank this program is for.
    pub dst_layout: SsmShardLayout,
    /// Its geometry; `None` allows only the gather side.
    pub dst_geometry: Option<SsmGeometry>,
    /// Source slot: one for every source rank, or one per source global rank.
    pub src_slots: SrcSlots,
    /// Destination slot; `None` allows only the gather side.
    pub dst_slot: Option<u32>,
    /// Direct, staged or auto.
    pub mode: ModeChoice,
    /// Constants of the auto decision.
    pub cost: CostModel,
}

/// Source SSM slot ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SrcSlots {
    /// The same slot on every source rank.
    Shared(u32),
    /// Slot per source global rank.
    PerRank(BTreeMap<u32, u32>),
}

/// One strided copy: `row` contiguous bytes at `base`, repeated over two outer dims, each
/// `[count, src stride, dst stride, packed stride]`. Index 0/1/2 of `base` and of the strides
/// is the source / destination / packed address space.
#[derive(Debug, Clone, Copy)]
struct CopyBox {
    base: [u64; 3],
    row: u64,
    dims: [[u64; 4]; 2],
}

const SRC: usize = 0;
const DST: usize = 1;
const PACKED: usize = 2;

/// A run of token positions inside one block of each side that matters.
#[derive(Debug, Clone, Copy)]
struct Segment {
    t_lo: u64,
    n: u64,
    src_block: u64,
    src_off: u64,
    dst_block: u64,
    dst_off: u64,
}

/// Cut `[lo, hi)` at every block boundary of the sides given.
fn segments(
    lo: u64,
    hi: u64,
    src: Option<(u64, &[u32])>,
    dst: Option<(u64, &[u32])>,
) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut t = lo;
    while t < hi {
        let mut end = hi;
        let mut seg = Segment { t_lo: t, n: 0, src_block: 0, src_off: 0, dst_block: 0, dst_off: 0 };
        if let Some((tpb, ids)) = src {
            end = end.min((t / tpb + 1) * tpb);
            seg.src_block = u64::from(ids[(t / tpb) as usize]);
            seg.src_off = t % tpb;
        }
        if let Some((tpb, ids)) = dst {
            end = end.min((t / tpb + 1) * tpb);
            seg.dst_block = u64::from(ids[(t / tpb) as usize]);
            seg.dst_off = t % tpb;
        }
        seg.n = end - t;
        out.push(seg);
        t = end;
    }
    out
}

/// One KV reshard transfer in local coordinates, with its packed region.
#[derive(Debug, Clone, Copy)]
struct KvPlaneSet {
    src_l0: u32,
    dst_l0: u32,
    num_layers: u32,
    src_h0: u64,
    dst_h0: u64,
    num_heads: u64,
    packed_off: u64,
}

#[derive(Debug, Clone)]
struct KvWork {
    src: KvGeometry,
    dst: Option<KvGeometry>,
    sets: Vec<KvPlaneSet>,
    seg_direct: Vec<Segment>,
    seg_src: Vec<Segment>,
    seg_dst: Vec<Segment>,
    token_start: u64,
    num_tokens: u64,
}

#[derive(Debug, Clone)]
enum Work {
    Kv(Box<KvWork>),
    Boxes(Vec<CopyBox>),
}

/// Which list a walk over the boxes produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Direct,
    Gather,
    Scatter,
}

impl Purpose {
    /// The (a, b) address spaces of the produced pairs.
    fn sides(self) -> (usize, usize) {
        match self {
            Self::Direct => (SRC, DST),
            Self::Gather => (SRC, PACKED),
            Self::Scatter => (PACKED, DST),
        }
    }
}

impl KvWork {
    /// Walk every (transfer, kv, layer, segment) box of `purpose` into `sink`.
    fn walk(&self, purpose: Purpose, sink: &mut impl FragmentSink) {
        let segs = match purpose {
            Purpose::Direct => &self.seg_direct,
            Purpose::Gather => &self.seg_src,
            Purpose::Scatter => &self.seg_dst,
        };
        let (ia, ib) = purpose.sides();
        let s = self.src.spec();
        let row = self.src.row_bytes();
        let n_tok = self.num_tokens - self.token_start;
        let heads_outer = self.src.heads_outer();
        let (d_bs, d_ts, d_hs) = self.dst.as_ref().map_or((0, 0, 0), |d| {
            let ds = d.spec();
            (ds.block_stride, ds.token_stride, ds.head_stride)
        });
        for set in &self.sets {
            let nh = set.num_heads;
            let tok_bytes = nh * row;
            let plane_bytes = n_tok * tok_bytes;
            let (p_ts, p_hs) = if heads_outer { (row, n_tok * row) } else { (tok_bytes, row) };
            let ts = [s.token_stride, d_ts, p_ts];
            let hs = [s.head_stride, d_hs, p_hs];
            // The heads of a token form one row on both sides and tokens follow each other:
            // every segment is one fragment (matched layouts), so skip the general emitter.
            let whole = (nh == 1 || (hs[ia] == row && hs[ib] == row))
                && ts[ia] == tok_bytes
                && ts[ib] == tok_bytes;
            // Whole segments: their offsets inside a plane are the same for every plane, so
            // compute and pre-merge them once; each plane then costs one add per run.
            let runs: Vec<[u64; 3]> = if whole {
                let mut c = Collect::<Vec<[u64; 3]>, false> { out: Vec::with_capacity(segs.len()) };
                for seg in segs {
                    let off = [
                        seg.src_block * s.block_stride + seg.src_off * s.token_stride,
                        seg.dst_block * d_bs + seg.dst_off * d_ts,
                        (seg.t_lo - self.token_start) * p_ts,
                    ];
                    c.push(off[ia], off[ib], seg.n * tok_bytes);
                }
                c.out
            } else {
                Vec::new()
            };
            for kv in 0..s.num_kv {
                for l in 0..set.num_layers {
                    let sp = self.src.plane_base(kv, set.src_l0 + l) + set.src_h0 * s.head_stride;
                    let dp = self
                        .dst
                        .as_ref()
                        .map_or(0, |d| d.plane_base(kv, set.dst_l0 + l) + set.dst_h0 * d_hs);
                    let plane_idx = u64::from(kv * set.num_layers + l);
                    let pp = set.packed_off + plane_idx * plane_bytes;
                    if whole {
                        let plane = [sp, dp, pp];
                        let (ba, bb) = (plane[ia], plane[ib]);
                        for r in &runs {
                            if !sink.push(ba + r[0], bb + r[1], r[2]) {
                                return;
                            }
                        }
                        continue;
                    }
                    for seg in segs {
                        let base = [
                            sp + seg.src_block * s.block_stride + seg.src_off * s.token_stride,
                            dp + seg.dst_block * d_bs + seg.dst_off * d_ts,
                            pp + (seg.t_lo - self.token_start) * p_ts,
                        ];
                        let b = CopyBox {
                            base,
                            row,
                            dims: [[seg.n, ts[0], ts[1], ts[2]], [nh, hs[0], hs[1], hs[2]]],
                        };
                        if !emit_box(&b, (ia, ib), sink) {
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// Receives the fragments of a walk, merging each with the previous one when both of its
/// address ranges continue the previous ones.
trait FragmentSink {
    /// Take `[a, a + len)` -> `[b, b + len)`; return false to stop the walk.
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool;

    /// Take `n >= 1` fragments `a + k * sa -> b + k * sb` of `len` bytes, which cannot merge
    /// with each other (the emitter folded every dim that could); only the first may continue
    /// the previous fragment.
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        (0..n).all(|k| self.push(a + k * sa, b + k * sb, len))
    }
}

/// Where collected rows go: a growing vector, or a caller's fixed buffer ([`SliceRows`]).
pub trait RowBuf {
    /// The last row written, to merge into.
    fn last_row(&mut self) -> Option<&mut [u64; 3]>;
    /// Append a row; false when the buffer is full (the walk stops).
    fn push_row(&mut self, row: [u64; 3]) -> bool;
    /// Append rows `row(0), .., row(n - 1)`; false (and nothing written) when they do not fit.
    fn extend_with(&mut self, n: usize, row: impl Fn(usize) -> [u64; 3]) -> bool;
}

impl RowBuf for Vec<[u64; 3]> {
    #[inline]
    fn last_row(&mut self) -> Option<&mut [u64; 3]> {
        self.last_mut()
    }
    #[inline]
    fn push_row(&mut self, row: [u64; 3]) -> bool {
        self.push(row);
        true
    }
    #[inline]
    fn extend_with(&mut self, n: usize, row: impl Fn(usize) -> [u64; 3]) -> bool {
        self.extend((0..n).map(row));
        true
    }
}

/// A caller's buffer of rows (for example a reused numpy array): fresh output memory costs a
/// page fault per 4 KiB, which for large lists costs more than computing them.
pub struct SliceRows<'a> {
    rows: &'a mut [[u64; 3]],
    len: usize,
}

impl<'a> SliceRows<'a> {
    /// An empty buffer over `rows`.
    pub fn new(rows: &'a mut [[u64; 3]]) -> Self {
        Self { rows, len: 0 }
    }
    /// Rows written.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no row was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl RowBuf for SliceRows<'_> {
    #[inline]
    fn last_row(&mut self) -> Option<&mut [u64; 3]> {
        self.len.checked_sub(1).and_then(|i| self.rows.get_mut(i))
    }
    #[inline]
    fn push_row(&mut self, row: [u64; 3]) -> bool {
        match self.rows.get_mut(self.len) {
            Some(slot) => {
                *slot = row;
                self.len += 1;
                true
            }
            None => false,
        }
    }
    #[inline]
    fn extend_with(&mut self, n: usize, row: impl Fn(usize) -> [u64; 3]) -> bool {
        let Some(free) = self.len.checked_add(n).and_then(|end| self.rows.get_mut(self.len..end))
        else {
            // Refused: count the buffer as full, so the caller sees `len == capacity` and
            // measures the list (a run that does not fit can leave free rows behind).
            self.len = self.rows.len();
            return false;
        };
        for (k, slot) in free.iter_mut().enumerate() {
            *slot = row(k);
        }
        self.len += n;
        true
    }
}

/// Collects merged fragments as rows `(a, len, b)` (gather format, `GATHER`) or
/// `(a, b, len)` (scatter format); the layout is a constant so each row is one store.
struct Collect<B, const GATHER: bool> {
    out: B,
}

impl<B, const GATHER: bool> Collect<B, GATHER> {
    #[inline]
    fn row(a: u64, b: u64, len: u64) -> [u64; 3] {
        if GATHER {
            [a, len, b]
        } else {
            [a, b, len]
        }
    }
    #[inline]
    fn parts(r: &mut [u64; 3]) -> (u64, u64, &mut u64) {
        if GATHER {
            let [a, len, b] = r;
            (*a, *b, len)
        } else {
            let [a, b, len] = r;
            (*a, *b, len)
        }
    }
}

impl<B: RowBuf, const GATHER: bool> FragmentSink for Collect<B, GATHER> {
    #[inline]
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let Some(last) = self.out.last_row() {
            let (la, lb, ll) = Self::parts(last);
            if la + *ll == a && lb + *ll == b {
                *ll += len;
                return true;
            }
        }
        self.out.push_row(Self::row(a, b, len))
    }

    #[inline]
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        if !self.push(a, b, len) {
            return false;
        }
        self.out.extend_with(n as usize - 1, |k| {
            let k = k as u64 + 1;
            Self::row(a + k * sa, b + k * sb, len)
        })
    }
}

/// Collects merged direct pairs straight into the two transport arrays
/// `(src_addr, len, src_device)` and `(dst_addr, len, dst_device)`.
struct CollectPairs<B> {
    src: B,
    dst: B,
    src_device: u64,
    dst_device: u64,
}

impl<B: RowBuf> FragmentSink for CollectPairs<B> {
    #[inline]
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let (Some(s), Some(d)) = (self.src.last_row(), self.dst.last_row()) {
            if s[0] + s[1] == a && d[0] + d[1] == b {
                s[1] += len;
                d[1] += len;
                return true;
            }
        }
        self.src.push_row([a, len, self.src_device]) && self.dst.push_row([b, len, self.dst_device])
    }

    #[inline]
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        if !self.push(a, b, len) {
            return false;
        }
        let (sd, dd) = (self.src_device, self.dst_device);
        let more = n as usize - 1;
        self.src.extend_with(more, |k| [a + (k as u64 + 1) * sa, len, sd])
            && self.dst.extend_with(more, |k| [b + (k as u64 + 1) * sb, len, dd])
    }
}

/// Collects strided runs `[a, b, len, count, a_stride, b_stride]`: fragment `k < count` is
/// `a + k * a_stride -> b + k * b_stride`, `len` bytes. Single fragments merge as usual.
#[derive(Default)]
struct CollectRuns {
    out: Vec<[u64; 6]>,
}

impl FragmentSink for CollectRuns {
    #[inline]
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let Some(last) = self.out.last_mut() {
            if last[3] == 1 && last[0] + last[2] == a && last[1] + last[2] == b {
                last[2] += len;
                return true;
            }
        }
        self.out.push([a, b, len, 1, 0, 0]);
        true
    }

    #[inline]
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        if n == 1 {
            return self.push(a, b, len);
        }
        self.out.push([a, b, len, n, sa, sb]);
        true
    }
}

/// Which list of a source rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListKind {
    /// What `descriptors` returns (direct pairs, or the one staged descriptor).
    Descriptors,
    /// The gather list.
    Gather,
    /// The scatter list.
    Scatter,
}

impl ListKind {
    /// Parse `"descriptors"`, `"gather"` or `"scatter"`.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "descriptors" => Ok(Self::Descriptors),
            "gather" => Ok(Self::Gather),
            "scatter" => Ok(Self::Scatter),
            other => Err(DisaggError::argument(
                "which",
                format!("which={other:?} is not one of 'descriptors', 'gather', 'scatter'"),
            )),
        }
    }
}

/// Counts merged fragments, stopping once the count passes `limit`.
struct Count {
    last: Option<[u64; 3]>,
    n: u64,
    limit: u64,
}

impl FragmentSink for Count {
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let Some(last) = self.last.as_mut() {
            if last[0] + last[2] == a && last[1] + last[2] == b {
                last[2] += len;
                return true;
            }
        }
        self.last = Some([a, b, len]);
        self.n += 1;
        self.n <= self.limit
    }

    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        self.push(a, b, len);
        let k = n - 1;
        self.n += k;
        self.last = Some([a + k * sa, b + k * sb, len]);
        self.n <= self.limit
    }
}

/// Emit one box as fragments: first fold every outer dim whose strides equal the current row
/// on both sides into the row (they are contiguous), then walk what is left.
#[inline]
fn emit_box(bx: &CopyBox, (ia, ib): (usize, usize), sink: &mut impl FragmentSink) -> bool {
    let mut row = bx.row;
    let mut dims = [(0u64, 0u64, 0u64); 2];
    let mut nd = 0;
    for d in &bx.dims {
        if d[0] == 0 {
            return true;
        }
        if d[0] > 1 {
            dims[nd] = (d[0], d[1 + ia], d[1 + ib]);
            nd += 1;
        }
    }
    let mut i = 0;
    while i < nd {
        if dims[i].1 == row && dims[i].2 == row {
            row *= dims[i].0;
            dims[i] = dims[nd - 1];
            nd -= 1;
            i = 0;
        } else {
            i += 1;
        }
    }
    let (a, b) = (bx.base[ia], bx.base[ib]);
    match nd {
        0 => sink.push(a, b, row),
        1 => {
            let (n, sa, sb) = dims[0];
            sink.push_run(a, b, row, n, sa, sb)
        }
        _ => {
            // Walk the dim with the larger stride on side a outside, so a advances in order.
            let (outer, inner) =
                if dims[0].1 >= dims[1].1 { (dims[0], dims[1]) } else { (dims[1], dims[0]) };
            (0..outer.0).all(|o| {
                let (ao, bo) = (a + o * outer.1, b + o * outer.2);
                sink.push_run(ao, bo, row, inner.0, inner.1, inner.2)
            })
        }
    }
}

/// The compiled program of one source rank.
#[derive(Debug, Clone)]
pub struct SourceProgram {
    /// Global rank of the source.
    pub src_rank: u32,
    /// Device of the source memory.
    pub src_device: u64,
    /// How its bytes move.
    pub mode: TransferMode,
    /// Payload bytes, which is also the size of its packed region `[0, packed_bytes)`.
    pub packed_bytes: u64,
    work: Work,
}

impl SourceProgram {
    fn walk(&self, purpose: Purpose, sink: &mut impl FragmentSink) {
        let sides = purpose.sides();
        match &self.work {
            Work::Kv(kv) => kv.walk(purpose, sink),
            Work::Boxes(boxes) => {
                for b in boxes {
                    if !emit_box(b, sides, sink) {
                        return;
                    }
                }
            }
        }
    }

    /// Boxes a walk visits: the capacity to reserve (one fragment per box when every box
    /// coalesces, as in matched layouts; vectors grow beyond it otherwise).
    fn box_count(&self, purpose: Purpose) -> usize {
        match &self.work {
            Work::Kv(kv) => {
                let segs = match purpose {
                    Purpose::Direct => kv.seg_direct.len(),
                    Purpose::Gather => kv.seg_src.len(),
                    Purpose::Scatter => kv.seg_dst.len(),
                };
                let planes: usize = kv
                    .sets
                    .iter()
                    .map(|s| s.num_layers as usize * kv.src.spec().num_kv as usize)
                    .sum();
                planes.saturating_mul(segs)
            }
            Work::Boxes(b) => b.len(),
        }
    }

    /// Rows of a walk: `(a, len, b)` when `GATHER`, else `(a, b, len)`.
    fn collect<const GATHER: bool>(&self, purpose: Purpose) -> Vec<[u64; 3]> {
        let mut c = Collect::<_, GATHER> { out: Vec::with_capacity(self.box_count(purpose)) };
        self.walk(purpose, &mut c);
        c.out
    }

    /// Number of merged direct descriptors, counting at most `limit + 1`.
    fn count_direct(&self, limit: u64) -> u64 {
        let mut c = Count { last: None, n: 0, limit };
        self.walk(Purpose::Direct, &mut c);
        c.n
    }
}

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
    fn device_plan(&self) -> Option<KvDevicePlan> {
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

/// Per-source figures of a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceStats {
    /// Global rank of the source.
    pub src_rank: u32,
    /// Its mode.
    pub mode: TransferMode,
    /// Descriptors handed to the transport: merged pairs (direct) or 1 (staged).
    pub descriptors: u64,
    /// Gather plus scatter fragments (staged; 0 for direct).
    pub fragments: u64,
    /// Payload bytes.
    pub bytes: u64,
}

/// The compiled transfer of one destination rank: what each source rank does.
#[derive(Debug, Clone)]
pub struct TransferProgram {
    /// Global rank of the destination.
    pub dst_rank: u32,
    /// Device of the destination memory.
    pub dst_device: u64,
    /// Sources in ascending global rank; only ranks that send something.
    pub sources: Vec<SourceProgram>,
    /// Whether destination addresses are known (destination geometry and blocks given).
    pub has_destination: bool,
    expected: Expected,
}

/// What the destination should receive, kept in input form: `verify` expands it cell by cell
/// only when asked (compiling must not pay for the check).
#[derive(Debug, Clone)]
enum Expected {
    None,
    Kv { geometry: KvGeometry, block_ids: Vec<u32>, lo: u64, hi: u64 },
    Ssm { geometry: SsmGeometry, layout: SsmShardLayout, slot: u32 },
}

impl Expected {
    fn cells(&self) -> Vec<[u64; 2]> {
        match self {
            Self::None => Vec::new(),
            Self::Kv { geometry, block_ids, lo, hi } => {
                expected_kv_cells(geometry, block_ids, *lo, *hi)
            }
            Self::Ssm { geometry, layout, slot } => expected_ssm_cells(geometry, layout, *slot),
        }
    }
}

/// One flat list of fragments, row-major `[n, 3]`.
pub type Rows = Vec<[u64; 3]>;

impl TransferProgram {
    /// The source program of `src_rank`.
    pub fn source(&self, src_rank: u32) -> DisaggResult<&SourceProgram> {
        self.sources.iter().find(|s| s.src_rank == src_rank).ok_or_else(|| {
            DisaggError::block(
                "src_rank",
                format!(
                    "src_rank={src_rank} sends nothing to destination rank {}; sources: {:?}",
                    self.dst_rank,
                    self.sources.iter().map(|s| s.src_rank).collect::<Vec<_>>()
                ),
            )
        })
    }

    fn need_destination(&self, what: &str) -> DisaggResult<()> {
        if self.has_destination {
            Ok(())
        } else {
            Err(DisaggError::block(
                "dst_block_ids",
                format!("{what} needs destination addresses, but the program was compiled with dst_block_ids=None or no destination geometry"),
            ))
        }
    }

    /// Direct descriptor pairs of `src_rank` regardless of its mode: `(src, dst)`, each row
    /// `(addr, len, device)`.
    pub fn direct_descriptors(&self, src_rank: u32) -> DisaggResult<(Rows, Rows)> {
        self.need_destination("direct descriptors")?;
        let s = self.source(src_rank)?;
        let cap = s.box_count(Purpose::Direct);
        let mut c = CollectPairs {
            src: Vec::with_capacity(cap),
            dst: Vec::with_capacity(cap),
            src_device: s.src_device,
            dst_device: self.dst_device,
        };
        s.walk(Purpose::Direct, &mut c);
        Ok((c.src, c.dst))
    }

    /// What the transport moves for `src_rank`: the direct pairs, or (staged) one pair whose
    /// addresses are `src_staging` and `dst_staging`, the packed regions' addresses.
    pub fn descriptors(
        &self,
        src_rank: u32,
        src_staging: u64,
        dst_staging: u64,
    ) -> DisaggResult<(Rows, Rows)> {
        let s = self.source(src_rank)?;
        match s.mode {
            TransferMode::Direct => self.direct_descriptors(src_rank),
            TransferMode::Staged => Ok((
                vec![[src_staging, s.packed_bytes, s.src_device]],
                vec![[dst_staging, s.packed_bytes, self.dst_device]],
            )),
        }
    }

    /// Gather list of `src_rank`: rows `(src_addr, len, packed_offset)`, merged where both the
    /// source and the packed ranges continue. Available in every mode and without destination.
    pub fn gather(&self, src_rank: u32) -> DisaggResult<Rows> {
        Ok(self.source(src_rank)?.collect::<true>(Purpose::Gather))
    }

    /// Scatter list of `src_rank`: rows `(packed_offset, dst_addr, len)`.
    pub fn scatter(&self, src_rank: u32) -> DisaggResult<Rows> {
        self.need_destination("scatter")?;
        Ok(self.source(src_rank)?.collect::<false>(Purpose::Scatter))
    }

    /// The gather list of `src_rank` as strided runs
    /// `(src_addr, packed_offset, len, count, src_stride, packed_stride)`: the compact form a
    /// pack kernel wants (one row per block run instead of one per token for head reshards).
    pub fn gather_runs(&self, src_rank: u32) -> DisaggResult<Vec<[u64; 6]>> {
        let mut c = CollectRuns::default();
        self.source(src_rank)?.walk(Purpose::Gather, &mut c);
        Ok(c.out)
    }

    /// The scatter list of `src_rank` as strided runs
    /// `(packed_offset, dst_addr, len, count, packed_stride, dst_stride)`.
    pub fn scatter_runs(&self, src_rank: u32) -> DisaggResult<Vec<[u64; 6]>> {
        self.need_destination("scatter")?;
        let mut c = CollectRuns::default();
        self.source(src_rank)?.walk(Purpose::Scatter, &mut c);
        Ok(c.out)
    }

    /// Exact number of rows of one list of `src_rank` (walks it without writing).
    pub fn row_count(&self, src_rank: u32, which: ListKind) -> DisaggResult<u64> {
        let s = self.source(src_rank)?;
        let purpose = match (which, s.mode) {
            (ListKind::Descriptors, TransferMode::Staged) => return Ok(1),
            (ListKind::Descriptors, TransferMode::Direct) => Purpose::Direct,
            (ListKind::Gather, _) => Purpose::Gather,
            (ListKind::Scatter, _) => Purpose::Scatter,
        };
        if purpose != Purpose::Gather {
            self.need_destination("row_count")?;
        }
        let mut c = Count { last: None, n: 0, limit: u64::MAX - 1 };
        s.walk(purpose, &mut c);
        Ok(c.n)
    }

    /// [`TransferProgram::descriptors`] written into caller buffers; returns the row count.
    pub fn descriptors_into(
        &self,
        src_rank: u32,
        src_staging: u64,
        dst_staging: u64,
        src_out: &mut [[u64; 3]],
        dst_out: &mut [[u64; 3]],
    ) -> DisaggResult<usize> {
        let s = self.source(src_rank)?;
        if s.mode == TransferMode::Staged {
            let (src_rows, dst_rows) = self.descriptors(src_rank, src_staging, dst_staging)?;
            let (Some(first_src), Some(first_dst)) = (src_out.first_mut(), dst_out.first_mut())
            else {
                return Err(too_small("out", 0, 1));
            };
            *first_src = src_rows[0];
            *first_dst = dst_rows[0];
            return Ok(1);
        }
        self.direct_descriptors_into(src_rank, src_out, dst_out)
    }

    /// Exact rows of [`TransferProgram::direct_descriptors`] of `src_rank` (walks the list).
    pub fn direct_row_count(&self, src_rank: u32) -> DisaggResult<u64> {
        self.need_destination("direct descriptors")?;
        Ok(self.source(src_rank)?.count_direct(u64::MAX - 1))
    }

    /// A cheap row count for [`TransferProgram::direct_descriptors`] of `src_rank` (no walk):
    /// enough for every program the KV compiler emits, but a caller must still handle a
    /// too-small buffer (see [`TransferProgram::direct_row_count`]).
    pub fn direct_row_hint(&self, src_rank: u32) -> DisaggResult<u64> {
        Ok(self.source(src_rank)?.box_count(Purpose::Direct) as u64)
    }

    /// [`TransferProgram::direct_descriptors`] written into caller buffers (whatever the mode
    /// of `src_rank`); returns the row count.
    pub fn direct_descriptors_into(
        &self,
        src_rank: u32,
        src_out: &mut [[u64; 3]],
        dst_out: &mut [[u64; 3]],
    ) -> DisaggResult<usize> {
        let s = self.source(src_rank)?;
        self.need_destination("direct descriptors")?;
        let cap = src_out.len().min(dst_out.len());
        let mut c = CollectPairs {
            src: SliceRows::new(src_out),
            dst: SliceRows::new(dst_out),
            src_device: s.src_device,
            dst_device: self.dst_device,
        };
        s.walk(Purpose::Direct, &mut c);
        finish_into(c.src.len(), c.dst.len().min(c.src.len()), cap, || {
            Ok(s.count_direct(u64::MAX - 1))
        })
    }

    /// [`TransferProgram::gather`] written into a caller buffer; returns the row count.
    pub fn gather_into(&self, src_rank: u32, out: &mut [[u64; 3]]) -> DisaggResult<usize> {
        let s = self.source(src_rank)?;
        let cap = out.len();
        let mut c = Collect::<_, true> { out: SliceRows::new(out) };
        s.walk(Purpose::Gather, &mut c);
        finish_into(c.out.len(), c.out.len(), cap, || self.row_count(src_rank, ListKind::Gather))
    }

    /// [`TransferProgram::scatter`] written into a caller buffer; returns the row count.
    pub fn scatter_into(&self, src_rank: u32, out: &mut [[u64; 3]]) -> DisaggResult<usize> {
        self.need_destination("scatter")?;
        let s = self.source(src_rank)?;
        let cap = out.len();
        let mut c = Collect::<_, false> { out: SliceRows::new(out) };
        s.walk(Purpose::Scatter, &mut c);
        finish_into(c.out.len(), c.out.len(), cap, || self.row_count(src_rank, ListKind::Scatter))
    }

    /// The block-id-free device plan of `src_rank` ([`KvDevicePlan`]), or `None` for SSM
    /// state and for KV transfers that do not have its shape.
    pub fn device_plan(&self, src_rank: u32) -> DisaggResult<Option<KvDevicePlan>> {
        Ok(match &self.source(src_rank)?.work {
            Work::Kv(kv) => kv.device_plan(),
            Work::Boxes(_) => None,
        })
    }

    /// Figures per source, in source order (walks the lists; not free).
    pub fn stats(&self) -> Vec<SourceStats> {
        self.sources
            .iter()
            .map(|s| {
                let (descriptors, fragments) = match s.mode {
                    TransferMode::Direct => (s.count_direct(u64::MAX - 1), 0),
                    TransferMode::Staged => {
                        let mut g = Count { last: None, n: 0, limit: u64::MAX - 1 };
                        s.walk(Purpose::Gather, &mut g);
                        let mut sc = Count { last: None, n: 0, limit: u64::MAX - 1 };
                        if self.has_destination {
                            s.walk(Purpose::Scatter, &mut sc);
                        }
                        (1, g.n + sc.n)
                    }
                };
                SourceStats {
                    src_rank: s.src_rank,
                    mode: s.mode,
                    descriptors,
                    fragments,
                    bytes: s.packed_bytes,
                }
            })
            .collect()
    }

    /// Check that the program writes every destination byte of the moved cells exactly once
    /// (direct pairs or scatter lists, per each source's mode), that nothing else is written,
    /// and that each staged source's gather and scatter lists tile its packed region exactly
    /// once. Names the first gap or overlap.
    pub fn verify(&self) -> DisaggResult<()> {
        self.need_destination("verify")?;
        let mut written: Vec<[u64; 2]> = Vec::new();
        for s in &self.sources {
            match s.mode {
                TransferMode::Direct => {
                    written.extend(
                        s.collect::<false>(Purpose::Direct).iter().map(|f| [f[1], f[1] + f[2]]),
                    );
                }
                TransferMode::Staged => {
                    let gather = s.collect::<false>(Purpose::Gather);
                    let scatter = s.collect::<false>(Purpose::Scatter);
                    for (what, list) in [
                        ("gather", gather.iter().map(|f| [f[1], f[1] + f[2]]).collect::<Vec<_>>()),
                        ("scatter", scatter.iter().map(|f| [f[0], f[0] + f[2]]).collect()),
                    ] {
                        let tiled =
                            disjoint_union(list, &format!("source {} {what} packed", s.src_rank))?;
                        if tiled != [[0, s.packed_bytes]]
                            && !(s.packed_bytes == 0 && tiled.is_empty())
                        {
                            return Err(DisaggError::Coverage {
                                detail: format!(
                                    "source {} {what} list covers {tiled:?} of its packed region [0, {})",
                                    s.src_rank, s.packed_bytes
                                ),
                            });
                        }
                    }
                    written.extend(scatter.iter().map(|f| [f[1], f[1] + f[2]]));
                }
            }
        }
        let got = disjoint_union(written, &format!("destination rank {}", self.dst_rank))?;
        let want = disjoint_union(self.expected.cells(), "expected destination")?;
        if got != want {
            let k = got
                .iter()
                .zip(&want)
                .position(|(g, w)| g != w)
                .unwrap_or(got.len().min(want.len()));
            return Err(DisaggError::Coverage {
                detail: format!(
                    "destination rank {} byte ranges differ from the moved cells at range {k}: \
                     written {:?}, expected {:?}",
                    self.dst_rank,
                    got.get(k),
                    want.get(k)
                ),
            });
        }
        Ok(())
    }
}

fn too_small(field: &str, have: usize, need: u64) -> DisaggError {
    DisaggError::layout(field, format!("{field} has {have} rows but the list needs {need}"))
}

/// A fill that stopped at the end of the buffer names the size it needed.
fn finish_into(
    written: usize,
    paired: usize,
    cap: usize,
    need: impl FnOnce() -> DisaggResult<u64>,
) -> DisaggResult<usize> {
    if written == cap || paired != written {
        let n = need()?;
        if n > cap as u64 {
            return Err(too_small("out", cap, n));
        }
    }
    Ok(paired)
}

/// Sort half-open byte ranges, reject any overlap, and merge touching ones.
fn disjoint_union(mut v: Vec<[u64; 2]>, what: &str) -> DisaggResult<Vec<[u64; 2]>> {
    v.sort_unstable();
    let mut out: Vec<[u64; 2]> = Vec::with_capacity(v.len());
    for r in v {
        if r[0] == r[1] {
            continue;
        }
        match out.last_mut() {
            Some(last) if r[0] < last[1] => {
                return Err(DisaggError::Coverage {
                    detail: format!(
                        "{what}: bytes [{:#x}, {:#x}) written more than once",
                        r[0],
                        r[1].min(last[1])
                    ),
                });
            }
            Some(last) if r[0] == last[1] => last[1] = r[1],
            _ => out.push(r),
        }
    }
    Ok(out)
}

fn geometry_eq<T: PartialEq + std::fmt::Debug>(
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

fn check_kv_geometry(l: &KvShardLayout, g: &KvGeometry, side: &str) -> DisaggResult<()> {
    let s = g.spec();
    let who = format!("{side} rank {} geometry vs layout", l.global_rank);
    geometry_eq("num_layers", &s.num_layers, &l.layers.len(), &who)?;
    geometry_eq("num_heads", &s.num_heads, &l.heads.len(), &who)
}

fn check_same_kv(a: &KvGeometry, b: &KvGeometry, who: &str) -> DisaggResult<()> {
    let (x, y) = (a.spec(), b.spec());
    geometry_eq("head_dim", &x.head_dim, &y.head_dim, who)?;
    geometry_eq("element_size", &x.element_size, &y.element_size, who)?;
    geometry_eq("num_kv", &x.num_kv, &y.num_kv, who)?;
    if let (Some(p), Some(q)) = (&x.dtype, &y.dtype) {
        geometry_eq("dtype", p, q, who)?;
    }
    Ok(())
}

/// Block list for `[0, num_tokens)`: right length, every id `< num_blocks`.
fn check_blocks(
    field: &str,
    who: &str,
    ids: &[u32],
    num_tokens: u64,
    g: &KvGeometry,
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
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= s.num_blocks) {
        return Err(DisaggError::block(
            field,
            format!("{who}: {field}[{i}]={id} must be < num_blocks={}", s.num_blocks),
        ));
    }
    Ok(())
}

fn reject_duplicates(field: &str, ids: &[u32]) -> DisaggResult<()> {
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

fn overflow(what: &str) -> DisaggError {
    DisaggError::overflow(format!("{what} exceeds u64"))
}

fn choose_mode(choice: ModeChoice, cost: &CostModel, s: &SourceProgram) -> TransferMode {
    match choice {
        ModeChoice::Direct => TransferMode::Direct,
        ModeChoice::Staged => TransferMode::Staged,
        ModeChoice::Auto => {
            let limit = cost.max_direct_descriptors(s.packed_bytes);
            if s.count_direct(limit) <= limit {
                TransferMode::Direct
            } else {
                TransferMode::Staged
            }
        }
    }
}

fn check_mode_needs(choice: ModeChoice, has_destination: bool) -> DisaggResult<()> {
    if !has_destination && choice != ModeChoice::Staged {
        return Err(DisaggError::block(
            "dst_block_ids",
            "mode='direct' and mode='auto' need the destination blocks and geometry; without \
             them only mode='staged' (gather side) compiles",
        ));
    }
    Ok(())
}

// Validation is one checklist read top to bottom; splitting it would scatter the order in
// which errors are reported.
#[allow(clippy::too_many_lines)]
/// Compile the KV transfer of one destination rank. Validates everything (layouts against
/// geometries, `head_dim`, element size, dtype, block list lengths and ranges, duplicate
/// destination blocks, address overflow) before building anything.
pub fn compile_kv_transfer(req: &KvTransferRequest) -> DisaggResult<TransferProgram> {
    let dst_l = &req.dst_layout;
    let dst_g = req.dst_geometry.as_ref();
    let has_destination = dst_g.is_some() && req.dst_block_ids.is_some();
    check_mode_needs(req.mode, has_destination)?;
    for (l, g) in &req.srcs {
        check_kv_geometry(l, g, "source")?;
        if let Some(d) = dst_g {
            check_same_kv(
                g,
                d,
                &format!("source rank {} vs destination rank {}", l.global_rank, dst_l.global_rank),
            )?;
        }
    }
    if let Some(d) = dst_g {
        check_kv_geometry(dst_l, d, "destination")?;
    }
    if let Some((first, rest)) = req.srcs.split_first() {
        for (l, g) in rest {
            check_same_kv(
                &first.1,
                g,
                &format!("source rank {} vs source rank {}", first.0.global_rank, l.global_rank),
            )?;
        }
    }
    if req.token_start > req.num_tokens {
        return Err(DisaggError::block(
            "token_start",
            format!("token_start={} must be <= num_tokens={}", req.token_start, req.num_tokens),
        ));
    }
    let layouts: Vec<KvShardLayout> = req.srcs.iter().map(|(l, _)| *l).collect();
    let plan = plan_kv_reshard(&layouts, std::slice::from_ref(dst_l))?;
    if let (Some(ids), Some(g)) = (&req.dst_block_ids, dst_g) {
        check_blocks(
            "dst_block_ids",
            &format!("destination rank {}", dst_l.global_rank),
            ids,
            req.num_tokens,
            g,
        )?;
        reject_duplicates("dst_block_ids", ids)?;
    }
    let n_tok = req.num_tokens - req.token_start;
    let mut by_src: BTreeMap<u32, Vec<KvPlaneSet>> = BTreeMap::new();
    for t in &plan.transfers {
        let (_, g) =
            req.srcs.iter().find(|(l, _)| l.global_rank == t.src_rank).ok_or_else(|| {
                DisaggError::layout(
                    "srcs",
                    format!("plan names source rank {} not in srcs", t.src_rank),
                )
            })?;
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
        let Some((_, g)) = req.srcs.iter().find(|(l, _)| l.global_rank == src_rank) else {
            continue;
        };
        let ids = req.src_block_ids.for_rank(src_rank, "src_block_ids")?;
        check_blocks("src_block_ids", &format!("source rank {src_rank}"), ids, req.num_tokens, g)?;
        let src_side = Some((u64::from(g.spec().tokens_per_block), ids));
        let dst_side = match (dst_g, &req.dst_block_ids) {
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
                segments(req.token_start, req.num_tokens, src_side, dst_side)
            } else {
                Vec::new()
            },
            seg_src: segments(req.token_start, req.num_tokens, src_side, None),
            seg_dst: if dst_side.is_some() {
                segments(req.token_start, req.num_tokens, None, dst_side)
            } else {
                Vec::new()
            },
            token_start: req.token_start,
            num_tokens: req.num_tokens,
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
    let expected = match (dst_g, &req.dst_block_ids) {
        (Some(d), Some(ids)) => Expected::Kv {
            geometry: d.clone(),
            block_ids: ids.clone(),
            lo: req.token_start,
            hi: req.num_tokens,
        },
        _ => Expected::None,
    };
    Ok(TransferProgram {
        dst_rank: dst_l.global_rank,
        dst_device: dst_g.map_or(0, |d| d.spec().device_id),
        sources,
        has_destination,
        expected,
    })
}

/// Every destination head row of the moved tokens, computed cell by cell (independently of
/// the compiler's segments and merging) for `verify`.
fn expected_kv_cells(d: &KvGeometry, ids: &[u32], lo: u64, hi: u64) -> Vec<[u64; 2]> {
    let s = d.spec();
    let row = d.row_bytes();
    let tpb = u64::from(s.tokens_per_block);
    let mut out = Vec::new();
    for kv in 0..s.num_kv {
        for l in 0..s.num_layers {
            let base = d.plane_base(kv, l);
            for t in lo..hi {
                let blk = u64::from(ids[(t / tpb) as usize]);
                let tok = base + blk * s.block_stride + (t % tpb) * s.token_stride;
                for h in 0..u64::from(s.num_heads) {
                    let a = tok + h * s.head_stride;
                    out.push([a, a + row]);
                }
            }
        }
    }
    out
}

/// Canonical packed order of SSM boxes: (recurrent?, source-local layer, band, first unit).
type SsmPackKey = (u8, usize, SsmBand, u32);

fn ssm_part_name(band: SsmBand) -> SsmStateKind {
    if band.is_conv() {
        SsmStateKind::Conv
    } else {
        SsmStateKind::Recurrent
    }
}

fn check_ssm_geometry(l: &SsmShardLayout, g: &SsmGeometry, side: &str) -> DisaggResult<()> {
    let who = format!("{side} rank {} geometry vs layout", l.global_rank);
    geometry_eq("num_layers", &(g.num_layers() as u64), &u64::from(l.layers.len()), &who)?;
    if let Some(c) = &g.conv {
        geometry_eq("conv.num_units", &c.num_units, &l.local_conv_channels(), &who)?;
    }
    if let Some(r) = &g.recurrent {
        geometry_eq("recurrent.num_units", &r.num_units, &l.heads.len(), &who)?;
    }
    Ok(())
}

fn check_slot(field: &str, slot: u32, g: &SsmGeometry) -> DisaggResult<()> {
    if slot >= g.num_slots() {
        return Err(DisaggError::block(
            field,
            format!("{field}={slot} must be < num_slots={}", g.num_slots()),
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_lines)]
/// Compile the SSM state transfer (conv bands x, B, C and the recurrent state) of one
/// destination rank for one slot. Validated like [`compile_kv_transfer`].
pub fn compile_ssm_transfer(req: &SsmTransferRequest) -> DisaggResult<TransferProgram> {
    let dst_l = &req.dst_layout;
    let dst_g = req.dst_geometry.as_ref();
    let has_destination = dst_g.is_some() && req.dst_slot.is_some();
    check_mode_needs(req.mode, has_destination)?;
    for (l, g) in &req.srcs {
        check_ssm_geometry(l, g, "source")?;
    }
    if let (Some(d), Some(slot)) = (dst_g, req.dst_slot) {
        check_ssm_geometry(dst_l, d, "destination")?;
        check_slot("dst_slot", slot, d)?;
    }
    let layouts: Vec<SsmShardLayout> = req.srcs.iter().map(|(l, _)| *l).collect();
    let plan = plan_ssm_reshard(&layouts, std::slice::from_ref(dst_l))?;
    // The parts moved are those the destination geometry registers (or, without one, the
    // first source's): a backend buffer may hold only the conv or only the recurrent state.
    let reference = dst_g.or(req.srcs.first().map(|(_, g)| g));
    let moved = |kind: SsmStateKind| reference.is_some_and(|g| g.part(kind).is_some());
    // Boxes per source with their canonical packed-order key: conv before recurrent, then
    // source-local layer, then band (x, B, C) and channel, so the [x | B | C] pieces of one
    // layer sit next to each other on both sides and merge.
    let mut by_src: BTreeMap<u32, Vec<(SsmPackKey, CopyBox)>> = BTreeMap::new();
    for t in plan.transfers.iter().filter(|t| moved(ssm_part_name(t.band))) {
        let (_, g) =
            req.srcs.iter().find(|(l, _)| l.global_rank == t.src_rank).ok_or_else(|| {
                DisaggError::layout(
                    "srcs",
                    format!("plan names source rank {} not in srcs", t.src_rank),
                )
            })?;
        let kind = ssm_part_name(t.band);
        let part_of = |geo: &SsmGeometry, side: &str| {
            geo.part(kind).cloned().ok_or_else(|| {
                DisaggError::geometry(
                    kind.name(),
                    format!(
                        "{side} geometry has no {} part but the plan moves band {}",
                        kind.name(),
                        t.band.name()
                    ),
                )
            })
        };
        let sp = part_of(g, "source")?;
        let dp = dst_g.map(|d| part_of(d, "destination")).transpose()?;
        if let Some(dp) = &dp {
            let who = format!(
                "{} part, source rank {} vs destination rank {}",
                kind.name(),
                t.src_rank,
                dst_l.global_rank
            );
            geometry_eq("unit_bytes", &sp.unit_bytes, &dp.unit_bytes, &who)?;
            geometry_eq("element_size", &sp.element_size, &dp.element_size, &who)?;
            if let (Some(a), Some(b)) = (&sp.dtype, &dp.dtype) {
                geometry_eq("dtype", a, b, &who)?;
            }
        }
        let src_slot = match &req.src_slots {
            SrcSlots::Shared(s) => *s,
            SrcSlots::PerRank(m) => *m.get(&t.src_rank).ok_or_else(|| {
                DisaggError::block(
                    "src_slot",
                    format!("no slot for source global_rank={}", t.src_rank),
                )
            })?,
        };
        check_slot("src_slot", src_slot, g)?;
        let boxes = by_src.entry(t.src_rank).or_default();
        let units = u64::from(t.src_local.len());
        for l in 0..t.layers.len() {
            let sl = (t.src_local_layers().lo + l) as usize;
            let dl = (t.dst_local_layers().lo + l) as usize;
            let src_addr = sp.layer_bases[sl]
                + u64::from(src_slot) * sp.slot_stride
                + u64::from(t.src_local.lo) * sp.unit_stride;
            let dst_addr = match (&dp, req.dst_slot) {
                (Some(dp), Some(slot)) => {
                    dp.layer_bases[dl]
                        + u64::from(slot) * dp.slot_stride
                        + u64::from(t.dst_local.lo) * dp.unit_stride
                }
                _ => 0,
            };
            let dst_stride = dp.as_ref().map_or(0, |d| d.unit_stride);
            let key = (u8::from(kind == SsmStateKind::Recurrent), sl, t.band, t.src_local.lo);
            boxes.push((
                key,
                CopyBox {
                    base: [src_addr, dst_addr, 0],
                    row: sp.unit_bytes,
                    dims: [[units, sp.unit_stride, dst_stride, sp.unit_bytes], [1, 0, 0, 0]],
                },
            ));
        }
    }
    let mut sources = Vec::with_capacity(by_src.len());
    for (src_rank, mut keyed) in by_src {
        keyed.sort_by_key(|(k, _)| *k);
        let mut packed_bytes = 0u64;
        let mut boxes = Vec::with_capacity(keyed.len());
        for (_, mut b) in keyed {
            b.base[PACKED] = packed_bytes;
            let size = b.dims[0][0].checked_mul(b.row).ok_or_else(|| overflow("packed size"))?;
            packed_bytes =
                packed_bytes.checked_add(size).ok_or_else(|| overflow("packed offset"))?;
            boxes.push(b);
        }
        let Some((_, g)) = req.srcs.iter().find(|(l, _)| l.global_rank == src_rank) else {
            continue;
        };
        let mut sp = SourceProgram {
            src_rank,
            src_device: g.device_id,
            mode: TransferMode::Staged,
            packed_bytes,
            work: Work::Boxes(boxes),
        };
        sp.mode = choose_mode(req.mode, &req.cost, &sp);
        sources.push(sp);
    }
    let expected = match (dst_g, req.dst_slot) {
        (Some(d), Some(slot)) => Expected::Ssm { geometry: d.clone(), layout: *dst_l, slot },
        _ => Expected::None,
    };
    Ok(TransferProgram {
        dst_rank: dst_l.global_rank,
        dst_device: dst_g.map_or(0, |d| d.device_id),
        sources,
        has_destination,
        expected,
    })
}

/// Every unit of the destination slot in every local layer, for the parts the plan moves.
fn expected_ssm_cells(d: &SsmGeometry, l: &SsmShardLayout, slot: u32) -> Vec<[u64; 2]> {
    let mut out = Vec::new();
    for (part, units) in [(&d.conv, l.local_conv_channels()), (&d.recurrent, l.heads.len())] {
        if let Some(p) = part {
            for base in &p.layer_bases {
                for u in 0..u64::from(units) {
                    let a = base + u64::from(slot) * p.slot_stride + u * p.unit_stride;
                    out.push([a, a + p.unit_bytes]);
                }
            }
        }
    }
    out
}
