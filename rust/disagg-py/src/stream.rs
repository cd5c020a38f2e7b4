//! Bindings of streamed staging (`disagg_core::stream`): the chunk ranges both sides cut a
//! packed copy with, the notifications, and each side's schedule.

use std::sync::Mutex;

use disagg_core::stream::{
    self, ChunkRange, StreamKind, StreamMailboxes, StreamMsg, StreamSink, StreamSource,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use disagg_core::wire::ticket::StagingTicket;

use crate::error::IntoPyResult;
use crate::pool::lock;
use crate::wire::to_wire;

fn kind_name(k: StreamKind) -> &'static str {
    match k {
        StreamKind::Ready => "ready",
        StreamKind::Ack => "ack",
        StreamKind::Abort => "abort",
    }
}

/// `sink` waiting for the announcement `t` names, if any.
fn gate(sink: StreamSink, t: &StagingTicket) -> StreamSink {
    match t.ready {
        Some(id) => sink.gated(id, t.nbytes),
        None => sink,
    }
}

fn bytes<'py>(py: Python<'py>, m: &StreamMsg) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &m.encode())
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
    Ok((kind_name(m.kind), m.stream))
}

/// `[the Abort notification]` of the stream a staging ticket names, `[]` when it names none.
/// `HandoffMetadataError` for a malformed ticket.
#[pyfunction]
pub fn stream_abort_msgs<'py>(
    py: Python<'py>,
    ticket: &Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let t = StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()?;
    Ok(t.stream.iter().map(|st| bytes(py, &StreamMsg::bare(StreamKind::Abort, st.id, 0))).collect())
}

/// What `release_staged` frees for a staging ticket: `(id of its stream or of its
/// announcement, else -1; [offset of a packed copy held whole])`. `HandoffMetadataError` for
/// a malformed ticket.
#[pyfunction]
pub fn staging_release(ticket: &Bound<'_, PyAny>) -> PyResult<(i64, Vec<u64>)> {
    let t = StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()?;
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
    let t = StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()?;
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
pub fn stream_abort_msg(py: Python<'_>, stream: u64) -> Bound<'_, PyBytes> {
    bytes(py, &StreamMsg::bare(StreamKind::Abort, stream, 0))
}

/// The source side of one stream: which chunk to pack next and into which slot, the
/// `Ready` notifications, and the acknowledgements it accepts.
/// `(running, give_up, [(chunk, slot)] to pack)` of one source poll.
type SourcePoll = (bool, bool, Vec<(usize, usize)>);
/// `([(chunk, slot)] to scatter, acks, first failure)` of one observation of reads in flight.
type PyObserved<'py> = (Vec<(usize, usize)>, Vec<Bound<'py, PyBytes>>, Option<String>);

#[pyclass(name = "StreamSource", module = "disagg_rs", frozen)]
pub struct PyStreamSource {
    inner: Mutex<StreamSource>,
}

#[pymethods]
impl PyStreamSource {
    #[new]
    fn new(stream: u64, chunks: Vec<ChunkRange>, offsets: Vec<u64>) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(StreamSource::new(stream, chunks, offsets).py()?) })
    }
    /// Claim the chunks whose slot is free now: `[(chunk, slot), ...]` in order.
    fn packable(&self) -> PyResult<Vec<(usize, usize)>> {
        Ok(lock(&self.inner)?.packable())
    }
    /// The announcement of a packed copy held whole (`nbytes` at `offset`), its pack
    /// queued: announced once that pack has completed (`announce([done])`), over then.
    #[staticmethod]
    fn whole(stream: u64, offset: u64, nbytes: u64) -> Self {
        Self { inner: Mutex::new(StreamSource::whole(stream, offset, nbytes)) }
    }
    /// The chunks to pack before the ticket is sent, `[(chunk, slot)]`: announced, like
    /// every later chunk, once their packs have completed (`announce`).
    fn first(&self) -> PyResult<Vec<(usize, usize)>> {
        Ok(lock(&self.inner)?.first())
    }
    /// One poll at `now` (the stream's deadline is `deadline`, same clock): take the
    /// decode's notifications; return `(running, give_up, [(chunk, slot)] to pack now)`.
    /// Once not running, close the stream (`close(give_up)`): `give_up` for a notification
    /// off the schedule or a passed deadline (the decode is told), not for a stream done or
    /// given up by the decode. `gone`: the decode's peer was forgotten (over, nothing to
    /// tell it).
    #[pyo3(signature = (msgs, now, deadline, gone=false))]
    fn poll(
        &self,
        msgs: Vec<Vec<u8>>,
        now: f64,
        deadline: f64,
        gone: bool,
    ) -> PyResult<SourcePoll> {
        Ok(lock(&self.inner)?.poll_at(&msgs, gone, now, deadline))
    }
    /// The `Ready` notifications of the packed chunks to announce now (`landed[i]`: whether
    /// the i-th queued chunk's pack has completed).
    fn announce<'py>(
        &self,
        py: Python<'py>,
        landed: Vec<bool>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(lock(&self.inner)?.announce(&landed).iter().map(|m| bytes(py, m)).collect())
    }
    /// End the stream (idempotent): `[abort notification]` to send when `give_up` and the
    /// decode may still read, else `[]`.
    fn close<'py>(&self, py: Python<'py>, give_up: bool) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(lock(&self.inner)?.close(give_up).iter().map(|m| bytes(py, m)).collect())
    }
    /// The `Ready` notification of a claimed chunk.
    fn ready<'py>(&self, py: Python<'py>, chunk: usize) -> PyResult<Bound<'py, PyBytes>> {
        Ok(bytes(py, &lock(&self.inner)?.ready(chunk).py()?))
    }
    /// Take a notification from the decode; return its kind (`"ack"` or `"abort"`).
    /// `MetadataError` naming the field for anything else; nothing changes then.
    fn receive(&self, msg: &[u8]) -> PyResult<&'static str> {
        let m = StreamMsg::decode(msg).py()?;
        Ok(kind_name(lock(&self.inner)?.receive(&m).py()?))
    }
    /// Whether every chunk is acknowledged.
    #[getter]
    fn done(&self) -> PyResult<bool> {
        Ok(lock(&self.inner)?.done())
    }
    /// Whether the decode gave the stream up.
    #[getter]
    fn aborted(&self) -> PyResult<bool> {
        Ok(lock(&self.inner)?.aborted())
    }
    fn __len__(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.len())
    }
}

/// The decode side of one stream: the announcements it accepts, which chunk to read next
/// into which decode slot, and the acknowledgements.
#[pyclass(name = "StreamSink", module = "disagg_rs", frozen)]
pub struct PyStreamSink {
    inner: Mutex<StreamSink>,
}

/// `(chunk, decode slot, source offset, (k_lo, k_hi, byte_lo, byte_hi))` of one read.
type Read = (usize, usize, u64, ChunkRange);

#[pymethods]
impl PyStreamSink {
    #[new]
    fn new(
        stream: u64,
        chunks: Vec<ChunkRange>,
        src_offsets: Vec<u64>,
        slot_bytes: u64,
        dst_slots: usize,
    ) -> PyResult<Self> {
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
    fn of_ticket(
        ticket: &Bound<'_, PyAny>,
        rows: Vec<(u64, u64)>,
        tokens_per_block: u64,
        n_tok: u64,
        slot_bytes: u64,
        dst_slots: usize,
    ) -> PyResult<Self> {
        let t = StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()?;
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
        let t = StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()?;
        let sink = StreamSink::whole(vec![[0, 0, 0, t.nbytes]], t.offset, 1).py()?;
        Ok(Self { inner: Mutex::new(gate(sink, &t)) })
    }
    /// Every chunk `(k_lo, k_hi, byte_lo, byte_hi)`, in order.
    #[getter]
    fn chunks(&self) -> PyResult<Vec<ChunkRange>> {
        Ok(lock(&self.inner)?.chunks().to_vec())
    }
    /// `"streamed"` for a stream, `"chunked"` for a copy held whole.
    #[getter]
    fn kind(&self) -> PyResult<&'static str> {
        Ok(if lock(&self.inner)?.is_stream() { "streamed" } else { "chunked" })
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
        Ok(kind_name(lock(&self.inner)?.receive(&m).py()?))
    }
    /// A read of a packed copy held whole at `offset` of the source's region, in `chunks`
    /// through `dst_slots` slots: every chunk ready, nothing acknowledged.
    #[staticmethod]
    fn whole(chunks: Vec<ChunkRange>, offset: u64, dst_slots: usize) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(StreamSink::whole(chunks, offset, dst_slots).py()?) })
    }
    /// Take the source's notifications in order (`StreamMailboxes.take`); what to fail the
    /// read with when the source gave the stream up or is gone (`gone`: its peer forgotten;
    /// `probed`: `[(sent, error)]` of sending `probes()`, one refused), else `None`.
    /// `MetadataError` naming the field for one off the schedule.
    #[pyo3(signature = (msgs, gone=false, probed=Vec::new()))]
    fn take(
        &self,
        msgs: Vec<Vec<u8>>,
        gone: bool,
        probed: Vec<(bool, String)>,
    ) -> PyResult<Option<String>> {
        lock(&self.inner)?.take(&msgs, gone, &probed).py()
    }
    /// The liveness probes to send the source now (`[bytes]`): one while the read waits
    /// for an announcement, at most every `PROBE_INTERVAL_S` of clock value `now`.
    fn probes<'py>(&self, py: Python<'py>, now: f64) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(lock(&self.inner)?.probes(now).iter().map(|m| PyBytes::new(py, m)).collect())
    }
    /// Claim the next reads: `[(chunk, decode slot, source offset, (k_lo, k_hi, lo, hi))]`.
    fn reads(&self) -> PyResult<Vec<Read>> {
        Ok(lock(&self.inner)?.reads())
    }
    /// Fold NIXL's states of the reads in flight (`[(chunk, state)]`): `([(chunk, slot) to
    /// scatter now], acks to send (a stream's chunk is acknowledged once read), first
    /// failure or None)`.
    fn observe<'py>(
        &self,
        py: Python<'py>,
        states: Vec<(usize, String)>,
    ) -> PyResult<PyObserved<'py>> {
        let (landed, acks, error) = lock(&self.inner)?.observe(&states);
        Ok((landed, acks.iter().map(|m| bytes(py, m)).collect(), error))
    }
    /// Fold which queued scatters completed (`completed[i]`: the i-th queued and not
    /// finished; they complete in order): how many finished (their slots are free again).
    fn scattered(&self, completed: Vec<bool>) -> PyResult<usize> {
        Ok(lock(&self.inner)?.scattered(&completed))
    }
    /// `"DONE"` once every chunk is scattered; `"WAIT"` while nothing is in flight (no read
    /// posted, no scatter queued: waiting for an announcement, nothing can be written);
    /// else `"PROC"`.
    #[getter]
    fn status(&self) -> PyResult<&'static str> {
        Ok(lock(&self.inner)?.status())
    }
    /// End the read (idempotent): `[abort notification]` for the source of an unfinished
    /// stream, else `[]`.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(lock(&self.inner)?.close().iter().map(|m| bytes(py, m)).collect())
    }
    /// A chunk is scattered: free its decode slot; return the `Ack` notification.
    fn landed<'py>(&self, py: Python<'py>, chunk: usize) -> PyResult<Bound<'py, PyBytes>> {
        Ok(bytes(py, &lock(&self.inner)?.landed(chunk).py()?))
    }
    /// Whether every chunk is scattered.
    #[getter]
    fn done(&self) -> PyResult<bool> {
        Ok(lock(&self.inner)?.done())
    }
    /// Whether the source gave the stream up.
    #[getter]
    fn aborted(&self) -> PyResult<bool> {
        Ok(lock(&self.inner)?.aborted())
    }
}

/// Stream notifications by (peer agent name, stream id): those of open streams, and those
/// received before their stream opened here.
#[pyclass(name = "StreamMailboxes", module = "disagg_rs", frozen)]
pub struct PyStreamMailboxes {
    inner: Mutex<StreamMailboxes>,
}

#[pymethods]
impl PyStreamMailboxes {
    #[new]
    fn new() -> Self {
        Self { inner: Mutex::new(StreamMailboxes::default()) }
    }
    /// Open a mailbox for the notifications of `stream` from `peer` (those received early
    /// first); its id.
    fn open(&self, peer: &str, stream: u64) -> PyResult<u64> {
        Ok(lock(&self.inner)?.open(peer, stream))
    }
    /// Close mailbox `id` (and drop what its stream received early, unless its peer was
    /// forgotten since).
    fn close(&self, id: u64) -> PyResult<()> {
        lock(&self.inner)?.close(id);
        Ok(())
    }
    /// Stop keeping the notifications of the stream or announcement a staging ticket of
    /// `peer` names (those received early too); nothing for a ticket that names none.
    /// `HandoffMetadataError` for a malformed ticket.
    fn forget_ticket(&self, peer: &str, ticket: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = StagingTicket::parse(&to_wire(ticket, "ticket")?, "ticket").py()?;
        if let Some(id) = t.stream.map(|st| st.id).or(t.ready) {
            lock(&self.inner)?.close_stream(peer, id);
        }
        Ok(())
    }
    /// Forget `peer` (restarted, declared lost or replaced): drop its early notifications;
    /// each of its open mailboxes takes nothing more and says it is gone.
    fn forget(&self, peer: &str) -> PyResult<()> {
        lock(&self.inner)?.forget(peer);
        Ok(())
    }
    /// Notifications waiting for a stream not open here.
    #[getter]
    fn early(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.early())
    }
    /// Route what NIXL's `get_new_notifs()` returned (`{peer: [bytes, ...]}`).
    fn route(&self, notifs: Vec<(String, Vec<Vec<u8>>)>) -> PyResult<()> {
        lock(&self.inner)?.route(notifs);
        Ok(())
    }
    /// Take what mailbox `id` received so far, in order, and whether its peer is gone:
    /// `([bytes, ...], gone)`.
    fn take<'py>(&self, py: Python<'py>, id: u64) -> PyResult<(Vec<Bound<'py, PyBytes>>, bool)> {
        let (msgs, gone) = lock(&self.inner)?.take(id);
        Ok((msgs.iter().map(|m| PyBytes::new(py, m)).collect(), gone))
    }
    /// Notifications dropped so far.
    #[getter]
    fn dropped(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.dropped())
    }
}
