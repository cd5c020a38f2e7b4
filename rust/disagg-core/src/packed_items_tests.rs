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

#[test]
fn a_side_kind_is_parsed_once_and_an_unknown_one_is_refused_on_side() {
    assert_eq!(
        CopySide::parse("packed", None, 16, 0).unwrap(),
        CopySide::Packed { bias: 16, nbytes: 0 }
    );
    assert_eq!(
        CopySide::parse("dst", Some(4), 0, 8).unwrap(),
        CopySide::Paged { kind: "dst", ids: Some(4), set_stride: 8 }
    );
    let err = CopySide::parse("Dst", Some(4), 0, 8).unwrap_err();
    assert_eq!(err.kind(), "Argument");
    assert!(err.to_string().contains("side") && err.to_string().contains("\"Dst\""), "{err}");
}
