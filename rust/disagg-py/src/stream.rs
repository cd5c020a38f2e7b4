//! Bindings of streamed staging (`disagg_core::stream`): the chunk ranges both sides cut a
//! packed copy with, the notifications, and each side's schedule.

use std::borrow::Cow;
use std::sync::Mutex;

use disagg_core::stream::{
    self, ChunkRange, Mail, Observed, StreamKind, StreamMailboxes, StreamMsg, StreamSink,
    StreamSource,
};
use disagg_core::wire::ticket::StagingTicket;
use disagg_core::DisaggError;
use pyo3::prelude::*;

use crate::args::Raw;
use crate::error::IntoPyResult;
use crate::pool::{core_methods, lock, lock_with, Out};
use crate::wire::to_wire;

/// A notification as Python `bytes`.
type Bytes = Cow<'static, [u8]>;

fn bytes(m: &StreamMsg) -> Bytes {
    Cow::Owned(m.encode())
}

/// Notifications as a list of `bytes`, whatever holds them.
macro_rules! bytes_out {
    ($($t:ty => $py:ty = |$v:ident| $e:expr;)*) => {$(
        impl Out for $t {
            type Py = $py;
            fn out(self) -> PyResult<$py> {
                let $v = self;
                Ok($e)
            }
        }
    )*};
}

bytes_out! {
    Vec<StreamMsg> => Vec<Bytes> = |v| v.iter().map(bytes).collect();
    Option<StreamMsg> => Vec<Bytes> = |v| v.iter().map(bytes).collect();
    Result<StreamMsg, DisaggError> => Bytes = |v| bytes(&v.py()?);
    Result<StreamKind, DisaggError> => &'static str = |v| v.py()?.name();
    Vec<Vec<u8>> => Vec<Bytes> = |v| v.into_iter().map(Cow::Owned).collect();
    Observed => PyObserved = |v| (v.0, v.1.iter().map(bytes).collect(), v.2);
    Mail => (Vec<Bytes>, bool) = |v| (v.0.into_iter().map(Cow::Owned).collect(), v.1);
}

/// The staging ticket `ticket`; `HandoffMetadataError` for a malformed one.
fn ticket_of(ticket: &Bound<'_, PyAny>) -> PyResult<StagingTicket> {
    StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()
}

/// `sink` waiting for the announcement `t` names, if any.
fn gate(sink: StreamSink, t: &StagingTicket) -> StreamSink {
    match t.ready {
        Some(id) => sink.gated(id, t.nbytes),
        None => sink,
    }
}

/// `(k_lo, k_hi, byte_lo, byte_hi)` of every chunk of a packed copy of `n_tok` tokens whose
/// plane rows are `rows` (`(packed coefficient, row bytes per token)`), runs of whole items
/// of at most `max_bytes` (one item at least).
#[pyfunction]
pub fn stream_chunks(
    rows: Vec<(u64, u64)>,
    tokens_per_block: u64,
    n_tok: u64,
    max_bytes: u64,
) -> PyResult<Vec<ChunkRange>> {
    stream::chunk_ranges(&rows, tokens_per_block, n_tok, max_bytes).py()
}

/// `(kind, stream)` of a stream notification (`"ready"`, `"ack"` or `"abort"`); raises
/// `MetadataError` (field `stream_msg`) for bytes that are not one.
#[pyfunction]
pub fn stream_msg_route(msg: &[u8]) -> PyResult<(&'static str, u64)> {
    let m = StreamMsg::decode(msg).py()?;
    Ok((m.kind.name(), m.stream))
}

/// `[the Abort notification]` of the stream a staging ticket names, `[]` when it names none.
/// `HandoffMetadataError` for a malformed ticket.
#[pyfunction]
pub fn stream_abort_msgs(ticket: &Bound<'_, PyAny>) -> PyResult<Vec<Bytes>> {
    let t = ticket_of(ticket)?;
    Ok(t.stream.iter().map(|st| bytes(&StreamMsg::bare(StreamKind::Abort, st.id, 0))).collect())
}

/// What `release_staged` frees for a staging ticket: `(id of its stream or of its
/// announcement, else -1; [offset of a packed copy held whole])`. `HandoffMetadataError` for
/// a malformed ticket.
#[pyfunction]
pub fn staging_release(ticket: &Bound<'_, PyAny>) -> PyResult<(i64, Vec<u64>)> {
    let t = ticket_of(ticket)?;
    let held = (t.staged && t.stream.is_none()).then_some(t.offset);
    let id = t.stream.map(|st| st.id).or(t.ready);
    let id = id.map_or(-1, |id| i64::try_from(id).unwrap_or(i64::MAX));
    Ok((id, held.into_iter().collect()))
}

/// Bytes each decode slot of a chunked read of a staging ticket's copy needs: one item
/// (`item_bytes`), and a whole chunk of its stream; `2**64 - 1` (no slot fits: read the
/// blocks) for a stream whose chunks cannot hold one item (a chunk could outgrow the
/// source's slots). `HandoffMetadataError` for a malformed ticket.
#[pyfunction]
pub fn chunk_read_slot_bytes(ticket: &Bound<'_, PyAny>, item_bytes: u64) -> PyResult<u64> {
    let t = ticket_of(ticket)?;
    Ok(match t.stream {
        Some(st) if st.chunk_bytes < item_bytes => u64::MAX,
        Some(st) => st.chunk_bytes,
        None => item_bytes,
    })
}

/// The agent names of `known` (`{agent name: incarnation registered here}`) that `current`
/// (the peer table now, same form) no longer names or names with another incarnation: the
/// peers to forget, in name order.
#[pyfunction]
pub fn stale_peers(
    known: std::collections::BTreeMap<String, u64>,
    current: std::collections::BTreeMap<String, u64>,
) -> Vec<String> {
    stream::stale_peers(&known, &current)
}

/// The `Abort` notification of stream `stream`.
#[pyfunction]
pub fn stream_abort_msg(stream: u64) -> Bytes {
    bytes(&StreamMsg::bare(StreamKind::Abort, stream, 0))
}

/// `(running, give_up, [(chunk, slot)] to pack)` of one source poll.
type SourcePoll = (bool, bool, Vec<(usize, usize)>);
/// `([(chunk, slot)] to scatter, acks, first failure)` of one observation of reads in flight.
type PyObserved = (Vec<(usize, usize)>, Vec<Bytes>, Option<String>);
/// `(chunk, decode slot, source offset, (k_lo, k_hi, byte_lo, byte_hi))` of one read.
type Read = (usize, usize, u64, ChunkRange);

/// The source side of one stream: which chunk to pack next and into which slot, the
/// `Ready` notifications, and the acknowledgements it accepts.
#[pyclass(name = "StreamSource", module = "disagg_rs", frozen)]
pub struct PyStreamSource {
    inner: Mutex<StreamSource>,
}

core_methods!(PyStreamSource, lock_with, inner,
calls {
    /// Claim the chunks whose slot is free now: `[(chunk, slot), ...]` in order.
    fn packable() -> Vec<(usize, usize)> = packable();
    /// The chunks to pack before the ticket is sent, `[(chunk, slot)]`: announced, like
    /// every later chunk, once their packs have completed (`announce`).
    fn first() -> Vec<(usize, usize)> = first();
    /// One poll at `now` (the stream's deadline is `deadline`, same clock): take the
    /// decode's notifications; return `(running, give_up, [(chunk, slot)] to pack now)`.
    /// Once not running, close the stream (`close(give_up)`): `give_up` for a notification
    /// off the schedule or a passed deadline (the decode is told), not for a stream done or
    /// given up by the decode. `gone`: the decode's peer was forgotten (over, nothing to
    /// tell it).
    #[pyo3(signature = (msgs, now, deadline, gone=false))]
    fn poll(msgs: Raw<Vec<Vec<u8>>>, now: Raw<f64>, deadline: Raw<f64>, gone: Raw<bool>)
        -> SourcePoll = poll_at(&msgs, gone, now, deadline);
    /// The `Ready` notifications of the packed chunks to announce now (`landed[i]`: whether
    /// the i-th queued chunk's pack has completed).
    fn announce(landed: Raw<Vec<bool>>) -> Vec<Bytes> = announce(&landed);
    /// End the stream (idempotent): `[abort notification]` to send when `give_up` and the
    /// decode may still read, else `[]`.
    fn close(give_up: Raw<bool>) -> Vec<Bytes> = close(give_up);
    /// The `Ready` notification of a claimed chunk.
    fn ready(chunk: Raw<usize>) -> Bytes = ready(chunk);
    /// Whether every chunk is acknowledged.
    #[getter] fn done() -> bool = done();
    /// Whether the decode gave the stream up.
    #[getter] fn aborted() -> bool = aborted();
    fn __len__() -> usize = len();
}
methods {
    #[new]
    fn new(stream: u64, chunks: Vec<ChunkRange>, offsets: Vec<u64>) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(StreamSource::new(stream, chunks, offsets).py()?) })
    }
    /// The announcement of a packed copy held whole (`nbytes` at `offset`), its pack
    /// queued: announced once that pack has completed (`announce([done])`), over then.
    #[staticmethod]
    fn whole(stream: u64, offset: u64, nbytes: u64) -> Self {
        Self { inner: Mutex::new(StreamSource::whole(stream, offset, nbytes)) }
    }
    /// Take a notification from the decode; return its kind (`"ack"` or `"abort"`).
    /// `MetadataError` naming the field for anything else; nothing changes then.
    fn receive(&self, msg: &[u8]) -> PyResult<&'static str> {
        let m = StreamMsg::decode(msg).py()?;
        lock(&self.inner)?.receive(&m).out()
    }
});

/// The decode side of one stream: the announcements it accepts, which chunk to read next
/// into which decode slot, and the acknowledgements.
#[pyclass(name = "StreamSink", module = "disagg_rs", frozen)]
pub struct PyStreamSink {
    inner: Mutex<StreamSink>,
}

core_methods!(PyStreamSink, lock_with, inner,
calls {
    /// `"streamed"` for a stream, `"chunked"` for a copy held whole.
    #[getter] fn kind() -> &'static str = kind_name();
    /// Take the source's notifications in order (`StreamMailboxes.take`); what to fail the
    /// read with when the source gave the stream up or is gone (`gone`: its peer forgotten;
    /// `probed`: `[(sent, error)]` of sending `probes()`, one refused), else `None`.
    /// `MetadataError` naming the field for one off the schedule.
    #[pyo3(signature = (msgs, gone=false, probed=Vec::new()))]
    fn take(msgs: Raw<Vec<Vec<u8>>>, gone: Raw<bool>, probed: Raw<Vec<(bool, String)>>)
        -> Option<String> = take(&msgs, gone, &probed);
    /// The liveness probes to send the source now (`[bytes]`): one while the read waits
    /// for an announcement, at most every `PROBE_INTERVAL_S` of clock value `now`.
    fn probes(now: Raw<f64>) -> Vec<Bytes> = probes(now);
    /// Claim the next reads: `[(chunk, decode slot, source offset, (k_lo, k_hi, lo, hi))]`.
    fn reads() -> Vec<Read> = reads();
    /// Fold NIXL's states of the reads in flight (`[(chunk, state)]`): `([(chunk, slot) to
    /// scatter now], acks to send (a stream's chunk is acknowledged once read), first
    /// failure or None)`.
    fn observe(states: Raw<Vec<(usize, String)>>) -> PyObserved = observe(&states);
    /// Fold which queued scatters completed (`completed[i]`: the i-th queued and not
    /// finished; they complete in order): how many finished (their slots are free again).
    fn scattered(completed: Raw<Vec<bool>>) -> usize = scattered(&completed);
    /// `"DONE"` once every chunk is scattered; `"WAIT"` while nothing is in flight (no read
    /// posted, no scatter queued: waiting for an announcement, nothing can be written);
    /// else `"PROC"`.
    #[getter] fn status() -> &'static str = status();
    /// End the read (idempotent): `[abort notification]` for the source of an unfinished
    /// stream, else `[]`.
    fn close() -> Vec<Bytes> = close();
    /// A chunk is scattered: free its decode slot; return the `Ack` notification.
    fn landed(chunk: Raw<usize>) -> Bytes = landed(chunk);
    /// Whether every chunk is scattered.
    #[getter] fn done() -> bool = done();
    /// Whether the source gave the stream up.
    #[getter] fn aborted() -> bool = aborted();
}
methods {
    #[new]
    fn new(stream: u64, chunks: Vec<ChunkRange>, src_offsets: Vec<u64>, slot_bytes: u64,
        dst_slots: usize) -> PyResult<Self> {
        let sink = StreamSink::new(stream, chunks, src_offsets, slot_bytes, dst_slots).py()?;
        Ok(Self { inner: Mutex::new(sink) })
    }
    /// The read of a staging ticket's packed copy of `n_tok` tokens whose device plan rows
    /// are `rows` (`(packed coefficient, row bytes per token)`) through `dst_slots` slots of
    /// `slot_bytes`: the ticket's stream, cut in its chunk size (each checked against the
    /// source's slots), else the copy held whole, cut in `slot_bytes` (read once the ticket's
    /// announcement has come, when it names one). Raises `HandoffMetadataError` for a
    /// malformed ticket.
    #[staticmethod]
    fn of_ticket(ticket: &Bound<'_, PyAny>, rows: Vec<(u64, u64)>, tokens_per_block: u64,
        n_tok: u64, slot_bytes: u64, dst_slots: usize) -> PyResult<Self> {
        let t = ticket_of(ticket)?;
        let size = t.stream.as_ref().map_or(slot_bytes, |st| st.chunk_bytes);
        let chunks = stream::chunk_ranges(&rows, tokens_per_block, n_tok, size).py()?;
        let sink = match t.stream {
            Some(st) => StreamSink::new(st.id, chunks, st.offsets, st.slot_bytes, dst_slots),
            None => StreamSink::whole(chunks, t.offset, dst_slots).map(|s| gate(s, &t)),
        };
        Ok(Self { inner: Mutex::new(sink.py()?) })
    }
    /// The read of a staging ticket's packed copy held whole in one piece, into one slot of
    /// its size (read once the ticket's announcement has come, when it names one). Raises
    /// `HandoffMetadataError` for a malformed ticket.
    #[staticmethod]
    fn one_piece(ticket: &Bound<'_, PyAny>) -> PyResult<Self> {
        let t = ticket_of(ticket)?;
        let sink = StreamSink::whole(vec![[0, 0, 0, t.nbytes]], t.offset, 1).py()?;
        Ok(Self { inner: Mutex::new(gate(sink, &t)) })
    }
    /// A read of a packed copy held whole at `offset` of the source's region, in `chunks`
    /// through `dst_slots` slots: every chunk ready, nothing acknowledged.
    #[staticmethod]
    fn whole(chunks: Vec<ChunkRange>, offset: u64, dst_slots: usize) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(StreamSink::whole(chunks, offset, dst_slots).py()?) })
    }
    /// Every chunk `(k_lo, k_hi, byte_lo, byte_hi)`, in order.
    #[getter]
    fn chunks(&self) -> PyResult<Vec<ChunkRange>> {
        Ok(lock(&self.inner)?.chunks().to_vec())
    }
    /// The stream whose notifications the read takes: its stream's or its announcement's
    /// id (0 for a read of a whole copy that waits for none).
    #[getter]
    fn stream_id(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.mailbox().unwrap_or(0))
    }
    /// Take a notification from the source; return its kind (`"ready"` or `"abort"`).
    /// `MetadataError` naming the field when it is not the schedule's; nothing changes then.
    fn receive(&self, msg: &[u8]) -> PyResult<&'static str> {
        let m = StreamMsg::decode(msg).py()?;
        lock(&self.inner)?.receive(&m).out()
    }
});

/// Stream notifications by (peer agent name, stream id): those of open streams, and those
/// received before their stream opened here.
#[pyclass(name = "StreamMailboxes", module = "disagg_rs", frozen)]
pub struct PyStreamMailboxes {
    inner: Mutex<StreamMailboxes>,
}

core_methods!(PyStreamMailboxes, lock_with, inner,
calls {
    /// Open a mailbox for the notifications of `stream` from `peer` (those received early
    /// first); its id.
    fn open(peer: Raw<String>, stream: Raw<u64>) -> u64 = open(&peer, stream);
    /// Close mailbox `id` (and drop what its stream received early, unless its peer was
    /// forgotten since).
    fn close(id: Raw<u64>) -> () = close(id);
    /// Forget `peer` (restarted, declared lost or replaced): drop its early notifications;
    /// each of its open mailboxes takes nothing more and says it is gone.
    fn forget(peer: Raw<String>) -> () = forget(&peer);
    /// Notifications waiting for a stream not open here.
    #[getter] fn early() -> usize = early();
    /// Route what NIXL's `get_new_notifs()` returned (`{peer: [bytes, ...]}`).
    fn route(notifs: Raw<Vec<(String, Vec<Vec<u8>>)>>) -> () = route(notifs);
    /// Take what mailbox `id` received so far, in order, and whether its peer is gone:
    /// `([bytes, ...], gone)`.
    fn take(id: Raw<u64>) -> (Vec<Bytes>, bool) = take(id);
    /// Notifications dropped so far.
    #[getter] fn dropped() -> u64 = dropped();
}
methods {
    #[new]
    fn new() -> Self {
        Self { inner: Mutex::new(StreamMailboxes::default()) }
    }
    /// Stop keeping the notifications of the stream or announcement a staging ticket of
    /// `peer` names (those received early too); nothing for a ticket that names none.
    /// `HandoffMetadataError` for a malformed ticket.
    fn forget_ticket(&self, peer: &str, ticket: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = ticket_of(ticket)?;
        if let Some(id) = t.stream.map(|st| st.id).or(t.ready) {
            lock(&self.inner)?.close_stream(peer, id);
        }
        Ok(())
    }
});
