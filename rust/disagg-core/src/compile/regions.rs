//! Region tables: the separately registered pieces of one rank's cache.
//!
//! Real engines allocate the KV cache per layer (one NHD or HND tensor per layer, separate K
//! and V tensors, one MLA latent per layer), so one rank's cache is a list of regions at
//! unrelated addresses. The compiler works with absolute addresses and merges ranges that are
//! contiguous, so a merged range may run from the end of one region into the next one that
//! happens to follow it in memory; a transport, which registers each region on its own, must
//! never see such a range. This module splits rows at region boundaries and tells which region
//! every row lies in, checking that every byte lies inside a region. All ranges are half-open.

use crate::error::{DisaggError, DisaggResult};
use crate::wire::peer::Region;

use super::program::Rows;

/// The regions of one rank, in registration order, with a sorted index for lookups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionTable {
    regions: Vec<Region>,
    /// Region indices in ascending address order.
    sorted: Vec<usize>,
}

/// Which list a row set is, which says where its address and length columns are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowForm {
    /// Gather rows `(src_addr, len, packed_offset)`: grouped by `src_addr`.
    Gather,
    /// Scatter rows `(packed_offset, dst_addr, len)`: grouped by `dst_addr`.
    Scatter,
}

impl RowForm {
    /// Parse `"gather"` or `"scatter"`.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "gather" => Ok(Self::Gather),
            "scatter" => Ok(Self::Scatter),
            other => Err(DisaggError::argument(
                "form",
                format!("form={other:?} is not one of 'gather', 'scatter'"),
            )),
        }
    }

    /// `(address, length, other)` of a row.
    fn parts(self, r: &[u64; 3]) -> (u64, u64, u64) {
        match self {
            Self::Gather => (r[0], r[1], r[2]),
            Self::Scatter => (r[1], r[2], r[0]),
        }
    }

    fn row(self, addr: u64, len: u64, other: u64) -> [u64; 3] {
        match self {
            Self::Gather => [addr, len, other],
            Self::Scatter => [other, addr, len],
        }
    }
}

impl RegionTable {
    /// Validate `regions` (`field` names them in errors): at least one, each addressable
    /// (`addr + nbytes` fits u64) and non-empty, no two sharing a byte.
    pub fn new(field: &str, regions: Vec<Region>) -> DisaggResult<Self> {
        if regions.is_empty() {
            return Err(DisaggError::wire(field, format!("{field} lists no region")));
        }
        for (i, r) in regions.iter().enumerate() {
            if r.nbytes == 0 || r.addr.checked_add(r.nbytes).is_none() {
                return Err(DisaggError::wire(
                    field,
                    format!(
                        "{field}[{i}] = (addr={:#x}, nbytes={}) must hold at least one byte and \
                         end below 2**64",
                        r.addr, r.nbytes
                    ),
                ));
            }
        }
        let mut sorted: Vec<usize> = (0..regions.len()).collect();
        sorted.sort_by_key(|&i| regions[i].addr);
        for w in sorted.windows(2) {
            let (a, b) = (regions[w[0]], regions[w[1]]);
            if a.overlaps(&b) {
                return Err(DisaggError::wire(
                    field,
                    format!(
                        "{field}[{}] [{:#x}, {:#x}) overlaps {field}[{}] [{:#x}, {:#x})",
                        w[0],
                        a.addr,
                        a.end(),
                        w[1],
                        b.addr,
                        b.end()
                    ),
                ));
            }
        }
        Ok(Self { regions, sorted })
    }

    /// A table of no region (a buffer of no bytes): every lookup misses.
    pub fn empty() -> Self {
        Self { regions: Vec::new(), sorted: Vec::new() }
    }

    /// Whether the table holds no region.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// The regions in registration order.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// The regions as `(addr, nbytes)` pairs, in registration order.
    #[must_use]
    pub fn pairs(&self) -> Vec<(u64, u64)> {
        self.regions.iter().map(|r| (r.addr, r.nbytes)).collect()
    }

    /// Index of the region holding byte `addr`, if any.
    pub fn locate(&self, addr: u64) -> Option<usize> {
        let k = self.sorted.partition_point(|&i| self.regions[i].addr <= addr);
        let i = *self.sorted.get(k.checked_sub(1)?)?;
        self.regions[i].contains(addr, 1).then_some(i)
    }

    /// Whether `[addr, addr + len)` lies inside region `i` (an index `locate` returned).
    fn holds(&self, i: usize, addr: u64, len: u64) -> bool {
        self.regions[i].contains(addr, len)
    }

    fn outside(&self, field: &str, row: usize, addr: u64, len: u64) -> DisaggError {
        let shown: Vec<String> = self
            .regions
            .iter()
            .take(8)
            .map(|g| format!("[{:#x}, {:#x})", g.addr, g.end()))
            .collect();
        let more = self.regions.len().saturating_sub(8);
        DisaggError::wire(
            field,
            format!(
                "row {row} byte range [{addr:#x}, {:#x}) lies outside the {} registered regions \
                 ({}{})",
                addr.saturating_add(len),
                self.regions.len(),
                shown.join(", "),
                if more > 0 { format!(", and {more} more") } else { String::new() }
            ),
        )
    }

    /// The end of the region holding `addr` (`field`, `row` name an error).
    fn end_of(&self, field: &str, row: usize, addr: u64, len: u64) -> DisaggResult<u64> {
        self.locate(addr)
            .map(|i| self.regions[i].end())
            .ok_or_else(|| self.outside(field, row, addr, len))
    }

    /// Split direct descriptor pairs (`src` rows `(addr, len, device)` in `src_t`, `dst` rows in
    /// `dst_t`) so that every piece lies inside one region on each side. `None` when every
    /// row already does (the common case: nothing is copied). Errors: `Wire`, naming
    /// `src_descriptors` or `dst_descriptors`, for a byte outside every region of its side.
    pub fn split_pairs(
        src_t: &RegionTable,
        dst_t: &RegionTable,
        src: &[[u64; 3]],
        dst: &[[u64; 3]],
    ) -> DisaggResult<Option<(Rows, Rows)>> {
        if src.len() != dst.len() {
            return Err(DisaggError::argument(
                "dst_rows",
                format!("{} source rows but {} destination rows", src.len(), dst.len()),
            ));
        }
        let inside =
            |t: &RegionTable, r: &[u64; 3]| t.locate(r[0]).is_some_and(|i| t.holds(i, r[0], r[1]));
        let first = src.iter().zip(dst).position(|(s, d)| !inside(src_t, s) || !inside(dst_t, d));
        let Some(first) = first else { return Ok(None) };
        let mut out_s: Rows = src[..first].to_vec();
        let mut out_d: Rows = dst[..first].to_vec();
        for (k, (s, d)) in src.iter().zip(dst).enumerate().skip(first) {
            if s[1] != d[1] {
                return Err(DisaggError::argument(
                    "dst_rows",
                    format!("row {k}: source length {} != destination length {}", s[1], d[1]),
                ));
            }
            let (mut a, mut b, mut left) = (s[0], d[0], s[1]);
            while left > 0 {
                let ea = src_t.end_of("src_descriptors", k, a, left)?;
                let eb = dst_t.end_of("dst_descriptors", k, b, left)?;
                let piece = left.min(ea - a).min(eb - b);
                out_s.push([a, piece, s[2]]);
                out_d.push([b, piece, d[2]]);
                (a, b, left) = (a + piece, b + piece, left - piece);
            }
        }
        Ok(Some((out_s, out_d)))
    }

    /// Gather or scatter rows grouped by the region their buffer-side address lies in:
    /// `(region index, rows)` in ascending region order, rows in list order within a region;
    /// a row that runs into the next region is split at the boundary; `None` for a table of
    /// one region, which holds the rows as they are. Errors: `Wire` (field `rows`) for a byte
    /// outside every region.
    pub fn group(
        &self,
        rows: &[[u64; 3]],
        form: RowForm,
    ) -> DisaggResult<Option<Vec<(usize, Rows)>>> {
        if self.regions.len() == 1 {
            if let Some(k) = rows.iter().position(|r| {
                let (a, len, _) = form.parts(r);
                !self.holds(0, a, len)
            }) {
                let (a, len, _) = form.parts(&rows[k]);
                return Err(self.outside("rows", k, a, len));
            }
            return Ok(None);
        }
        let mut groups: Vec<Rows> = vec![Vec::new(); self.regions.len()];
        for (k, r) in rows.iter().enumerate() {
            let (mut a, mut left, mut other) = form.parts(r);
            while left > 0 {
                let i = self.locate(a).ok_or_else(|| self.outside("rows", k, a, left))?;
                let piece = left.min(self.regions[i].end() - a);
                groups[i].push(form.row(a, piece, other));
                (a, left, other) = (a + piece, left - piece, other.saturating_add(piece));
            }
        }
        Ok(Some(groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table(rs: &[(u64, u64)]) -> RegionTable {
        RegionTable::new(
            "regions",
            rs.iter().map(|&(addr, nbytes)| Region { addr, nbytes }).collect(),
        )
        .unwrap()
    }

    #[test]
    fn pairs_keep_registration_order() {
        assert_eq!(table(&[(100, 50), (0, 100)]).pairs(), [(100, 50), (0, 100)]);
    }

    #[test]
    fn overlapping_empty_or_missing_regions_are_refused() {
        let r = |addr, nbytes| Region { addr, nbytes };
        assert!(RegionTable::new("regions", vec![]).is_err());
        assert!(RegionTable::new("regions", vec![r(0, 0)]).is_err());
        assert!(RegionTable::new("regions", vec![r(u64::MAX, 2)]).is_err());
        let e = RegionTable::new("regions", vec![r(100, 50), r(0, 101)]).unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{e}");
        assert!(RegionTable::new("regions", vec![r(100, 50), r(0, 100)]).is_ok());
    }

    #[test]
    fn locate_finds_the_region_of_every_byte_and_none_between_them() {
        let t = table(&[(1000, 100), (0, 10), (500, 1)]);
        assert_eq!(t.locate(0), Some(1));
        assert_eq!(t.locate(9), Some(1));
        assert_eq!(t.locate(10), None);
        assert_eq!(t.locate(500), Some(2));
        assert_eq!(t.locate(501), None);
        assert_eq!(t.locate(1099), Some(0));
        assert_eq!(t.locate(1100), None);
    }

    #[test]
    fn a_pair_running_across_adjacent_regions_is_split_at_the_boundary() {
        let src = table(&[(0, 64), (64, 64)]);
        let dst = table(&[(1000, 200)]);
        let (s, d) = RegionTable::split_pairs(&src, &dst, &[[32, 64, 7]], &[[1000, 64, 9]])
            .unwrap()
            .unwrap();
        assert_eq!(s, vec![[32, 32, 7], [64, 32, 7]]);
        assert_eq!(d, vec![[1000, 32, 9], [1032, 32, 9]]);
        assert_eq!(
            RegionTable::split_pairs(&src, &dst, &[[0, 64, 7]], &[[1000, 64, 9]]).unwrap(),
            None
        );
        let e =
            RegionTable::split_pairs(&src, &dst, &[[100, 64, 7]], &[[1000, 64, 9]]).unwrap_err();
        assert!(e.to_string().contains("src_descriptors"), "{e}");
        let e = RegionTable::split_pairs(&src, &dst, &[[0, 8, 7]], &[[1199, 8, 9]]).unwrap_err();
        assert!(e.to_string().contains("dst_descriptors"), "{e}");
    }

    #[test]
    fn grouping_keeps_list_order_and_splits_at_boundaries() {
        let t = table(&[(100, 10), (110, 10), (0, 50)]);
        let rows = [[0, 8, 0], [105, 10, 8], [40, 10, 18]];
        let g = t.group(&rows, RowForm::Gather).unwrap().unwrap();
        assert_eq!(
            g,
            vec![
                (0, vec![[105, 5, 8]]),
                (1, vec![[110, 5, 13]]),
                (2, vec![[0, 8, 0], [40, 10, 18]])
            ]
        );
        let sc = t.group(&[[3, 112, 4]], RowForm::Scatter).unwrap();
        assert_eq!(sc, Some(vec![(1, vec![[3, 112, 4]])]));
        assert!(t.group(&[[60, 4, 0]], RowForm::Gather).is_err());
        // One region holds the rows as they are, once each lies inside it.
        let one = table(&[(100, 50)]);
        assert_eq!(one.group(&[[100, 8, 0], [140, 10, 8]], RowForm::Gather).unwrap(), None);
        assert_eq!(one.group(&[], RowForm::Gather).unwrap(), None);
        assert!(one.group(&[[145, 10, 0]], RowForm::Gather).is_err());
    }

    proptest! {
        /// Splitting and grouping never change which bytes move where: expanding the pieces
        /// byte by byte gives the input's bytes, and every piece lies in one region.
        #[test]
        fn split_pieces_cover_exactly_the_input_bytes(
            sizes in prop::collection::vec(1u64..40, 1..6),
            gaps in prop::collection::vec(0u64..3, 6),
            rows in prop::collection::vec((0u64..200, 1u64..60), 1..8),
        ) {
            let mut regions = Vec::new();
            let mut at = 0;
            for (i, s) in sizes.iter().enumerate() {
                at += gaps[i] * 7;
                regions.push((at, *s));
                at += s;
            }
            let t = table(&regions);
            let src: Vec<[u64; 3]> = rows.iter().map(|&(a, l)| [a, l, 0]).collect();
            let dst: Vec<[u64; 3]> = rows.iter().map(|&(a, l)| [a, l, 1]).collect();
            let fits = rows.iter().all(|&(a, l)| (a..a + l).all(|b| t.locate(b).is_some()));
            match RegionTable::split_pairs(&t, &t, &src, &dst) {
                Err(_) => prop_assert!(!fits),
                Ok(out) => {
                    prop_assert!(fits);
                    let (s, d) = out.unwrap_or((src.clone(), dst.clone()));
                    let bytes = |rs: &[[u64; 3]]| rs.iter().flat_map(|r| r[0]..r[0] + r[1]).collect::<Vec<_>>();
                    prop_assert_eq!(bytes(&s), bytes(&src));
                    prop_assert_eq!(bytes(&d), bytes(&dst));
                    for r in &s {
                        let i = t.locate(r[0]).unwrap();
                        prop_assert!(t.holds(i, r[0], r[1]));
                    }
                    let gathered: Vec<[u64; 3]> = {
                        let mut p = 0;
                        src.iter().map(|r| { let row = [r[0], r[1], p]; p += r[1]; row }).collect()
                    };
                    let mut pairs: Vec<(u64, u64)> = Vec::new();
                    let groups = t.group(&gathered, RowForm::Gather).unwrap();
                    for (i, g) in groups.unwrap_or_else(|| vec![(0, gathered.clone())]) {
                        for r in g {
                            prop_assert!(t.regions[i].contains(r[0], r[1]));
                            pairs.extend((0..r[1]).map(|k| (r[2] + k, r[0] + k)));
                        }
                    }
                    pairs.sort_unstable();
                    let want: Vec<(u64, u64)> = gathered
                        .iter()
                        .flat_map(|r| (0..r[1]).map(move |k| (r[2] + k, r[0] + k)))
                        .collect();
                    prop_assert_eq!(pairs, want);
                }
            }
        }
    }
}
