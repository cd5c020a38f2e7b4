//! The compiled program: per-source lists, in-place fills and figures.

use crate::error::{DisaggError, DisaggResult};

use super::cost::TransferMode;
use super::kv::KvDevicePlan;
use super::sink::{
    Collect, CollectPairs, CollectRuns, Count, FragmentSink, ListKind, RowBuf, SliceRows,
};
use super::verify::Expected;
use super::walk::{emit_box, Purpose, Work};

/// The compiled program of one source rank.
#[derive(Debug, Clone)]
pub struct SourceProgram {
    /// Global rank of the source.
    pub src_rank: u32,
    /// Device of the source memory.
    pub src_device: u64,
    /// How its bytes move.
    pub mode: TransferMode,
    /// Payload bytes, which is also the size of its packed region `[0, packed_bytes)`.
    pub packed_bytes: u64,
    pub(super) work: Work,
}

impl SourceProgram {
    pub(super) fn walk(&self, purpose: Purpose, sink: &mut impl FragmentSink) {
        let sides = purpose.sides();
        match &self.work {
            Work::Kv(kv) => kv.walk(purpose, sink),
            Work::Boxes(boxes) => {
                for b in boxes {
                    if !emit_box(b, sides, sink) {
                        return;
                    }
                }
            }
        }
    }

    /// Boxes a walk visits: the capacity to reserve (one fragment per box when every box
    /// coalesces, as in matched layouts; vectors grow beyond it otherwise).
    pub(super) fn box_count(&self, purpose: Purpose) -> usize {
        match &self.work {
            Work::Kv(kv) => {
                let segs = match purpose {
                    Purpose::Direct => kv.seg_direct.len(),
                    Purpose::Gather => kv.seg_src.len(),
                    Purpose::Scatter => kv.seg_dst.len(),
                };
                let planes: usize = kv
                    .sets
                    .iter()
                    .map(|s| s.num_layers as usize * kv.src.spec().num_kv as usize)
                    .sum();
                planes.saturating_mul(segs)
            }
            Work::Boxes(b) => b.len(),
        }
    }

    /// Rows of a walk: `(a, len, b)` when `GATHER`, else `(a, b, len)`.
    pub(super) fn collect<const GATHER: bool>(&self, purpose: Purpose) -> Vec<[u64; 3]> {
        let mut c = Collect::<_, GATHER> { out: Vec::with_capacity(self.box_count(purpose)) };
        self.walk(purpose, &mut c);
        c.out
    }

    /// Number of merged direct descriptors, counting at most `limit + 1`.
    pub(super) fn count_direct(&self, limit: u64) -> u64 {
        let mut c = Count { last: None, n: 0, limit };
        self.walk(Purpose::Direct, &mut c);
        c.n
    }
}

/// Per-source figures of a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceStats {
    /// Global rank of the source.
    pub src_rank: u32,
    /// Its mode.
    pub mode: TransferMode,
    /// Descriptors handed to the transport: merged pairs (direct) or 1 (staged).
    pub descriptors: u64,
    /// Gather plus scatter fragments (staged; 0 for direct).
    pub fragments: u64,
    /// Payload bytes.
    pub bytes: u64,
}

impl SourceStats {
    /// `descriptors`, `fragments` and `bytes` by name, in that order.
    pub fn figures(&self) -> [(&'static str, u64); 3] {
        [("descriptors", self.descriptors), ("fragments", self.fragments), ("bytes", self.bytes)]
    }

    /// [`SourceStats::totals`] by name, as [`SourceStats::figures`] names them.
    pub fn total_figures(stats: &[SourceStats]) -> [(&'static str, u64); 3] {
        let (descriptors, fragments, bytes) = Self::totals(stats);
        Self { src_rank: 0, mode: TransferMode::Direct, descriptors, fragments, bytes }.figures()
    }

    /// Totals over sources `(descriptors, fragments, bytes)`, saturating.
    pub fn totals(stats: &[SourceStats]) -> (u64, u64, u64) {
        stats.iter().fold((0, 0, 0), |(d, f, b), s| {
            (
                d.saturating_add(s.descriptors),
                f.saturating_add(s.fragments),
                b.saturating_add(s.bytes),
            )
        })
    }
}

/// The compiled transfer of one destination rank: what each source rank does.
#[derive(Debug, Clone)]
pub struct TransferProgram {
    /// Global rank of the destination.
    pub dst_rank: u32,
    /// Device of the destination memory.
    pub dst_device: u64,
    /// Sources in ascending global rank; only ranks that send something.
    pub sources: Vec<SourceProgram>,
    /// Whether destination addresses are known (destination geometry and blocks given).
    pub has_destination: bool,
    /// Whether device plans may be offered: false when a side's cache is several separately
    /// registered regions (per-layer tensors), which a plan relative to one buffer base
    /// cannot address.
    pub device_plans: bool,
    pub(super) expected: Expected,
}

/// One flat list of fragments, row-major `[n, 3]`.
pub type Rows = Vec<[u64; 3]>;

impl TransferProgram {
    /// The source program of `src_rank`.
    pub fn source(&self, src_rank: u32) -> DisaggResult<&SourceProgram> {
        self.sources.iter().find(|s| s.src_rank == src_rank).ok_or_else(|| {
            DisaggError::block(
                "src_rank",
                format!(
                    "src_rank={src_rank} sends nothing to destination rank {}; sources: {:?}",
                    self.dst_rank,
                    self.sources.iter().map(|s| s.src_rank).collect::<Vec<_>>()
                ),
            )
        })
    }

    pub(super) fn need_destination(&self, what: &str) -> DisaggResult<()> {
        if self.has_destination {
            Ok(())
        } else {
            Err(DisaggError::block(
                "dst_block_ids",
                format!("{what} needs destination addresses, but the program was compiled with dst_block_ids=None or no destination geometry"),
            ))
        }
    }

    /// Direct descriptor pairs of `src_rank` regardless of its mode: `(src, dst)`, each row
    /// `(addr, len, device)`.
    pub fn direct_descriptors(&self, src_rank: u32) -> DisaggResult<(Rows, Rows)> {
        self.need_destination("direct descriptors")?;
        let s = self.source(src_rank)?;
        let cap = s.box_count(Purpose::Direct);
        Ok(self.direct_pairs(s, Vec::with_capacity(cap), Vec::with_capacity(cap)))
    }

    /// Walk `s`'s direct pairs into the row buffers `src` and `dst` (rows `(addr, len,
    /// device)`, merged where both sides continue), and return them.
    fn direct_pairs<B: RowBuf>(&self, s: &SourceProgram, src: B, dst: B) -> (B, B) {
        let mut c =
            CollectPairs { src, dst, src_device: s.src_device, dst_device: self.dst_device };
        s.walk(Purpose::Direct, &mut c);
        (c.src, c.dst)
    }

    /// What the transport moves for `src_rank`: the direct pairs, or (staged) one pair whose
    /// addresses are `src_staging` and `dst_staging`, the packed regions' addresses.
    pub fn descriptors(
        &self,
        src_rank: u32,
        src_staging: u64,
        dst_staging: u64,
    ) -> DisaggResult<(Rows, Rows)> {
        let s = self.source(src_rank)?;
        match s.mode {
            TransferMode::Direct => self.direct_descriptors(src_rank),
            TransferMode::Staged => Ok((
                vec![[src_staging, s.packed_bytes, s.src_device]],
                vec![[dst_staging, s.packed_bytes, self.dst_device]],
            )),
        }
    }

    /// Gather list of `src_rank`: rows `(src_addr, len, packed_offset)`, merged where both the
    /// source and the packed ranges continue. Available in every mode and without destination.
    pub fn gather(&self, src_rank: u32) -> DisaggResult<Rows> {
        Ok(self.source(src_rank)?.collect::<true>(Purpose::Gather))
    }

    /// Scatter list of `src_rank`: rows `(packed_offset, dst_addr, len)`.
    pub fn scatter(&self, src_rank: u32) -> DisaggResult<Rows> {
        self.need_destination("scatter")?;
        Ok(self.source(src_rank)?.collect::<false>(Purpose::Scatter))
    }

    /// The gather list of `src_rank` as strided runs
    /// `(src_addr, packed_offset, len, count, src_stride, packed_stride)`: the compact form a
    /// pack kernel wants (one row per block run instead of one per token for head reshards).
    pub fn gather_runs(&self, src_rank: u32) -> DisaggResult<Vec<[u64; 6]>> {
        let mut c = CollectRuns::default();
        self.source(src_rank)?.walk(Purpose::Gather, &mut c);
        Ok(c.out)
    }

    /// The scatter list of `src_rank` as strided runs
    /// `(packed_offset, dst_addr, len, count, packed_stride, dst_stride)`.
    pub fn scatter_runs(&self, src_rank: u32) -> DisaggResult<Vec<[u64; 6]>> {
        self.need_destination("scatter")?;
        let mut c = CollectRuns::default();
        self.source(src_rank)?.walk(Purpose::Scatter, &mut c);
        Ok(c.out)
    }

    /// Source ranks that send something, ascending.
    pub fn src_ranks(&self) -> Vec<u32> {
        self.sources.iter().map(|s| s.src_rank).collect()
    }

    /// [`TransferProgram::scatter`] when `scatter`, else [`TransferProgram::gather`].
    pub fn packed(&self, src_rank: u32, scatter: bool) -> DisaggResult<Rows> {
        if scatter {
            self.scatter(src_rank)
        } else {
            self.gather(src_rank)
        }
    }

    /// [`TransferProgram::scatter_into`] when `scatter`, else [`TransferProgram::gather_into`].
    pub fn packed_into(
        &self,
        src_rank: u32,
        scatter: bool,
        out: &mut [[u64; 3]],
    ) -> DisaggResult<usize> {
        if scatter {
            self.scatter_into(src_rank, out)
        } else {
            self.gather_into(src_rank, out)
        }
    }

    /// [`TransferProgram::scatter_runs`] when `scatter`, else [`TransferProgram::gather_runs`].
    pub fn packed_runs(&self, src_rank: u32, scatter: bool) -> DisaggResult<Vec<[u64; 6]>> {
        if scatter {
            self.scatter_runs(src_rank)
        } else {
            self.gather_runs(src_rank)
        }
    }

    /// Exact number of rows of one list of `src_rank` (walks it without writing).
    pub fn row_count(&self, src_rank: u32, which: ListKind) -> DisaggResult<u64> {
        let s = self.source(src_rank)?;
        let purpose = match (which, s.mode) {
            (ListKind::Descriptors, TransferMode::Staged) => return Ok(1),
            (ListKind::Descriptors, TransferMode::Direct) => Purpose::Direct,
            (ListKind::Gather, _) => Purpose::Gather,
            (ListKind::Scatter, _) => Purpose::Scatter,
        };
        if purpose != Purpose::Gather {
            self.need_destination("row_count")?;
        }
        let mut c = Count { last: None, n: 0, limit: u64::MAX - 1 };
        s.walk(purpose, &mut c);
        Ok(c.n)
    }

    /// [`TransferProgram::descriptors`] written into caller buffers; returns the row count.
    pub fn descriptors_into(
        &self,
        src_rank: u32,
        src_staging: u64,
        dst_staging: u64,
        src_out: &mut [[u64; 3]],
        dst_out: &mut [[u64; 3]],
    ) -> DisaggResult<usize> {
        let s = self.source(src_rank)?;
        if s.mode == TransferMode::Staged {
            let (src_rows, dst_rows) = self.descriptors(src_rank, src_staging, dst_staging)?;
            let (Some(first_src), Some(first_dst)) = (src_out.first_mut(), dst_out.first_mut())
            else {
                return Err(too_small("out", 0, 1));
            };
            *first_src = src_rows[0];
            *first_dst = dst_rows[0];
            return Ok(1);
        }
        self.direct_descriptors_into(src_rank, src_out, dst_out)
    }

    /// Exact rows of [`TransferProgram::direct_descriptors`] of `src_rank` (walks the list).
    pub fn direct_row_count(&self, src_rank: u32) -> DisaggResult<u64> {
        self.need_destination("direct descriptors")?;
        Ok(self.source(src_rank)?.count_direct(u64::MAX - 1))
    }

    /// A cheap row count for [`TransferProgram::direct_descriptors`] of `src_rank` (no walk):
    /// enough for most programs, but not for one whose destination splits source rows (an HND
    /// destination), so a caller must handle a too-small buffer ([`TransferProgram::fill_direct`]).
    pub fn direct_row_hint(&self, src_rank: u32) -> DisaggResult<u64> {
        Ok(self.source(src_rank)?.box_count(Purpose::Direct) as u64)
    }

    /// [`TransferProgram::direct_descriptors`] written into caller buffers (whatever the mode
    /// of `src_rank`); returns the row count.
    pub fn direct_descriptors_into(
        &self,
        src_rank: u32,
        src_out: &mut [[u64; 3]],
        dst_out: &mut [[u64; 3]],
    ) -> DisaggResult<usize> {
        let s = self.source(src_rank)?;
        self.need_destination("direct descriptors")?;
        let cap = src_out.len().min(dst_out.len());
        let (src, dst) = self.direct_pairs(s, SliceRows::new(src_out), SliceRows::new(dst_out));
        finish_into(src.len(), dst.len().min(src.len()), cap, || Ok(s.count_direct(u64::MAX - 1)))
    }

    /// The direct pairs of `src_rank` through `fill(rows)`, which writes them (with
    /// [`TransferProgram::direct_descriptors_into`]) into buffers of `rows` rows: sized at the
    /// cheap [`TransferProgram::direct_row_hint`] first, and only when that fill fails at the
    /// exact [`TransferProgram::direct_row_count`], which `exact` runs (a binding releases the
    /// GIL there); a second failure is returned. `err` maps this function's own errors.
    pub fn fill_direct<R, E>(
        &self,
        src_rank: u32,
        err: impl Fn(DisaggError) -> E,
        exact: impl FnOnce(&(dyn Fn() -> DisaggResult<u64> + Sync)) -> DisaggResult<u64>,
        mut fill: impl FnMut(usize) -> Result<R, E>,
    ) -> Result<R, E> {
        let rows = |n: u64| {
            usize::try_from(n).map_err(|_| DisaggError::argument("src_rank", format!("{n} rows")))
        };
        if let Ok(r) = fill(self.direct_row_hint(src_rank).and_then(rows).map_err(&err)?) {
            return Ok(r);
        }
        let n = exact(&|| self.direct_row_count(src_rank));
        fill(n.and_then(rows).map_err(err)?)
    }

    /// [`TransferProgram::gather`] written into a caller buffer; returns the row count.
    pub fn gather_into(&self, src_rank: u32, out: &mut [[u64; 3]]) -> DisaggResult<usize> {
        let s = self.source(src_rank)?;
        let cap = out.len();
        let mut c = Collect::<_, true> { out: SliceRows::new(out) };
        s.walk(Purpose::Gather, &mut c);
        finish_into(c.out.len(), c.out.len(), cap, || self.row_count(src_rank, ListKind::Gather))
    }

    /// [`TransferProgram::scatter`] written into a caller buffer; returns the row count.
    pub fn scatter_into(&self, src_rank: u32, out: &mut [[u64; 3]]) -> DisaggResult<usize> {
        self.need_destination("scatter")?;
        let s = self.source(src_rank)?;
        let cap = out.len();
        let mut c = Collect::<_, false> { out: SliceRows::new(out) };
        s.walk(Purpose::Scatter, &mut c);
        finish_into(c.out.len(), c.out.len(), cap, || self.row_count(src_rank, ListKind::Scatter))
    }

    /// The block-id-free device plan of `src_rank` ([`KvDevicePlan`]), or `None` for SSM
    /// state and for KV transfers that do not have its shape.
    pub fn device_plan(&self, src_rank: u32) -> DisaggResult<Option<KvDevicePlan>> {
        Ok(match &self.source(src_rank)?.work {
            Work::Kv(_) if !self.device_plans => None,
            Work::Kv(kv) => kv.device_plan(),
            Work::Boxes(_) => None,
        })
    }

    /// Figures per source, in source order (walks the lists; not free).
    pub fn stats(&self) -> Vec<SourceStats> {
        self.sources
            .iter()
            .map(|s| {
                let (descriptors, fragments) = match s.mode {
                    TransferMode::Direct => (s.count_direct(u64::MAX - 1), 0),
                    TransferMode::Staged => {
                        let mut g = Count { last: None, n: 0, limit: u64::MAX - 1 };
                        s.walk(Purpose::Gather, &mut g);
                        let mut sc = Count { last: None, n: 0, limit: u64::MAX - 1 };
                        if self.has_destination {
                            s.walk(Purpose::Scatter, &mut sc);
                        }
                        (1, g.n + sc.n)
                    }
                };
                SourceStats {
                    src_rank: s.src_rank,
                    mode: s.mode,
                    descriptors,
                    fragments,
                    bytes: s.packed_bytes,
                }
            })
            .collect()
    }
}

/// `TransferProgram(dst_rank=1, sources={0: direct 4096 B, 2: staged 512 B})`.
impl std::fmt::Display for TransferProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TransferProgram(dst_rank={}, sources={{", self.dst_rank)?;
        for (i, s) in self.sources.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{}: {} {} B", s.src_rank, s.mode.name(), s.packed_bytes)?;
        }
        write!(f, "}})")
    }
}

pub(super) fn too_small(field: &str, have: usize, need: u64) -> DisaggError {
    DisaggError::layout(field, format!("{field} has {have} rows but the list needs {need}"))
}

/// A fill that stopped at the end of the buffer names the size it needed.
pub(super) fn finish_into(
    written: usize,
    paired: usize,
    cap: usize,
    need: impl FnOnce() -> DisaggResult<u64>,
) -> DisaggResult<usize> {
    if written == cap || paired != written {
        let n = need()?;
        if n > cap as u64 {
            return Err(too_small("out", cap, n));
        }
    }
    Ok(paired)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_every_source_and_saturate() {
        let s = |descriptors, bytes| SourceStats {
            src_rank: 0,
            mode: TransferMode::Direct,
            descriptors,
            fragments: 2,
            bytes,
        };
        assert_eq!(SourceStats::totals(&[]), (0, 0, 0));
        assert_eq!(SourceStats::totals(&[s(3, 10), s(4, 20)]), (7, 4, 30));
        assert_eq!(SourceStats::totals(&[s(1, u64::MAX), s(1, 1)]), (2, 4, u64::MAX));
        let named = [("descriptors", 7), ("fragments", 4), ("bytes", 30)];
        assert_eq!(SourceStats::total_figures(&[s(3, 10), s(4, 20)]), named);
        assert_eq!(s(3, 10).figures(), [("descriptors", 3), ("fragments", 2), ("bytes", 10)]);
    }

    #[test]
    fn display_names_every_source_in_order() {
        let program = |sources| TransferProgram {
            dst_rank: 1,
            dst_device: 0,
            sources,
            has_destination: false,
            device_plans: false,
            expected: Expected::None,
        };
        assert_eq!(program(Vec::new()).to_string(), "TransferProgram(dst_rank=1, sources={})");
    }
}
