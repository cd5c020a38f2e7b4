//! Run tables: what the GPU copy kernel takes to pack or scatter a compiler row list.
//!
//! A row list is one of the compiler's forms: per-fragment `gather` rows `(offset, len,
//! packed)` or `scatter` rows `(packed, offset, len)`, or per-run `gather_runs` rows
//! `(offset, packed, len, count, stride, packed_stride)` / `scatter_runs` rows `(packed,
//! offset, len, count, packed_stride, stride)`. The kernel needs the runs sorted by packed
//! offset and packed back to back from 0 (canonical); [`run_table`] checks that, the bounds of
//! both sides, and picks the widest power-of-two unit (at most 16 bytes) dividing every
//! offset, length, used stride and buffer address, so the kernel moves whole units.

use crate::error::{DisaggError, DisaggResult};

/// The form of a compiler row list (per fragment or per strided run; `compile::RowForm` names
/// only the per-fragment forms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListForm {
    /// `(offset, len, packed)` per fragment.
    Gather,
    /// `(packed, offset, len)` per fragment.
    Scatter,
    /// `(offset, packed, len, count, stride, packed_stride)` per run.
    GatherRuns,
    /// `(packed, offset, len, count, packed_stride, stride)` per run.
    ScatterRuns,
}

impl ListForm {
    /// The form called `name` (`"gather"`, `"scatter"`, `"gather_runs"`, `"scatter_runs"`).
    pub fn from_name(name: &str) -> DisaggResult<ListForm> {
        Ok(match name {
            "gather" => ListForm::Gather,
            "scatter" => ListForm::Scatter,
            "gather_runs" => ListForm::GatherRuns,
            "scatter_runs" => ListForm::ScatterRuns,
            other => {
                return Err(DisaggError::argument(
                    "form",
                    format!(
                        "form={other:?} must be one of \"gather\", \"scatter\", \
                         \"gather_runs\", \"scatter_runs\""
                    ),
                ))
            }
        })
    }

    /// Columns per row.
    pub fn width(self) -> usize {
        match self {
            ListForm::Gather | ListForm::Scatter => 3,
            ListForm::GatherRuns | ListForm::ScatterRuns => 6,
        }
    }
}

/// One run: `count` fragments of `len` bytes, `stride` apart on the scattered side, back to
/// back from `packed` on the packed side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    packed: i128,
    other: i128,
    len: i128,
    count: i128,
    stride: i128,
}

/// A run table in host memory, laid out as the kernel reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunTable {
    /// `n_runs + 1` packed starts (the last is the total), then `n_runs` scattered starts,
    /// fragment lengths and scattered strides, all in units.
    pub host: Vec<i64>,
    /// Runs.
    pub n_runs: usize,
    /// Bytes per unit (1, 2, 4, 8 or 16).
    pub unit: u64,
    /// Packed bytes.
    pub total_bytes: u64,
    /// One past the last scattered byte written or read.
    pub other_end_bytes: u64,
    /// Units of the shortest run (0 without runs).
    pub min_run_units: u64,
    /// Fragment-index arithmetic the kernel needs: 0 (one fragment per run), 32 or 64 bits.
    pub div_bits: u32,
}

/// The runs of `rows` with scattered offsets relative to `base`, empty ones dropped; `None`
/// when a run's packed side does not advance by exactly one fragment.
fn runs_of(rows: &[u64], form: ListForm, base: u64) -> Option<Vec<Run>> {
    let mut runs = Vec::with_capacity(rows.len() / form.width());
    for r in rows.chunks_exact(form.width()) {
        let c = |i: usize| i128::from(r[i]);
        let (packed, other, len, count, stride, packed_stride) = match form {
            ListForm::Gather => (c(2), c(0), c(1), 1, 0, c(1)),
            ListForm::Scatter => (c(0), c(1), c(2), 1, 0, c(2)),
            ListForm::GatherRuns => (c(1), c(0), c(2), c(3), c(4), c(5)),
            ListForm::ScatterRuns => (c(0), c(1), c(2), c(3), c(5), c(4)),
        };
        if len > 0 && count > 0 {
            if count > 1 && packed_stride != len {
                return None;
            }
            runs.push(Run { packed, other: other - i128::from(base), len, count, stride });
        }
    }
    Some(runs)
}

/// The run table of `rows` (`form`, flat row-major, `cols` columns), scattered offsets
/// relative to `other_base`; `None` when the packed side is not canonical (the caller takes a
/// path that needs no table). The scattered side must fit `[0, other_limit)` and the packed
/// side `[0, packed_limit)` bytes; `align` are buffer addresses folded into the unit.
pub fn run_table(
    rows: &[u64],
    cols: usize,
    form: ListForm,
    other_base: u64,
    other_limit: u64,
    packed_limit: u64,
    align: &[u64],
) -> DisaggResult<Option<RunTable>> {
    let w = form.width();
    if cols != w || !rows.len().is_multiple_of(w) {
        return Err(DisaggError::argument(
            "rows",
            format!("{} values in rows of {cols} columns; {form:?} rows have {w}", rows.len()),
        ));
    }
    let Some(mut runs) = runs_of(rows, form, other_base) else { return Ok(None) };
    runs.sort_by_key(|r| r.packed); // stable: equal starts keep their order
    let mut total: i128 = 0;
    for r in &runs {
        if r.packed != total {
            return Ok(None);
        }
        total += r.len * r.count;
    }
    let other_end = match runs.iter().map(|r| r.other).min() {
        Some(low) if low < 0 => {
            return Err(DisaggError::argument(
                "rows",
                format!("scattered side: fragment starts below the buffer (offset {low})"),
            ))
        }
        _ => runs.iter().map(|r| r.other + (r.count - 1) * r.stride + r.len).max().unwrap_or(0),
    };
    if other_end > i128::from(other_limit) {
        return Err(DisaggError::argument(
            "rows",
            format!(
                "scattered side: fragment ends at byte {other_end}, past the buffer's \
                 {other_limit} bytes"
            ),
        ));
    }
    if total > i128::from(packed_limit) {
        return Err(DisaggError::argument(
            "rows",
            format!(
                "packed side: fragments end at byte {total}, past the staging region's \
                 {packed_limit} bytes"
            ),
        ));
    }
    Ok(Some(table_of(&runs, total, other_end, align)))
}

/// The table of canonical, bounded `runs` (every value non-negative).
fn table_of(runs: &[Run], total: i128, other_end: i128, align: &[u64]) -> RunTable {
    let mut bits: i128 = 16;
    for r in runs {
        bits |= r.packed | r.other | r.len | if r.count > 1 { r.stride } else { 0 };
    }
    for &a in align {
        bits |= i128::from(a);
    }
    let u = bits & -bits;
    let n = runs.len();
    let units = |v: i128| i64::try_from(v / u).unwrap_or(i64::MAX);
    let mut host = Vec::with_capacity(4 * n + 1);
    host.extend(runs.iter().map(|r| units(r.packed)));
    host.push(units(total));
    host.extend(runs.iter().map(|r| units(r.other)));
    host.extend(runs.iter().map(|r| units(r.len)));
    host.extend(runs.iter().map(|r| units(r.stride)));
    let run_units = runs.iter().map(|r| r.len * r.count / u);
    let div_bits = match (runs.iter().map(|r| r.count).max(), run_units.clone().max()) {
        (None | Some(1), _) => 0,
        (_, Some(m)) if m < 1 << 31 => 32,
        _ => 64,
    };
    let to_u64 = |v: i128| u64::try_from(v).unwrap_or(u64::MAX);
    RunTable {
        host,
        n_runs: n,
        unit: to_u64(u),
        total_bytes: to_u64(total),
        other_end_bytes: to_u64(other_end),
        min_run_units: to_u64(run_units.min().unwrap_or(0)),
        div_bits,
    }
}

/// A fragment copy by whole rows: what a row-gather/row-scatter (index ops on `row_bytes`
/// wide rows) needs to pack or scatter a `gather` or `scatter` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowCopy {
    /// Row width: the greatest common divisor of every offset and length (1 for none).
    pub row_bytes: u64,
    /// Scattered-side row of every row moved, fragment by fragment in list order.
    pub side_rows: Vec<i64>,
    /// Packed-side row of every row moved, or `None` when the packed side is back to back
    /// from 0 in list order (row `j` of the copy is packed row `j`).
    pub packed_rows: Option<Vec<i64>>,
    /// Bytes moved.
    pub total: u64,
}

/// Check that `[start, start + len)` fragments lie in `[0, limit)`; `name` says which side.
fn check_side(name: &str, starts: &[i128], lens: &[i128], limit: u64) -> DisaggResult<()> {
    if let Some(&low) = starts.iter().min().filter(|&&m| m < 0) {
        return Err(DisaggError::argument(
            "rows",
            format!("{name}: fragment starts below the buffer (offset {low})"),
        ));
    }
    let end = starts.iter().zip(lens).map(|(s, l)| s + l).max().unwrap_or(0);
    if end > i128::from(limit) {
        return Err(DisaggError::argument(
            "rows",
            format!("{name}: fragment ends at byte {end}, past the buffer's {limit} bytes"),
        ));
    }
    Ok(())
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 {
        a.abs()
    } else {
        gcd(b, a % b)
    }
}

/// The rows of fragments `[start, start + len)` in units of `g` bytes, in order.
fn expand(starts: &[i128], lens: &[i128], g: i128) -> Vec<i64> {
    let row = |v: i128| i64::try_from(v / g).unwrap_or(i64::MAX);
    starts.iter().zip(lens).flat_map(|(&s, &l)| row(s)..row(s + l)).collect()
}

/// The row copy of a `gather` (`(addr, len, packed)`) or `scatter` (`(packed, addr, len)`)
/// list whose addresses are relative to `base`: the scattered side must fit `[0, side_limit)`
/// and the packed side `[0, packed_limit)` bytes (`ArgumentError` naming the side
/// otherwise).
pub fn row_copy(
    rows: &[u64],
    cols: usize,
    form: ListForm,
    base: u64,
    side_limit: u64,
    packed_limit: u64,
) -> DisaggResult<RowCopy> {
    let (side_at, len_at, packed_at, names) = match form {
        ListForm::Gather => (0, 1, 2, ["gather source", "gather packed"]),
        ListForm::Scatter => (1, 2, 0, ["scatter destination", "scatter packed"]),
        other => {
            return Err(DisaggError::argument(
                "form",
                format!(
                    "{other:?} lists are run lists; a row copy takes \"gather\" or \"scatter\""
                ),
            ))
        }
    };
    if cols != 3 || !rows.len().is_multiple_of(3) {
        return Err(DisaggError::argument(
            "rows",
            format!("{} values in rows of {cols} columns; fragment rows have 3", rows.len()),
        ));
    }
    let col =
        |at: usize| -> Vec<i128> { rows.chunks_exact(3).map(|r| i128::from(r[at])).collect() };
    let side: Vec<i128> = col(side_at).into_iter().map(|a| a - i128::from(base)).collect();
    let (lens, packed) = (col(len_at), col(packed_at));
    let checks = [(names[0], &side, side_limit), (names[1], &packed, packed_limit)];
    let order = if form == ListForm::Gather { [0, 1] } else { [1, 0] };
    for i in order {
        let (name, starts, limit) = checks[i];
        check_side(name, starts, &lens, limit)?;
    }
    let g = side.iter().chain(&lens).chain(&packed).fold(0, |g, &v| gcd(g, v)).max(1);
    let mut at: i128 = 0;
    let dense = packed.iter().zip(&lens).all(|(&p, &l)| {
        let ok = p == at;
        at += l;
        ok
    });
    Ok(RowCopy {
        row_bytes: u64::try_from(g).unwrap_or(1),
        side_rows: expand(&side, &lens, g),
        packed_rows: (!dense).then(|| expand(&packed, &lens, g)),
        total: u64::try_from(at).unwrap_or(u64::MAX),
    })
}

/// [`row_copy`] between two byte views at storage offsets `offsets` (scattered side, packed
/// side) and the unit each is read in (`backend_rules::row_unit` of the row width there).
pub fn row_copy_units(
    rows: &[u64],
    cols: usize,
    (form, base): (ListForm, u64),
    (side_limit, packed_limit): (u64, u64),
    (side_offset, packed_offset): (u64, u64),
) -> DisaggResult<(RowCopy, (u64, u64))> {
    let rc = row_copy(rows, cols, form, base, side_limit, packed_limit)?;
    let unit = |offset| crate::backend_rules::row_unit(rc.row_bytes, offset);
    let units = (unit(side_offset), unit(packed_offset));
    Ok((rc, units))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table(rows: &[u64], form: &str, base: u64, limits: (u64, u64)) -> Option<RunTable> {
        run_table(
            rows,
            ListForm::from_name(form).unwrap().width(),
            ListForm::from_name(form).unwrap(),
            base,
            limits.0,
            limits.1,
            &[],
        )
        .unwrap()
    }

    #[test]
    fn the_unit_is_the_widest_power_of_two_dividing_every_offset_and_address() {
        let rows = [1024, 256, 0, 4096, 512, 256];
        let t = table(&rows, "gather", 0, (8192, 768)).unwrap();
        assert_eq!((t.unit, t.total_bytes, t.n_runs, t.div_bits), (16, 768, 2, 0));
        assert_eq!(t.host, [0, 16, 48, 64, 256, 16, 32, 0, 0]);
        let odd = run_table(&rows, 3, ListForm::Gather, 0, 8192, 768, &[4100]).unwrap().unwrap();
        assert_eq!(odd.unit, 4);
    }

    #[test]
    fn runs_are_sorted_by_packed_offset_and_holes_have_no_table() {
        let t = table(&[256, 0, 256, 0, 4096, 256], "scatter", 0, (8192, 512)).unwrap();
        assert_eq!(t.host[3..5], [256, 0]);
        assert_eq!(table(&[0, 16, 32, 64, 16, 0], "gather", 0, (128, 48)), None);
    }

    #[test]
    fn bounds_are_refused_naming_the_side() {
        let err = |rows: &[u64], base, limits: (u64, u64)| {
            run_table(rows, 3, ListForm::Gather, base, limits.0, limits.1, &[])
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[120, 16, 0], 0, (128, 16)).contains("past the buffer's 128 bytes"));
        assert!(err(&[120, 16, 0], 200, (128, 16)).contains("below the buffer"));
        assert!(err(&[0, 16, 0], 0, (128, 8)).contains("staging region's 8 bytes"));
        assert!(ListForm::from_name("pack").is_err());
        assert!(run_table(&[1, 2], 3, ListForm::Gather, 0, 8, 8, &[]).is_err());
        assert!(run_table(&[0; 6], 3, ListForm::GatherRuns, 0, 8, 8, &[]).is_err());
    }

    #[test]
    fn strided_runs_need_the_packed_side_to_advance_one_fragment() {
        // 2 fragments of 32 bytes, 256 apart on the scattered side, packed back to back.
        let t = table(&[0, 0, 32, 2, 256, 32], "gather_runs", 0, (4096, 64)).unwrap();
        assert_eq!((t.unit, t.total_bytes, t.other_end_bytes, t.div_bits), (16, 64, 288, 32));
        assert_eq!(table(&[0, 0, 32, 2, 256, 48], "gather_runs", 0, (4096, 96)), None);
    }

    #[test]
    fn row_copies_use_the_widest_common_row_and_skip_the_packed_index_when_dense() {
        // Two 256-byte fragments at 1024 and 4096, packed back to back.
        let rc =
            row_copy(&[1024, 256, 0, 4096, 256, 256], 3, ListForm::Gather, 0, 8192, 512).unwrap();
        assert_eq!((rc.row_bytes, rc.total), (256, 512));
        assert_eq!(rc.side_rows, [4, 16]);
        assert_eq!(rc.packed_rows, None);
        // Scatter rows (packed, addr, len), packed out of order: the packed index is kept.
        let rc = row_copy(&[32, 0, 32, 0, 64, 32], 3, ListForm::Scatter, 0, 128, 64).unwrap();
        assert_eq!(
            (rc.row_bytes, rc.side_rows.clone(), rc.packed_rows.clone()),
            (32, vec![0, 2], Some(vec![1, 0]))
        );
        let (same, units) =
            row_copy_units(&[32, 0, 32, 0, 64, 32], 3, (ListForm::Scatter, 0), (128, 64), (4, 3))
                .unwrap();
        assert_eq!((same, units), (rc, (4, 1)));
        let empty = row_copy(&[], 3, ListForm::Gather, 0, 0, 0).unwrap();
        assert_eq!((empty.row_bytes, empty.total, empty.side_rows.len()), (1, 0, 0));
    }

    #[test]
    fn row_copies_refuse_fragments_outside_either_side_naming_it() {
        let err = |rows: &[u64], form, base, limits: (u64, u64)| {
            row_copy(rows, 3, form, base, limits.0, limits.1).unwrap_err().to_string()
        };
        assert!(err(&[120, 16, 0], ListForm::Gather, 0, (128, 16))
            .contains("gather source: fragment ends at byte 136, past the buffer's 128 bytes"));
        assert!(err(&[120, 16, 0], ListForm::Gather, 200, (128, 16)).contains("below the buffer"));
        assert!(err(&[0, 16, 0], ListForm::Gather, 0, (128, 8)).contains("gather packed"));
        assert!(err(&[8, 0, 16], ListForm::Scatter, 0, (128, 16)).contains("scatter packed"));
        assert!(err(&[0, 120, 16], ListForm::Scatter, 0, (128, 16)).contains("scatter destination"));
        assert!(row_copy(&[0; 6], 6, ListForm::GatherRuns, 0, 8, 8).is_err());
    }

    proptest! {
        #[test]
        fn a_shuffled_canonical_list_gives_the_table_of_the_sorted_one(
            lens in proptest::collection::vec(1u64..8, 0..24),
            gaps in proptest::collection::vec(0u64..4, 24),
            unit_exp in 0u32..6,
            seed in any::<u64>(),
        ) {
            let unit = 1u64 << unit_exp;
            let (mut rows, mut packed, mut other) = (Vec::new(), 0u64, 0u64);
            for (len, gap) in lens.iter().zip(&gaps) {
                other += gap * unit;
                rows.push([other, len * unit, packed]);
                packed += len * unit;
                other += len * unit;
            }
            let sorted: Vec<u64> = rows.concat();
            let n = rows.len();
            if n > 1 {
                let k = usize::try_from(seed % n as u64).unwrap();
                rows.rotate_left(k);
                rows.swap(0, n - 1);
            }
            let a = table(&sorted, "gather", 0, (other, packed)).unwrap();
            let b = table(&rows.concat(), "gather", 0, (other, packed)).unwrap();
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(a.total_bytes, packed);
            prop_assert!(a.unit >= unit.min(16) && a.unit <= 16);
            for (i, r) in sorted.chunks_exact(3).enumerate() {
                prop_assert_eq!(u64::try_from(a.host[i]).unwrap() * a.unit, r[2]);
                prop_assert_eq!(u64::try_from(a.host[n + 1 + i]).unwrap() * a.unit, r[0]);
            }
        }
    }
}
