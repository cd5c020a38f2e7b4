//! Which descriptor-row buffers are kept for reuse: a small process-wide pool of `u64`
//! buffers, so a large handoff's rows (3.9 MB at 32K tokens) do not pay fresh page faults
//! every call (7 ms against 0.5 ms).

/// The most buffers kept.
pub const POOL_BUFFERS: usize = 8;
/// The most bytes the kept buffers may hold together.
pub const POOL_BYTES: usize = 256 << 20;

/// Buffers given back for reuse.
#[derive(Debug, Default)]
pub struct RowPool {
    kept: Vec<Vec<u64>>,
}

impl RowPool {
    /// An empty pool.
    #[must_use]
    pub const fn new() -> Self {
        Self { kept: Vec::new() }
    }

    /// A buffer of `n` initialised values (a kept buffer's old values, or zeros): a kept one
    /// when one fits, its capacity at least `n` and at most four times `n`.
    pub fn take(&mut self, n: usize) -> Vec<u64> {
        let fits = |v: &Vec<u64>| v.capacity() >= n && v.capacity() <= 4 * n.max(1);
        let mut v = match self.kept.iter().position(fits) {
            Some(i) => self.kept.swap_remove(i),
            None => Vec::new(),
        };
        v.resize(n, 0);
        v
    }

    /// Keep `v` for reuse unless that would exceed [`POOL_BUFFERS`] or [`POOL_BYTES`].
    pub fn give_back(&mut self, v: Vec<u64>) {
        let held: usize = self.kept.iter().map(|b| b.capacity() * 8).sum();
        if self.kept.len() < POOL_BUFFERS && held + v.capacity() * 8 <= POOL_BYTES {
            self.kept.push(v);
        }
    }

    /// Buffers kept now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether no buffer is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_buffer_is_reused_only_when_it_fits_within_four_times() {
        let mut pool = RowPool::new();
        let v = pool.take(100);
        assert_eq!(v.len(), 100);
        let addr = v.as_ptr();
        pool.give_back(v);
        assert_eq!(pool.len(), 1);
        // Too large for a request of 10 (more than four times): a fresh buffer.
        let small = pool.take(10);
        assert_ne!(small.as_ptr(), addr);
        assert_eq!((small.len(), pool.len()), (10, 1));
        // Too small for 200: fresh too.
        assert_eq!(pool.take(200).len(), 200);
        assert_eq!(pool.len(), 1);
        // 30 fits (100 <= 4 * 30): the kept buffer comes back, resized.
        let again = pool.take(30);
        assert_eq!((again.as_ptr(), again.len()), (addr, 30));
        assert!(pool.is_empty());
    }

    #[test]
    fn the_pool_keeps_at_most_its_buffers_and_bytes() {
        let mut pool = RowPool::new();
        for _ in 0..POOL_BUFFERS + 2 {
            pool.give_back(Vec::with_capacity(16));
        }
        assert_eq!(pool.len(), POOL_BUFFERS);
        let mut pool = RowPool::new();
        pool.give_back(Vec::with_capacity(POOL_BYTES / 8 - 16));
        pool.give_back(Vec::with_capacity(32));
        assert_eq!(pool.len(), 1);
        pool.give_back(Vec::with_capacity(16));
        assert_eq!(pool.len(), 2);
    }
}
