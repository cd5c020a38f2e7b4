//! Byte ranges of a staging region: the allocator behind a transport's fixed staging pool.
//!
//! A staged transfer packs its fragments into a contiguous range of a registered region and
//! the peer reads that range with one descriptor. [`StagingRanges`] hands out those ranges,
//! first fit, every range starting on `alignment` bytes (so packed rows can use wide element
//! views), and tracks one entry per range in flight, never one per block. Ranges are half-open
//! `[offset, offset + size)`.

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};

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
        let budget = self.largest_free() / share.max(1);
        let slots = max_slots.min(budget / item_bytes.max(1));
        if slots < 2 {
            return None;
        }
        let slot_bytes = budget / slots / self.alignment * self.alignment;
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

    /// The reserved ranges `(offset, size)` in address order.
    #[must_use]
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.used.iter().map(|(&o, &l)| (o, l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

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
}
