//! Property tests of the reshard planners over random valid layouts: TP 1..16 in either
//! direction, PP 1..4 with uneven windows, EP replicas, GQA replication, shuffled rank ids.

// Test code: a panic is how a failure is reported.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use disagg_core::{
    plan_kv_reshard, plan_ssm_reshard, KvLayoutSpec, KvShardLayout, RankCoords, SsmLayoutSpec,
    SsmShardLayout, SsmStateDims,
};
use proptest::prelude::*;

/// One engine's parallel shape.
#[derive(Debug, Clone)]
struct Side {
    tp: u32,
    pp: u32,
    ep: u32,
    /// Layers per PP stage (uneven windows), sums to the model's layer count.
    split: Vec<u32>,
    /// Global rank of each (ep, pp, tp) slot, a permutation (rank ids need not follow the grid).
    ranks: Vec<u32>,
}

fn split_strategy(layers: u32, pp: u32) -> impl Strategy<Value = Vec<u32>> {
    // Choose pp-1 distinct cut points in 1..layers.
    proptest::sample::subsequence((1..layers).collect::<Vec<_>>(), (pp - 1) as usize).prop_map(
        move |cuts| {
            let mut bounds = vec![0];
            bounds.extend(cuts);
            bounds.push(layers);
            bounds.windows(2).map(|w| w[1] - w[0]).collect()
        },
    )
}

fn side_strategy(layers: u32, units: u32, rank_base: u32) -> impl Strategy<Value = Side> {
    let tps: Vec<u32> = (1..=16).filter(|&t| units.is_multiple_of(t) || t % units == 0).collect();
    (proptest::sample::select(tps), 1..=4u32.min(layers), 1..=2u32)
        .prop_flat_map(move |(tp, pp, ep)| {
            let n = (tp * pp * ep) as usize;
            let ranks = Just((rank_base..rank_base + n as u32).collect::<Vec<_>>()).prop_shuffle();
            (Just(tp), Just(pp), Just(ep), split_strategy(layers, pp), ranks)
        })
        .prop_map(|(tp, pp, ep, split, ranks)| Side { tp, pp, ep, split, ranks })
}

/// One (ep, pp, tp) slot of a side, in rank-list order: its coordinates, global rank and
/// explicit layer window.
struct Slot {
    ep: u32,
    pp: u32,
    tp: u32,
    global_rank: u32,
    layer_start: u32,
    num_local_layers: u32,
}

impl Slot {
    /// The slot's coordinates on `side` (ETP replica 0).
    fn ranks(&self, side: &Side) -> RankCoords {
        RankCoords {
            ep_rank: self.ep,
            ..RankCoords::grid(side.tp, self.tp, side.pp, self.pp, self.global_rank)
        }
    }
}

fn slots(side: &Side) -> Vec<Slot> {
    let mut out = Vec::new();
    for ep in 0..side.ep {
        let mut start = 0;
        for pp in 0..side.pp {
            let len = side.split[pp as usize];
            for tp in 0..side.tp {
                let global_rank = side.ranks[out.len()];
                out.push(Slot {
                    ep,
                    pp,
                    tp,
                    global_rank,
                    layer_start: start,
                    num_local_layers: len,
                });
            }
            start += len;
        }
    }
    out
}

/// Source and destination layouts over one model: two sides drawn by `side` (the
/// destination's rank ids from 1000), each slot made a layout by `layout`.
fn two_sides<S: Strategy<Value = Side>, L: std::fmt::Debug>(
    side: impl Fn(u32) -> S,
    layout: impl Fn(&Side, &Slot) -> L,
) -> impl Strategy<Value = (Vec<L>, Vec<L>)> {
    let layouts = move |s: &Side| slots(s).iter().map(|slot| layout(s, slot)).collect::<Vec<_>>();
    (side(0), side(1000)).prop_map(move |(s, d)| (layouts(&s), layouts(&d)))
}

fn kv_case() -> impl Strategy<Value = (Vec<KvShardLayout>, Vec<KvShardLayout>)> {
    (4..=24u32, proptest::sample::select(vec![1u32, 2, 3, 4, 6, 8, 12, 16])).prop_flat_map(
        |(layers, heads)| {
            let layout = move |side: &Side, s: &Slot| {
                KvShardLayout::new(KvLayoutSpec {
                    num_layers: layers,
                    num_kv_heads: heads,
                    ranks: s.ranks(side),
                    ep_size: side.ep,
                    etp_size: 1,
                    layer_start: Some(s.layer_start),
                    num_local_layers: Some(s.num_local_layers),
                })
                .unwrap()
            };
            two_sides(move |base| side_strategy(layers, heads, base), layout)
        },
    )
}

fn ssm_side(layers: u32, heads: u32, groups: u32, base: u32) -> impl Strategy<Value = Side> {
    side_strategy(layers, heads, base).prop_filter("groups must split or replicate", move |s| {
        heads.is_multiple_of(s.tp) && (groups.is_multiple_of(s.tp) || s.tp % groups == 0)
    })
}

fn ssm_case() -> impl Strategy<Value = (Vec<SsmShardLayout>, Vec<SsmShardLayout>)> {
    (2..=12u32, proptest::sample::select(vec![2u32, 4, 8, 16]), 0..=2u32).prop_flat_map(
        |(layers, heads, g_exp)| {
            let groups = (1u32 << g_exp).min(heads);
            let dims = SsmStateDims::new(heads, 2, 3, groups, 4).unwrap();
            let layout = move |side: &Side, s: &Slot| {
                SsmShardLayout::new(SsmLayoutSpec {
                    num_layers: Some(layers),
                    dims,
                    ranks: s.ranks(side),
                    layer_start: Some(s.layer_start),
                    num_local_layers: Some(s.num_local_layers),
                    replicate_groups: true,
                })
                .unwrap()
            };
            two_sides(move |base| ssm_side(layers, heads, groups, base), layout)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn kv_plans_write_every_destination_cell_exactly_once((srcs, dsts) in kv_case()) {
        let plan = plan_kv_reshard(&srcs, &dsts).unwrap();
        plan.verify().unwrap();
    }

    #[test]
    fn kv_plans_do_not_depend_on_layout_list_order(
        (srcs, dsts) in kv_case(), seed in any::<u64>()
    ) {
        let plan = plan_kv_reshard(&srcs, &dsts).unwrap();
        let mut s2 = srcs.clone();
        let mut d2 = dsts.clone();
        // Deterministic rotation driven by the seed: a different list order, same layouts.
        s2.rotate_left((seed % srcs.len() as u64) as usize);
        d2.reverse();
        let again = plan_kv_reshard(&s2, &d2).unwrap();
        prop_assert_eq!(&plan.transfers, &again.transfers);
    }

    #[test]
    fn kv_plan_order_is_destination_then_layer_then_head((srcs, dsts) in kv_case()) {
        let plan = plan_kv_reshard(&srcs, &dsts).unwrap();
        let keys: Vec<_> = plan.transfers.iter().map(|t| (t.dst_rank, t.layers.lo, t.heads.lo)).collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        prop_assert_eq!(keys, sorted);
    }

    #[test]
    fn kv_src_and_dst_filters_partition_the_plan((srcs, dsts) in kv_case()) {
        let plan = plan_kv_reshard(&srcs, &dsts).unwrap();
        let mut by_src: Vec<_> = srcs.iter().flat_map(|l| plan.for_src(l.ranks.global_rank)).collect();
        let mut by_dst: Vec<_> = dsts.iter().flat_map(|l| plan.for_dst(l.ranks.global_rank)).collect();
        let mut all = plan.transfers.clone();
        let key = |t: &disagg_core::KvReshardTransfer| (t.dst_rank, t.layers.lo, t.heads.lo, t.src_rank);
        all.sort_by_key(key);
        by_src.sort_by_key(key);
        by_dst.sort_by_key(key);
        prop_assert_eq!(&by_src, &all);
        prop_assert_eq!(&by_dst, &all);
    }

    #[test]
    fn kv_cells_are_read_from_the_smallest_rank_holding_them((srcs, dsts) in kv_case()) {
        let plan = plan_kv_reshard(&srcs, &dsts).unwrap();
        for t in &plan.transfers {
            for s in srcs.iter().filter(|s| s.ranks.global_rank < t.src_rank) {
                let overlap = s.layers.intersect(t.layers).is_some() && s.heads.intersect(t.heads).is_some();
                prop_assert!(!overlap, "rank {} also holds part of {:?}", s.ranks.global_rank, t);
            }
        }
    }

    #[test]
    fn ssm_plans_cover_every_band_exactly_once((srcs, dsts) in ssm_case()) {
        let plan = plan_ssm_reshard(&srcs, &dsts).unwrap();
        plan.verify().unwrap();
    }

    #[test]
    fn ssm_plans_do_not_depend_on_layout_list_order((srcs, dsts) in ssm_case()) {
        let plan = plan_ssm_reshard(&srcs, &dsts).unwrap();
        let mut s2 = srcs.clone();
        s2.reverse();
        let mut d2 = dsts.clone();
        d2.reverse();
        prop_assert_eq!(&plan.transfers, &plan_ssm_reshard(&s2, &d2).unwrap().transfers);
    }
}
