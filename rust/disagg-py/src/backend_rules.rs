//! Bindings of the transfer backends' host-side rules (`disagg_core::backend_rules`): argument
//! conversion only.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use disagg_core::backend_rules::peers::{self, IdentityMemo, MessagePeer, MetaNode};
use disagg_core::backend_rules::peers::{NodeShape, PollVerdict, ResolvedIds};
use disagg_core::backend_rules::{self as rules, ChunkFacts, WindowLaunches};
use disagg_core::p2p_header::MessageKind;
use disagg_core::refmeta;
use disagg_core::wire::peer::PeerMeta;
use disagg_core::wire::value::WireValue;
use disagg_core::DisaggError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PyMapping, PyString, PyTuple};

use crate::args::{wire_dict_to_py, Raw};
use crate::error::IntoPyResult;
use crate::layout::{PyKvShardLayout, PySsmShardLayout};
use crate::peer_records::Node;
use crate::pool::{core_fns, lock, outs};
use crate::stream::Bytes;
use crate::wire::{to_wire, PyPeer, PyPeerTable};

/// The siblings `backend_rules::group_siblings` finds, as the layout class given.
#[derive(IntoPyObject)]
pub enum Siblings {
    Kv(Vec<Option<PyKvShardLayout>>),
    Ssm(Vec<Option<PySsmShardLayout>>),
}

/// `backend_rules::group_siblings` of `layout` (`MetadataError`, `src_metas`).
#[pyfunction]
pub fn group_layouts(layout: &Bound<'_, PyAny>) -> PyResult<Siblings> {
    fn wrap<L, P>(sibs: Vec<Option<L>>, class: fn(L) -> P) -> Vec<Option<P>> {
        sibs.into_iter().map(|s| s.map(class)).collect()
    }
    if let Ok(kv) = layout.cast::<PyKvShardLayout>() {
        let sibs = rules::group_siblings(&kv.get().inner).py()?;
        return Ok(Siblings::Kv(wrap(sibs, |inner| PyKvShardLayout { inner })));
    }
    let sibs = rules::group_siblings(&layout.cast::<PySsmShardLayout>()?.get().inner).py()?;
    Ok(Siblings::Ssm(wrap(sibs, |inner| PySsmShardLayout { inner })))
}

/// Whether a two-sided handoff between these ranks moves in chunks (`backend_rules::chunkable`
/// of each parsed `Peer`'s facts, or of a metadata dict's).
#[pyfunction]
pub fn chunkable(metas: Vec<Bound<'_, PyAny>>) -> PyResult<bool> {
    let facts = |m: &Bound<'_, PyAny>| match m.cast::<PyPeer>() {
        Ok(p) => Ok(ChunkFacts::of_peer(&p.get().inner)),
        Err(_) => ChunkFacts::of_meta(&to_wire(m, "peer_meta")?).py(),
    };
    Ok(rules::chunkable(&metas.iter().map(facts).collect::<PyResult<Vec<_>>>()?))
}

/// Python objects, in order.
type Objects<'py> = Vec<Bound<'py, PyAny>>;

/// The tensors of a buffer argument, flattened, and its per-layer items (`([tensor], None)` for
/// one tensor); `GeometryMismatchError` (`memory_buffer`) for anything else.
#[pyfunction]
pub fn buffer_tensors(
    memory_buffer: Bound<'_, PyAny>,
) -> PyResult<(Objects<'_>, Option<Objects<'_>>)> {
    let tensor = memory_buffer.py().import("torch")?.getattr("Tensor")?;
    if memory_buffer.is_instance(&tensor)? {
        return Ok((vec![memory_buffer], None));
    }
    let layers = memory_buffer.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    let mut flat = Vec::new();
    for item in &layers {
        match item.cast::<PyTuple>() {
            Ok(pair) => flat.extend(pair.iter()),
            Err(_) => flat.push(item.clone()),
        }
    }
    let kind = |t: &Bound<'_, PyAny>| -> PyResult<Option<String>> {
        Ok((!t.is_instance(&tensor)?).then(|| Node(t.clone()).type_name()))
    };
    let items = flat.iter().map(kind).collect::<PyResult<Vec<_>>>()?;
    rules::check_buffer_tensors(&items, &Node(memory_buffer).type_name()).py()?;
    Ok((flat, Some(layers)))
}

core_fns! {
    /// `backend_rules::staging_slots`.
    fn staging_slots(pool_bytes: Raw<Option<i64>>, chunk_bytes: Raw<Option<i64>>,
        default_pool_bytes: Raw<i64>, default_chunk_bytes: Raw<i64>) -> (u64, u64)
        = rules::staging_slots(pool_bytes, chunk_bytes, (default_pool_bytes, default_chunk_bytes));
    /// `backend_rules::check_chunk_blocks`.
    fn check_chunk_blocks(field: Raw<String>, held: Raw<u64>, num_tokens: Raw<u64>,
        needs: Raw<Vec<u64>>) -> () = rules::check_chunk_blocks(&field, held, num_tokens, &needs);
    /// `backend_rules::packed_window`.
    fn packed_window(range: Raw<(i64, Option<i64>)>, table: Raw<(u64, u64)>,
        chunk_units: Raw<u64>) -> (u64, u64, u64) = rules::packed_window(range, table, chunk_units);
    /// `backend_rules::pipeline_launches`.
    fn pipeline_launches(gather: Raw<(u64, u64)>, scatter: Raw<(u64, u64)>,
        chunk_bytes: Raw<i64>, chunk_units: Raw<u64>) -> Launches
        = rules::pipeline_launches(gather, scatter, chunk_bytes, chunk_units);
    /// `backend_rules::staging_path`.
    fn staging_path(forced: Raw<String>, cuda_with_triton: Raw<bool>) -> &'static str
        = rules::staging_path(&forced, cuda_with_triton);
    /// `backend_rules::reader_gpu` for a reader on `local` (a `torch.device` or `None`).
    fn ipc_reader_gpu(home: Raw<u32>, local: Raw<Option<Device>>, unset: Raw<u32>) -> u32
        = rules::reader_gpu(home, local.as_ref().map(|d| (d.kind.as_str(), d.index)), unset);
    /// `peers::p2p_outcome`.
    fn p2p_outcome(posted: Raw<Option<String>>, works: Raw<Vec<Option<String>>>,
        threads: Raw<Vec<String>>) -> Option<String> = peers::p2p_outcome(posted, works, threads);
}

/// Launch windows, as they are.
type Launches = Vec<WindowLaunches>;

outs! {
    Launches => Launches = |v| v;
}

/// A `torch.device`: its type and index.
#[derive(FromPyObject)]
pub struct Device {
    #[pyo3(attribute("type"))]
    kind: String,
    #[pyo3(attribute)]
    index: Option<u32>,
}

/// Whether two CUDA IPC exports (dicts, or `None`) come from one host
/// (`backend_rules::same_host_exports`).
#[pyfunction]
pub fn ipc_same_host(
    mine: Option<Bound<'_, PyAny>>,
    theirs: Option<Bound<'_, PyAny>>,
) -> PyResult<bool> {
    let wire = |e: Option<Bound<'_, PyAny>>| e.map(|e| to_wire(&e, "ipc")).transpose();
    Ok(rules::same_host_exports(wire(mine)?.as_ref(), wire(theirs)?.as_ref()))
}

impl<'py> Node<'py> {
    fn mapping(&self) -> Option<&Bound<'py, PyMapping>> {
        self.0.cast::<PyMapping>().ok()
    }
    fn entry<K: IntoPyObject<'py> + Copy>(&self, key: K) -> Option<Self> {
        let m = self.mapping()?;
        m.contains(key).ok()?.then(|| m.get_item(key).ok().map(Node))?
    }
}

impl MetaNode for Node<'_> {
    fn shape(&self) -> NodeShape {
        if self.0.is_none() {
            NodeShape::Null
        } else if self.0.is_instance_of::<PyString>() || self.0.is_instance_of::<PyBytes>() {
            NodeShape::Text
        } else if self.mapping().is_some() {
            NodeShape::Map
        } else {
            NodeShape::Seq
        }
    }
    fn field(&self, key: &str) -> Option<Self> {
        self.entry(key)
    }
    fn rank_entry(&self, rank: u32) -> Option<Self> {
        self.entry(rank)
    }
    fn elements(&self) -> Option<Vec<Self>> {
        self.0.try_iter().ok()?.map(|v| v.ok().map(Node)).collect()
    }
    fn type_name(&self) -> String {
        self.0.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
    }
}

/// `peers::peer_records`: `(meta, block ids)` of every source rank (`src_block_ids` as given
/// for a rank without its own).
#[pyfunction]
pub fn backend_peer_records<'py>(
    peer_meta: Bound<'py, PyAny>,
    src_block_ids: Bound<'py, PyAny>,
) -> PyResult<Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    let records = peers::peer_records(&Node(peer_meta)).py()?;
    Ok(records
        .into_iter()
        .map(|r| (r.meta.0, r.ids.map_or_else(|| src_block_ids.clone(), |n| n.0)))
        .collect())
}

/// `peers::nothing_to_move` of the block id lists (`None` skipped; a map counts each list).
#[pyfunction]
#[pyo3(signature = (*block_ids))]
pub fn no_blocks(block_ids: Vec<Bound<'_, PyAny>>) -> PyResult<bool> {
    // An array's element count (numpy `size`), else its length.
    let size =
        |x: &Bound<'_, PyAny>| x.getattr("size").and_then(|n| n.extract()).or_else(|_| x.len());
    let mut counts = Vec::new();
    for ids in block_ids.iter().filter(|i| !i.is_none()) {
        let lists: Vec<Bound<'_, PyAny>> = match ids.cast::<PyMapping>() {
            Ok(m) => m.values()?.iter().collect(),
            Err(_) => vec![ids.clone()],
        };
        counts.push(lists.iter().map(size).collect::<PyResult<Vec<usize>>>()?);
    }
    Ok(peers::nothing_to_move(&counts))
}

pyo3::import_exception!(disagg_rs.exceptions, TransferError);
pyo3::import_exception!(disagg_rs.exceptions, TransferTimeout);

// A settled poll as Python sees it: `TransferError` (failed), `TransferTimeout` (past its
// deadline), else whether it is done.
outs! {
    PollVerdict => bool = |v| match v {
        PollVerdict::Running => false,
        PollVerdict::Done => true,
        PollVerdict::Failed(e) => return Err(TransferError::new_err(e)),
        PollVerdict::TimedOut(e) => return Err(TransferTimeout::new_err(e)),
    };
}

core_fns! {
    /// `peers::poll_verdict`.
    fn poll_verdict(done: Raw<bool>, error: Raw<Option<String>>, now: Raw<f64>,
        deadline: Raw<f64>, timeout_s: Raw<f64>) -> bool
        = peers::poll_verdict(done, error, now, (deadline, timeout_s));
}

/// `(source rank, packed bytes)` of every source rank of a `TransferProgram`.
fn program_sources(program: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u64)>> {
    let ranks: Vec<u32> = program.getattr("src_ranks")?.extract()?;
    ranks
        .into_iter()
        .map(|r| Ok((r, program.call_method1("packed_bytes", (r,))?.extract()?)))
        .collect()
}

/// One receive: `(process rank, incarnation, packed bytes, source rank)`.
type Receive = (u64, u64, u64, u32);
/// One send: `(destination index, packed bytes, header)`.
type Send = (usize, u64, Bytes);

/// `peers::p2p_receives`: the wire tag and `(process rank, incarnation, packed bytes, source
/// rank)` per sender.
#[pyfunction]
pub fn p2p_receives(
    program: Bound<'_, PyAny>,
    peers: Vec<Bound<'_, PyAny>>,
    tag: u64,
    match_by_order: bool,
) -> PyResult<(i64, Vec<Receive>)> {
    let peer = |p: &Bound<'_, PyAny>| -> PyResult<MessagePeer> {
        Ok(MessagePeer {
            global_rank: p.getattr("global_rank")?.extract()?,
            dist_rank: p.getattr("meta")?.get_item("dist_rank")?.extract()?,
            incarnation: p.getattr("incarnation")?.extract()?,
        })
    };
    let peers = peers.iter().map(peer).collect::<PyResult<Vec<_>>>()?;
    let wire = (tag, match_by_order);
    let (tag, got) = peers::p2p_receives(&program_sources(&program)?, &peers, wire).py()?;
    Ok((
        tag,
        got.into_iter().map(|(p, n)| (p.dist_rank, p.incarnation, n, p.global_rank)).collect(),
    ))
}

/// `peers::p2p_send_messages`: the wire tag and `(destination index, packed bytes, header)` of
/// the messages rank `me` sends (`filler`: aborted ones).
#[pyfunction]
pub fn p2p_sends(
    me: u32,
    programs: Vec<Bound<'_, PyAny>>,
    filler: bool,
    wire: (u64, u64, bool),
) -> PyResult<(i64, Vec<Send>)> {
    let sources = programs.iter().map(program_sources).collect::<PyResult<Vec<_>>>()?;
    let (tag, incarnation, by_order) = wire;
    let kind = MessageKind::sent(filler);
    let (tag, sends) =
        peers::p2p_send_messages(me, &sources, kind, (tag, incarnation), by_order).py()?;
    Ok((tag, sends.into_iter().map(|(i, n, head)| (i, n, Cow::Owned(head))).collect()))
}

/// One backend's peers (`peers::adopt_peer` over its `PeerTable`), and a handoff's peer
/// argument resolved into parsed peers and block ids.
#[pyclass(name = "PeerResolver", module = "disagg_rs")]
pub struct PyPeerResolver {
    table: Py<PyPeerTable>,
    local: refmeta::LocalFacts,
    memo: Mutex<IdentityMemo<Memo>>,
}

/// Most metadata dicts a resolver remembers by identity.
const PEER_MEMO_LIMIT: usize = 256;
/// A metadata dict handed in before, a deep copy of it then, and its peer: the same unchanged
/// dict skips the content conversion (a handoff hands the same dicts again and again).
type Memo = (Py<PyAny>, Py<PyAny>, Py<PyPeer>);

impl PyPeerResolver {
    /// `peers::adopt_peer` of `meta`, a new entry's `Peer` carrying its schema as a dict.
    fn entry(&self, meta: &Bound<'_, PyAny>, to_plan: bool) -> PyResult<Py<PyPeer>> {
        let py = meta.py();
        let memo = !to_plan && meta.is_instance_of::<PyDict>();
        let id = meta.as_ptr() as usize;
        if memo {
            let same = |(m, copy, _): &Memo| m.is(meta) && copy.bind(py).eq(meta).unwrap_or(false);
            if let Some((_, _, peer)) = lock(&self.memo)?.get(id, same) {
                return Ok(peer.clone_ref(py));
            }
        }
        let raw = to_wire(meta, "peer_meta")?;
        let mut made = None;
        let mut attach = |m: &Arc<PeerMeta>, schema: &WireValue| {
            let peer = wire_dict_to_py(py, schema).and_then(|d| {
                Py::new(py, PyPeer { inner: Arc::clone(m), meta: d.into_any().unbind() })
            });
            peer.map(Arc::new).map_err(|e| {
                made = Some(e);
                DisaggError::wire("peer_meta", "could not build the peer")
            })
        };
        let mut table = self.table.borrow_mut(py);
        let out = peers::adopt_peer(&mut table.inner, (raw, to_plan), &self.local, &mut attach);
        let peer = made.map_or_else(|| Ok(out.py()?.1.clone_ref(py)), Err)?;
        if memo {
            let copy = py.import("copy")?.call_method1("deepcopy", (meta,))?.unbind();
            let entry = (meta.clone().unbind(), copy, peer.clone_ref(py));
            lock(&self.memo)?.insert(id, entry);
        }
        Ok(peer)
    }
}

#[pymethods]
impl PyPeerResolver {
    /// A resolver over `table` for this rank (what translating a reference-only dict needs).
    #[new]
    fn new(
        table: Py<PyPeerTable>,
        backend: String,
        state_kind: String,
        element_size: u64,
        dtype: String,
    ) -> Self {
        let local = refmeta::LocalFacts { backend, state_kind, element_size, dtype };
        Self { table, local, memo: Mutex::new(IdentityMemo::new(PEER_MEMO_LIMIT)) }
    }

    /// The backend's `PeerTable`.
    #[getter]
    fn table(&self, py: Python<'_>) -> Py<PyPeerTable> {
        self.table.clone_ref(py)
    }

    /// `peers::adopt_peer`: the parsed `Peer` of one metadata dict.
    fn adopt(&self, meta: &Bound<'_, PyAny>) -> PyResult<Py<PyPeer>> {
        self.entry(meta, false)
    }

    /// A `Peer` as is, else `peers::adopt_peer` of a metadata dict to plan with.
    fn peer(&self, meta: &Bound<'_, PyAny>) -> PyResult<Py<PyPeer>> {
        match meta.cast::<PyPeer>() {
            Ok(peer) => Ok(peer.clone().unbind()),
            Err(_) => self.entry(meta, true),
        }
    }

    /// The parsed peers a handoff's `peer_meta` names (`peers::source_records`) and their block
    /// ids (`src_block_ids`, or `{global_rank: ids}` where a dict or a stage carries its own).
    fn resolve<'py>(
        &self,
        peer_meta: Bound<'py, PyAny>,
        src_block_ids: Bound<'py, PyAny>,
    ) -> PyResult<(Vec<Py<PyPeer>>, Bound<'py, PyAny>)> {
        let py = peer_meta.py();
        let records = peers::source_records(&Node(peer_meta)).py()?;
        let mut found = Vec::with_capacity(records.len());
        let mut ranks = Vec::with_capacity(records.len());
        for r in records {
            let peer = self.adopt(&r.meta.0)?;
            ranks.push((peer.get().inner.layout.global_rank(), r.ids));
            found.push(peer);
        }
        let ids = match peers::ids_by_rank(&ranks, &Node(src_block_ids.clone())) {
            ResolvedIds::Given => src_block_ids,
            ResolvedIds::ByRank(by_rank) => {
                by_rank.into_iter().map(|(rank, ids)| (rank, ids.0)).into_py_dict(py)?.into_any()
            }
        };
        Ok((found, ids))
    }
}
