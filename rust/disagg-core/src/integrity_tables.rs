//! The full integrity digest tables of a handoff, assembled from every rank's pieces, and the
//! first cell a rank's own pieces disagree with.
//!
//! A table has shape `[outer..., layers, units]` (`kv`: `[chunks, 2, layers, kv heads]`;
//! `conv` and `recurrent`: `[layers, units]`), row-major. A piece is a dense block of one table
//! covering every outer index and the cells `[layer_start, layer_start + n_layers)` x
//! `[unit_start, unit_start + n_units)`.

use crate::error::{DisaggError, DisaggResult};
use crate::layout::{KvShardLayout, Span, SsmBand, SsmShardLayout};

/// The table shapes of a model given any rank's layouts, in order `kv`, `conv`, `recurrent`
/// (those the model has): `kv` is `[num_chunks, 2, layers, kv heads]`, `conv` `[ssm layers,
/// heads + 2 groups]`, `recurrent` `[ssm layers, heads]`. An SSM layout without the model's
/// layer count is a `Layout` error naming `total_layers`.
pub fn shapes(
    kv: Option<&KvShardLayout>,
    ssm: Option<&SsmShardLayout>,
    num_chunks: u64,
) -> DisaggResult<Vec<(String, Vec<u64>)>> {
    let mut out = Vec::new();
    if let Some(l) = kv {
        out.push((
            "kv".to_owned(),
            vec![num_chunks, 2, l.num_layers.into(), l.num_kv_heads.into()],
        ));
    }
    if let Some(l) = ssm {
        let total = u64::from(l.num_layers.ok_or_else(|| {
            DisaggError::layout(
                "total_layers",
                "integrity tables need the model's SSM layer count: build the SSMShardLayout \
                 with total_layers=",
            )
        })?);
        let (heads, groups) = (u64::from(l.dims.num_heads), u64::from(l.dims.n_groups));
        out.push(("conv".to_owned(), vec![total, heads + 2 * groups]));
        out.push(("recurrent".to_owned(), vec![total, heads]));
    }
    Ok(out)
}

/// One rank's block of one table.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// The table's name.
    pub table: &'a str,
    /// First global layer of the block.
    pub layer_start: u64,
    /// First global unit (KV head, conv band unit, SSM head) of the block.
    pub unit_start: u64,
    /// The block's shape: the table's outer dimensions, then its layers and units.
    pub shape: &'a [u64],
    /// The block's entries, row-major.
    pub entries: &'a [u64],
}

/// The first cell whose entry differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Which piece (index into the pieces given).
    pub piece: usize,
    /// The table's name.
    pub table: String,
    /// Global layer.
    pub layer: u64,
    /// Global unit.
    pub unit: u64,
    /// The table's entry.
    pub expected: u64,
    /// The piece's entry.
    pub got: u64,
    /// `K` or `V` (a `kv` cell).
    pub kv: Option<String>,
    /// The KV chunk's token range `[lo, hi)` (a `kv` cell of a chunked table).
    pub tokens: Option<(u64, u64)>,
}

fn product(dims: &[u64]) -> u64 {
    dims.iter().product()
}

/// Where a piece sits: its table's index, the outer cell count and the table's layer and
/// unit extents, after checking that it fits.
fn place(shapes: &[(String, Vec<u64>)], p: &Piece<'_>) -> DisaggResult<(usize, u64, u64, u64)> {
    let t = shapes.iter().position(|(n, _)| n == p.table).ok_or_else(|| {
        DisaggError::argument("table", format!("integrity piece for unknown table '{}'", p.table))
    })?;
    let shape = &shapes[t].1;
    let overrun = || {
        DisaggError::argument(
            "integrity",
            format!(
                "integrity piece '{}' at layer {}, unit {} of shape {:?} overruns the table {:?}",
                p.table, p.layer_start, p.unit_start, p.shape, shape
            ),
        )
    };
    let (n, m) = (shape.len(), p.shape.len());
    if n < 2 || m != n || shape[..n - 2] != p.shape[..m - 2] {
        return Err(overrun());
    }
    let (layers, units) = (shape[n - 2], shape[n - 1]);
    let fits =
        |start: u64, len: u64, extent: u64| start.checked_add(len).is_some_and(|e| e <= extent);
    if !fits(p.layer_start, p.shape[m - 2], layers) || !fits(p.unit_start, p.shape[m - 1], units) {
        return Err(overrun());
    }
    if u64::try_from(p.entries.len()).ok() != Some(product(p.shape)) {
        return Err(DisaggError::argument(
            "integrity",
            format!(
                "integrity piece '{}' has {} entries for shape {:?}",
                p.table,
                p.entries.len(),
                p.shape
            ),
        ));
    }
    Ok((t, product(&shape[..n - 2]), layers, units))
}

/// Every cell of a placed piece: (offset in the table, offset in the piece), row-major.
fn cells(
    p: &Piece<'_>,
    outer: u64,
    layers: u64,
    units: u64,
) -> impl Iterator<Item = (usize, usize)> {
    let m = p.shape.len();
    let (nl, nu) = (p.shape[m - 2], p.shape[m - 1]);
    let (ls, us) = (p.layer_start, p.unit_start);
    (0..outer).flat_map(move |o| {
        (0..nl).flat_map(move |l| {
            (0..nu).map(move |u| {
                let at = ((o * layers + ls + l) * units + us + u) as usize;
                let own = ((o * nl + l) * nu + u) as usize;
                (at, own)
            })
        })
    })
}

fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for (i, d) in shape.iter().enumerate().rev() {
        idx[i] = flat % d;
        flat /= d;
    }
    idx
}

/// One rank's part of the conv table, per band: `(band, units, local channels)`, the units
/// global (x head `h` is unit `h`, B group `g` is `num_heads + g`, C group `g` is
/// `num_heads + n_groups + g`) and the band's channels in this rank's local conv state.
pub fn conv_bands(layout: &SsmShardLayout) -> [(&'static str, Span, Span); 3] {
    let (d, heads, groups) = (layout.dims, layout.heads, layout.groups);
    let shift = |s: Span, by: u32| Span::new(s.lo + by, s.hi + by);
    [
        ("x", heads, layout.band(SsmBand::X).local),
        ("B", shift(groups, d.num_heads), layout.band(SsmBand::B).local),
        ("C", shift(groups, d.num_heads + d.n_groups), layout.band(SsmBand::C).local),
    ]
}

/// The full tables (per name of `shapes`, row-major) from every rank's `pieces`: the first
/// holder of a cell wins (replicas hold identical values). `Argument` errors: a piece of an
/// unknown table (field `table`), a piece that does not fit its table, or a cell no piece
/// holds (field `integrity`, naming the cell).
pub fn merge(shapes: &[(String, Vec<u64>)], pieces: &[Piece<'_>]) -> DisaggResult<Vec<Vec<u64>>> {
    let mut tables: Vec<Vec<u64>> =
        shapes.iter().map(|(_, s)| vec![0; usize::try_from(product(s)).unwrap_or(0)]).collect();
    let mut filled: Vec<Vec<bool>> = tables.iter().map(|t| vec![false; t.len()]).collect();
    for p in pieces {
        let (t, outer, layers, units) = place(shapes, p)?;
        for (at, own) in cells(p, outer, layers, units) {
            if !filled[t][at] {
                tables[t][at] = p.entries[own];
                filled[t][at] = true;
            }
        }
    }
    for ((name, shape), f) in shapes.iter().zip(&filled) {
        if let Some(flat) = f.iter().position(|x| !x) {
            let cell: Vec<String> =
                unravel(flat as u64, shape).iter().map(ToString::to_string).collect();
            return Err(DisaggError::argument(
                "integrity",
                format!(
                    "integrity table '{name}': cell ({}) has no holder among the ranks",
                    cell.join(", ")
                ),
            ));
        }
    }
    Ok(tables)
}

/// The first cell of `pieces` (in order, each row-major) whose entry differs from `tables`;
/// `kv` chunks before `first_chunk` (a prefix the decode reused, not moved) are skipped.
/// `chunk_tokens` gives a `kv` cell's token range.
pub fn first_mismatch(
    shapes: &[(String, Vec<u64>)],
    tables: &[&[u64]],
    pieces: &[Piece<'_>],
    first_chunk: u64,
    chunk_tokens: Option<u64>,
) -> DisaggResult<Option<Mismatch>> {
    for (i, p) in pieces.iter().enumerate() {
        let (t, outer, layers, units) = place(shapes, p)?;
        let table = tables.get(t).copied().unwrap_or_default();
        let is_kv = p.table == "kv";
        // Outer cells per KV chunk: the chunk is the first outer index.
        let per_chunk = if is_kv { product(&p.shape[1..p.shape.len() - 2]) } else { 0 };
        let per_outer = p.shape[p.shape.len() - 2] * p.shape[p.shape.len() - 1];
        let skip =
            if is_kv { first_chunk.saturating_mul(per_chunk).saturating_mul(per_outer) } else { 0 };
        let found = cells(p, outer, layers, units)
            .skip(usize::try_from(skip).unwrap_or(usize::MAX))
            .find(|&(at, own)| table.get(at).is_none_or(|&e| e != p.entries[own]));
        let Some((at, own)) = found else { continue };
        let idx = unravel(own as u64, p.shape);
        let m = idx.len();
        let kv_cell = is_kv.then(|| if idx[1] == 0 { "K" } else { "V" }.to_owned());
        return Ok(Some(Mismatch {
            piece: i,
            table: p.table.to_owned(),
            layer: p.layer_start + idx[m - 2],
            unit: p.unit_start + idx[m - 1],
            expected: table.get(at).copied().unwrap_or(0),
            got: p.entries[own],
            kv: kv_cell,
            tokens: chunk_tokens.filter(|_| is_kv).map(|c| (idx[0] * c, (idx[0] + 1) * c)),
        }));
    }
    Ok(None)
}

/// A one-line description naming the cell and both values (`band`: a conv cell's band).
pub fn describe(m: &Mismatch, band: Option<&str>) -> String {
    let cell = match m.table.as_str() {
        "kv" => {
            let kv = m.kv.as_deref().unwrap_or("?");
            let tokens =
                m.tokens.map_or_else(String::new, |(lo, hi)| format!(" tokens=[{lo}, {hi})"));
            format!("kv={kv} layer={} head={}{tokens}", m.layer, m.unit)
        }
        "conv" => {
            format!("conv layer={} unit={} (band {})", m.layer, m.unit, band.unwrap_or("None"))
        }
        _ => format!("recurrent layer={} head={}", m.layer, m.unit),
    };
    format!("{cell}: expected 0x{:016x}, got 0x{:016x}", m.expected, m.got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shapes() -> Vec<(String, Vec<u64>)> {
        vec![("kv".into(), vec![2, 2, 3, 2]), ("conv".into(), vec![3, 4])]
    }

    /// Oracle: a dense model of the tables, filled cell by cell (first holder wins).
    fn model(shapes: &[(String, Vec<u64>)], pieces: &[ModelPiece]) -> Vec<Vec<Option<u64>>> {
        let mut t: Vec<Vec<Option<u64>>> =
            shapes.iter().map(|(_, s)| vec![None; product(s) as usize]).collect();
        for (ti, ls, us, shape, entries) in pieces {
            let s = &shapes[*ti].1;
            let n = s.len();
            for (k, e) in entries.iter().enumerate() {
                let idx = unravel(k as u64, shape);
                let mut full = idx.clone();
                full[n - 2] += ls;
                full[n - 1] += us;
                let flat = full.iter().zip(s).fold(0, |acc, (i, d)| acc * d + i) as usize;
                t[*ti][flat].get_or_insert(*e);
            }
        }
        t
    }

    type ModelPiece = (usize, u64, u64, Vec<u64>, Vec<u64>);

    fn piece_strategy() -> impl Strategy<Value = ModelPiece> {
        (0usize..2).prop_flat_map(|t| {
            let s = shapes()[t].1.clone();
            let n = s.len();
            let (l, u) = (s[n - 2], s[n - 1]);
            (0..l, 0..u)
                .prop_flat_map(move |(ls, us)| (Just(ls), Just(us), 1..=l - ls, 1..=u - us))
                .prop_flat_map(move |(ls, us, nl, nu)| {
                    let mut shape = s[..n - 2].to_vec();
                    shape.extend([nl, nu]);
                    let len = product(&shape) as usize;
                    (
                        Just(t),
                        Just(ls),
                        Just(us),
                        Just(shape),
                        proptest::collection::vec(0u64..4, len),
                    )
                })
        })
    }

    /// Oracle of `first_mismatch`: the first cell of the pieces, in order, that differs from
    /// the model's table.
    fn model_mismatch(
        shapes: &[(String, Vec<u64>)],
        want: &[Vec<Option<u64>>],
        pieces: &[ModelPiece],
    ) -> Option<(usize, u64, u64, u64)> {
        for (i, (ti, ls, us, shape, entries)) in pieces.iter().enumerate() {
            let s = &shapes[*ti].1;
            let n = s.len();
            for (k, e) in entries.iter().enumerate() {
                let mut full = unravel(k as u64, shape);
                full[n - 2] += ls;
                full[n - 1] += us;
                let flat = full.iter().zip(s).fold(0, |acc, (i, d)| acc * d + i) as usize;
                let held = want[*ti][flat].unwrap_or(0);
                if held != *e {
                    return Some((i, full[n - 2], full[n - 1], held));
                }
            }
        }
        None
    }

    proptest! {
        #[test]
        fn merge_matches_a_cell_by_cell_model(pieces in proptest::collection::vec(piece_strategy(), 0..8)) {
            let sh = shapes();
            let views: Vec<Piece<'_>> = pieces.iter().map(|(t, ls, us, shape, e)| Piece {
                table: &sh[*t].0, layer_start: *ls, unit_start: *us, shape, entries: e,
            }).collect();
            let want = model(&sh, &pieces);
            match merge(&sh, &views) {
                Ok(tables) => {
                    for (t, w) in tables.iter().zip(&want) {
                        let w: Vec<u64> = w.iter().map(|c| c.expect("every cell held")).collect();
                        prop_assert_eq!(t, &w);
                    }
                    // Only a later holder of a cell can disagree with the merged tables.
                    let refs: Vec<&[u64]> = tables.iter().map(Vec::as_slice).collect();
                    let got = first_mismatch(&sh, &refs, &views, 0, None)
                        .unwrap()
                        .map(|m| (m.piece, m.layer, m.unit, m.expected));
                    prop_assert_eq!(got, model_mismatch(&sh, &want, &pieces));
                }
                Err(DisaggError::Argument { field, detail }) => {
                    prop_assert_eq!(field, "integrity");
                    prop_assert!(detail.contains("has no holder"), "{}", detail);
                    prop_assert!(want.iter().any(|t| t.iter().any(Option::is_none)));
                }
                Err(other) => prop_assert!(false, "{other:?}"),
            }
        }
    }

    #[test]
    fn a_piece_is_refused_for_an_unknown_table_or_an_overrun() {
        let sh = shapes();
        let e = [0; 12];
        let p = |table, ls, shape: &'static [u64]| Piece {
            table,
            layer_start: ls,
            unit_start: 0,
            shape,
            entries: &e[..product(shape) as usize],
        };
        let field = |r: DisaggResult<Vec<Vec<u64>>>| match r {
            Err(DisaggError::Argument { field, detail }) => (field, detail),
            other => panic!("{other:?}"),
        };
        assert_eq!(field(merge(&sh, &[p("ssm", 0, &[1, 1])])).0, "table");
        let (f, d) = field(merge(&sh, &[p("conv", 2, &[2, 4])]));
        assert_eq!(f, "integrity");
        assert!(d.contains("overruns the table [3, 4]"), "{d}");
        assert_eq!(field(merge(&sh, &[p("kv", 0, &[1, 2, 3, 2])])).0, "integrity");
        let (_, d) = field(merge(&sh, &[p("conv", 0, &[3, 4])]));
        assert!(d.contains("table 'kv': cell (0, 0, 0, 0) has no holder"), "{d}");
    }

    #[test]
    fn the_first_kv_mismatch_names_its_chunk_half_and_tokens_past_the_reused_prefix() {
        let sh = vec![("kv".to_owned(), vec![2u64, 2, 1, 1])];
        let table = [1u64, 2, 3, 4];
        let got = [9u64, 2, 3, 8];
        let p = Piece {
            table: "kv",
            layer_start: 0,
            unit_start: 0,
            shape: &[2, 2, 1, 1],
            entries: &got,
        };
        let m = first_mismatch(&sh, &[&table], &[p], 0, Some(64)).unwrap().unwrap();
        assert_eq!(
            (m.expected, m.got, m.kv.as_deref(), m.tokens),
            (1, 9, Some("K"), Some((0, 64)))
        );
        // The first chunk was reused, not moved: only the second is compared.
        let m = first_mismatch(&sh, &[&table], &[p], 1, Some(64)).unwrap().unwrap();
        assert_eq!(
            (m.expected, m.got, m.kv.as_deref(), m.tokens),
            (4, 8, Some("V"), Some((64, 128)))
        );
        assert!(first_mismatch(&sh, &[&table], &[p], 2, Some(64)).unwrap().is_none());
        assert_eq!(
            describe(&m, None),
            "kv=V layer=0 head=0 tokens=[64, 128): expected 0x0000000000000004, got 0x0000000000000008"
        );
    }
}

#[cfg(test)]
mod shape_tests {
    use super::*;
    use crate::layout::{KvLayoutSpec, RankCoords, SsmLayoutSpec, SsmStateDims};

    #[test]
    fn shapes_cover_the_parts_a_model_has_and_need_the_ssm_layer_count() {
        let kv = KvShardLayout::new(KvLayoutSpec {
            num_layers: 3,
            num_kv_heads: 4,
            ranks: RankCoords::single(),
            ..KvLayoutSpec::default()
        })
        .unwrap();
        let dims = SsmStateDims::new(4, 2, 3, 2, 4).unwrap();
        let ssm = SsmShardLayout::new(SsmLayoutSpec::single_rank(5, dims)).unwrap();
        let want_kv = ("kv".to_owned(), vec![2, 2, 3, 4]);
        assert_eq!(shapes(Some(&kv), None, 2).unwrap(), vec![want_kv.clone()]);
        let both = shapes(Some(&kv), Some(&ssm), 2).unwrap();
        let heads = u64::from(dims.num_heads);
        let conv = heads + 2 * u64::from(dims.n_groups);
        assert_eq!(
            both,
            vec![want_kv, ("conv".into(), vec![5, conv]), ("recurrent".into(), vec![5, heads])]
        );
        let unknown = SsmShardLayout { num_layers: None, ..ssm };
        match shapes(None, Some(&unknown), 1) {
            Err(DisaggError::Layout { field, .. }) => assert_eq!(field, "total_layers"),
            other => panic!("{other:?}"),
        }
        assert!(shapes(None, None, 1).unwrap().is_empty());
    }

    #[test]
    fn conv_bands_name_each_band_by_its_global_units_and_local_channels() {
        let dims = SsmStateDims::new(4, 2, 3, 2, 4).unwrap();
        let ranks = RankCoords::grid(2, 1, 1, 0, 0);
        let spec = SsmLayoutSpec { ranks, ..SsmLayoutSpec::single_rank(5, dims) };
        let l = SsmShardLayout::new(spec).unwrap();
        // heads [2, 4) (2 channels each), groups [1, 2) (3 channels each).
        let s = Span::new;
        assert_eq!(
            conv_bands(&l),
            [("x", s(2, 4), s(0, 4)), ("B", s(5, 6), s(4, 7)), ("C", s(7, 8), s(7, 10))]
        );
    }
}
