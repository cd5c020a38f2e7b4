//! Independent check that a program writes every destination byte exactly once.

use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{KvGeometry, SsmGeometry};
use crate::layout::SsmShardLayout;

use super::cost::TransferMode;
use super::program::TransferProgram;
use super::walk::Purpose;

/// What the destination should receive, kept in input form: `verify` expands it cell by cell
/// only when asked (compiling must not pay for the check).
#[derive(Debug, Clone)]
pub(super) enum Expected {
    None,
    Kv { geometry: KvGeometry, block_ids: Vec<u32>, lo: u64, hi: u64 },
    Ssm { geometry: SsmGeometry, layout: SsmShardLayout, slot: u32 },
}

impl Expected {
    pub(super) fn cells(&self) -> Vec<[u64; 2]> {
        match self {
            Self::None => Vec::new(),
            Self::Kv { geometry, block_ids, lo, hi } => {
                expected_kv_cells(geometry, block_ids, *lo, *hi)
            }
            Self::Ssm { geometry, layout, slot } => expected_ssm_cells(geometry, layout, *slot),
        }
    }
}

impl TransferProgram {
    /// Check that the program writes every destination byte of the moved cells exactly once
    /// (direct pairs or scatter lists, per each source's mode), that nothing else is written,
    /// and that each staged source's gather and scatter lists tile its packed region exactly
    /// once. Names the first gap or overlap.
    pub fn verify(&self) -> DisaggResult<()> {
        self.need_destination("verify")?;
        let mut written: Vec<[u64; 2]> = Vec::new();
        for s in &self.sources {
            match s.mode {
                TransferMode::Direct => {
                    written.extend(
                        s.collect::<false>(Purpose::Direct).iter().map(|f| [f[1], f[1] + f[2]]),
                    );
                }
                TransferMode::Staged => {
                    let gather = s.collect::<false>(Purpose::Gather);
                    let scatter = s.collect::<false>(Purpose::Scatter);
                    for (what, list) in [
                        ("gather", gather.iter().map(|f| [f[1], f[1] + f[2]]).collect::<Vec<_>>()),
                        ("scatter", scatter.iter().map(|f| [f[0], f[0] + f[2]]).collect()),
                    ] {
                        let tiled =
                            disjoint_union(list, &format!("source {} {what} packed", s.src_rank))?;
                        if tiled != [[0, s.packed_bytes]]
                            && !(s.packed_bytes == 0 && tiled.is_empty())
                        {
                            return Err(DisaggError::Coverage {
                                detail: format!(
                                    "source {} {what} list covers {tiled:?} of its packed region [0, {})",
                                    s.src_rank, s.packed_bytes
                                ),
                            });
                        }
                    }
                    written.extend(scatter.iter().map(|f| [f[1], f[1] + f[2]]));
                }
            }
        }
        let got = disjoint_union(written, &format!("destination rank {}", self.dst_rank))?;
        let want = disjoint_union(self.expected.cells(), "expected destination")?;
        if got != want {
            let k = got
                .iter()
                .zip(&want)
                .position(|(g, w)| g != w)
                .unwrap_or(got.len().min(want.len()));
            return Err(DisaggError::Coverage {
                detail: format!(
                    "destination rank {} byte ranges differ from the moved cells at range {k}: \
                     written {:?}, expected {:?}",
                    self.dst_rank,
                    got.get(k),
                    want.get(k)
                ),
            });
        }
        Ok(())
    }
}

/// Sort half-open byte ranges, reject any overlap, and merge touching ones.
pub(super) fn disjoint_union(mut v: Vec<[u64; 2]>, what: &str) -> DisaggResult<Vec<[u64; 2]>> {
    v.sort_unstable();
    let mut out: Vec<[u64; 2]> = Vec::with_capacity(v.len());
    for r in v {
        if r[0] == r[1] {
            continue;
        }
        match out.last_mut() {
            Some(last) if r[0] < last[1] => {
                return Err(DisaggError::Coverage {
                    detail: format!(
                        "{what}: bytes [{:#x}, {:#x}) written more than once",
                        r[0],
                        r[1].min(last[1])
                    ),
                });
            }
            Some(last) if r[0] == last[1] => last[1] = r[1],
            _ => out.push(r),
        }
    }
    Ok(out)
}

/// Every destination head row of the moved tokens, computed cell by cell (independently of
/// the compiler's segments and merging) for `verify`.
pub(super) fn expected_kv_cells(d: &KvGeometry, ids: &[u32], lo: u64, hi: u64) -> Vec<[u64; 2]> {
    let s = d.spec();
    let row = d.row_bytes();
    let tpb = u64::from(s.tokens_per_block);
    let mut out = Vec::new();
    for kv in 0..s.num_kv {
        for l in 0..s.num_layers {
            let base = d.plane_base(kv, l);
            for t in lo..hi {
                let blk = u64::from(ids[(t / tpb) as usize]);
                let tok = base + blk * s.block_stride + (t % tpb) * s.token_stride;
                for h in 0..u64::from(s.num_heads) {
                    let a = tok + h * s.head_stride;
                    out.push([a, a + row]);
                }
            }
        }
    }
    out
}

/// Every unit of the destination slot in every local layer, for the parts the plan moves.
pub(super) fn expected_ssm_cells(d: &SsmGeometry, l: &SsmShardLayout, slot: u32) -> Vec<[u64; 2]> {
    let mut out = Vec::new();
    for (part, units) in [(&d.conv, l.local_conv_channels()), (&d.recurrent, l.heads.len())] {
        if let Some(p) = part {
            for base in &p.layer_bases {
                for u in 0..u64::from(units) {
                    let a = base + u64::from(slot) * p.slot_stride + u * p.unit_stride;
                    out.push([a, a + p.unit_bytes]);
                }
            }
        }
    }
    out
}
