use super::*;
use crate::{KvLayoutSpec, RankCoords, SsmLayoutSpec, SsmStateDims};
use proptest::prelude::*;

fn kv(tp: u32, pp: u32, tp_rank: u32, pp_rank: u32, global_rank: u32) -> KvShardLayout {
    KvShardLayout::new(KvLayoutSpec {
        num_layers: 8,
        num_kv_heads: 4,
        ranks: RankCoords::grid(tp, tp_rank, pp, pp_rank, global_rank),
        ..KvLayoutSpec::default()
    })
    .unwrap()
}

#[test]
fn a_kv_group_is_numbered_tp_fastest_from_its_first_rank() {
    let me = kv(2, 2, 1, 1, 13); // group starts at rank 10
    let sibs = group_siblings(&me).unwrap();
    assert_eq!(sibs.len(), 4);
    assert!(sibs[3].is_none());
    let got: Vec<_> = sibs
        .iter()
        .flatten()
        .map(|l| (l.ranks.pp_rank, l.ranks.tp_rank, l.ranks.global_rank))
        .collect();
    assert_eq!(got, [(0, 0, 10), (0, 1, 11), (1, 0, 12)]);
    assert_eq!(sibs[0].as_ref().unwrap().spec(), kv(2, 2, 0, 0, 10).spec());
}

#[test]
fn a_group_starting_below_rank_zero_or_with_explicit_stage_windows_is_refused() {
    let err = group_siblings(&kv(2, 1, 1, 0, 0)).unwrap_err();
    assert!(matches!(&err, DisaggError::Wire { field, .. } if field == "src_metas"));
    assert!(err.to_string().contains("(tp_rank=0, pp_rank=0)"), "{err}");
    let explicit = KvShardLayout::new(KvLayoutSpec {
        layer_start: Some(0),
        num_local_layers: Some(5),
        ..kv(1, 2, 0, 0, 0).spec()
    })
    .unwrap();
    assert!(group_siblings(&explicit).is_err());
    // One stage: an explicit window is every rank's, the TP siblings share it.
    let one_stage = KvShardLayout::new(KvLayoutSpec {
        layer_start: Some(0),
        num_local_layers: Some(8),
        ..kv(2, 1, 0, 0, 0).spec()
    })
    .unwrap();
    assert_eq!(group_siblings(&one_stage).unwrap().len(), 2);
}

#[test]
fn an_ssm_group_is_inferred_like_a_kv_group() {
    let dims = SsmStateDims::new(8, 4, 16, 2, 4).unwrap();
    let spec = SsmLayoutSpec {
        ranks: RankCoords::grid(2, 1, 1, 0, 5),
        ..SsmLayoutSpec::single_rank(4, dims)
    };
    let sibs = group_siblings(&SsmShardLayout::new(spec).unwrap()).unwrap();
    assert!(sibs[1].is_none());
    let first = sibs[0].as_ref().unwrap();
    assert_eq!((first.ranks.tp_rank, first.ranks.global_rank), (0, 4));
}

fn facts(tpb: u64, heads: u64, head_stride: u64) -> ChunkFacts {
    ChunkFacts { kv: true, regions: 1, geometry: Some([tpb, heads, head_stride, 8, 2]) }
}

#[test]
fn only_kv_caches_with_one_block_size_and_contiguous_heads_move_in_chunks() {
    assert!(chunkable(&[facts(16, 4, 16), facts(16, 1, 999)]));
    assert!(!chunkable(&[facts(16, 4, 16), facts(64, 4, 16)]));
    assert!(!chunkable(&[facts(16, 4, 16), facts(16, 4, 256)]));
    assert!(!chunkable(&[ChunkFacts { kv: false, ..facts(16, 4, 16) }]));
    assert!(!chunkable(&[ChunkFacts { regions: 2, ..facts(16, 4, 16) }]));
    assert!(!chunkable(&[ChunkFacts { geometry: None, ..facts(16, 4, 16) }]));
    assert!(!chunkable(&[]));
}

#[test]
fn staging_slots_need_a_multiple_of_256_and_give_at_least_one_slot() {
    assert_eq!(staging_slots(Some(1024), Some(512), (0, 0)).unwrap(), (2, 512));
    assert_eq!(staging_slots(None, Some(512), (100, 0)).unwrap(), (1, 512));
    assert_eq!(staging_slots(Some(-5), None, (1 << 20, 256)).unwrap(), (1, 256));
    for bad in [0, 128, 300, -256] {
        let err = staging_slots(Some(1024), Some(bad), (0, 0)).unwrap_err();
        assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "chunk_bytes"));
    }
}

#[test]
fn an_item_larger_than_a_slot_and_a_wrong_block_count_are_refused() {
    assert!(check_slot_capacity(&[512, 100], 512).is_ok());
    let err = check_slot_capacity(&[100, 1024], 512).unwrap_err();
    assert!(err.to_string().contains("1024 bytes but staging slots hold chunk_bytes=512"));
    assert!(check_chunk_blocks("dst_block_ids", 2, 32, &[2, 2]).is_ok());
    assert!(check_chunk_blocks("dst_block_ids", 0, 32, &[]).is_ok());
    let err = check_chunk_blocks("src_block_ids", 3, 32, &[2]).unwrap_err();
    assert!(matches!(&err, DisaggError::Block { field, .. } if field == "src_block_ids"));
    assert!(err.to_string().contains("holds 3 blocks, 32 tokens need 2"));
}

#[test]
fn a_launch_window_must_lie_inside_the_table_on_unit_bounds() {
    assert_eq!(packed_window((0, None), (64, 16), 3).unwrap(), (0, 4, 2));
    assert_eq!(packed_window((16, Some(16)), (64, 16), 3).unwrap(), (1, 1, 0));
    let err = packed_window((0, Some(48)), (32, 16), 1).unwrap_err();
    assert!(err.to_string().contains("[0, 48) is not inside [0, 32)"), "{err}");
    assert!(packed_window((-1, None), (32, 16), 1).is_err());
    assert!(packed_window((20, Some(10)), (32, 16), 1).is_err());
    let err = packed_window((8, None), (32, 16), 1).unwrap_err();
    assert!(err.to_string().contains("16-byte units"), "{err}");
}

#[test]
fn tables_of_different_totals_cannot_be_pipelined() {
    let err = pipeline_windows((64, 16), (32, 16), 16).unwrap_err();
    assert!(err.to_string().contains("gather packs 64 bytes but scatter expects 32"));
    assert_eq!(pipeline_windows((0, 16), (0, 16), 16).unwrap(), []);
    // Units 4 and 6 share 12-byte steps; a chunk below one unit still moves one.
    assert_eq!(pipeline_windows((30, 4), (30, 6), 25).unwrap(), [(0, 24), (24, 30)]);
    assert_eq!(pipeline_windows((30, 4), (30, 6), 5).unwrap()[0], (0, 12));
}

#[test]
fn each_pipeline_window_launches_both_tables_over_its_units() {
    let got = pipeline_launches((48, 4), (48, 6), 25, 2).unwrap();
    let want = [((0, 24), (0, 6, 3), (0, 4, 2)), ((24, 48), (6, 12, 3), (4, 8, 2))];
    assert_eq!(got, want);
    for ((lo, hi), g, s) in got {
        let range = (i64::try_from(lo).unwrap(), Some(i64::try_from(hi).unwrap()));
        assert_eq!(
            (g, s),
            (packed_window(range, (48, 4), 2).unwrap(), packed_window(range, (48, 6), 2).unwrap())
        );
    }
    assert!(pipeline_launches((48, 4), (40, 4), 16, 2).is_err());
    // A window off a table's units is refused as a single launch would be.
    let err = pipeline_launches((30, 4), (30, 6), 25, 1).unwrap_err();
    assert!(err.to_string().contains("4-byte units"), "{err}");
}

#[test]
fn the_staging_path_honours_the_override_then_the_device() {
    assert_eq!(staging_path("torch", true), "torch");
    assert_eq!(staging_path("triton", false), "triton");
    assert_eq!(staging_path("auto", true), "triton");
    assert_eq!(staging_path("auto", false), "torch");
    assert_eq!(staging_path("other", false), "torch");
}

#[test]
fn two_exports_share_a_host_when_both_exist_and_agree() {
    let h = |n: &str, b: &str| IpcHost { hostname: Some(n.into()), boot_id: Some(b.into()) };
    assert!(same_host(Some(&h("h", "b")), Some(&h("h", "b"))));
    assert!(!same_host(Some(&h("h", "b")), Some(&h("o", "b"))));
    assert!(!same_host(Some(&h("h", "b")), Some(&h("h", "r"))));
    assert!(!same_host(None, Some(&h("h", "b"))));
    assert!(!same_host(Some(&h("h", "b")), None));
}

fn map(entries: &[(&str, WireValue)]) -> WireValue {
    WireValue::Map(entries.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect())
}

#[test]
fn export_dicts_share_a_host_when_both_name_it_alike() {
    let s = |t: &str| WireValue::Str(t.to_owned());
    let a = map(&[("hostname", s("h")), ("boot_id", s("b")), ("pid", WireValue::Int(3))]);
    let b = map(&[("hostname", s("h")), ("boot_id", s("b"))]);
    let other = map(&[("hostname", s("h")), ("boot_id", s("r"))]);
    assert!(same_host_exports(Some(&a), Some(&b)));
    assert!(!same_host_exports(Some(&a), Some(&other)));
    assert!(!same_host_exports(Some(&a), None));
    assert!(!same_host_exports(Some(&map(&[])), Some(&map(&[]))));
    assert!(!same_host_exports(Some(&WireValue::Null), Some(&WireValue::Null)));
    // Neither names a host: both exports still agree (the same absent identity).
    let bare = map(&[("pid", WireValue::Int(1))]);
    assert!(same_host_exports(Some(&bare), Some(&bare)));
}

#[test]
fn chunk_facts_are_read_from_a_metadata_dict() {
    let int = |v: i128| WireValue::Int(v);
    let geometry = map(&[
        ("tokens_per_block", int(16)),
        ("num_heads", int(4)),
        ("head_stride", int(16)),
        ("head_dim", int(8)),
        ("element_size", int(2)),
    ]);
    let regions = WireValue::List(vec![WireValue::Null, WireValue::Null]);
    let meta = |kind: &str, regions: WireValue| {
        map(&[
            ("state_kind", WireValue::Str(kind.to_owned())),
            ("buffer", map(&[("regions", regions)])),
            ("geometry", geometry.clone()),
        ])
    };
    let one = meta("kv", WireValue::List(vec![WireValue::Null]));
    assert_eq!(ChunkFacts::of_meta(&one).unwrap(), facts(16, 4, 16));
    assert_eq!(ChunkFacts::of_meta(&meta("kv", regions)).unwrap().regions, 2);
    assert!(!ChunkFacts::of_meta(&meta("ssm", WireValue::Null)).unwrap().kv);
    let bare = ChunkFacts::of_meta(&map(&[])).unwrap();
    assert_eq!(bare, ChunkFacts { kv: false, regions: 0, geometry: None });
    let bare_facts = ChunkFacts::of_meta(&map(&[])).unwrap();
    assert!(chunkable(&[ChunkFacts::of_meta(&one).unwrap(); 2]));
    assert!(!chunkable(&[ChunkFacts::of_meta(&one).unwrap(), bare_facts]));
    let short = map(&[("geometry", map(&[("tokens_per_block", int(16))]))]);
    let err = ChunkFacts::of_meta(&short).unwrap_err();
    assert!(matches!(&err, DisaggError::Wire { field, .. } if field == "geometry.num_heads"));
}

#[test]
fn rows_are_viewed_in_the_widest_unit_dividing_row_and_offset() {
    assert_eq!(row_unit(16, 0), 8);
    assert_eq!(row_unit(16, 4), 4);
    assert_eq!(row_unit(6, 0), 2);
    assert_eq!(row_unit(16, 3), 1);
}

#[test]
fn a_mapped_buffer_is_read_from_the_local_gpu_when_one_is_given() {
    assert_eq!(reader_gpu(2, None, 0), 2);
    assert_eq!(reader_gpu(2, Some(("cpu", Some(5))), 0), 2);
    assert_eq!(reader_gpu(2, Some(("cuda", Some(5))), 0), 5);
    assert_eq!(reader_gpu(2, Some(("cuda", None)), 7), 7);
}

proptest! {
    /// The windows against a simple model: consecutive, unit-aligned steps covering the total.
    #[test]
    fn pipeline_windows_cover_the_total_in_aligned_steps(
        total in 0u64..5000, gu in 1u64..40, su in 1u64..40, chunk in -100i64..3000,
    ) {
        let w = pipeline_windows((total, gu), (total, su), chunk).unwrap();
        let unit = (1..=gu * su).find(|u| u % gu == 0 && u % su == 0).unwrap();
        let step = std::cmp::max(chunk.max(0).cast_unsigned() / unit, 1) * unit;
        let model: Vec<_> = (0..total).step_by(step as usize).map(|lo| (lo, (lo + step).min(total))).collect();
        prop_assert_eq!(w, model);
    }

    /// The slot cut against the Python rule it replaces.
    #[test]
    fn staging_slots_match_floor_division(pool in -5000i64..100_000, chunk in -600i64..5000) {
        let got = staging_slots(Some(pool), Some(chunk), (0, 0));
        if chunk >= 256 && chunk % 256 == 0 {
            prop_assert_eq!(got.unwrap(), (pool.div_euclid(chunk).max(1).cast_unsigned(), chunk.cast_unsigned()));
        } else {
            prop_assert!(got.is_err());
        }
    }
}

#[test]
fn a_buffer_argument_flattens_into_at_least_one_tensor_and_nothing_else() {
    assert!(check_buffer_tensors(&[None, None], "list").is_ok());
    for items in [vec![], vec![None, Some("int".to_owned())]] {
        let err = check_buffer_tensors(&items, "list").unwrap_err();
        assert!(matches!(&err, DisaggError::Geometry { field, .. } if field == "memory_buffer"));
        assert!(err.to_string().contains("got list"), "{err}");
    }
}
