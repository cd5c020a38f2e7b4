//! Bindings of streamed staging (`disagg_core::stream`): the chunk ranges both sides cut a
//! packed copy with, the notifications, and each side's schedule.

use std::borrow::Cow;
use std::sync::Mutex;

use disagg_core::stream::{
    ChunkRange, Mail, Observed, StreamKind, StreamMailboxes, StreamMsg, StreamSink, StreamSource,
};
use disagg_core::wire::ticket::StagingTicket;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::{convs, Raw};
use crate::error::IntoPyResult;
use crate::pool::{core_fns, core_methods, lock_with, outs};
use crate::wire::to_wire;

/// A notification as Python `bytes`.
pub(crate) type Bytes = Cow<'static, [u8]>;

fn bytes(m: &StreamMsg) -> Bytes {
    Cow::Owned(m.encode())
}

// Notifications as `bytes`, whatever holds them.
outs! {
    StreamMsg => Bytes = |v| bytes(&v);
    Vec<StreamMsg> => Vec<Bytes> = |v| v.iter().map(bytes).collect();
    Option<StreamMsg> => Vec<Bytes> = |v| v.iter().map(bytes).collect();
    Vec<u8> => Bytes = |v| Cow::Owned(v);
    StreamKind => &'static str = |v| v.name();
    Vec<Vec<u8>> => Vec<Bytes> = |v| v.into_iter().map(Cow::Owned).collect();
    Observed => PyObserved = |v| (v.0, v.1.iter().map(bytes).collect(), v.2);
    Mail => (Vec<Bytes>, bool) = |v| (v.0.into_iter().map(Cow::Owned).collect(), v.1);
}

convs! {
    /// A staging ticket (`HandoffMetadataError` for a malformed one).
    Ticket: Py<PyAny> => StagingTicket = |f, v| Python::attach(|py| {
        StagingTicket::parse(&to_wire(v.bind(py), f)?, f).py()
    });
    /// A stream notification (`MetadataError`, field `stream_msg`, for bytes that are not one).
    Msg: Py<PyBytes> => StreamMsg = |_f, v| Python::attach(|py| {
        StreamMsg::decode(v.as_bytes(py)).py()
    });
}

core_fns! {
    /// `[the Abort notification]` of the stream a staging ticket names, `[]` when none.
    fn stream_abort_msgs(ticket: Ticket) -> Vec<Bytes>
        = ticket.stream.map(|st| StreamMsg::bare(StreamKind::Abort, st.id, 0));
    /// What `release_staged` frees: `(notice id or -1, [offset of a copy held whole])`.
    fn staging_release(ticket: Ticket) -> (i64, Vec<u64>) = ticket.release_plan();
}

/// `(running, give_up, [(chunk, slot)] to pack)` of one source poll.
type SourcePoll = (bool, bool, Vec<(usize, usize)>);
/// `([(chunk, slot)] to scatter, acks, first failure)` of one observation of reads in flight.
type PyObserved = (Vec<(usize, usize)>, Vec<Bytes>, Option<String>);
/// `(chunk, decode slot, source offset, (k_lo, k_hi, byte_lo, byte_hi))` of one read.
type Read = (usize, usize, u64, ChunkRange);

/// `disagg_core::stream::StreamSource`: the source side of one stream.
#[pyclass(name = "StreamSource", module = "disagg_rs", frozen)]
pub struct PyStreamSource {
    inner: Mutex<StreamSource>,
}

core_methods!(PyStreamSource, lock_with, inner,
ctors {
    #[new]
    fn new(stream: Raw<u64>, chunks: Raw<Vec<ChunkRange>>, offsets: Raw<Vec<u64>>)
        = StreamSource::new(stream, chunks, offsets).py()?.into();
    #[staticmethod]
    fn whole(stream: Raw<u64>, offset: Raw<u64>, nbytes: Raw<u64>)
        = StreamSource::whole(stream, offset, nbytes).into();
}
calls {
    fn packable() -> Vec<(usize, usize)> = packable();
    fn first() -> Vec<(usize, usize)> = first();
    #[pyo3(signature = (msgs, now, deadline, gone=false))]
    fn poll(msgs: Raw<Vec<Vec<u8>>>, now: Raw<f64>, deadline: Raw<f64>, gone: Raw<bool>)
        -> SourcePoll = poll_at(&msgs, gone, now, deadline);
    fn announce(landed: Raw<Vec<bool>>) -> Vec<Bytes> = announce(&landed);
    fn close(give_up: Raw<bool>) -> Vec<Bytes> = close(give_up);
    fn ready(chunk: Raw<usize>) -> Bytes = ready(chunk);
    fn receive(msg: Msg) -> &'static str = receive(&msg);
    #[getter] fn done() -> bool = done();
    #[getter] fn aborted() -> bool = aborted();
    fn __len__() -> usize = len();
}
methods {});

/// `disagg_core::stream::StreamSink`: the decode side of one stream.
#[pyclass(name = "StreamSink", module = "disagg_rs", frozen)]
pub struct PyStreamSink {
    inner: Mutex<StreamSink>,
}

core_methods!(PyStreamSink, lock_with, inner,
ctors {
    #[new]
    fn new(stream: Raw<u64>, chunks: Raw<Vec<ChunkRange>>, src_offsets: Raw<Vec<u64>>,
        slot_bytes: Raw<u64>, dst_slots: Raw<usize>)
        = StreamSink::new(stream, chunks, src_offsets, slot_bytes, dst_slots).py()?.into();
    #[staticmethod]
    fn of_ticket(ticket: Ticket, rows: Raw<Vec<(u64, u64)>>, tokens_per_block: Raw<u64>,
        n_tok: Raw<u64>, slot_bytes: Raw<u64>, dst_slots: Raw<usize>)
        = StreamSink::of_ticket(&ticket, &rows, tokens_per_block, n_tok, slot_bytes, dst_slots)
            .py()?.into();
    #[staticmethod]
    fn one_piece(ticket: Ticket) = StreamSink::one_piece(&ticket).py()?.into();
    #[staticmethod]
    fn whole(chunks: Raw<Vec<ChunkRange>>, offset: Raw<u64>, dst_slots: Raw<usize>)
        = StreamSink::whole(chunks, offset, dst_slots).py()?.into();
}
calls {
    #[getter] fn kind() -> &'static str = kind_name();
    #[pyo3(signature = (msgs, gone=false, probed=Vec::new()))]
    fn take(msgs: Raw<Vec<Vec<u8>>>, gone: Raw<bool>, probed: Raw<Vec<(bool, String)>>)
        -> Option<String> = take(&msgs, gone, &probed);
    fn probes(now: Raw<f64>) -> Vec<Bytes> = probes(now);
    fn reads() -> Vec<Read> = reads();
    fn observe(states: Raw<Vec<(usize, String)>>) -> PyObserved = observe(&states);
    fn scattered(completed: Raw<Vec<bool>>) -> usize = scattered(&completed);
    #[getter] fn status() -> &'static str = status();
    fn close() -> Vec<Bytes> = close();
    fn landed(chunk: Raw<usize>) -> Bytes = landed(chunk);
    fn receive(msg: Msg) -> &'static str = receive(&msg);
    #[getter] fn done() -> bool = done();
    #[getter] fn aborted() -> bool = aborted();
    #[getter] fn chunks() -> Vec<ChunkRange> = chunks().to_vec();
    /// The id whose notifications the read takes (0 for none).
    #[getter] fn stream_id() -> u64 = mailbox().unwrap_or(0);
}
methods {});

/// `disagg_core::stream::StreamMailboxes`: notifications by (peer agent name, stream id).
#[pyclass(name = "StreamMailboxes", module = "disagg_rs", frozen)]
pub struct PyStreamMailboxes {
    inner: Mutex<StreamMailboxes>,
}

core_methods!(PyStreamMailboxes, lock_with, inner,
ctors {
    #[new]
    fn new() = StreamMailboxes::default().into();
}
calls {
    fn open(peer: Raw<String>, stream: Raw<u64>) -> u64 = open(&peer, stream);
    fn close(id: Raw<u64>) -> () = close(id);
    fn forget(peer: Raw<String>) -> () = forget(&peer);
    #[getter] fn early() -> usize = early();
    /// Route what NIXL's `get_new_notifs()` returned (`{peer: [bytes, ...]}`) at `now`.
    fn route(notifs: Raw<Vec<(String, Vec<Vec<u8>>)>>, now: Raw<f64>, early_ttl_s: Raw<f64>)
        -> () = route(notifs, now, early_ttl_s);
    fn take(id: Raw<u64>) -> (Vec<Bytes>, bool) = take(id);
    /// Stop keeping the notifications of the stream a staging ticket of `peer` names.
    fn forget_ticket(peer: Raw<String>, ticket: Ticket) -> () = forget_ticket(&peer, &ticket);
    #[getter] fn dropped() -> u64 = dropped();
}
methods {});
