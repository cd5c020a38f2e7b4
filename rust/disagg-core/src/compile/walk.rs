//! Strided copy boxes and the walk that expands them into fragments.

use crate::geometry::KvGeometry;

use super::sink::{Collect, FragmentSink};

/// One strided copy: `row` contiguous bytes at `base`, repeated over two outer dims, each
/// `[count, src stride, dst stride, packed stride]`. Index 0/1/2 of `base` and of the strides
/// is the source / destination / packed address space.
#[derive(Debug, Clone, Copy)]
pub(super) struct CopyBox {
    pub(super) base: [u64; 3],
    pub(super) row: u64,
    pub(super) dims: [[u64; 4]; 2],
}

pub(super) const SRC: usize = 0;
pub(super) const DST: usize = 1;
pub(super) const PACKED: usize = 2;

/// A run of `n` token positions from `t_lo` inside one block of each side that matters:
/// `at[SRC]` and `at[DST]` are that side's block id and the first token's offset in it
/// (`(0, 0)` for a side not given).
#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub(super) t_lo: u64,
    pub(super) n: u64,
    pub(super) at: [(u64, u64); 2],
}

impl Segment {
    /// Byte offset of the first token inside one plane of each side (`[SRC, DST, PACKED]`),
    /// from the sides' block and token strides; the packed copy starts at `token_start`.
    fn plane_offsets(
        &self,
        block_stride: [u64; 2],
        token_stride: [u64; 3],
        token_start: u64,
    ) -> [u64; 3] {
        let side = |i: usize| self.at[i].0 * block_stride[i] + self.at[i].1 * token_stride[i];
        [side(SRC), side(DST), (self.t_lo - token_start) * token_stride[PACKED]]
    }
}

/// Cut `[lo, hi)` at every block boundary of the sides given.
pub(super) fn segments(
    lo: u64,
    hi: u64,
    src: Option<(u64, &[u32])>,
    dst: Option<(u64, &[u32])>,
) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut t = lo;
    while t < hi {
        let mut end = hi;
        let mut at = [(0, 0); 2];
        for (side, given) in [(SRC, src), (DST, dst)] {
            if let Some((tpb, ids)) = given {
                end = end.min((t / tpb + 1) * tpb);
                at[side] = (u64::from(ids[(t / tpb) as usize]), t % tpb);
            }
        }
        out.push(Segment { t_lo: t, n: end - t, at });
        t = end;
    }
    out
}

/// One KV reshard transfer in local coordinates, with its packed region.
#[derive(Debug, Clone, Copy)]
pub(super) struct KvPlaneSet {
    pub(super) src_l0: u32,
    pub(super) dst_l0: u32,
    pub(super) num_layers: u32,
    pub(super) src_h0: u64,
    pub(super) dst_h0: u64,
    pub(super) num_heads: u64,
    pub(super) packed_off: u64,
}

#[derive(Debug, Clone)]
pub(super) struct KvWork {
    pub(super) src: KvGeometry,
    pub(super) dst: Option<KvGeometry>,
    pub(super) sets: Vec<KvPlaneSet>,
    pub(super) seg_direct: Vec<Segment>,
    pub(super) seg_src: Vec<Segment>,
    pub(super) seg_dst: Vec<Segment>,
    pub(super) token_start: u64,
    pub(super) num_tokens: u64,
}

#[derive(Debug, Clone)]
pub(super) enum Work {
    Kv(Box<KvWork>),
    Boxes(Vec<CopyBox>),
}

/// Which list a walk over the boxes produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    Direct,
    Gather,
    Scatter,
}

impl Purpose {
    /// The (a, b) address spaces of the produced pairs.
    pub(super) fn sides(self) -> (usize, usize) {
        match self {
            Self::Direct => (SRC, DST),
            Self::Gather => (SRC, PACKED),
            Self::Scatter => (PACKED, DST),
        }
    }
}

impl KvWork {
    /// Walk every (transfer, kv, layer, segment) box of `purpose` into `sink`.
    pub(super) fn walk(&self, purpose: Purpose, sink: &mut impl FragmentSink) {
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
        let bs = [s.block_stride, d_bs];
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
                    let off = seg.plane_offsets(bs, ts, self.token_start);
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
                        let off = seg.plane_offsets(bs, ts, self.token_start);
                        let base = [sp + off[SRC], dp + off[DST], pp + off[PACKED]];
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

/// Emit one box as fragments: first fold every outer dim whose strides equal the current row
/// on both sides into the row (they are contiguous), then walk what is left.
#[inline]
pub(super) fn emit_box(
    bx: &CopyBox,
    (ia, ib): (usize, usize),
    sink: &mut impl FragmentSink,
) -> bool {
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
