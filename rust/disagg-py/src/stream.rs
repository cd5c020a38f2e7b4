//! Bindings of streamed staging (`disagg_core::stream`): the chunk ranges both sides cut a
//! packed copy with, the notifications, and each side's schedule.

use std::sync::Mutex;

use disagg_core::stream::{self, ChunkRange, StreamKind, StreamMsg, StreamSink, StreamSource};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::IntoPyResult;
use crate::pool::lock;

fn kind_name(k: StreamKind) -> &'static str {
    match k {
        StreamKind::Ready => "ready",
        StreamKind::Ack => "ack",
        StreamKind::Abort => "abort",
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

/// The `Abort` notification of stream `stream`.
#[pyfunction]
pub fn stream_abort_msg(py: Python<'_>, stream: u64) -> Bound<'_, PyBytes> {
    bytes(py, &StreamMsg::bare(StreamKind::Abort, stream, 0))
}

/// The source side of one stream: which chunk to pack next and into which slot, the
/// `Ready` notifications, and the acknowledgements it accepts.
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
        dst_slots: usize,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: Mutex::new(StreamSink::new(stream, chunks, src_offsets, dst_slots).py()?),
        })
    }
    /// Take a notification from the source; return its kind (`"ready"` or `"abort"`).
    /// `MetadataError` naming the field when it is not the schedule's; nothing changes then.
    fn receive(&self, msg: &[u8]) -> PyResult<&'static str> {
        let m = StreamMsg::decode(msg).py()?;
        Ok(kind_name(lock(&self.inner)?.receive(&m).py()?))
    }
    /// Claim the next reads: `[(chunk, decode slot, source offset, (k_lo, k_hi, lo, hi))]`.
    fn reads(&self) -> PyResult<Vec<Read>> {
        Ok(lock(&self.inner)?.reads())
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
