//! The block and slot allocators a ledger (or an engine) draws from.
//!
//! [`BlockPool`] hands out fixed-size KV blocks with reference counts, publishes full blocks
//! into a prefix cache keyed by a parent-aware hash chain, and evicts unreferenced cached blocks
//! least-recently-released first. [`SlotPool`] hands out SSM state slots. Both validate every
//! argument before they change anything, so a rejected call leaves the pool exactly as it was.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::args::{named, Kind};
use crate::error::{DisaggError, DisaggResult};

/// Seed of the hash chain; the parent of the first block.
const HASH_SEED: u64 = 0x6469_7361_6767_5f72; // "disagg_r"

/// 64-bit finaliser (splitmix64): cheap, deterministic across processes and platforms, unlike
/// Python's salted `hash()`.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hasher for maps keyed by integers (block ids, request ids, prefix hashes): one splitmix
/// finaliser instead of `SipHash`. The keys are not attacker-chosen map keys in a way that
/// matters here (a collision only costs a probe), and the ledger's hot path is map lookups.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = mix(self.0 ^ n);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

/// `HashMap` with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Per-token step of one hash lane: xor, odd multiply (a bijection), rotate.
fn lane_step(h: u64, t: i64) -> u64 {
    (h ^ t.cast_unsigned()).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)
}

/// Hash chain over the FULL blocks of `tokens`: hash `i` covers tokens `[0, (i+1)*bs)` through
/// its parent, so equal hashes mean equal prefixes (up to 64-bit collisions; not a
/// cryptographic hash, like the prefix-cache keys of other engines). A trailing partial block
/// gets no hash: it is still being written and must never be shared. Four independent lanes per
/// block keep the multiply chain short (about 1 ns per token); the lanes and the parent are
/// folded through a full finaliser.
pub fn block_hashes(tokens: &[i64], block_size_tokens: u32) -> DisaggResult<Vec<u64>> {
    Kind::Argument.at_least_one(&named!(block_size_tokens))?;
    let bs = block_size_tokens as usize;
    let mut parent = HASH_SEED;
    let mut out = Vec::with_capacity(tokens.len() / bs);
    for block in tokens.chunks_exact(bs) {
        let seed = mix(parent ^ u64::from(block_size_tokens));
        let mut lanes = [seed, seed ^ 0x5555_5555_5555_5555, seed ^ 0x3333_3333_3333_3333, !seed];
        let mut quads = block.chunks_exact(4);
        for q in &mut quads {
            for (lane, &t) in lanes.iter_mut().zip(q) {
                *lane = lane_step(*lane, t);
            }
        }
        for (lane, &t) in lanes.iter_mut().zip(quads.remainder()) {
            *lane = lane_step(*lane, t);
        }
        let h = mix(lanes[0] ^ mix(lanes[1] ^ mix(lanes[2] ^ mix(lanes[3] ^ seed))));
        out.push(h);
        parent = h;
    }
    Ok(out)
}

/// Fixed pool of KV blocks with reference counts, prefix caching and LRU eviction.
///
/// Every block is in exactly one of three places: never-used/plain free (refcount 0, no hash),
/// evictable (refcount 0, published in the prefix cache) or referenced (refcount > 0).
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size_tokens: u32,
    refcount: Vec<u32>,
    /// The prefix-cache hash a block is published under, if any.
    hash_of: Vec<Option<u64>>,
    /// Prefix cache: hash -> block holding that prefix.
    cached: IdMap<u64, u32>,
    /// Plain free blocks (no hash), used before any cached block is evicted. A stack, so the
    /// order is deterministic.
    free: Vec<u32>,
    /// Evictable cached blocks by release tick: the smallest tick is evicted first.
    evictable: BTreeMap<u64, u32>,
    /// The tick under which an evictable block sits in `evictable`.
    evict_tick: Vec<u64>,
    tick: u64,
}

/// Most blocks one [`BlockPool`] may hold (a larger count is a configuration error, refused
/// before anything is allocated; 2**24 blocks of 16 tokens hold 268M tokens).
pub const MAX_POOL_BLOCKS: u32 = 1 << 24;
/// Most slots one [`SlotPool`] may hold.
pub const MAX_SSM_SLOTS: u32 = 1 << 20;

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size_tokens` tokens each, all free.
    /// `num_blocks` is at most [`MAX_POOL_BLOCKS`].
    pub fn new(num_blocks: u32, block_size_tokens: u32) -> DisaggResult<Self> {
        Kind::Argument.at_least_one(&named!(block_size_tokens))?;
        if num_blocks > MAX_POOL_BLOCKS {
            return Err(DisaggError::argument(
                "num_blocks",
                format!("num_blocks={num_blocks} must be <= {MAX_POOL_BLOCKS}"),
            ));
        }
        let n = num_blocks as usize;
        Ok(Self {
            block_size_tokens,
            refcount: vec![0; n],
            hash_of: vec![None; n],
            cached: IdMap::default(),
            // Reversed so that `pop` hands out block 0 first.
            free: (0..num_blocks).rev().collect(),
            evictable: BTreeMap::new(),
            evict_tick: vec![0; n],
            tick: 0,
        })
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.refcount.len() as u32
    }

    /// Tokens per block.
    pub fn block_size_tokens(&self) -> u32 {
        self.block_size_tokens
    }

    /// Blocks an `allocate` can hand out now: plain free plus evictable cached blocks.
    pub fn num_free(&self) -> u32 {
        (self.free.len() + self.evictable.len()) as u32
    }

    /// Unreferenced blocks that still hold a published prefix.
    pub fn num_evictable(&self) -> u32 {
        self.evictable.len() as u32
    }

    /// Blocks with a refcount above zero.
    pub fn num_referenced(&self) -> u32 {
        self.num_blocks() - self.num_free()
    }

    /// Whether `allocate(n)` would succeed now.
    pub fn can_allocate(&self, n: u32) -> bool {
        n <= self.num_free()
    }

    /// Reference count of one block.
    pub fn refcount(&self, block_id: u32) -> DisaggResult<u32> {
        self.refcount
            .get(block_id as usize)
            .copied()
            .ok_or_else(|| self.out_of_range("block_id", block_id))
    }

    /// The hash a block is published under in the prefix cache, if any.
    pub fn cached_hash(&self, block_id: u32) -> Option<u64> {
        self.hash_of.get(block_id as usize).copied().flatten()
    }

    /// Whether a block is unreferenced and published (evictable).
    pub fn is_evictable(&self, block_id: u32) -> bool {
        self.refcount.get(block_id as usize) == Some(&0) && self.cached_hash(block_id).is_some()
    }

    /// Hash chain over the full blocks of `tokens` with this pool's block size.
    pub fn block_hashes(&self, tokens: &[i64]) -> DisaggResult<Vec<u64>> {
        block_hashes(tokens, self.block_size_tokens)
    }

    fn out_of_range(&self, field: &str, block_id: u32) -> DisaggError {
        DisaggError::block(
            field,
            format!("block id {block_id} >= num_blocks={}", self.num_blocks()),
        )
    }

    /// `n` blocks with refcount 1, all or nothing. Plain free blocks go first; then cached
    /// blocks are evicted least-recently-released first (their prefix is unpublished).
    pub fn allocate(&mut self, n: u32) -> DisaggResult<Vec<u32>> {
        if n > self.num_free() {
            return Err(DisaggError::Capacity {
                resource: "blocks".into(),
                detail: format!(
                    "allocate needs {n} blocks > {} free ({} evictable) of num_blocks={}",
                    self.num_free(),
                    self.num_evictable(),
                    self.num_blocks()
                ),
            });
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let b = if let Some(b) = self.free.pop() {
                b
            } else if let Some((_, b)) = self.evictable.pop_first() {
                if let Some(h) = self.hash_of[b as usize].take() {
                    self.cached.remove(&h);
                }
                b
            } else {
                // Unreachable: n <= num_free was checked above.
                break;
            };
            self.refcount[b as usize] = 1;
            out.push(b);
        }
        Ok(out)
    }

    /// Add one reference per occurrence. A block must be referenced or evictable (retaining an
    /// evictable block takes it out of the LRU: this is how a prefix-cache hit is claimed).
    pub fn retain(&mut self, block_ids: &[u32]) -> DisaggResult<()> {
        for &b in block_ids {
            let rc = self.refcount(b).map_err(|_| self.out_of_range("block_ids", b))?;
            if rc == 0 && self.hash_of[b as usize].is_none() {
                return Err(DisaggError::block(
                    "block_ids",
                    format!(
                        "retain of free block {b}: refcount=0 and not cached; allocate it first"
                    ),
                ));
            }
        }
        for &b in block_ids {
            let i = b as usize;
            if self.refcount[i] == 0 {
                self.evictable.remove(&self.evict_tick[i]);
            }
            self.refcount[i] = self.refcount[i].saturating_add(1);
        }
        Ok(())
    }

    /// Drop one reference per occurrence (a block repeated twice loses two). All or nothing: a
    /// list that would drive any refcount below zero is rejected whole.
    pub fn release(&mut self, block_ids: &[u32]) -> DisaggResult<()> {
        let mut drops: IdMap<u32, u32> = IdMap::default();
        for &b in block_ids {
            let rc = self.refcount(b).map_err(|_| self.out_of_range("block_ids", b))?;
            let d = drops.entry(b).or_insert(0);
            *d += 1;
            if *d > rc {
                return Err(DisaggError::block(
                    "block_ids",
                    format!("release of block {b} {d} time(s) but refcount={rc}"),
                ));
            }
        }
        for &b in block_ids {
            let i = b as usize;
            self.refcount[i] -= 1;
            if self.refcount[i] == 0 {
                if self.hash_of[i].is_some() {
                    self.tick += 1;
                    self.evict_tick[i] = self.tick;
                    self.evictable.insert(self.tick, b);
                } else {
                    self.free.push(b);
                }
            }
        }
        Ok(())
    }

    /// Publish referenced full blocks under their hashes. A hash already cached in another
    /// block is left alone (the first copy wins; the new block just stays unpublished); a block
    /// already published under a different hash is an error.
    pub fn register_cached(&mut self, block_ids: &[u32], hashes: &[u64]) -> DisaggResult<()> {
        if block_ids.len() != hashes.len() {
            return Err(DisaggError::block(
                "hashes",
                format!("len(hashes)={} != len(block_ids)={}", hashes.len(), block_ids.len()),
            ));
        }
        for (&b, &h) in block_ids.iter().zip(hashes) {
            let rc = self.refcount(b).map_err(|_| self.out_of_range("block_ids", b))?;
            if rc == 0 {
                return Err(DisaggError::block(
                    "block_ids",
                    format!("block {b} has refcount=0; only held blocks can be published"),
                ));
            }
            if let Some(old) = self.hash_of[b as usize] {
                if old != h {
                    return Err(DisaggError::block(
                        "hashes",
                        format!("block {b} is published as {old:#x}, not {h:#x}"),
                    ));
                }
            }
        }
        for (&b, &h) in block_ids.iter().zip(hashes) {
            if self.hash_of[b as usize].is_none() && !self.cached.contains_key(&h) {
                self.hash_of[b as usize] = Some(h);
                self.cached.insert(h, b);
            }
        }
        Ok(())
    }

    /// Blocks holding the longest cached prefix of `hashes`, in order. Does not retain them.
    pub fn match_prefix(&self, hashes: &[u64]) -> Vec<u32> {
        hashes.iter().map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// Verify that every block is in exactly one place and the cache maps agree.
    pub fn check(&self) -> DisaggResult<()> {
        let n = self.refcount.len();
        let mut seen = vec![0u8; n];
        for &b in &self.free {
            let i = b as usize;
            DisaggError::conserved(self.refcount[i] == 0 && self.hash_of[i].is_none(), || {
                format!("free block {b} is referenced or cached")
            })?;
            seen[i] += 1;
        }
        for (&t, &b) in &self.evictable {
            let i = b as usize;
            DisaggError::conserved(
                self.refcount[i] == 0 && self.hash_of[i].is_some() && self.evict_tick[i] == t,
                || format!("evictable block {b} is referenced, unpublished or mis-ticked"),
            )?;
            seen[i] += 1;
        }
        for (i, &rc) in self.refcount.iter().enumerate() {
            let expect = u8::from(rc == 0);
            DisaggError::conserved(seen[i] == expect, || {
                format!("block {i} with refcount={rc} is listed {} time(s) as free", seen[i])
            })?;
        }
        for (&h, &b) in &self.cached {
            DisaggError::conserved(self.hash_of[b as usize] == Some(h), || {
                format!("cache entry {h:#x} -> block {b} disagrees")
            })?;
        }
        let published = self.hash_of.iter().filter(|h| h.is_some()).count();
        DisaggError::conserved(published == self.cached.len(), || {
            format!("{published} published blocks but {} cache entries", self.cached.len())
        })?;
        Ok(())
    }
}

/// Where one SSM slot is accounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// In the pool, ready to hand out.
    Free,
    /// Handed out and still accounted to whoever allocated it (a ledger, an engine).
    Allocated,
    /// Handed out and moved to a live request: it left the pool's accounting until `free`.
    Detached,
}

impl SlotState {
    /// `"free"`, `"allocated"` or `"detached"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Allocated => "allocated",
            Self::Detached => "detached",
        }
    }
}

impl std::fmt::Display for BlockPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockPool(num_blocks={}, block_size_tokens={}, num_free={}, num_evictable={})",
            self.num_blocks(),
            self.block_size_tokens(),
            self.num_free(),
            self.num_evictable()
        )
    }
}

impl std::fmt::Display for SlotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotPool(num_slots={}, num_free={})", self.num_slots(), self.num_free())
    }
}

/// Fixed pool of SSM state slots.
///
/// `detach` records that ownership moved on (for example to a request admitted into the decode
/// batch): the slot is still not free, but whoever allocated it no longer owns it. `free`
/// returns an allocated or detached slot to the pool.
#[derive(Debug, Clone)]
pub struct SlotPool {
    state: Vec<SlotState>,
    free: Vec<u32>,
}

impl SlotPool {
    /// A pool of `num_slots` free slots. Input from outside goes through
    /// [`SlotPool::try_new`], which caps the count.
    pub fn new(num_slots: u32) -> Self {
        Self {
            state: vec![SlotState::Free; num_slots as usize],
            free: (0..num_slots).rev().collect(),
        }
    }

    /// A pool of `num_slots` free slots; more than [`MAX_SSM_SLOTS`] is an argument error.
    pub fn try_new(num_slots: u32) -> DisaggResult<Self> {
        if num_slots > MAX_SSM_SLOTS {
            return Err(DisaggError::argument(
                "num_ssm_slots",
                format!("num_ssm_slots={num_slots} must be <= {MAX_SSM_SLOTS}"),
            ));
        }
        Ok(Self::new(num_slots))
    }

    /// Total number of slots.
    pub fn num_slots(&self) -> u32 {
        self.state.len() as u32
    }

    /// Slots ready to hand out.
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Slots handed out and moved to a live request.
    pub fn num_detached(&self) -> u32 {
        self.state.iter().filter(|s| **s == SlotState::Detached).count() as u32
    }

    /// State of one slot.
    pub fn state(&self, slot: u32) -> DisaggResult<SlotState> {
        self.state.get(slot as usize).copied().ok_or_else(|| {
            DisaggError::block("slot", format!("slot {slot} >= num_slots={}", self.num_slots()))
        })
    }

    /// One free slot, or a capacity error when none is free.
    pub fn allocate(&mut self) -> DisaggResult<u32> {
        let s = self.free.pop().ok_or_else(|| DisaggError::Capacity {
            resource: "ssm_slots".into(),
            detail: format!("no free slot of num_slots={}", self.num_slots()),
        })?;
        self.state[s as usize] = SlotState::Allocated;
        Ok(s)
    }

    /// Return an allocated or detached slot to the pool; freeing a free slot is an error.
    pub fn free(&mut self, slot: u32) -> DisaggResult<()> {
        if self.state(slot)? == SlotState::Free {
            return Err(DisaggError::block("slot", format!("slot {slot} is already free")));
        }
        self.state[slot as usize] = SlotState::Free;
        self.free.push(slot);
        Ok(())
    }

    /// Move an allocated slot out of its allocator's accounting (to a live request).
    pub fn detach(&mut self, slot: u32) -> DisaggResult<()> {
        let st = self.state(slot)?;
        if st != SlotState::Allocated {
            return Err(DisaggError::block(
                "slot",
                format!("slot {slot} is {st:?}, only an Allocated slot can be detached"),
            ));
        }
        self.state[slot as usize] = SlotState::Detached;
        Ok(())
    }

    /// Verify that free list and states agree.
    pub fn check(&self) -> DisaggResult<()> {
        let mut seen = vec![false; self.state.len()];
        for &s in &self.free {
            let i = s as usize;
            DisaggError::conserved(
                self.state.get(i) == Some(&SlotState::Free) && !seen[i],
                || format!("free list holds slot {s} twice or in a non-free state"),
            )?;
            seen[i] = true;
        }
        let free_states = self.state.iter().filter(|s| **s == SlotState::Free).count();
        DisaggError::conserved(free_states == self.free.len(), || {
            format!("{free_states} slots are Free but the free list holds {}", self.free.len())
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pools_print_their_counts() {
        let mut p = super::BlockPool::new(4, 16).unwrap();
        p.allocate(1).unwrap();
        let text = "BlockPool(num_blocks=4, block_size_tokens=16, num_free=3, num_evictable=0)";
        assert_eq!(p.to_string(), text);
        let mut s = super::SlotPool::try_new(2).unwrap();
        let slot = s.allocate().unwrap();
        assert_eq!(s.to_string(), "SlotPool(num_slots=2, num_free=1)");
        s.detach(slot).unwrap();
        assert_eq!(s.state(slot).unwrap().name(), "detached");
    }

    use super::*;

    #[test]
    fn release_counts_each_occurrence_and_rejects_underflow_whole() {
        let mut p = BlockPool::new(4, 2).unwrap();
        let b = p.allocate(2).unwrap();
        p.retain(&[b[0]]).unwrap();
        assert!(p.release(&[b[0], b[0], b[0]]).is_err());
        assert_eq!(p.refcount(b[0]).unwrap(), 2);
        p.release(&[b[0], b[0], b[1]]).unwrap();
        assert_eq!(p.num_free(), 4);
        p.check().unwrap();
    }

    #[test]
    fn eviction_takes_the_least_recently_released_cached_block() {
        let mut p = BlockPool::new(2, 2).unwrap();
        let b = p.allocate(2).unwrap();
        let h = p.block_hashes(&[1, 2, 3, 4]).unwrap();
        p.register_cached(&b, &h).unwrap();
        p.release(&[b[1]]).unwrap();
        p.release(&[b[0]]).unwrap();
        assert_eq!(p.num_evictable(), 2);
        let got = p.allocate(1).unwrap();
        assert_eq!(got, vec![b[1]]);
        assert_eq!(p.match_prefix(&h), vec![b[0]]);
        p.check().unwrap();
    }

    #[test]
    fn pools_past_their_caps_are_argument_errors_before_any_allocation() {
        let e = BlockPool::new(MAX_POOL_BLOCKS + 1, 16).unwrap_err();
        assert!(matches!(&e, DisaggError::Argument { field, .. } if field == "num_blocks"));
        assert!(e.to_string().contains(&format!("{}", MAX_POOL_BLOCKS + 1)), "{e}");
        let e = SlotPool::try_new(u32::MAX).unwrap_err();
        assert!(matches!(&e, DisaggError::Argument { field, .. } if field == "num_ssm_slots"));
        assert_eq!(SlotPool::try_new(3).unwrap().num_slots(), 3);
    }

    #[test]
    fn hash_chain_is_parent_aware_and_skips_partial_blocks() {
        let a = block_hashes(&[1, 2, 3, 4, 5], 2).unwrap();
        let b = block_hashes(&[9, 9, 3, 4], 2).unwrap();
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1]);
        assert_eq!(a, block_hashes(&[1, 2, 3, 4], 2).unwrap());
    }

    #[test]
    fn hash_chain_values_are_pinned_so_every_build_agrees() {
        // Prefill and decode may run different builds: a change here breaks prefix reuse across
        // a mixed deployment and must come with a wire-version bump.
        let h = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4).unwrap();
        assert_eq!(h, vec![10_387_378_703_444_614_187, 5_092_859_689_871_276_153]);
    }

    #[test]
    fn slot_pool_detach_then_free_returns_the_slot() {
        let mut s = SlotPool::new(1);
        let x = s.allocate().unwrap();
        assert!(s.allocate().is_err());
        s.detach(x).unwrap();
        assert_eq!(s.num_detached(), 1);
        s.free(x).unwrap();
        assert!(s.free(x).is_err());
        s.check().unwrap();
    }
}
