//! Byte ranges of a staging region: the allocator behind a transport's fixed staging pool.
//!
//! A staged transfer packs its fragments into a contiguous range of a registered region and
//! the peer reads that range with one descriptor. [`StagingRanges`] hands out those ranges,
//! first fit, every range starting on `alignment` bytes (so packed rows can use wide element
//! views), and tracks one entry per range in flight, never one per block. Ranges are half-open
//! `[offset, offset + size)`.

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
use crate::wire::peer::{check_transfer, LocalSide, PeerMeta, SourceIds};

/// First-fit allocator of aligned byte ranges in a region of `capacity` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingRanges {
    capacity: u64,
    alignment: u64,
    /// Reserved ranges: offset -> rounded size.
    used: BTreeMap<u64, u64>,
    in_use: u64,
}

impl StagingRanges {
    /// A pool of `capacity` bytes whose ranges start on multiples of `alignment` (a power of
    /// two).
    pub fn new(capacity: u64, alignment: u64) -> DisaggResult<Self> {
        if !alignment.is_power_of_two() {
            return Err(DisaggError::argument(
                "alignment",
                format!("alignment={alignment} must be a power of two"),
            ));
        }
        Ok(Self { capacity, alignment, used: BTreeMap::new(), in_use: 0 })
    }

    /// Bytes of the region.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Start alignment of every range.
    #[must_use]
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Bytes reserved now (sizes rounded up to the alignment).
    #[must_use]
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Ranges reserved now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.used.len()
    }

    /// Whether no range is reserved.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }

    /// `size` rounded up to the alignment; an empty request takes one unit so every range
    /// has its own offset. `None` when the rounding overflows.
    fn rounded(&self, size: u64) -> Option<u64> {
        size.max(1).checked_next_multiple_of(self.alignment)
    }

    /// Free gaps `(start, len)` in address order, the tail included.
    fn gaps(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut cursor = 0u64;
        let mut tail_done = false;
        let mut it = self.used.iter();
        std::iter::from_fn(move || loop {
            if let Some((&off, &len)) = it.next() {
                let gap = (cursor, off - cursor);
                cursor = off + len;
                if gap.1 > 0 {
                    return Some(gap);
                }
            } else if !tail_done {
                tail_done = true;
                let gap = (cursor, self.capacity.saturating_sub(cursor));
                return (gap.1 > 0).then_some(gap);
            } else {
                return None;
            }
        })
    }

    /// The largest free range.
    #[must_use]
    pub fn largest_free(&self) -> u64 {
        self.gaps().map(|(_, len)| len).max().unwrap_or(0)
    }

    /// Reserve `size` bytes at the lowest offset where they fit; return the offset.
    ///
    /// # Errors
    /// `Capacity` (resource `staging_bytes`) when no free range holds `size` bytes; the pool
    /// is unchanged.
    pub fn alloc(&mut self, size: u64) -> DisaggResult<u64> {
        let full = |pool: &Self| DisaggError::Capacity {
            resource: "staging_bytes".into(),
            detail: format!(
                "staging needs {size} bytes but only {} of staging_bytes={} are free (largest \
                 free range {})",
                pool.capacity - pool.in_use.min(pool.capacity),
                pool.capacity,
                pool.largest_free()
            ),
        };
        let need = self.rounded(size).ok_or_else(|| full(self))?;
        let offset = self.gaps().find(|&(_, len)| len >= need).map(|(start, _)| start);
        let offset = offset.ok_or_else(|| full(self))?;
        self.used.insert(offset, need);
        self.in_use += need;
        Ok(offset)
    }

    /// Slots for a chunked transfer: at most `max_slots` equal ranges of the largest free
    /// range's `1 / share` (the rest is left to `share - 1` other transfers), each a multiple
    /// of the alignment and at least `item_bytes` (the smallest piece a chunk can hold), at
    /// least two (one lands while the other is read). Returns `(slot_bytes, offsets)`, or
    /// `None` (nothing reserved) when two such slots do not fit.
    pub fn alloc_slots(
        &mut self,
        item_bytes: u64,
        share: u64,
        max_slots: u64,
    ) -> Option<(u64, Vec<u64>)> {
        let (slot_bytes, slots) =
            slot_plan(self.largest_free(), self.alignment, item_bytes, share, max_slots)?;
        self.take_slots(slot_bytes, slots, item_bytes)
    }

    /// Slots for streaming a packed copy to a peer whose pool has `peer_pool` bytes and reads
    /// `sources` copies at once (two slots each at least): as [`Self::alloc_slots`], each
    /// slot also at most `peer_pool / (2 * sources)`. Returns `(slot_bytes, offsets)`, the
    /// slot size being the chunk size too, or `None` (nothing reserved) when two slots of
    /// `item_bytes` do not fit either pool, without an item size (no device plan) or without
    /// a peer pool.
    pub fn alloc_stream(
        &mut self,
        item_bytes: Option<u64>,
        peer_pool: Option<u64>,
        sources: u64,
        share: u64,
        max_slots: u64,
    ) -> Option<(u64, Vec<u64>)> {
        let (item_bytes, peer_pool) = (item_bytes?, peer_pool?);
        let cap = peer_pool / sources.max(1).saturating_mul(2) / self.alignment * self.alignment;
        let budget = self.largest_free() / share.max(1);
        let slots = max_slots.min(budget / item_bytes.max(1));
        if slots < 2 {
            return None;
        }
        let slot_bytes = (budget / slots / self.alignment * self.alignment).min(cap);
        self.take_slots(slot_bytes, slots, item_bytes)
    }

    /// `slots` ranges of `slot_bytes` (at least `item_bytes`), all or none.
    fn take_slots(
        &mut self,
        slot_bytes: u64,
        slots: u64,
        item_bytes: u64,
    ) -> Option<(u64, Vec<u64>)> {
        if slot_bytes < item_bytes.max(1) {
            return None;
        }
        let mut offsets = Vec::new();
        for _ in 0..slots {
            if let Ok(at) = self.alloc(slot_bytes) {
                offsets.push(at);
            } else {
                for at in offsets {
                    self.free(at);
                }
                return None;
            }
        }
        Some((slot_bytes, offsets))
    }

    /// Return the range starting at `offset`; `false` (and nothing changes) when no range
    /// starts there, so a repeated release is harmless.
    pub fn free(&mut self, offset: u64) -> bool {
        match self.used.remove(&offset) {
            Some(len) => {
                self.in_use -= len;
                true
            }
            None => false,
        }
    }

    /// Return every range of `offsets` (as [`Self::free`] each; unknown offsets are ignored).
    pub fn free_all(&mut self, offsets: &[u64]) {
        for &at in offsets {
            self.free(at);
        }
    }

    /// The reserved ranges `(offset, size)` in address order.
    #[must_use]
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.used.iter().map(|(&o, &l)| (o, l)).collect()
    }
}

/// The slots [`StagingRanges::alloc_slots`] takes from a pool whose largest free range is
/// `largest_free`: `(slot_bytes, slots)`, or `None` when two slots of `item_bytes` do not fit
/// (so a caller can tell beforehand whether a chunked transfer gets its slots).
#[must_use]
pub fn slot_plan(
    largest_free: u64,
    alignment: u64,
    item_bytes: u64,
    share: u64,
    max_slots: u64,
) -> Option<(u64, u64)> {
    let budget = largest_free / share.max(1);
    let slots = max_slots.min(budget / item_bytes.max(1));
    if slots < 2 {
        return None;
    }
    let slot_bytes = budget / slots / alignment.max(1) * alignment.max(1);
    (slot_bytes >= item_bytes.max(1)).then_some((slot_bytes, slots))
}

/// Where one pull's block ids went in a device id slot ([`write_pull_ids`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullIds {
    /// Tokens the pull moves (what [`check_transfer`] returned).
    pub num_tokens: u64,
    /// Block indices of every side.
    pub num_blocks: usize,
    /// Ids between the starts of two consecutive parts (`num_blocks` rounded up to even).
    pub stride: usize,
    /// Ids written.
    pub len: usize,
}

/// Ids a slot needs for a pull of `dst_len` destination ids from `sources` source ranks.
#[must_use]
pub fn pull_ids_len(dst_len: usize, sources: usize) -> usize {
    (dst_len + (dst_len & 1)) * (sources + 1)
}

/// Check the peers and block ids of one KV transfer ([`check_transfer`], same errors), then
/// lay the ids out in `out` for a device plan launched once for all source ranks: with `dst`
/// (a pull into this rank) the destination ids at 0 and the ids of `ranks[j]` at `(j + 1) *
/// stride`; without (this rank packs its own blocks: `local` is a source) the ids of
/// `ranks[j]` at `j * stride`. Every part starts on an even index (16-byte aligned on the
/// device).
///
/// `checked`: the caller checked these peers and ids already and `num_tokens` is the count
/// [`check_transfer`] returned; only the layout is written (`None` without a count).
/// `tokens_per_block` is the plan's block size. `Ok(None)`: the ids do not fit this layout
/// (SSM state, a side whose id count is not the plan's block count for the tokens moved, a
/// rank without ids, `out` too short); the caller takes its general path, which names the
/// mismatch if there is one.
///
/// # Errors
/// What [`check_transfer`] raises (`MetadataError`, `BlockIdError`).
#[allow(clippy::too_many_arguments)]
pub fn write_pull_ids(
    checked: bool,
    peers: &[&PeerMeta],
    ranks: &[u32],
    src: &SourceIds,
    dst: Option<&[i64]>,
    num_tokens: Option<i64>,
    local: LocalSide,
    tokens_per_block: u32,
    out: &mut [i64],
) -> DisaggResult<Option<PullIds>> {
    if checked {
        let n_tok = num_tokens.and_then(|n| u64::try_from(n).ok());
        return Ok(n_tok.and_then(|n| lay_out_ids(ranks, src, dst, n, tokens_per_block, out)));
    }
    let Some(n_tok) = check_transfer(peers, src, dst, num_tokens, local)? else {
        return Ok(None);
    };
    Ok(lay_out_ids(ranks, src, dst, n_tok, tokens_per_block, out))
}

/// [`write_pull_ids`] of ids the caller has checked already ([`check_transfer`] returned
/// `n_tok` for them): the layout alone, `None` when the ids do not fit it.
#[must_use]
pub fn lay_out_ids(
    ranks: &[u32],
    src: &SourceIds,
    dst: Option<&[i64]>,
    n_tok: u64,
    tokens_per_block: u32,
    out: &mut [i64],
) -> Option<PullIds> {
    if tokens_per_block == 0 {
        return None;
    }
    let n_blk = usize::try_from(n_tok.div_ceil(u64::from(tokens_per_block))).unwrap_or(0);
    let stride = n_blk + (n_blk & 1);
    let mut parts: Vec<&[i64]> = dst.into_iter().collect();
    let len = stride * (parts.len() + ranks.len());
    if parts.iter().any(|d| d.len() != n_blk) || out.len() < len {
        return None;
    }
    for &rank in ranks {
        match src.of_rank(i64::from(rank)) {
            Some(ids) if ids.len() == n_blk => parts.push(ids),
            _ => return None,
        }
    }
    for (j, ids) in parts.into_iter().enumerate() {
        out[j * stride..j * stride + n_blk].copy_from_slice(ids);
    }
    Some(PullIds { num_tokens: n_tok, num_blocks: n_blk, stride, len })
}

impl std::fmt::Display for StagingRanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (cap, align, used) = (self.capacity(), self.alignment(), self.in_use());
        write!(
            f,
            "StagingRanges(capacity={cap}, alignment={align}, in_use={used}, ranges={})",
            self.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    #[test]
    fn free_all_returns_every_range_and_the_pool_prints_its_use() {
        let mut pool = StagingRanges::new(4096, 256).unwrap();
        let (a, b) = (pool.alloc(100).unwrap(), pool.alloc(300).unwrap());
        let text = "StagingRanges(capacity=4096, alignment=256, in_use=768, ranges=2)";
        assert_eq!(pool.to_string(), text);
        pool.free_all(&[a, 12345, b]);
        assert_eq!((pool.in_use(), pool.len()), (0, 0));
    }

    #[test]
    fn chunk_slots_share_the_largest_free_range_and_each_hold_an_item() {
        let mut pool = StagingRanges::new(4096, 256).unwrap();
        let (bytes, offs) = pool.alloc_slots(1024, 2, 3).unwrap();
        assert_eq!((bytes, offs.len()), (1024, 2));
        // The other half is left for the second source.
        assert_eq!(pool.largest_free(), 2048);
        let (bytes2, offs2) = pool.alloc_slots(512, 1, 3).unwrap();
        assert_eq!((bytes2, offs2.len()), (512, 3));
        for at in offs.into_iter().chain(offs2) {
            assert!(pool.free(at));
        }
        assert_eq!(pool.in_use(), 0);
        // Fewer than two items fit: nothing is reserved.
        assert!(pool.alloc_slots(3000, 1, 3).is_none());
        // A stream's slots also fit two per source in the peer's pool.
        let mut fresh = StagingRanges::new(8192, 256).unwrap();
        let (bytes, offs) = fresh.alloc_stream(Some(512), Some(4096), 2, 2, 3).unwrap();
        assert_eq!((bytes, offs.len()), (1024, 3));
        let under = fresh.alloc_stream(Some(512), Some(1024), 2, 1, 3);
        assert!(under.is_none(), "peer slots under an item");
        // No item size (no device plan) or no peer pool: nothing is reserved.
        assert!(fresh.alloc_stream(None, Some(4096), 2, 1, 3).is_none());
        assert!(fresh.alloc_stream(Some(512), None, 2, 1, 3).is_none());
        assert_eq!(fresh.in_use(), 3072);
        assert!(pool.alloc_slots(0, 0, 3).is_some_and(|(b, o)| b >= 256 && o.len() == 3));
    }

    use super::*;

    /// Oracle: one flag per alignment unit, first fit by scanning units.
    struct Oracle {
        units: Vec<bool>,
        unit: u64,
        sizes: BTreeMap<u64, u64>,
    }

    impl Oracle {
        fn alloc(&mut self, size: u64) -> Option<u64> {
            let need = usize::try_from(size.max(1).div_ceil(self.unit)).ok()?;
            let mut run = 0usize;
            for i in 0..self.units.len() {
                run = if self.units[i] { 0 } else { run + 1 };
                if run == need {
                    let start = i + 1 - need;
                    self.units[start..=i].iter_mut().for_each(|u| *u = true);
                    let off = start as u64 * self.unit;
                    self.sizes.insert(off, need as u64 * self.unit);
                    return Some(off);
                }
            }
            None
        }

        fn free(&mut self, off: u64) -> bool {
            let Some(len) = self.sizes.remove(&off) else { return false };
            let (a, n) = ((off / self.unit) as usize, (len / self.unit) as usize);
            self.units[a..a + n].iter_mut().for_each(|u| *u = false);
            true
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        FreeUnknown(u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                3 => (0u64..700).prop_map(Op::Alloc),
                2 => (0usize..16).prop_map(Op::Free),
                1 => (0u64..2048).prop_map(Op::FreeUnknown),
            ],
            0..60,
        )
    }

    proptest! {
        #[test]
        fn allocations_match_a_unit_by_unit_first_fit_oracle(
            cap_units in 0u64..24, align_bits in 0u32..6, ops in ops()
        ) {
            let unit = 1u64 << align_bits;
            let cap = cap_units * 64;
            let mut pool = StagingRanges::new(cap, unit).unwrap();
            let mut oracle = Oracle {
                units: vec![false; usize::try_from(cap / unit).unwrap()],
                unit,
                sizes: BTreeMap::new(),
            };
            let mut live: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        let before = pool.clone();
                        let got = pool.alloc(size);
                        let want = oracle.alloc(size);
                        prop_assert_eq!(got.as_ref().ok().copied(), want);
                        match got {
                            Ok(off) => {
                                prop_assert_eq!(off % unit, 0);
                                live.push(off);
                            }
                            Err(e) => {
                                prop_assert_eq!(e.kind(), "Capacity");
                                prop_assert!(e.to_string().contains("staging_bytes"));
                                prop_assert_eq!(&pool, &before);
                            }
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let off = live.remove(i % live.len());
                        prop_assert!(pool.free(off));
                        prop_assert!(oracle.free(off));
                    }
                    Op::Free(_) => {}
                    Op::FreeUnknown(off) => {
                        prop_assert_eq!(pool.free(off), oracle.free(off));
                        live.retain(|&o| o != off);
                    }
                }
                // Disjoint, in bounds, and the byte count agrees with the oracle.
                let ranges = pool.ranges();
                for w in ranges.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0);
                }
                prop_assert!(ranges.iter().all(|&(o, l)| o + l <= cap));
                let used = oracle.units.iter().filter(|&&u| u).count() as u64 * unit;
                prop_assert_eq!(pool.in_use(), used);
                prop_assert_eq!(pool.len(), oracle.sizes.len());
                let free_max = ranges
                    .iter()
                    .fold((0u64, 0u64), |(cur, best), &(o, l)| (o + l, best.max(o - cur)));
                prop_assert_eq!(pool.largest_free(), free_max.1.max(cap - free_max.0));
            }
        }
    }

    #[test]
    fn alignment_must_be_a_power_of_two() {
        let e = StagingRanges::new(1024, 48).unwrap_err();
        assert!(e.to_string().contains("alignment=48"));
    }

    #[test]
    fn a_huge_request_is_a_capacity_error_not_an_overflow() {
        let mut pool = StagingRanges::new(1024, 256).unwrap();
        assert_eq!(pool.alloc(u64::MAX).unwrap_err().kind(), "Capacity");
        assert!(pool.is_empty());
    }

    mod pull_ids {
        use super::super::*;
        use crate::wire::peer::{tests::meta_with_staging, Region};
        use crate::wire::value::WireValue;
        use proptest::prelude::*;

        // Two source ranks of the test export: 4 blocks of 2 tokens each.
        fn peer(rank: i128) -> PeerMeta {
            let mut v = meta_with_staging(Region { addr: 1 << 20, nbytes: 4096 });
            if let WireValue::Map(entries) = &mut v {
                for (k, val) in entries.iter_mut() {
                    if k == "layout" {
                        if let WireValue::Map(lay) = val {
                            for (lk, lv) in lay.iter_mut() {
                                if lk == "global_rank" {
                                    *lv = WireValue::Int(rank);
                                }
                            }
                        }
                    }
                }
            }
            PeerMeta::parse(&v, "nixl").unwrap()
        }
        /// Source ids, destination ids, tokens, ranks, slot room.
        type Case<'a> = (SourceIds, Vec<i64>, Option<i64>, &'a [u32], usize);
        const LOCAL: LocalSide =
            LocalSide { is_dst: true, num_blocks: 4, tokens_per_block: Some(2) };

        #[test]
        fn bad_ids_raise_what_check_transfer_raises_and_leave_the_slot_untouched() {
            let (a, b) = (peer(0), peer(1));
            let mut out = vec![-7_i64; 16];
            for (src, dst) in [
                (SourceIds::Shared(vec![0, 4]), vec![0, 1]),
                (SourceIds::PerRank(vec![(0, vec![0, 1]), (1, vec![2, 2])]), vec![0, 1]),
                (SourceIds::Shared(vec![0, 1]), vec![3, 3]),
            ] {
                let want = check_transfer(&[&a, &b], &src, Some(&dst), None, LOCAL).unwrap_err();
                let got = write_pull_ids(
                    false,
                    &[&a, &b],
                    &[0, 1],
                    &src,
                    Some(&dst),
                    None,
                    LOCAL,
                    2,
                    &mut out,
                )
                .unwrap_err();
                assert_eq!(got.to_string(), want.to_string());
                assert!(out.iter().all(|&x| x == -7));
            }
        }

        #[test]
        fn ids_that_do_not_fit_the_layout_are_left_to_the_general_path() {
            let (a, b) = (peer(0), peer(1));
            let mut out = [-7_i64; 16];
            let per = |x: Vec<i64>| SourceIds::PerRank(vec![(0, vec![0, 1]), (1, x)]);
            // 3 tokens span 2 blocks; 1 token spans 1 block but 2 ids are given.
            let cases: [Case<'_>; 4] = [
                (per(vec![2, 3]), vec![0, 1], Some(1), &[0, 1], 16),
                (SourceIds::PerRank(vec![(0, vec![0, 1])]), vec![0, 1], None, &[0, 1], 16),
                (per(vec![2, 3]), vec![0, 1], None, &[0, 1], 5),
                (per(vec![2, 3]), vec![0, 1], None, &[0, 1], 16),
            ];
            for (k, (src, dst, n, ranks, room)) in cases.into_iter().enumerate() {
                let got = write_pull_ids(
                    false,
                    &[&a, &b],
                    ranks,
                    &src,
                    Some(&dst),
                    n,
                    LOCAL,
                    2,
                    &mut out[..room],
                )
                .unwrap();
                assert_eq!(got.is_some(), k == 3, "case {k}: {got:?}");
            }
        }

        proptest! {
            #[test]
            fn the_slot_holds_the_destination_then_each_rank_on_even_starts(
                n_tok in 1_i64..=8,
                perm in Just((0_i64..4).collect::<Vec<_>>()).prop_shuffle(),
                shared in any::<bool>(),
            ) {
                let (a, b) = (peer(0), peer(1));
                let n_blk = usize::try_from(n_tok).unwrap().div_ceil(2);
                let dst: Vec<i64> = perm[..n_blk].to_vec();
                let s0: Vec<i64> = perm.iter().rev().take(n_blk).copied().collect();
                let s1: Vec<i64> = if shared { s0.clone() } else { perm[4 - n_blk..].to_vec() };
                let src = if shared {
                    SourceIds::Shared(s0.clone())
                } else {
                    SourceIds::PerRank(vec![(1, s1.clone()), (0, s0.clone())])
                };
                let mut out = vec![-7_i64; 16];
                let got = write_pull_ids(false, &[&a, &b], &[0, 1], &src, Some(&dst), Some(n_tok), LOCAL, 2, &mut out)
                    .unwrap()
                    .unwrap();
                let stride = n_blk + n_blk % 2;
                prop_assert_eq!(got, PullIds {
                    num_tokens: u64::try_from(n_tok).unwrap(), num_blocks: n_blk, stride,
                    len: 3 * stride,
                });
                prop_assert_eq!(pull_ids_len(n_blk, 2), 3 * stride);
                let mut want = vec![-7_i64; 16];
                for (j, ids) in [&dst, &s0, &s1].into_iter().enumerate() {
                    want[j * stride..j * stride + n_blk].copy_from_slice(ids);
                }
                prop_assert_eq!(&out, &want);
                // Checked already: the same layout, no second check.
                let mut again = vec![-7_i64; 16];
                let got = write_pull_ids(true, &[], &[0, 1], &src, Some(&dst), Some(n_tok), LOCAL, 2, &mut again);
                prop_assert_eq!(got.unwrap().map(|g| g.len), Some(3 * stride));
                prop_assert_eq!(&again, &want);
                let none = write_pull_ids(true, &[], &[0, 1], &src, Some(&dst), None, LOCAL, 2, &mut again);
                prop_assert_eq!(none.unwrap(), None);
            }

            #[test]
            fn a_source_packing_its_own_blocks_gets_its_ids_at_zero(
                n_tok in 1_i64..=8,
                perm in Just((0_i64..4).collect::<Vec<_>>()).prop_shuffle(),
                rank in 0_u32..2,
            ) {
                let (a, b) = (peer(0), peer(1));
                let n_blk = usize::try_from(n_tok).unwrap().div_ceil(2);
                let s0: Vec<i64> = perm[..n_blk].to_vec();
                let s1: Vec<i64> = perm[4 - n_blk..].to_vec();
                let src = SourceIds::PerRank(vec![(0, s0.clone()), (1, s1.clone())]);
                let local = LocalSide { is_dst: false, ..LOCAL };
                // The same checks as the transfer's (a bad id raises alike) ...
                let bad = SourceIds::PerRank(vec![(0, vec![9; n_blk]), (1, s1.clone())]);
                let want = check_transfer(&[&a, &b], &bad, None, Some(n_tok), local).unwrap_err();
                let mut out = vec![-7_i64; 8];
                let got = write_pull_ids(false, &[&a, &b], &[rank], &bad, None, Some(n_tok), local, 2, &mut out);
                prop_assert_eq!(got.unwrap_err().to_string(), want.to_string());
                // ... and only this rank's ids are laid out, from index 0.
                let got = write_pull_ids(false, &[&a, &b], &[rank], &src, None, Some(n_tok), local, 2, &mut out)
                    .unwrap()
                    .unwrap();
                let stride = n_blk + n_blk % 2;
                prop_assert_eq!(got, PullIds {
                    num_tokens: u64::try_from(n_tok).unwrap(), num_blocks: n_blk, stride, len: stride,
                });
                let mut want = vec![-7_i64; 8];
                want[..n_blk].copy_from_slice(if rank == 0 { &s0 } else { &s1 });
                prop_assert_eq!(&out, &want);
                // Ids checked before: the same layout without a second check.
                let mut again = vec![-7_i64; 8];
                let n = u64::try_from(n_tok).unwrap();
                prop_assert_eq!(lay_out_ids(&[rank], &src, None, n, 2, &mut again), Some(got));
                prop_assert_eq!(again, want);
            }
        }
    }
}
