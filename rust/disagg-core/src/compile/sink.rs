//! Where the fragments of a walk go: merging collectors, caller buffers and counters.

use crate::error::{DisaggError, DisaggResult};

/// Receives the fragments of a walk, merging each with the previous one when both of its
/// address ranges continue the previous ones.
pub(super) trait FragmentSink {
    /// Take `[a, a + len)` -> `[b, b + len)`; return false to stop the walk.
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool;

    /// Take `n >= 1` fragments `a + k * sa -> b + k * sb` of `len` bytes, which cannot merge
    /// with each other (the emitter folded every dim that could); only the first may continue
    /// the previous fragment.
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        (0..n).all(|k| self.push(a + k * sa, b + k * sb, len))
    }
}

/// Where collected rows go: a growing vector, or a caller's fixed buffer ([`SliceRows`]).
pub trait RowBuf {
    /// The last row written, to merge into.
    fn last_row(&mut self) -> Option<&mut [u64; 3]>;
    /// Append a row; false when the buffer is full (the walk stops).
    fn push_row(&mut self, row: [u64; 3]) -> bool;
    /// Append rows `row(0), .., row(n - 1)`; false (and nothing written) when they do not fit.
    fn extend_with(&mut self, n: usize, row: impl Fn(usize) -> [u64; 3]) -> bool;
}

impl RowBuf for Vec<[u64; 3]> {
    #[inline]
    fn last_row(&mut self) -> Option<&mut [u64; 3]> {
        self.last_mut()
    }
    #[inline]
    fn push_row(&mut self, row: [u64; 3]) -> bool {
        self.push(row);
        true
    }
    #[inline]
    fn extend_with(&mut self, n: usize, row: impl Fn(usize) -> [u64; 3]) -> bool {
        self.extend((0..n).map(row));
        true
    }
}

/// A caller's buffer of rows (for example a reused numpy array): fresh output memory costs a
/// page fault per 4 KiB, which for large lists costs more than computing them.
pub struct SliceRows<'a> {
    pub(super) rows: &'a mut [[u64; 3]],
    pub(super) len: usize,
}

impl<'a> SliceRows<'a> {
    /// An empty buffer over `rows`.
    pub fn new(rows: &'a mut [[u64; 3]]) -> Self {
        Self { rows, len: 0 }
    }
    /// Rows written.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no row was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl RowBuf for SliceRows<'_> {
    #[inline]
    fn last_row(&mut self) -> Option<&mut [u64; 3]> {
        self.len.checked_sub(1).and_then(|i| self.rows.get_mut(i))
    }
    #[inline]
    fn push_row(&mut self, row: [u64; 3]) -> bool {
        match self.rows.get_mut(self.len) {
            Some(slot) => {
                *slot = row;
                self.len += 1;
                true
            }
            None => false,
        }
    }
    #[inline]
    fn extend_with(&mut self, n: usize, row: impl Fn(usize) -> [u64; 3]) -> bool {
        let Some(free) = self.len.checked_add(n).and_then(|end| self.rows.get_mut(self.len..end))
        else {
            // Refused: count the buffer as full, so the caller sees `len == capacity` and
            // measures the list (a run that does not fit can leave free rows behind).
            self.len = self.rows.len();
            return false;
        };
        for (k, slot) in free.iter_mut().enumerate() {
            *slot = row(k);
        }
        self.len += n;
        true
    }
}

/// Collects merged fragments as rows `(a, len, b)` (gather format, `GATHER`) or
/// `(a, b, len)` (scatter format); the layout is a constant so each row is one store.
pub(super) struct Collect<B, const GATHER: bool> {
    pub(super) out: B,
}

impl<B, const GATHER: bool> Collect<B, GATHER> {
    #[inline]
    pub(super) fn row(a: u64, b: u64, len: u64) -> [u64; 3] {
        if GATHER {
            [a, len, b]
        } else {
            [a, b, len]
        }
    }
    #[inline]
    pub(super) fn parts(r: &mut [u64; 3]) -> (u64, u64, &mut u64) {
        if GATHER {
            let [a, len, b] = r;
            (*a, *b, len)
        } else {
            let [a, b, len] = r;
            (*a, *b, len)
        }
    }
}

impl<B: RowBuf, const GATHER: bool> FragmentSink for Collect<B, GATHER> {
    #[inline]
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let Some(last) = self.out.last_row() {
            let (la, lb, ll) = Self::parts(last);
            if la + *ll == a && lb + *ll == b {
                *ll += len;
                return true;
            }
        }
        self.out.push_row(Self::row(a, b, len))
    }

    #[inline]
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        if !self.push(a, b, len) {
            return false;
        }
        self.out.extend_with(n as usize - 1, |k| {
            let k = k as u64 + 1;
            Self::row(a + k * sa, b + k * sb, len)
        })
    }
}

/// Collects merged direct pairs straight into the two transport arrays
/// `(src_addr, len, src_device)` and `(dst_addr, len, dst_device)`.
pub(super) struct CollectPairs<B> {
    pub(super) src: B,
    pub(super) dst: B,
    pub(super) src_device: u64,
    pub(super) dst_device: u64,
}

impl<B: RowBuf> FragmentSink for CollectPairs<B> {
    #[inline]
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let (Some(s), Some(d)) = (self.src.last_row(), self.dst.last_row()) {
            if s[0] + s[1] == a && d[0] + d[1] == b {
                s[1] += len;
                d[1] += len;
                return true;
            }
        }
        self.src.push_row([a, len, self.src_device]) && self.dst.push_row([b, len, self.dst_device])
    }

    #[inline]
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        if !self.push(a, b, len) {
            return false;
        }
        let (sd, dd) = (self.src_device, self.dst_device);
        let more = n as usize - 1;
        self.src.extend_with(more, |k| [a + (k as u64 + 1) * sa, len, sd])
            && self.dst.extend_with(more, |k| [b + (k as u64 + 1) * sb, len, dd])
    }
}

/// Collects strided runs `[a, b, len, count, a_stride, b_stride]`: fragment `k < count` is
/// `a + k * a_stride -> b + k * b_stride`, `len` bytes. Single fragments merge as usual.
#[derive(Default)]
pub(super) struct CollectRuns {
    pub(super) out: Vec<[u64; 6]>,
}

impl FragmentSink for CollectRuns {
    #[inline]
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let Some(last) = self.out.last_mut() {
            if last[3] == 1 && last[0] + last[2] == a && last[1] + last[2] == b {
                last[2] += len;
                return true;
            }
        }
        self.out.push([a, b, len, 1, 0, 0]);
        true
    }

    #[inline]
    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        if n == 1 {
            return self.push(a, b, len);
        }
        self.out.push([a, b, len, n, sa, sb]);
        true
    }
}

/// Which list of a source rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListKind {
    /// What `descriptors` returns (direct pairs, or the one staged descriptor).
    Descriptors,
    /// The gather list.
    Gather,
    /// The scatter list.
    Scatter,
}

impl ListKind {
    /// Parse `"descriptors"`, `"gather"` or `"scatter"`.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "descriptors" => Ok(Self::Descriptors),
            "gather" => Ok(Self::Gather),
            "scatter" => Ok(Self::Scatter),
            other => Err(DisaggError::argument(
                "which",
                format!("which={other:?} is not one of 'descriptors', 'gather', 'scatter'"),
            )),
        }
    }
}

/// Counts merged fragments, stopping once the count passes `limit`.
pub(super) struct Count {
    pub(super) last: Option<[u64; 3]>,
    pub(super) n: u64,
    pub(super) limit: u64,
}

impl FragmentSink for Count {
    fn push(&mut self, a: u64, b: u64, len: u64) -> bool {
        if let Some(last) = self.last.as_mut() {
            if last[0] + last[2] == a && last[1] + last[2] == b {
                last[2] += len;
                return true;
            }
        }
        self.last = Some([a, b, len]);
        self.n += 1;
        self.n <= self.limit
    }

    fn push_run(&mut self, a: u64, b: u64, len: u64, n: u64, sa: u64, sb: u64) -> bool {
        self.push(a, b, len);
        let k = n - 1;
        self.n += k;
        self.last = Some([a + k * sa, b + k * sb, len]);
        self.n <= self.limit
    }
}
