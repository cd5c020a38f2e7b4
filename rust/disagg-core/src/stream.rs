//! Streamed staging: a packed copy larger than the source's staging pool moves chunk by chunk.
//!
//! The source reserves a few slots of its pool; chunk `k` of the packed copy lives in source
//! slot `k % slots`. The source packs a chunk into its slot and announces it (`Ready`); the
//! decode reads it into one of its own slots and acknowledges it (`Ack`) as it queues the
//! scatter; the acknowledgement frees the source slot for chunk `k + slots`. Either side may give the
//! stream up (`Abort`). Everything both sides must agree on is decided here:
//!
//! - [`chunk_ranges`]: the item and byte ranges of every chunk (a chunk is a run of whole
//!   items of a device plan, at most `max_bytes` unless one item is larger);
//! - [`StreamSource`]: which chunk the source may pack next and into which slot, and whether
//!   an acknowledgement is one it may receive;
//! - [`StreamSink`]: whether an announcement is the one the schedule says, which chunk the
//!   decode reads next and into which of its slots, what to acknowledge (a chunk is
//!   acknowledged once its read has landed in the decode's slot, before its scatter);
//! - [`StreamMsg`]: the notification each side sends, encoded and parsed here.
//!
//! Every chunk, the first ones too, is announced by a `Ready` once its pack has completed on
//! the source: the ticket leaves as soon as the first packs are queued, and the decode reads
//! nothing before its announcement. A packed copy held whole is announced the same way, as a
//! stream of one chunk in one slot (the copy's region) that is over once announced
//! ([`StreamSource::whole`], [`StreamSink::gated`]). A notification may reach the decode
//! before it has the ticket: [`StreamMailboxes`] keeps it until the stream is opened.
//! Ranges are half-open `[lo, hi)`.

use std::collections::VecDeque;

use crate::error::{DisaggError, DisaggResult};
use crate::packed_items::PackedItems;
use crate::wire::ticket::StagingTicket;

/// Most slots a stream may hold in the source's pool.
pub const MAX_STREAM_SLOTS: usize = 16;

/// One chunk: items `[k_lo, k_hi)` of the device plan, packed bytes `[lo, hi)`.
pub type ChunkRange = [u64; 4];

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
    PackedItems::new(rows, tokens_per_block, n_tok)?.chunks(max_bytes)
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

impl StreamKind {
    /// `"ready"`, `"ack"` or `"abort"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Ack => "ack",
            Self::Abort => "abort",
        }
    }
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

/// The liveness probe a decode sends the source it waits for ([`StreamSink::probes`]): not a
/// stream message (the source's mailboxes drop it uncounted); sending it fails at once when
/// the source's process is gone, which ends the wait then rather than at its deadline.
pub const STREAM_PROBE: &[u8] = b"DRS1probe";

/// Seconds between two probes of a read waiting for an announcement.
pub const PROBE_INTERVAL_S: f64 = 0.1;

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

/// Sort a message to one side of stream `want`: the chunk it names when it is of the kind
/// this side takes (`taken`), `None` for an `Abort` (the stream is then marked `aborted`).
///
/// # Errors
/// `Wire` for another stream's message, or `refused` for the other side's kind.
fn take_kind(
    msg: &StreamMsg,
    want: u64,
    taken: StreamKind,
    refused: &str,
    aborted: &mut bool,
) -> DisaggResult<Option<usize>> {
    check_stream("stream_msg.stream", want, msg)?;
    match msg.kind {
        StreamKind::Abort => {
            *aborted = true;
            Ok(None)
        }
        kind if kind == taken => Ok(Some(usize::try_from(msg.chunk).unwrap_or(usize::MAX))),
        _ => Err(DisaggError::wire("stream_msg.kind", refused)),
    }
}

/// `Ok` when chunk `k` is below `open` and not `seen` yet.
///
/// # Errors
/// `Wire` on `stream_msg.chunk`: `beyond()` for a chunk past `open`, `chunk {k} {done} twice`
/// for one seen already.
fn check_fresh(
    k: usize,
    open: usize,
    seen: &[bool],
    beyond: impl FnOnce() -> String,
    done: &str,
) -> DisaggResult<()> {
    if k >= open {
        return Err(DisaggError::wire("stream_msg.chunk", beyond()));
    }
    if seen[k] {
        return Err(DisaggError::wire("stream_msg.chunk", format!("chunk {k} {done} twice")));
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

/// What the source does with a stream after a poll ([`StreamSource::poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceVerdict {
    /// Keep going: pack the chunks returned beside it.
    Run,
    /// Over, nothing to tell: every chunk acknowledged, or the decode gave it up.
    Over,
    /// Give it up and tell the decode: a notification off the schedule, or the deadline.
    GiveUp,
}

/// The source side of one stream: which chunk to pack next, into which slot, which packed
/// chunks to announce, and which acknowledgements are valid.
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
    /// Packed chunks not announced yet, in order.
    queued: VecDeque<usize>,
    announced: usize,
    /// A packed copy held whole: over once announced (nothing is acknowledged).
    whole: bool,
    closed: bool,
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
            queued: VecDeque::new(),
            announced: 0,
            whole: false,
            closed: false,
        })
    }

    /// The announcement of a packed copy held whole (`nbytes` at `offset` of the staging
    /// region), its pack queued already: one chunk in one slot, announced by
    /// [`Self::announce`] once the pack has completed; over then (the region stays the
    /// ticket's, freed when it is released).
    #[must_use]
    pub fn whole(stream: u64, offset: u64, nbytes: u64) -> Self {
        Self {
            stream,
            chunks: vec![[0, 0, 0, nbytes]],
            offsets: vec![offset],
            next: 1,
            acked: vec![false],
            acked_count: 0,
            aborted: false,
            queued: VecDeque::from([0]),
            announced: 0,
            whole: true,
            closed: false,
        }
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

    /// The chunks to pack before the ticket is sent: the first `slots`, `(chunk, slot)`,
    /// queued to be announced ([`Self::announce`]) once packed, like every later chunk.
    pub fn first(&mut self) -> Vec<(usize, usize)> {
        let todo = self.packable();
        self.queued.extend(todo.iter().map(|&(k, _)| k));
        todo
    }

    /// Claim every chunk whose slot is free now, in order: `(chunk, slot)`. Chunk `k` takes
    /// slot `k % slots` once chunk `k - slots` is acknowledged. Nothing after an abort.
    pub fn packable(&mut self) -> Vec<(usize, usize)> {
        let slots = self.offsets.len();
        let mut out = Vec::new();
        while !self.aborted
            && !self.closed
            && self.next < self.chunks.len()
            && (self.next < slots || self.acked[self.next - slots])
        {
            out.push((self.next, self.next % slots));
            self.next += 1;
        }
        out
    }

    /// One poll: take the decode's notifications (`msgs`, in order) and say what to do;
    /// with [`SourceVerdict::Run`], the chunks to pack now (announced by [`Self::announce`]
    /// once packed). `gone`: the decode's peer was forgotten (over, nothing to tell it);
    /// `expired`: the stream's deadline has passed.
    pub fn poll(
        &mut self,
        msgs: &[Vec<u8>],
        gone: bool,
        expired: bool,
    ) -> (SourceVerdict, Vec<(usize, usize)>) {
        if gone {
            self.aborted = true;
            return (SourceVerdict::Over, Vec::new());
        }
        for m in msgs {
            if StreamMsg::decode(m).and_then(|m| self.receive(&m)).is_err() {
                return (SourceVerdict::GiveUp, Vec::new());
            }
        }
        if self.aborted || self.done() {
            return (SourceVerdict::Over, Vec::new());
        }
        if expired {
            return (SourceVerdict::GiveUp, Vec::new());
        }
        let todo = self.packable();
        self.queued.extend(todo.iter().map(|&(k, _)| k));
        (SourceVerdict::Run, todo)
    }

    /// [`Self::poll`] at time `now` of a stream whose deadline is `deadline` (seconds on
    /// the caller's clock): `(running, give_up, chunks to pack)`; once not running, the
    /// caller closes the stream ([`Self::close`] with `give_up`).
    pub fn poll_at(
        &mut self,
        msgs: &[Vec<u8>],
        gone: bool,
        now: f64,
        deadline: f64,
    ) -> (bool, bool, Vec<(usize, usize)>) {
        let (verdict, todo) = self.poll(msgs, gone, now >= deadline);
        (verdict == SourceVerdict::Run, verdict == SourceVerdict::GiveUp, todo)
    }

    /// The `Ready` messages of the queued chunks whose pack has completed: `landed[i]` says
    /// whether the `i`-th queued chunk's pack has (in order; announcing stops at the first
    /// that has not).
    pub fn announce(&mut self, landed: &[bool]) -> Vec<StreamMsg> {
        let n = landed.iter().take_while(|&&l| l).count().min(self.queued.len());
        let ks: Vec<usize> = self.queued.drain(..n).collect();
        self.announced += ks.len();
        ks.into_iter().filter_map(|k| self.ready(k).ok()).collect()
    }

    /// End the stream (idempotent): the `Abort` to send when `give_up` and the decode may
    /// still be reading (not every chunk acknowledged, no abort from it); `None` otherwise
    /// and on every later call.
    pub fn close(&mut self, give_up: bool) -> Option<StreamMsg> {
        let first = !self.closed;
        self.closed = true;
        self.queued.clear();
        (first && give_up && !self.done() && !self.aborted)
            .then(|| StreamMsg::bare(StreamKind::Abort, self.stream, 0))
            .filter(|_| !self.whole || self.announced == 0)
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
        let refused = "a source received a Ready message";
        let Some(k) = take_kind(msg, self.stream, StreamKind::Ack, refused, &mut self.aborted)?
        else {
            return Ok(StreamKind::Abort);
        };
        let beyond = || format!("Ack of chunk {k}, only {} announced", self.next);
        check_fresh(k, self.next, &self.acked, beyond, "acknowledged")?;
        self.acked[k] = true;
        self.acked_count += 1;
        Ok(StreamKind::Ack)
    }

    /// Whether every chunk is acknowledged (the slots may be freed); a copy held whole:
    /// whether it is announced.
    #[must_use]
    pub fn done(&self) -> bool {
        if self.whole {
            return self.announced == 1;
        }
        self.acked_count == self.chunks.len()
    }

    /// Whether the decode gave the stream up.
    #[must_use]
    pub fn aborted(&self) -> bool {
        self.aborted
    }
}

/// Where a decode reads its chunks from.
#[derive(Debug, Clone)]
enum SinkSource {
    /// A stream: chunk `k` in source slot `k % offsets.len()`, announced one by one.
    Stream { id: u64, offsets: Vec<u64> },
    /// A packed copy held whole at `offset` of the source's region: every chunk is there
    /// once `gate`'s announcement `(stream, nbytes of the copy)` has come (at once without).
    Whole { offset: u64, gate: Option<(u64, u64)> },
}

/// `([(chunk, decode slot)] to scatter, acks to send, first failure)` of
/// [`StreamSink::observe`].
pub type Observed = (Vec<(usize, usize)>, Vec<StreamMsg>, Option<String>);

/// Where one chunk of a decode's read stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Reading(usize),
    Scattering(usize),
}

/// The decode side of a chunked read: which announcements are valid (a stream), which chunk
/// to read next into which of the decode's slots, which reads to scatter, which slots to
/// free and what to acknowledge.
#[derive(Debug, Clone)]
pub struct StreamSink {
    src: SinkSource,
    chunks: Vec<ChunkRange>,
    ready: Vec<bool>,
    /// Announcements taken: by chunk of a stream, one for a copy held whole.
    announced: Vec<bool>,
    /// Chunks handed out to read so far (`0..next`).
    next: usize,
    free: VecDeque<usize>,
    held: Vec<Option<Held>>,
    /// Chunks scattering, in the order their scatters were queued.
    scattering: VecDeque<usize>,
    landed: usize,
    aborted: bool,
    closed: bool,
    /// When the last probe went ([`Self::probes`]).
    probed: Option<f64>,
}

impl StreamSink {
    /// The decode side of stream `stream`: `chunks` (computed from the ticket's chunk size
    /// with [`chunk_ranges`]), the source slots at `src_offsets`, `dst_slots` slots of the
    /// decode's pool. No chunk is ready before the source announces it.
    ///
    /// # Errors
    /// `Argument` (field `slots`) for no source slot or more than [`MAX_STREAM_SLOTS`], or no
    /// decode slot; `Wire` (field `stream.slot_bytes`) when a chunk is larger than a source slot.
    pub fn new(
        stream: u64,
        chunks: Vec<ChunkRange>,
        src_offsets: Vec<u64>,
        slot_bytes: u64,
        dst_slots: usize,
    ) -> DisaggResult<Self> {
        check_slots(&src_offsets)?;
        if let Some([k, _, lo, hi]) = chunks.iter().find(|c| c[3] - c[2] > slot_bytes) {
            return Err(DisaggError::wire(
                "stream.slot_bytes",
                format!("chunk at item {k} has {} bytes, a source slot {slot_bytes}", hi - lo),
            ));
        }
        Self::build(SinkSource::Stream { id: stream, offsets: src_offsets }, chunks, 0, dst_slots)
    }

    /// A read of a packed copy held whole at `offset` of the source's staging region, in
    /// `chunks` through `dst_slots` decode slots: every chunk is ready, nothing is
    /// acknowledged.
    ///
    /// # Errors
    /// `Argument` (field `slots`) for no decode slot.
    pub fn whole(chunks: Vec<ChunkRange>, offset: u64, dst_slots: usize) -> DisaggResult<Self> {
        let n = chunks.len();
        Self::build(SinkSource::Whole { offset, gate: None }, chunks, n, dst_slots)
    }

    /// This read of a copy held whole waits for the source's announcement of stream `stream`
    /// (one `Ready` of chunk 0 in slot 0 at the copy's offset, `nbytes` the copy's size)
    /// before its first read; a stream reads as before.
    #[must_use]
    pub fn gated(mut self, stream: u64, nbytes: u64) -> Self {
        if let SinkSource::Whole { gate, .. } = &mut self.src {
            *gate = Some((stream, nbytes));
            self.ready.fill(false);
        }
        self
    }

    /// The read of staging ticket `t`'s packed copy of `n_tok` tokens whose device plan rows
    /// are `rows` (see [`chunk_ranges`]), through `dst_slots` decode slots of `slot_bytes`:
    /// the ticket's stream cut in its chunk size (each chunk checked against the source's
    /// slots), else the copy held whole cut in `slot_bytes`, read once the ticket's
    /// announcement has come when it names one.
    pub fn of_ticket(
        t: &StagingTicket,
        rows: &[(u64, u64)],
        tokens_per_block: u64,
        n_tok: u64,
        slot_bytes: u64,
        dst_slots: usize,
    ) -> DisaggResult<Self> {
        let size = t.stream.as_ref().map_or(slot_bytes, |st| st.chunk_bytes);
        let chunks = chunk_ranges(rows, tokens_per_block, n_tok, size)?;
        match &t.stream {
            Some(st) => Self::new(st.id, chunks, st.offsets.clone(), st.slot_bytes, dst_slots),
            None => Self::whole(chunks, t.offset, dst_slots).map(|s| s.gated_by(t)),
        }
    }

    /// The read of staging ticket `t`'s packed copy held whole, in one piece into one slot of
    /// its size (once the ticket's announcement has come, when it names one).
    pub fn one_piece(t: &StagingTicket) -> DisaggResult<Self> {
        Self::whole(vec![[0, 0, 0, t.nbytes]], t.offset, 1).map(|s| s.gated_by(t))
    }

    /// Gated by the announcement `t` names, if any.
    fn gated_by(self, t: &StagingTicket) -> Self {
        match t.ready {
            Some(id) => self.gated(id, t.nbytes),
            None => self,
        }
    }

    /// The stream whose notifications this read takes: the stream, or the announcement of
    /// a copy held whole.
    #[must_use]
    pub fn mailbox(&self) -> Option<u64> {
        match self.src {
            SinkSource::Stream { id, .. } | SinkSource::Whole { gate: Some((id, _)), .. } => {
                Some(id)
            }
            SinkSource::Whole { gate: None, .. } => None,
        }
    }

    fn build(
        src: SinkSource,
        chunks: Vec<ChunkRange>,
        first: usize,
        dst_slots: usize,
    ) -> DisaggResult<Self> {
        if dst_slots == 0 {
            return Err(DisaggError::argument(
                "slots",
                "dst_slots=0: a chunked read goes through one slot at least",
            ));
        }
        let n = chunks.len();
        let mut ready = vec![false; n];
        ready[..first.min(n)].fill(true);
        Ok(Self {
            src,
            chunks,
            ready,
            announced: vec![false; n.max(1)],
            next: 0,
            free: (0..dst_slots).collect(),
            held: vec![None; n],
            scattering: VecDeque::new(),
            landed: 0,
            aborted: false,
            closed: false,
            probed: None,
        })
    }

    fn stream_id(&self) -> Option<u64> {
        match self.src {
            SinkSource::Stream { id, .. } => Some(id),
            SinkSource::Whole { .. } => None,
        }
    }

    /// Take one message from the source: a `Ready` that is exactly the schedule's (chunk in
    /// range and not announced yet, its slot `chunk % slots`, that slot's offset, the chunk's
    /// size), or an `Abort`. Returns the kind.
    ///
    /// # Errors
    /// `Wire` (field `stream_msg.*`, both values named) otherwise, and for any message to a
    /// read of a whole copy that waits for no announcement; nothing changes.
    pub fn receive(&mut self, msg: &StreamMsg) -> DisaggResult<StreamKind> {
        let Some(id) = self.mailbox() else {
            return Err(DisaggError::wire(
                "stream_msg.stream",
                "a read of a whole copy without an announcement has no stream",
            ));
        };
        let refused = "a decode received an Ack message";
        let Some(k) = take_kind(msg, id, StreamKind::Ready, refused, &mut self.aborted)? else {
            return Ok(StreamKind::Abort);
        };
        // The chunk the message may announce, its slot, offset and size.
        let (n, want) = match &self.src {
            SinkSource::Stream { offsets, .. } => {
                let n = self.chunks.len();
                let slot = k % offsets.len();
                let size = self.chunks.get(k).map_or(0, |c| c[3] - c[2]);
                (n, (slot as u64, offsets[slot], size))
            }
            SinkSource::Whole { offset, gate } => (1, (0, *offset, gate.map_or(0, |g| g.1))),
        };
        let beyond = || format!("Ready of chunk {k}, the stream has {n}");
        check_fresh(k, n, &self.announced, beyond, "announced")?;
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
        self.announced[k] = true;
        // A whole copy's one announcement makes every chunk of the read ready.
        match self.src {
            SinkSource::Stream { .. } => self.ready[k] = true,
            SinkSource::Whole { .. } => self.ready.fill(true),
        }
        Ok(StreamKind::Ready)
    }

    /// Take the source's notifications in order ([`StreamMailboxes::take`]); what to fail
    /// the read with when the source gave the stream up or is gone: its peer forgotten
    /// (`gone`), or a probe to it refused (`probed`: the outcome of sending each of
    /// [`Self::probes`], `(sent, error)`). Nothing more will come then; the read is over and
    /// nothing is sent back.
    ///
    /// # Errors
    /// The first [`Self::receive`] error (later messages are not taken).
    pub fn take(
        &mut self,
        msgs: &[Vec<u8>],
        gone: bool,
        probed: &[(bool, String)],
    ) -> DisaggResult<Option<String>> {
        let id = self.mailbox().unwrap_or(0);
        let refused = probed.iter().find(|(sent, _)| !sent).map(|(_, e)| e.as_str());
        if (gone || refused.is_some()) && !self.done() {
            self.aborted = true;
            let why = refused.unwrap_or("restarted, declared lost or forgotten");
            return Ok(Some(format!("the source of stream {id} is gone ({why})")));
        }
        for m in msgs {
            let m = StreamMsg::decode(m)?;
            self.receive(&m)?;
        }
        Ok(self.aborted.then(|| format!("the source gave stream {id} up")))
    }

    /// Claim the next chunks to read, in order, while they are ready and a decode slot is
    /// free: `(chunk, decode slot, source offset, [k_lo, k_hi, lo, hi])`. Nothing after an
    /// abort or close.
    pub fn reads(&mut self) -> Vec<(usize, usize, u64, ChunkRange)> {
        let mut out = Vec::new();
        while !self.aborted
            && !self.closed
            && self.next < self.chunks.len()
            && self.ready[self.next]
        {
            let Some(slot) = self.free.pop_front() else { break };
            let k = self.next;
            let c = self.chunks[k];
            let at = match &self.src {
                SinkSource::Stream { offsets, .. } => offsets[k % offsets.len()],
                SinkSource::Whole { offset, .. } => offset.saturating_add(c[2]),
            };
            self.held[k] = Some(Held::Reading(slot));
            out.push((k, slot, at, c));
            self.next += 1;
        }
        out
    }

    /// Fold the states NIXL reports for reads in flight (`(chunk, state)`, `"DONE"`, `"ERR"`
    /// or anything else for still running): the chunks to scatter now (each now
    /// scattering), for a stream the `Ack` of each (the source's slot is free once the read
    /// has landed here), and the first failure.
    pub fn observe(&mut self, states: &[(usize, String)]) -> Observed {
        let id = self.stream_id();
        let (mut landed, mut acks) = (Vec::new(), Vec::new());
        for (k, state) in states {
            let Some(Some(Held::Reading(slot))) = self.held.get(*k).copied() else {
                return (landed, acks, Some(format!("chunk {k} is not being read")));
            };
            match state.as_str() {
                "DONE" => {
                    self.held[*k] = Some(Held::Scattering(slot));
                    self.scattering.push_back(*k);
                    landed.push((*k, slot));
                    acks.extend(id.map(|id| StreamMsg::bare(StreamKind::Ack, id, *k as u64)));
                }
                "ERR" => return (landed, acks, Some(format!("NIXL reported ERR for chunk {k}"))),
                _ => {}
            }
        }
        (landed, acks, None)
    }

    /// Fold which scatters have completed: `completed[i]` for the `i`-th scatter queued and
    /// not finished yet (scatters complete in the order they were queued; folding stops at
    /// the first that has not). Frees their slots; returns how many finished.
    pub fn scattered(&mut self, completed: &[bool]) -> usize {
        let n = completed.iter().take_while(|&&c| c).count().min(self.scattering.len());
        for k in self.scattering.drain(..n).collect::<Vec<_>>() {
            if let Some(Some(Held::Scattering(slot))) = self.held.get(k).copied() {
                self.free.push_back(slot);
                self.held[k] = None;
                self.landed += 1;
            }
        }
        n
    }

    /// Every chunk, in order.
    #[must_use]
    pub fn chunks(&self) -> &[ChunkRange] {
        &self.chunks
    }

    /// Whether this reads a stream (not a copy held whole).
    #[must_use]
    pub fn is_stream(&self) -> bool {
        self.stream_id().is_some()
    }

    /// `"streamed"` for a stream, `"chunked"` for a copy held whole.
    #[must_use]
    pub fn kind_name(&self) -> &'static str {
        if self.is_stream() {
            "streamed"
        } else {
            "chunked"
        }
    }

    /// The stream's id (0 for a read of a whole copy).
    #[must_use]
    pub fn id(&self) -> u64 {
        self.stream_id().unwrap_or(0)
    }

    /// Chunk `chunk` is read and scattered (both at once): free its decode slot; return the
    /// `Ack` to send.
    ///
    /// # Errors
    /// `Argument` (field `chunk`) for a chunk not being read.
    pub fn landed(&mut self, chunk: usize) -> DisaggResult<StreamMsg> {
        match self.held.get(chunk).copied().flatten() {
            Some(Held::Reading(s) | Held::Scattering(s)) => {
                self.held[chunk] = Some(Held::Scattering(s));
            }
            None => {
                return Err(DisaggError::argument(
                    "chunk",
                    format!("chunk {chunk} is not being read"),
                ))
            }
        }
        let id = self.stream_id().unwrap_or(0);
        self.scattering.retain(|&k| k != chunk);
        self.scattering.push_front(chunk);
        self.scattered(&[true]);
        Ok(StreamMsg::bare(StreamKind::Ack, id, chunk as u64))
    }

    /// `"DONE"` once every chunk is scattered; `"WAIT"` while nothing is read or scattered
    /// (no READ in flight, no scatter queued: waiting for an announcement, so nothing of this
    /// read can write a destination or a slot now); else `"PROC"`.
    #[must_use]
    pub fn status(&self) -> &'static str {
        if self.done() {
            "DONE"
        } else if self.quiet() {
            "WAIT"
        } else {
            "PROC"
        }
    }

    /// The probes to send the source now: one while this read waits for an announcement
    /// (nothing in flight, the next chunk not announced), at most every
    /// [`PROBE_INTERVAL_S`] of the caller's clock (`now`), the first at once.
    pub fn probes(&mut self, now: f64) -> Vec<Vec<u8>> {
        let waiting = !self.aborted
            && !self.closed
            && self.quiet()
            && self.ready.get(self.next).is_some_and(|&r| !r);
        let due = self.probed.is_none_or(|at| now - at >= PROBE_INTERVAL_S);
        if !(waiting && due) {
            return Vec::new();
        }
        self.probed = Some(now);
        vec![STREAM_PROBE.to_vec()]
    }

    /// Whether nothing of this read is in flight: no READ posted and not landed, no scatter
    /// queued and not completed.
    #[must_use]
    pub fn quiet(&self) -> bool {
        self.held.iter().all(Option::is_none)
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

    /// End the read (idempotent): the `Abort` to send the source of an unfinished stream it
    /// has not given up; `None` otherwise and on every later call.
    pub fn close(&mut self) -> Option<StreamMsg> {
        let first = !self.closed;
        self.closed = true;
        let id = self.stream_id()?;
        (first && !self.done() && !self.aborted).then(|| StreamMsg::bare(StreamKind::Abort, id, 0))
    }
}

/// Stream notifications kept before their stream is opened here, at most (the oldest goes
/// first): an announcement may overtake the ticket that names its stream.
pub const MAX_EARLY_NOTIFS: usize = 4096;

/// The peers of `known` (agent name to the incarnation registered here) that `current` (the
/// control plane's peer table now, agent name to incarnation) no longer names, or names with
/// another incarnation: declared lost, or restarted. They are to be forgotten (their streams
/// end, [`StreamMailboxes::forget`]). In name order.
#[must_use]
pub fn stale_peers(
    known: &std::collections::BTreeMap<String, u64>,
    current: &std::collections::BTreeMap<String, u64>,
) -> Vec<String> {
    known
        .iter()
        .filter(|(name, inc)| current.get(*name) != Some(inc))
        .map(|(n, _)| n.clone())
        .collect()
}

/// One open mailbox: whose notifications it takes, what it holds, and whether its peer was
/// forgotten since it opened.
#[derive(Debug, Clone)]
struct Mailbox {
    key: (String, u64),
    msgs: Vec<Vec<u8>>,
    gone: bool,
}

/// What [`StreamMailboxes::take`] hands out: the notifications received so far, in order,
/// and whether the peer was forgotten (restarted, declared lost or replaced by a new
/// incarnation) since the mailbox opened: nothing more will come, the stream is over.
pub type Mail = (Vec<Vec<u8>>, bool);

/// Stream notifications waiting for their stream, by (peer agent name, stream id): NIXL
/// hands out every notification of an agent at once, so they are routed here. One of a
/// stream not open (yet) is kept among the early ones (at most [`MAX_EARLY_NOTIFS`]) until
/// the stream opens or closes, or until it has waited longer than the stream could run (one
/// of a stream that never opens here: its ticket lost, or its sender forgotten before the
/// notification arrived); anything else is dropped (and counted).
///
/// Each open stream has its own mailbox, named by the id [`Self::open`] returns: a peer
/// forgotten ([`Self::forget`]) numbers its streams anew, so its open mailboxes stop taking
/// notifications (a new incarnation's stream of the same id opens a mailbox of its own) and
/// say the peer is gone.
#[derive(Debug, Clone, Default)]
pub struct StreamMailboxes {
    boxes: std::collections::BTreeMap<u64, Mailbox>,
    /// The mailbox taking the notifications of each (peer, stream) now.
    routes: std::collections::BTreeMap<(String, u64), u64>,
    /// `((peer, stream), notification, arrival time)`, oldest first.
    early: VecDeque<((String, u64), Vec<u8>, f64)>,
    next: u64,
    dropped: u64,
}

impl StreamMailboxes {
    /// Open a mailbox for the notifications of `stream` from `peer`, those received early
    /// first; its id. A later mailbox of the same stream takes its notifications from then on.
    pub fn open(&mut self, peer: &str, stream: u64) -> u64 {
        let key = (peer.to_owned(), stream);
        let (mine, rest): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.early).into_iter().partition(|(k, ..)| *k == key);
        self.early = rest;
        self.next += 1;
        let msgs = mine.into_iter().map(|(_, m, _)| m).collect();
        self.routes.insert(key.clone(), self.next);
        self.boxes.insert(self.next, Mailbox { key, msgs, gone: false });
        self.next
    }

    /// Close mailbox `id` (unknown ids: nothing). Unless its peer was forgotten since, the
    /// early notifications of its stream go too, and later ones wait among the early ones.
    pub fn close(&mut self, id: u64) {
        let Some(b) = self.boxes.remove(&id) else { return };
        if self.routes.get(&b.key) == Some(&id) {
            self.routes.remove(&b.key);
            self.early.retain(|(k, ..)| *k != b.key);
        }
    }

    /// Stop keeping the notifications of `stream` from `peer` (its open mailbox and those
    /// received early): a stream this rank will not read.
    pub fn close_stream(&mut self, peer: &str, stream: u64) {
        let key = (peer.to_owned(), stream);
        if let Some(id) = self.routes.remove(&key) {
            self.boxes.remove(&id);
        }
        self.early.retain(|(k, ..)| *k != key);
    }

    /// [`Self::close_stream`] of the stream or announcement a staging ticket of `peer` names
    /// (nothing for a ticket that names none).
    pub fn forget_ticket(&mut self, peer: &str, ticket: &StagingTicket) {
        if let Some(id) = ticket.notice_id() {
            self.close_stream(peer, id);
        }
    }

    /// Forget `peer` (forgotten, declared lost or replaced: its stream ids start over): its
    /// early notifications are dropped and each of its open mailboxes is gone (it takes no
    /// more notifications; [`Self::take`] says so until it is closed).
    pub fn forget(&mut self, peer: &str) {
        self.routes.retain(|(p, _), _| p != peer);
        for b in self.boxes.values_mut().filter(|b| b.key.0 == peer) {
            b.gone = true;
        }
        self.early.retain(|((p, _), ..)| p != peer);
    }

    /// Route notifications `(peer, messages)`, received at `now` (seconds), to their
    /// mailboxes; early ones that have waited more than `early_ttl_s` go first (dropped).
    pub fn route(&mut self, notifs: Vec<(String, Vec<Vec<u8>>)>, now: f64, early_ttl_s: f64) {
        while self.early.front().is_some_and(|(_, _, at)| now - at > early_ttl_s) {
            self.early.pop_front();
            self.dropped += 1;
        }
        for (peer, msgs) in notifs {
            for m in msgs {
                if m == STREAM_PROBE {
                    continue;
                }
                let Ok(d) = StreamMsg::decode(&m) else {
                    self.dropped += 1;
                    continue;
                };
                let key = (peer.clone(), d.stream);
                if let Some(b) = self.routes.get(&key).and_then(|id| self.boxes.get_mut(id)) {
                    b.msgs.push(m);
                    continue;
                }
                if self.early.len() == MAX_EARLY_NOTIFS {
                    self.early.pop_front();
                    self.dropped += 1;
                }
                self.early.push_back((key, m, now));
            }
        }
    }

    /// Take what mailbox `id` received so far and whether its peer is gone (an unknown or
    /// closed mailbox: nothing, not gone).
    pub fn take(&mut self, id: u64) -> Mail {
        self.boxes
            .get_mut(&id)
            .map_or((Vec::new(), false), |b| (std::mem::take(&mut b.msgs), b.gone))
    }

    /// Whether no mailbox is open and no notification waits.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.boxes.is_empty() && self.early.is_empty()
    }

    /// Notifications waiting for a stream not open here.
    #[must_use]
    pub fn early(&self) -> usize {
        self.early.len()
    }

    /// Notifications dropped so far (not a stream notification, the oldest early one past
    /// [`MAX_EARLY_NOTIFS`], or an early one that waited too long).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
