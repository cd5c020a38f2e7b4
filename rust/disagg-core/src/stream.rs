//! Streamed staging: a packed copy larger than the source's staging pool moves chunk by chunk.
//!
//! The source reserves a few slots of its pool; chunk `k` of the packed copy lives in source
//! slot `k % slots`. The source packs a chunk into its slot and announces it (`Ready`); the
//! decode reads it into one of its own slots, scatters it and acknowledges it (`Ack`); the
//! acknowledgement frees the source slot for chunk `k + slots`. Either side may give the
//! stream up (`Abort`). Everything both sides must agree on is decided here:
//!
//! - [`chunk_ranges`]: the item and byte ranges of every chunk (a chunk is a run of whole
//!   items of a device plan, at most `max_bytes` unless one item is larger);
//! - [`StreamSource`]: which chunk the source may pack next and into which slot, and whether
//!   an acknowledgement is one it may receive;
//! - [`StreamSink`]: whether an announcement is the one the schedule says, which chunk the
//!   decode reads next and into which of its slots;
//! - [`StreamMsg`]: the notification each side sends, encoded and parsed here.
//!
//! The first `slots` chunks are packed before the ticket is sent: the ticket announces them.
//! Ranges are half-open `[lo, hi)`.

use std::collections::VecDeque;

use crate::error::{DisaggError, DisaggResult};

/// Most slots a stream may hold in the source's pool.
pub const MAX_STREAM_SLOTS: usize = 16;

/// One chunk: items `[k_lo, k_hi)` of the device plan, packed bytes `[lo, hi)`.
pub type ChunkRange = [u64; 4];

fn overflow(what: &str) -> DisaggError {
    DisaggError::AddressOverflow { detail: format!("streamed staging: {what} exceeds u64") }
}

/// The chunks of a packed copy of `n_tok` tokens whose plane rows are `rows` (`(packed
/// coefficient, row bytes per token)`: plane `p` starts at `coefficient * n_tok` in the packed
/// copy), cut in runs of whole items of at most `max_bytes` (one item at least). Item `k` is
/// plane `k / n_blk`, block `k % n_blk`, with `n_blk = ceil(n_tok / tokens_per_block)`.
///
/// # Errors
/// `Argument` for `tokens_per_block = 0`; `AddressOverflow` when an offset exceeds `u64`.
pub fn chunk_ranges(
    rows: &[(u64, u64)],
    tokens_per_block: u64,
    n_tok: u64,
    max_bytes: u64,
) -> DisaggResult<Vec<ChunkRange>> {
    if tokens_per_block == 0 {
        return Err(DisaggError::argument("tokens_per_block", "tokens_per_block=0"));
    }
    let n_blk = n_tok.div_ceil(tokens_per_block);
    let planes = rows.len() as u64;
    let total = planes.checked_mul(n_blk).ok_or_else(|| overflow("item count"))?;
    let row_max = rows.iter().map(|r| r.1).max().unwrap_or(0);
    let item_max = row_max.checked_mul(tokens_per_block).ok_or_else(|| overflow("item bytes"))?;
    let per = (max_bytes / item_max.max(1)).max(1);
    let row_sum = rows.iter().try_fold(0u64, |a, r| a.checked_add(r.1));
    let packed =
        row_sum.and_then(|s| s.checked_mul(n_tok)).ok_or_else(|| overflow("packed bytes"))?;
    let offset = |k: u64| -> DisaggResult<u64> {
        if k >= total {
            return Ok(packed);
        }
        let (coef, row) = rows[usize::try_from(k / n_blk).map_err(|_| overflow("plane"))?];
        let tok = ((k % n_blk) * tokens_per_block).min(n_tok);
        coef.checked_mul(n_tok)
            .zip(tok.checked_mul(row))
            .and_then(|(a, b)| a.checked_add(b))
            .ok_or_else(|| overflow("packed offset"))
    };
    let mut out = Vec::with_capacity(usize::try_from(total.div_ceil(per)).unwrap_or(0));
    let mut k = 0;
    while k < total {
        let end = k.saturating_add(per).min(total);
        out.push([k, end, offset(k)?, offset(end)?]);
        k = end;
    }
    Ok(out)
}

/// What a stream notification says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// Source -> decode: chunk `chunk` is packed in source slot `slot`, `nbytes` bytes at
    /// `offset` of the source's staging region.
    Ready = 1,
    /// Decode -> source: chunk `chunk` is read (and scattered); its slot may be reused.
    Ack = 2,
    /// Either way: the sender gave the stream up; the receiver frees its slots.
    Abort = 3,
}

/// One notification of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamMsg {
    /// What it says.
    pub kind: StreamKind,
    /// The stream (the source's id, from its ticket).
    pub stream: u64,
    /// The chunk (0 for `Abort`).
    pub chunk: u64,
    /// The source slot (`Ready` only).
    pub slot: u32,
    /// Where the chunk lies in the source's staging region (`Ready` only).
    pub offset: u64,
    /// The chunk's bytes (`Ready` only).
    pub nbytes: u64,
}

/// The first bytes of every stream notification (and its format version).
pub const STREAM_MAGIC: [u8; 4] = *b"DRS1";
/// Bytes of an encoded [`StreamMsg`].
pub const STREAM_MSG_LEN: usize = 41;

impl StreamMsg {
    /// A message without a slot, offset or size (`Ack`, `Abort`).
    #[must_use]
    pub fn bare(kind: StreamKind, stream: u64, chunk: u64) -> Self {
        Self { kind, stream, chunk, slot: 0, offset: 0, nbytes: 0 }
    }

    /// The fixed little-endian encoding: magic, kind, stream, chunk, slot, offset, nbytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(STREAM_MSG_LEN);
        out.extend_from_slice(&STREAM_MAGIC);
        out.push(self.kind as u8);
        out.extend_from_slice(&self.stream.to_le_bytes());
        out.extend_from_slice(&self.chunk.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.nbytes.to_le_bytes());
        out
    }

    /// Parse a notification: `Wire` errors (field `stream_msg`) for another length, magic or
    /// kind, or a bare message (`Ack`, `Abort`) carrying a slot, offset or size.
    pub fn decode(b: &[u8]) -> DisaggResult<Self> {
        let bad = |detail: String| DisaggError::wire("stream_msg", detail);
        if b.len() != STREAM_MSG_LEN {
            return Err(bad(format!("{} bytes, a stream message has {STREAM_MSG_LEN}", b.len())));
        }
        if b[..4] != STREAM_MAGIC {
            return Err(bad(format!("magic {:?}, expected {:?}", &b[..4], STREAM_MAGIC)));
        }
        let u64_at = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[21..25]);
        let kind = match b[4] {
            1 => StreamKind::Ready,
            2 => StreamKind::Ack,
            3 => StreamKind::Abort,
            k => return Err(bad(format!("kind {k}, expected 1 (ready), 2 (ack) or 3 (abort)"))),
        };
        let msg = Self {
            kind,
            stream: u64_at(5),
            chunk: u64_at(13),
            slot: u32::from_le_bytes(w),
            offset: u64_at(25),
            nbytes: u64_at(33),
        };
        if kind != StreamKind::Ready && (msg.slot, msg.offset, msg.nbytes) != (0, 0, 0) {
            return Err(bad(format!(
                "a {kind:?} message carries slot={} offset={} nbytes={}, expected zeros",
                msg.slot, msg.offset, msg.nbytes
            )));
        }
        if kind == StreamKind::Abort && msg.chunk != 0 {
            return Err(bad(format!("an Abort message carries chunk={}, expected 0", msg.chunk)));
        }
        Ok(msg)
    }
}

fn check_stream(field: &str, want: u64, msg: &StreamMsg) -> DisaggResult<()> {
    if msg.stream != want {
        return Err(DisaggError::wire(
            field,
            format!("message of stream {} delivered to stream {want}", msg.stream),
        ));
    }
    Ok(())
}

fn check_slots(offsets: &[u64]) -> DisaggResult<()> {
    if offsets.is_empty() || offsets.len() > MAX_STREAM_SLOTS {
        return Err(DisaggError::argument(
            "slots",
            format!("{} slots, a stream holds 1 to {MAX_STREAM_SLOTS}", offsets.len()),
        ));
    }
    Ok(())
}

/// The source side of one stream: which chunk to pack next, into which slot, and which
/// acknowledgements are valid.
#[derive(Debug, Clone)]
pub struct StreamSource {
    stream: u64,
    chunks: Vec<ChunkRange>,
    offsets: Vec<u64>,
    /// Chunks handed out to pack so far (`0..next`).
    next: usize,
    acked: Vec<bool>,
    acked_count: usize,
    aborted: bool,
}

impl StreamSource {
    /// A stream `stream` of `chunks` through source slots at `offsets` of the staging region.
    ///
    /// # Errors
    /// `Argument` (field `slots`) for no slot or more than [`MAX_STREAM_SLOTS`].
    pub fn new(stream: u64, chunks: Vec<ChunkRange>, offsets: Vec<u64>) -> DisaggResult<Self> {
        check_slots(&offsets)?;
        let n = chunks.len();
        Ok(Self {
            stream,
            chunks,
            offsets,
            next: 0,
            acked: vec![false; n],
            acked_count: 0,
            aborted: false,
        })
    }

    /// Chunks of the stream.
    #[must_use]
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether the stream has no chunk.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Claim every chunk whose slot is free now, in order: `(chunk, slot)`. Chunk `k` takes
    /// slot `k % slots` once chunk `k - slots` is acknowledged. Nothing after an abort.
    pub fn packable(&mut self) -> Vec<(usize, usize)> {
        let slots = self.offsets.len();
        let mut out = Vec::new();
        while !self.aborted
            && self.next < self.chunks.len()
            && (self.next < slots || self.acked[self.next - slots])
        {
            out.push((self.next, self.next % slots));
            self.next += 1;
        }
        out
    }

    /// The `Ready` message of claimed chunk `chunk`.
    ///
    /// # Errors
    /// `Argument` (field `chunk`) for a chunk not claimed by [`Self::packable`].
    pub fn ready(&self, chunk: usize) -> DisaggResult<StreamMsg> {
        if chunk >= self.next {
            return Err(DisaggError::argument(
                "chunk",
                format!("chunk {chunk} is not packed yet ({} claimed)", self.next),
            ));
        }
        let [_, _, lo, hi] = self.chunks[chunk];
        let slot = chunk % self.offsets.len();
        Ok(StreamMsg {
            kind: StreamKind::Ready,
            stream: self.stream,
            chunk: chunk as u64,
            slot: u32::try_from(slot).unwrap_or(u32::MAX),
            offset: self.offsets[slot],
            nbytes: hi - lo,
        })
    }

    /// Take one message from the decode: an `Ack` of a chunk announced and not acknowledged
    /// yet, or an `Abort`. Returns the kind.
    ///
    /// # Errors
    /// `Wire` (field `stream_msg.*`) for another stream, a `Ready`, or an `Ack` of a chunk
    /// not announced or acknowledged twice; nothing changes.
    pub fn receive(&mut self, msg: &StreamMsg) -> DisaggResult<StreamKind> {
        check_stream("stream_msg.stream", self.stream, msg)?;
        match msg.kind {
            StreamKind::Ready => {
                Err(DisaggError::wire("stream_msg.kind", "a source received a Ready message"))
            }
            StreamKind::Abort => {
                self.aborted = true;
                Ok(StreamKind::Abort)
            }
            StreamKind::Ack => {
                let k = usize::try_from(msg.chunk).unwrap_or(usize::MAX);
                if k >= self.next {
                    return Err(DisaggError::wire(
                        "stream_msg.chunk",
                        format!("Ack of chunk {k}, only {} announced", self.next),
                    ));
                }
                if self.acked[k] {
                    return Err(DisaggError::wire(
                        "stream_msg.chunk",
                        format!("chunk {k} acknowledged twice"),
                    ));
                }
                self.acked[k] = true;
                self.acked_count += 1;
                Ok(StreamKind::Ack)
            }
        }
    }

    /// Whether every chunk is acknowledged (the slots may be freed).
    #[must_use]
    pub fn done(&self) -> bool {
        self.acked_count == self.chunks.len()
    }

    /// Whether the decode gave the stream up.
    #[must_use]
    pub fn aborted(&self) -> bool {
        self.aborted
    }
}

/// The decode side of one stream: which announcements are valid, which chunk to read next
/// into which of the decode's slots, and what to acknowledge.
#[derive(Debug, Clone)]
pub struct StreamSink {
    stream: u64,
    chunks: Vec<ChunkRange>,
    src_offsets: Vec<u64>,
    ready: Vec<bool>,
    /// Chunks handed out to read so far (`0..next`).
    next: usize,
    free: VecDeque<usize>,
    /// Per chunk: the decode slot it was read into while it is held.
    held: Vec<Option<usize>>,
    landed: usize,
    aborted: bool,
}

impl StreamSink {
    /// The decode side of stream `stream`: `chunks` (computed from the ticket's chunk size
    /// with [`chunk_ranges`]), the source slots at `src_offsets`, `dst_slots` slots of the
    /// decode's pool. The chunks the ticket announces (the first `src_offsets.len()`) are
    /// ready.
    ///
    /// # Errors
    /// `Argument` (field `slots`) for no source slot or more than [`MAX_STREAM_SLOTS`], or no
    /// decode slot.
    pub fn new(
        stream: u64,
        chunks: Vec<ChunkRange>,
        src_offsets: Vec<u64>,
        dst_slots: usize,
    ) -> DisaggResult<Self> {
        check_slots(&src_offsets)?;
        if dst_slots == 0 {
            return Err(DisaggError::argument(
                "slots",
                "dst_slots=0: a stream reads through one slot at least",
            ));
        }
        let n = chunks.len();
        let first = src_offsets.len().min(n);
        let mut ready = vec![false; n];
        ready[..first].fill(true);
        Ok(Self {
            stream,
            chunks,
            src_offsets,
            ready,
            next: 0,
            free: (0..dst_slots).collect(),
            held: vec![None; n],
            landed: 0,
            aborted: false,
        })
    }

    /// Take one message from the source: a `Ready` that is exactly the schedule's (chunk in
    /// range and not announced yet, its slot `chunk % slots`, that slot's offset, the chunk's
    /// size), or an `Abort`. Returns the kind.
    ///
    /// # Errors
    /// `Wire` (field `stream_msg.*`, both values named) otherwise; nothing changes.
    pub fn receive(&mut self, msg: &StreamMsg) -> DisaggResult<StreamKind> {
        check_stream("stream_msg.stream", self.stream, msg)?;
        match msg.kind {
            StreamKind::Ack => {
                Err(DisaggError::wire("stream_msg.kind", "a decode received an Ack message"))
            }
            StreamKind::Abort => {
                self.aborted = true;
                Ok(StreamKind::Abort)
            }
            StreamKind::Ready => {
                let n = self.chunks.len();
                let k = usize::try_from(msg.chunk).unwrap_or(usize::MAX);
                if k >= n {
                    return Err(DisaggError::wire(
                        "stream_msg.chunk",
                        format!("Ready of chunk {k}, the stream has {n}"),
                    ));
                }
                if self.ready[k] {
                    return Err(DisaggError::wire(
                        "stream_msg.chunk",
                        format!("chunk {k} announced twice"),
                    ));
                }
                let slot = k % self.src_offsets.len();
                let [_, _, lo, hi] = self.chunks[k];
                let want = (slot as u64, self.src_offsets[slot], hi - lo);
                let got = (u64::from(msg.slot), msg.offset, msg.nbytes);
                for (field, w, g) in [
                    ("stream_msg.slot", want.0, got.0),
                    ("stream_msg.offset", want.1, got.1),
                    ("stream_msg.nbytes", want.2, got.2),
                ] {
                    if w != g {
                        return Err(DisaggError::wire(
                            field,
                            format!("chunk {k}: the message says {g}, the schedule {w}"),
                        ));
                    }
                }
                self.ready[k] = true;
                Ok(StreamKind::Ready)
            }
        }
    }

    /// Claim the next chunks to read, in order, while they are announced and a decode slot
    /// is free: `(chunk, decode slot, source offset, [k_lo, k_hi, lo, hi])`. Nothing after an
    /// abort.
    pub fn reads(&mut self) -> Vec<(usize, usize, u64, ChunkRange)> {
        let mut out = Vec::new();
        while !self.aborted && self.next < self.chunks.len() && self.ready[self.next] {
            let Some(slot) = self.free.pop_front() else { break };
            let k = self.next;
            self.held[k] = Some(slot);
            out.push((k, slot, self.src_offsets[k % self.src_offsets.len()], self.chunks[k]));
            self.next += 1;
        }
        out
    }

    /// Chunk `chunk` is scattered: free its decode slot; return the `Ack` to send.
    ///
    /// # Errors
    /// `Argument` (field `chunk`) for a chunk not being read.
    pub fn landed(&mut self, chunk: usize) -> DisaggResult<StreamMsg> {
        let slot = self.held.get_mut(chunk).and_then(Option::take).ok_or_else(|| {
            DisaggError::argument("chunk", format!("chunk {chunk} is not being read"))
        })?;
        self.free.push_back(slot);
        self.landed += 1;
        Ok(StreamMsg::bare(StreamKind::Ack, self.stream, chunk as u64))
    }

    /// Whether every chunk is scattered.
    #[must_use]
    pub fn done(&self) -> bool {
        self.landed == self.chunks.len()
    }

    /// Whether the source gave the stream up.
    #[must_use]
    pub fn aborted(&self) -> bool {
        self.aborted
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
