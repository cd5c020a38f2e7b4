//! Bindings of streamed staging (`disagg_core::stream`): the chunk ranges both sides cut a
//! packed copy with, the notifications, and each side's schedule.

use std::borrow::Cow;
use std::sync::Mutex;

use disagg_core::stream::{
    ChunkRange, Mail, Observed, StreamKind, StreamMailboxes, StreamMsg, StreamSink, StreamSource,
};
use disagg_core::wire::ticket::StagingTicket;
use disagg_core::DisaggError;
use pyo3::prelude::*;

use crate::args::Raw;
use crate::error::IntoPyResult;
use crate::pool::{core_fns, core_methods, lock, lock_with, Out};
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
    StreamMsg => Bytes = |v| bytes(&v);
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

core_fns! {
    /// The `Abort` notification of stream `stream`.
    fn stream_abort_msg(stream: Raw<u64>) -> Bytes = StreamMsg::bare(StreamKind::Abort, stream, 0);
}

/// `(kind, stream)` of a stream notification (`"ready"`, `"ack"` or `"abort"`); raises
/// `MetadataError` (field `stream_msg`) for bytes that are not one.
#[pyfunction]
pub fn stream_msg_route(msg: &[u8]) -> PyResult<(&'static str, u64)> {
    let m = StreamMsg::decode(msg).py()?;
    Ok((m.kind.name(), m.stream))
}

/// `[the Abort notification]` of the stream a staging ticket names, `[]` when it names none.
#[pyfunction]
pub fn stream_abort_msgs(ticket: &Bound<'_, PyAny>) -> PyResult<Vec<Bytes>> {
    ticket_of(ticket)?.stream.map(|st| StreamMsg::bare(StreamKind::Abort, st.id, 0)).out()
}

/// What `release_staged` frees for a staging ticket: `(id of its stream or announcement, else
/// -1; [offset of a packed copy held whole])`.
#[pyfunction]
pub fn staging_release(ticket: &Bound<'_, PyAny>) -> PyResult<(i64, Vec<u64>)> {
    let t = ticket_of(ticket)?;
    let id = t.notice_id().map_or(-1, |id| i64::try_from(id).unwrap_or(i64::MAX));
    Ok((id, t.held_offset().into_iter().collect()))
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
    /// The chunks to pack before the ticket is sent, `[(chunk, slot)]` (`announce`d once packed).
    fn first() -> Vec<(usize, usize)> = first();
    /// One poll at `now` (deadline `deadline`, same clock) taking the decode's notifications:
    /// `(running, give_up, [(chunk, slot)] to pack now)`; once not running, `close(give_up)`.
    /// `gone`: the decode's peer was forgotten.
    #[pyo3(signature = (msgs, now, deadline, gone=false))]
    fn poll(msgs: Raw<Vec<Vec<u8>>>, now: Raw<f64>, deadline: Raw<f64>, gone: Raw<bool>)
        -> SourcePoll = poll_at(&msgs, gone, now, deadline);
    /// The `Ready` notifications to send now (`landed[i]`: the i-th queued pack completed).
    fn announce(landed: Raw<Vec<bool>>) -> Vec<Bytes> = announce(&landed);
    /// End the stream (idempotent): `[abort]` to send when `give_up`, else `[]`.
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
    /// The announcement of a packed copy held whole (`nbytes` at `offset`), pack queued.
    #[staticmethod]
    fn whole(stream: u64, offset: u64, nbytes: u64) -> Self {
        Self { inner: Mutex::new(StreamSource::whole(stream, offset, nbytes)) }
    }
    /// Take a notification from the decode; its kind (`"ack"` or `"abort"`).
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
    /// Take the source's notifications in order; what to fail the read with when the source
    /// gave up or is gone (`gone`; `probed`: `[(sent, error)]` of sending `probes()`), else
    /// `None`. `MetadataError` for one off the schedule.
    #[pyo3(signature = (msgs, gone=false, probed=Vec::new()))]
    fn take(msgs: Raw<Vec<Vec<u8>>>, gone: Raw<bool>, probed: Raw<Vec<(bool, String)>>)
        -> Option<String> = take(&msgs, gone, &probed);
    /// The liveness probes to send the source now (`[bytes]`), at most one per interval.
    fn probes(now: Raw<f64>) -> Vec<Bytes> = probes(now);
    /// Claim the next reads: `[(chunk, decode slot, source offset, (k_lo, k_hi, lo, hi))]`.
    fn reads() -> Vec<Read> = reads();
    /// Fold NIXL's states of the reads in flight (`[(chunk, state)]`): `([(chunk, slot) to
    /// scatter now], acks to send, first failure or None)`.
    fn observe(states: Raw<Vec<(usize, String)>>) -> PyObserved = observe(&states);
    /// Fold which queued scatters completed (in order); how many finished (slots freed).
    fn scattered(completed: Raw<Vec<bool>>) -> usize = scattered(&completed);
    /// `"DONE"` once every chunk is scattered, `"WAIT"` while nothing is in flight, else
    /// `"PROC"`.
    #[getter] fn status() -> &'static str = status();
    /// End the read (idempotent): `[abort]` for an unfinished stream, else `[]`.
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
    /// The read of a staging ticket's packed copy of `n_tok` tokens (device plan `rows`)
    /// through `dst_slots` slots of `slot_bytes`: the ticket's stream in its chunk size, else
    /// the copy held whole cut in `slot_bytes`. `HandoffMetadataError` for a malformed ticket.
    #[staticmethod]
    fn of_ticket(ticket: &Bound<'_, PyAny>, rows: Vec<(u64, u64)>, tokens_per_block: u64,
        n_tok: u64, slot_bytes: u64, dst_slots: usize) -> PyResult<Self> {
        let t = ticket_of(ticket)?;
        let sink = StreamSink::of_ticket(&t, &rows, tokens_per_block, n_tok, slot_bytes, dst_slots);
        Ok(Self { inner: Mutex::new(sink.py()?) })
    }
    /// The read of a staging ticket's packed copy held whole, in one piece into one slot.
    #[staticmethod]
    fn one_piece(ticket: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(StreamSink::one_piece(&ticket_of(ticket)?).py()?) })
    }
    /// A read of a packed copy held whole at `offset`, in `chunks` through `dst_slots` slots.
    #[staticmethod]
    fn whole(chunks: Vec<ChunkRange>, offset: u64, dst_slots: usize) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(StreamSink::whole(chunks, offset, dst_slots).py()?) })
    }
    /// Every chunk `(k_lo, k_hi, byte_lo, byte_hi)`, in order.
    #[getter]
    fn chunks(&self) -> PyResult<Vec<ChunkRange>> {
        Ok(lock(&self.inner)?.chunks().to_vec())
    }
    /// The id whose notifications the read takes (0 for none).
    #[getter]
    fn stream_id(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.mailbox().unwrap_or(0))
    }
    /// Take a notification from the source; its kind (`"ready"` or `"abort"`).
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
    /// Open a mailbox for the notifications of `stream` from `peer`; its id.
    fn open(peer: Raw<String>, stream: Raw<u64>) -> u64 = open(&peer, stream);
    /// Close mailbox `id` (and drop what its stream received early).
    fn close(id: Raw<u64>) -> () = close(id);
    /// Forget `peer` (restarted, lost or replaced): its open mailboxes say it is gone.
    fn forget(peer: Raw<String>) -> () = forget(&peer);
    /// Notifications waiting for a stream not open here.
    #[getter] fn early() -> usize = early();
    /// Route what NIXL's `get_new_notifs()` returned (`{peer: [bytes, ...]}`).
    fn route(notifs: Raw<Vec<(String, Vec<Vec<u8>>)>>) -> () = route(notifs);
    /// `([bytes, ...], gone)`: what mailbox `id` received so far, in order.
    fn take(id: Raw<u64>) -> (Vec<Bytes>, bool) = take(id);
    /// Notifications dropped so far.
    #[getter] fn dropped() -> u64 = dropped();
}
methods {
    #[new]
    fn new() -> Self {
        Self { inner: Mutex::new(StreamMailboxes::default()) }
    }
    /// Stop keeping the notifications of the stream a staging ticket of `peer` names.
    fn forget_ticket(&self, peer: &str, ticket: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Some(id) = ticket_of(ticket)?.notice_id() {
            lock(&self.inner)?.close_stream(peer, id);
        }
        Ok(())
    }
});
