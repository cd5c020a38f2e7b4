//! Property tests of the descriptor compiler on simulated memory: every source rank and the
//! destination live in two byte vectors; programs are applied byte for byte.
//!
//! - merged direct descriptors never overlap on the destination and cover exactly the plan's
//!   bytes;
//! - direct and staged programs produce the same destination bytes, equal to a cell-by-cell
//!   oracle, and leave every other byte untouched.

// Test helpers outside `#[test]` functions: a failed unwrap is a failed test here.
#![allow(clippy::unwrap_used, clippy::many_single_char_names)]

use disagg_core::{
    compile_kv_transfer, CostModel, DisaggError, KvGeometry, KvGeometrySpec, KvShardLayout,
    KvTokens, KvTransferRequest, ModeChoice, SrcBlockIds, TransferProgram,
};
use proptest::prelude::*;

const ELEM: u64 = 4;
const SENTINEL: u8 = 0xEE;

/// Unique 4-byte content of global cell `(kv, layer, token, head, dim)`.
fn content(kv: u64, layer: u64, token: u64, head: u64, dim: u64) -> [u8; 4] {
    let id = (((kv * 64 + layer) * 64 + token) * 16 + head) * 8 + dim + 1;
    u32::try_from(id).unwrap().to_le_bytes()
}

#[derive(Debug, Clone)]
struct Case {
    layers: u32,
    heads: u32,
    src_tp: u32,
    src_pp: u32,
    dst_tp: u32,
    dst_pp: u32,
    src_tpb: u32,
    dst_tpb: u32,
    num_tokens: u64,
    token_start: u64,
    head_dim: u32,
    src_hnd: bool,
    dst_hnd: bool,
    src_ids: Vec<u32>,
    dst_ids: Vec<u32>,
}

fn layouts(tp: u32, pp: u32, layers: u32, heads: u32, rank0: u32) -> Vec<KvShardLayout> {
    KvShardLayout::engine(layers, heads, tp, pp, rank0).unwrap()
}

/// A Megatron-style geometry (NHD or HND inside a block) at `base`; returns it and its size.
fn geometry(
    l: &KvShardLayout,
    blocks: u32,
    tpb: u32,
    d: u32,
    hnd: bool,
    base: u64,
) -> (KvGeometry, u64) {
    let (h, t, row) = (u64::from(l.heads.len()), u64::from(tpb), u64::from(d) * ELEM);
    let block = h * t * row;
    let plane = u64::from(blocks) * block;
    let (token_stride, head_stride) = if hnd { (row, t * row) } else { (h * row, row) };
    let n_planes = 2 * u64::from(l.layers.len());
    let spec = KvGeometrySpec {
        num_kv: 2,
        num_layers: l.layers.len(),
        num_blocks: blocks,
        tokens_per_block: tpb,
        num_heads: l.heads.len(),
        head_dim: d,
        element_size: ELEM as u32,
        block_stride: block,
        token_stride,
        head_stride,
        plane_bases: (0..n_planes).map(|i| base + i * plane).collect(),
        device_id: 0,
        dtype: None,
    };
    (KvGeometry::new(spec).unwrap(), n_planes * plane)
}

/// Write global cells of token positions `[lo, hi)` into `mem` the way `g` lays them out.
fn write_cells(mem: &mut [u8], l: &KvShardLayout, g: &KvGeometry, ids: &[u32], lo: u64, hi: u64) {
    let s = g.spec();
    for kv in 0..2u32 {
        for layer in 0..s.num_layers {
            for t in lo..hi {
                let tpb = u64::from(s.tokens_per_block);
                let blk = u64::from(ids[(t / tpb) as usize]);
                for h in 0..u64::from(s.num_heads) {
                    let row = g.plane_base(kv, layer)
                        + blk * s.block_stride
                        + (t % tpb) * s.token_stride
                        + h * s.head_stride;
                    for dim in 0..u64::from(s.head_dim) {
                        let a = (row + dim * ELEM) as usize;
                        mem[a..a + 4].copy_from_slice(&content(
                            u64::from(kv),
                            u64::from(l.layers.lo + layer),
                            t,
                            u64::from(l.heads.lo) + h,
                            dim,
                        ));
                    }
                }
            }
        }
    }
}

fn tp_for(heads: u32) -> impl Strategy<Value = u32> {
    prop::sample::select(
        [1u32, 2, 4, 8]
            .into_iter()
            .filter(|tp| heads.is_multiple_of(*tp) || tp.is_multiple_of(heads))
            .collect::<Vec<_>>(),
    )
}

fn ids(n: u64, contiguous: bool) -> impl Strategy<Value = Vec<u32>> {
    let n = n as usize;
    let pool: Vec<u32> = (0..(n as u32 + 3)).collect();
    (Just(pool).prop_shuffle(), 0u32..3).prop_map(move |(p, start)| {
        if contiguous {
            (start..start + n as u32).collect()
        } else {
            p[..n].to_vec()
        }
    })
}

fn cases() -> impl Strategy<Value = Case> {
    (prop::sample::select(vec![2u32, 4]), prop::sample::select(vec![1u32, 2, 4]), 1u64..20)
        .prop_flat_map(|(layers, heads, n)| {
            (
                (tp_for(heads), 1u32..=2, tp_for(heads), 1u32..=2),
                (
                    prop::sample::select(vec![1u32, 2, 4, 8]),
                    prop::sample::select(vec![1u32, 2, 4, 8]),
                ),
                (0..=n, 1u32..=3, any::<bool>(), any::<bool>(), any::<bool>()),
                Just((layers, heads, n)),
            )
        })
        .prop_flat_map(
            |(
                (stp, spp, dtp, dpp),
                (stpb, dtpb),
                (start, d, shnd, dhnd, contig),
                (layers, heads, n),
            )| {
                let ns = n.div_ceil(u64::from(stpb));
                let nd = n.div_ceil(u64::from(dtpb));
                (ids(ns, contig), ids(nd, contig)).prop_map(move |(src_ids, dst_ids)| Case {
                    layers,
                    heads,
                    src_tp: stp,
                    src_pp: spp,
                    dst_tp: dtp,
                    dst_pp: dpp,
                    src_tpb: stpb,
                    dst_tpb: dtpb,
                    num_tokens: n,
                    token_start: start,
                    head_dim: d,
                    src_hnd: shnd,
                    dst_hnd: dhnd,
                    src_ids: src_ids.clone(),
                    dst_ids,
                })
            },
        )
}

fn apply(mode: ModeChoice, c: &Case) -> Result<(), TestCaseError> {
    let src_ls = layouts(c.src_tp, c.src_pp, c.layers, c.heads, 0);
    let dst_ls = layouts(c.dst_tp, c.dst_pp, c.layers, c.heads, 100);
    let src_blocks = c.src_ids.iter().max().unwrap() + 1;
    let dst_blocks = c.dst_ids.iter().max().unwrap() + 1;
    let mut src_mem = Vec::new();
    let mut srcs = Vec::new();
    for l in &src_ls {
        let (g, size) =
            geometry(l, src_blocks, c.src_tpb, c.head_dim, c.src_hnd, src_mem.len() as u64);
        src_mem.resize(src_mem.len() + size as usize, 0);
        write_cells(&mut src_mem, l, &g, &c.src_ids, 0, c.num_tokens);
        srcs.push((*l, g));
    }
    for dl in &dst_ls {
        let (dg, size) = geometry(dl, dst_blocks, c.dst_tpb, c.head_dim, c.dst_hnd, 0);
        let mut want = vec![SENTINEL; size as usize];
        write_cells(&mut want, dl, &dg, &c.dst_ids, c.token_start, c.num_tokens);
        let req = KvTransferRequest {
            srcs: srcs.clone(),
            dst_layout: *dl,
            dst_geometry: Some(dg),
            moved: KvTokens {
                src_block_ids: SrcBlockIds::Shared(c.src_ids.clone()),
                dst_block_ids: Some(c.dst_ids.clone()),
                num_tokens: c.num_tokens,
                token_start: c.token_start,
            },
            mode,
            cost: CostModel::default(),
        };
        let p = compile_kv_transfer(&req).unwrap();
        p.verify().unwrap();
        let mut got = vec![SENTINEL; size as usize];
        let mut written: Vec<(u64, u64)> = Vec::new();
        for sp in &p.sources {
            if mode == ModeChoice::Direct {
                let (s, d) = p.descriptors(sp.src_rank, 0, 0).unwrap();
                for (a, b) in s.iter().zip(&d) {
                    prop_assert_eq!(a[1], b[1]);
                    let (sa, da, n) = (a[0] as usize, b[0] as usize, a[1] as usize);
                    got[da..da + n].copy_from_slice(&src_mem[sa..sa + n]);
                    written.push((b[0], b[0] + b[1]));
                }
            } else {
                let mut packed = vec![0u8; sp.packed_bytes as usize];
                for [sa, n, off] in p.gather(sp.src_rank).unwrap() {
                    let (sa, n, off) = (sa as usize, n as usize, off as usize);
                    packed[off..off + n].copy_from_slice(&src_mem[sa..sa + n]);
                }
                for [off, da, n] in p.scatter(sp.src_rank).unwrap() {
                    let (off, da, n) = (off as usize, da as usize, n as usize);
                    got[da..da + n].copy_from_slice(&packed[off..off + n]);
                    written.push((da as u64, (da + n) as u64));
                }
            }
        }
        written.sort_unstable();
        for w in written.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "overlapping destination writes {:?}", w);
        }
        let total: u64 = written.iter().map(|(lo, hi)| hi - lo).sum();
        let n_tok = c.num_tokens - c.token_start;
        let cells = 2 * u64::from(dl.layers.len()) * u64::from(dl.heads.len()) * n_tok;
        prop_assert_eq!(total, cells * u64::from(c.head_dim) * ELEM);
        prop_assert!(got == want, "destination bytes differ from the oracle ({:?})", mode);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn direct_descriptors_are_disjoint_and_cover_exactly_the_plan(c in cases()) {
        apply(ModeChoice::Direct, &c)?;
    }

    #[test]
    fn staged_programs_write_the_same_bytes_as_direct_ones(c in cases()) {
        apply(ModeChoice::Staged, &c)?;
        apply(ModeChoice::Direct, &c)?;
    }
}

fn request(dst_ids: Option<Vec<u32>>, mode: ModeChoice, dst_hnd: bool) -> KvTransferRequest {
    let src = layouts(2, 1, 2, 4, 0);
    let dst = layouts(1, 1, 2, 4, 10)[0];
    let srcs = src
        .iter()
        .enumerate()
        .map(|(i, l)| (*l, geometry(l, 8, 4, 2, false, (i as u64 + 1) << 20).0))
        .collect();
    KvTransferRequest {
        srcs,
        dst_layout: dst,
        dst_geometry: Some(geometry(&dst, 8, 16, 2, dst_hnd, 1 << 30).0),
        moved: KvTokens {
            src_block_ids: SrcBlockIds::Shared(vec![3, 1, 6, 0, 2]),
            dst_block_ids: dst_ids,
            num_tokens: 18,
            token_start: 0,
        },
        mode,
        cost: CostModel::default(),
    }
}

#[test]
fn packed_offsets_do_not_depend_on_destination_blocks_or_geometry() {
    let prefill = compile_kv_transfer(&request(None, ModeChoice::Staged, false)).unwrap();
    for (ids, hnd) in [(vec![5, 2], false), (vec![0, 7], true)] {
        let decode = compile_kv_transfer(&request(Some(ids), ModeChoice::Staged, hnd)).unwrap();
        for s in &decode.sources {
            assert_eq!(prefill.gather(s.src_rank).unwrap(), decode.gather(s.src_rank).unwrap());
            assert_eq!(prefill.source(s.src_rank).unwrap().packed_bytes, s.packed_bytes);
        }
        decode.verify().unwrap();
    }
}

#[test]
fn duplicate_destination_blocks_and_missing_destinations_are_block_errors() {
    let e = compile_kv_transfer(&request(Some(vec![4, 4]), ModeChoice::Direct, false)).unwrap_err();
    assert_eq!(e.kind(), "Block");
    assert!(e.to_string().contains("same block"), "{e}");
    let e = compile_kv_transfer(&request(None, ModeChoice::Auto, false)).unwrap_err();
    assert!(e.to_string().contains("dst_block_ids"), "{e}");
    let p = compile_kv_transfer(&request(None, ModeChoice::Staged, false)).unwrap();
    assert_eq!(p.scatter(0).unwrap_err().kind(), "Block");
}

#[test]
fn packed_lists_pick_gather_or_scatter_and_the_display_names_each_source() {
    let p = compile_kv_transfer(&request(Some(vec![5, 2]), ModeChoice::Staged, false)).unwrap();
    assert_eq!(p.src_ranks(), vec![0, 1]);
    for s in &p.sources {
        let r = s.src_rank;
        assert_eq!(p.packed(r, false).unwrap(), p.gather(r).unwrap());
        assert_eq!(p.packed(r, true).unwrap(), p.scatter(r).unwrap());
        assert_eq!(p.packed_runs(r, false).unwrap(), p.gather_runs(r).unwrap());
        assert_eq!(p.packed_runs(r, true).unwrap(), p.scatter_runs(r).unwrap());
        let mut out = vec![[0_u64; 3]; p.scatter(r).unwrap().len()];
        let n = p.packed_into(r, true, &mut out).unwrap();
        assert_eq!(out[..n], p.scatter(r).unwrap()[..]);
    }
    let b = p.source(0).unwrap().packed_bytes;
    let want =
        format!("TransferProgram(dst_rank=10, sources={{0: staged {b} B, 1: staged {b} B}})");
    assert_eq!(p.to_string(), want);
}

type Rows = Vec<[u64; 3]>;

/// `fill_direct` of source `r` of `p` with a fill that fails while `fail(call)` holds: the
/// rows it returns and the sizes it was asked for.
fn fill_direct_logged(
    p: &TransferProgram,
    r: u32,
    fail: impl Fn(usize) -> bool,
) -> (Result<(Rows, Rows), DisaggError>, Vec<usize>) {
    let mut sizes = Vec::new();
    let fill = |n: usize| {
        sizes.push(n);
        let n = if fail(sizes.len()) { 0 } else { n };
        let (mut a, mut b) = (vec![[0_u64; 3]; n], vec![[0_u64; 3]; n]);
        let m = p.direct_descriptors_into(r, &mut a, &mut b)?;
        a.truncate(m);
        b.truncate(m);
        Ok((a, b))
    };
    let got = p.fill_direct(r, |e| e, |count| count(), fill);
    (got, sizes)
}

#[test]
fn direct_fills_retry_once_at_the_exact_count_when_the_hint_fill_fails() {
    for hnd in [false, true] {
        let p = compile_kv_transfer(&request(Some(vec![5, 2]), ModeChoice::Direct, hnd)).unwrap();
        for s in &p.sources {
            let r = s.src_rank;
            let want = p.direct_descriptors(r).unwrap();
            let exact = usize::try_from(p.direct_row_count(r).unwrap()).unwrap();
            let hint = usize::try_from(p.direct_row_hint(r).unwrap()).unwrap();
            assert_eq!(want.0.len(), exact);
            // Filled at the hint, and again at the exact count only when the hint is short
            // (an HND destination splits each source row).
            let (got, sizes) = fill_direct_logged(&p, r, |_| false);
            let asked = if hint >= exact { vec![hint] } else { vec![hint, exact] };
            assert_eq!((got.unwrap(), sizes), (want.clone(), asked));
            assert!(hint < exact || !hnd, "an HND destination needs more rows than the hint");
            // A fill that fails for another reason is retried once too.
            let (got, sizes) = fill_direct_logged(&p, r, |call| call == 1);
            assert_eq!((got.unwrap(), sizes), (want, vec![hint, exact]));
            // A second failure is the caller's error.
            let (got, sizes) = fill_direct_logged(&p, r, |_| true);
            assert!(got.unwrap_err().to_string().contains("out has 0 rows"));
            assert_eq!(sizes.len(), 2);
        }
        let e = p.fill_direct(99, |e| e.kind(), |c| c(), |_| Ok::<_, &str>(())).unwrap_err();
        assert_eq!(e, "Block");
    }
}
