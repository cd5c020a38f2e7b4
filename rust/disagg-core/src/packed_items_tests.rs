use proptest::prelude::*;

use super::*;

const ROWS: [(u64, u64); 3] = [(0, 256), (256, 512), (768, 256)];

#[test]
fn offsets_follow_the_planes_in_packed_order() {
    // 100 tokens of 64 per block: 2 blocks per plane, the second one 36 tokens.
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    assert_eq!(items.total(), 6);
    assert_eq!(items.packed_bytes(), 1024 * 100);
    let got: Vec<u64> = (0..=6).map(|k| items.offset(k).unwrap()).collect();
    assert_eq!(got, [0, 64 * 256, 25_600, 25_600 + 64 * 512, 76_800, 76_800 + 64 * 256, 102_400]);
}

#[test]
fn one_range_at_an_offset_is_biased_by_its_first_byte() {
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    let l = items.launch(&[(4096, 1, 3)], Some(1 << 20), 16).unwrap();
    assert_eq!((l.k_lo, l.k_hi), (1, 3));
    assert_eq!(l.nbytes, items.offset(3).unwrap() - items.offset(1).unwrap());
    assert_eq!(l.placement, [(64 * 256) / 16, 3, 0, 3, 0]);
}

#[test]
fn bad_launches_are_refused_naming_the_field() {
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    let field = |r: DisaggResult<Launch>| match r {
        Err(DisaggError::Argument { field, .. }) => field,
        other => panic!("expected an argument error, got {other:?}"),
    };
    assert_eq!(field(items.launch(&[(0, 0, 1)], Some(1 << 20), 3)), "unit");
    assert_eq!(field(items.launch(&[], Some(1 << 20), 16)), "parts");
    assert_eq!(field(items.launch(&[(0, 0, 1); 4], Some(1 << 20), 16)), "parts");
    assert_eq!(field(items.launch(&[(0, 0, 1), (0, 1, 2)], None, 16)), "parts");
    assert_eq!(field(items.launch(&[(0, 2, 7)], Some(1 << 20), 16)), "items");
    assert_eq!(field(items.launch(&[(0, 0, 1), (1 << 16, 2, 3)], Some(1 << 20), 16)), "items");
    assert_eq!(field(items.launch(&[(8, 0, 1)], Some(1 << 20), 16)), "b_offset");
    assert_eq!(field(items.launch(&[(16, 0, 6)], Some(102_400), 16)), "b_offset");
    assert_eq!(field(items.launch(&[(16, 0, 1)], None, 16)), "b_offset");
    let msg = items.launch(&[(16, 0, 6)], Some(102_400), 16).unwrap_err().to_string();
    assert!(msg.contains("102400 packed bytes at 16 of 102400"), "{msg}");
    assert!(matches!(PackedItems::new(&ROWS, 0, 1), Err(DisaggError::Argument { .. })));
}

#[test]
fn id_counts_cover_every_set_without_overlap() {
    // 100 tokens of 64 per block: 2 block indices.
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    assert!(items.check_ids(2, 0, 1, Some(2)).is_ok());
    assert!(items.check_ids(6, 2, 3, None).is_ok());
    assert!(items.check_ids(2, 0, 3, None).is_ok(), "stride 0: every set reads the same ids");
    for (a, stride, sets, b) in
        [(1, 0, 1, None), (2, 0, 1, Some(1)), (5, 2, 3, None), (6, 1, 3, None)]
    {
        let err = items.check_ids(a, stride, sets, b).unwrap_err();
        assert!(
            matches!(&err, DisaggError::Argument { field, .. } if field == "block_ids"),
            "{err}"
        );
    }
}

#[test]
fn a_copy_checks_its_items_and_both_sides() {
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    let src = |ids| CopySide::Paged { kind: "src", ids, set_stride: 0 };
    let window = |bias, nbytes| CopySide::Packed { bias, nbytes };
    let whole = window(0, 102_400);
    assert_eq!(
        items.check_copy(None, [src(Some(2)), whole], 1, false).unwrap(),
        [0, 6, 0, 102_400]
    );
    let mid = items.check_copy(Some((1, 3)), [src(Some(2)), window(16_384, 50_000)], 1, false);
    assert_eq!(mid.unwrap(), [1, 3, 16_384, 25_600 + 32_768]);
    let field = |r: DisaggResult<[u64; 4]>| match r {
        Err(DisaggError::Argument { field, detail }) => (field, detail),
        other => panic!("expected an argument error, got {other:?}"),
    };
    assert_eq!(field(items.check_copy(Some((2, 7)), [src(Some(2)), whole], 1, false)).0, "items");
    assert_eq!(field(items.check_copy(None, [src(Some(2)), whole], 1, true)).0, "packed");
    let (f, d) =
        field(items.check_copy(Some((1, 3)), [src(Some(2)), window(16_385, 90_000)], 1, false));
    assert_eq!(f, "packed");
    assert!(d.contains("window holds [16385, 106385)"), "{d}");
    let (f, d) = field(items.check_copy(None, [src(None), whole], 1, false));
    assert_eq!((f.as_str(), d.as_str()), ("block_ids", "src side needs block ids"));
    assert_eq!(field(items.check_copy(None, [src(Some(1)), whole], 1, false)).0, "block_ids");
    let sets = CopySide::Paged { kind: "src", ids: Some(5), set_stride: 1 };
    assert_eq!(field(items.check_copy(None, [sets, src(Some(2))], 3, false)).0, "block_ids");
}

#[test]
fn chunks_cover_every_item_once() {
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    let c = items.chunks(64 * 512).unwrap();
    assert_eq!(c.first().map(|r| r[0]), Some(0));
    assert_eq!(c.last().map(|r| r[1]), Some(6));
    assert!(c.windows(2).all(|w| w[0][1] == w[1][0] && w[0][3] == w[1][2]));
}

proptest! {
    /// The kernel's rule (item `k` lands at `off0 + offset(k) - bias(k) * unit`, the bias
    /// picked by the cuts) puts every item where its range's own offset says.
    #[test]
    fn every_item_lands_in_its_range_at_its_offset(
        rows in proptest::collection::vec((1u64..8, 1u64..8), 1..6),
        tpb in 1u64..9,
        n_tok in 1u64..70,
        cuts in proptest::collection::vec(0u64..1000, 0..3),
        gaps in proptest::collection::vec(0u64..4, 3),
        first in 0u64..1000,
    ) {
        let unit = 16u64;
        // Rows in units; packed coefficients follow the rows' order.
        let mut coef = 0;
        let rows: Vec<(u64, u64)> = rows.iter().map(|&(_, r)| {
            let row = (coef, r * unit);
            coef += r * unit;
            row
        }).collect();
        let items = PackedItems::new(&rows, tpb, n_tok).unwrap();
        let total = items.total();
        let mut bounds: Vec<u64> = cuts.iter().map(|c| c % (total + 1)).collect();
        bounds.push(first % (total + 1));
        bounds.sort_unstable();
        let k_end = total;
        bounds.push(k_end);
        let mut parts = Vec::new();
        let mut at = 0u64;
        for (j, w) in bounds.windows(2).enumerate() {
            let (lo, hi) = (w[0], w[1]);
            let size = items.offset(hi).unwrap() - items.offset(lo).unwrap();
            parts.push((at, lo, hi));
            at += size + gaps[j] * unit;
        }
        let l = items.launch(&parts, Some(at), unit).unwrap();
        prop_assert_eq!((l.k_lo, l.k_hi), (parts[0].1, k_end));
        let off0 = i128::from(parts[0].0);
        for k in l.k_lo..l.k_hi {
            let p = l.placement;
            let ki = i64::try_from(k).unwrap();
            let bias = if ki >= p[3] { p[4] } else if ki >= p[1] { p[2] } else { p[0] };
            let got = off0 + i128::from(items.offset(k).unwrap()) - i128::from(bias) * i128::from(unit);
            let (offset, lo, _) = *parts.iter().rev().find(|r| r.1 <= k && k < r.2).unwrap();
            let want = i128::from(offset) + i128::from(items.offset(k).unwrap() - items.offset(lo).unwrap());
            prop_assert_eq!(got, want);
        }
    }
}

/// Planes `[src offset, dst offset, packed coefficient, row bytes]` of [`ROWS`].
const PLANES: [[i64; 4]; 3] = [[4096, 0, 0, 256], [8192, 512, 256, 512], [12_288, 1024, 768, 256]];
/// Strides `[src block, src token, dst block, dst token]`.
const STRIDES: [u64; 4] = [1 << 16, 1024, 1 << 15, 512];

fn table() -> PlaneTable {
    PlaneTable::new(&PLANES, 64, STRIDES).unwrap()
}

#[test]
fn a_table_keeps_the_rows_in_packed_order_and_refuses_negative_sizes() {
    let t = table();
    assert_eq!(t.rows(), ROWS);
    assert_eq!(t.items(100).unwrap().offset(2).unwrap(), 25_600);
    let bad = [[0, 0, 0, -4]];
    let err = PlaneTable::new(&bad, 64, STRIDES).unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "planes"), "{err}");
    assert!(PlaneTable::new(&PLANES, 0, STRIDES).is_err());
}

#[test]
fn each_side_kind_reads_its_column_and_strides() {
    let t = table();
    let side = |k| t.side(k);
    assert_eq!(
        side(SideKind::Src),
        SideArgs { col: 0, block_stride: 1 << 16, token_stride: 1024, packed: false }
    );
    assert_eq!(
        side(SideKind::Dst),
        SideArgs { col: 1, block_stride: 1 << 15, token_stride: 512, packed: false }
    );
    assert_eq!(
        side(SideKind::Packed),
        SideArgs { col: 2, block_stride: 0, token_stride: 0, packed: true }
    );
    for k in [SideKind::Src, SideKind::Dst, SideKind::Packed] {
        assert_eq!(SideKind::parse(k.name()).unwrap(), k);
    }
    let err = SideKind::parse("peer").unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "kind"), "{err}");
}

#[test]
fn the_unit_is_the_widest_power_of_two_dividing_everything() {
    let t = table();
    assert_eq!(t.unit(&[]), 16);
    assert_eq!(t.unit(&[1 << 20, 8]), 8);
    assert_eq!(t.unit(&[6]), 2);
    let odd = PlaneTable::new(&[[0, 0, 0, 12]], 4, [48, 12, 0, 0]).unwrap();
    assert_eq!(odd.unit(&[]), 4);
}

#[test]
fn a_paged_end_is_the_last_byte_of_the_last_block_plus_one() {
    let t = table();
    // src: plane 2 at 12288 + 3 blocks * 65536 + 63 tokens * 1024 + 256 bytes.
    assert_eq!(t.paged_end(SideKind::Src, 4).unwrap(), 12_288 + 3 * 65_536 + 63 * 1024 + 256);
    // dst: plane 1 (512 + 512 row) or plane 2 (1024 + 256): plane 2 ends last.
    assert_eq!(t.paged_end(SideKind::Dst, 1).unwrap(), 1024 + 63 * 512 + 256);
    let err = t.paged_end(SideKind::Packed, 1).unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "kind"), "{err}");
    let empty = PlaneTable::new(&[], 64, STRIDES).unwrap();
    assert!(empty.paged_end(SideKind::Src, 1).is_err());
}

#[test]
fn a_prepared_copy_reads_a_paged_source_and_packs_into_its_window() {
    let t = table();
    let (s, window) = t.prepare(SideKind::Src, SideKind::Packed, 1 << 20, 4104, 777).unwrap();
    assert_eq!((s.unit, s.a.col, s.b.packed, window), (8, 0, true, Some(777)));
    let (s, window) = t.prepare(SideKind::Src, SideKind::Dst, 1 << 20, 1 << 21, 777).unwrap();
    assert_eq!((s.unit, s.b.col, s.b.packed, window), (16, 1, false, None));
    let err = t.prepare(SideKind::Packed, SideKind::Dst, 0, 0, 0).unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "a"), "{err}");
}

#[test]
fn a_checked_copy_gives_its_span_and_its_launch_sides() {
    let t = table();
    let src = CopySpec {
        kind: SideKind::Src,
        ids: Some(2),
        nbytes: 0,
        bias: 0,
        set_stride: 0,
        addr: 1 << 20,
    };
    let window = CopySpec {
        kind: SideKind::Packed,
        ids: None,
        nbytes: 102_400,
        bias: 0,
        set_stride: 0,
        addr: 1 << 21,
    };
    let (span, s) = t.check_copy(100, None, &src, &window, 1, false).unwrap();
    assert_eq!(span, [0, 6, 0, 102_400]);
    assert_eq!((s.unit, s.a, s.b), (16, t.side(SideKind::Src), t.side(SideKind::Packed)));
    // A window starting at packed byte 16 384 (a multiple of 4 only in the unit's terms).
    let biased = CopySpec { bias: 16_388, ..window };
    let (_, s) = t.check_copy(100, Some((2, 3)), &src, &biased, 1, false).unwrap();
    assert_eq!(s.unit, 4);
    let no_ids = CopySpec { ids: None, ..src };
    let err = t.check_copy(100, None, &no_ids, &window, 1, false).unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "block_ids"), "{err}");
}

#[test]
fn a_packed_launch_ignores_destination_ids_and_a_paged_one_checks_them() {
    let items = PackedItems::new(&ROWS, 64, 100).unwrap();
    assert!(items.checked_launch(&[(0, 0, 6)], Some(1 << 20), 16, [2, 0, 1, 0]).is_ok());
    assert!(items.checked_launch(&[(0, 0, 6)], None, 16, [2, 0, 1, 2]).is_ok());
    let err = items.checked_launch(&[(0, 0, 6)], None, 16, [2, 0, 1, 1]).unwrap_err();
    assert!(matches!(&err, DisaggError::Argument { field, .. } if field == "block_ids"), "{err}");
}

proptest! {
    /// The unit divides every plane offset, row, stride and address, and twice the unit
    /// (up to 16) does not divide all of them: the model checks each value one by one.
    #[test]
    fn the_unit_matches_a_value_by_value_model(
        planes in proptest::collection::vec((0i64..1 << 20, 0i64..1 << 20, 0i64..64, 0i64..4096), 0..5),
        strides in proptest::array::uniform4(0u64..1 << 20),
        addresses in proptest::collection::vec(0u64..1 << 40, 0..4),
    ) {
        let planes: Vec<[i64; 4]> = planes.iter().map(|&(s, d, c, r)| [s, d, c * 16, r]).collect();
        let t = PlaneTable::new(&planes, 8, strides).unwrap();
        let mut values: Vec<u64> = planes.iter().flat_map(|p| [p[0], p[1], p[3]]).map(|v| u64::try_from(v).unwrap()).collect();
        values.extend(strides);
        values.extend(&addresses);
        let want = [16u64, 8, 4, 2, 1].into_iter().find(|u| values.iter().all(|v| v % u == 0)).unwrap();
        prop_assert_eq!(t.unit(&addresses), want);
    }

    /// A paged end is one past the largest byte any (plane, block, token) row can touch.
    #[test]
    fn a_paged_end_matches_every_row_it_bounds(
        planes in proptest::collection::vec((0i64..1 << 16, 0i64..1 << 16, 1i64..64), 1..4),
        tpb in 1u64..5,
        num_blocks in 1u64..5,
        strides in proptest::array::uniform4(0u64..4096),
    ) {
        let planes: Vec<[i64; 4]> = planes.iter().map(|&(s, d, r)| [s, d, 0, r]).collect();
        let t = PlaneTable::new(&planes, tpb, strides).unwrap();
        for (kind, col, bs, ts) in [(SideKind::Src, 0, strides[0], strides[1]), (SideKind::Dst, 1, strides[2], strides[3])] {
            let mut last = i64::MIN;
            for p in &planes {
                for b in 0..num_blocks {
                    for tok in 0..tpb {
                        let end = p[col] + i64::try_from(b * bs + tok * ts).unwrap() + p[3];
                        last = last.max(end);
                    }
                }
            }
            prop_assert_eq!(t.paged_end(kind, num_blocks).unwrap(), last);
        }
    }
}
