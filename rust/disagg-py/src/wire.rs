//! Bindings of the typed wire contract (`disagg_core::wire`): Python dicts and lists are
//! converted into wire values under the core's size caps; parsing, validation, the peer
//! table, the address checks and the one-call transfer plan are the core's.

use std::collections::BTreeMap;
use std::sync::Arc;

use disagg_core::wire::peer::{
    block_check_count, check_transfer, compat_hash, parse_count, LocalFacts, LocalSide,
    PeerGeometry, PeerLayout, PeerMeta, PeerTable, StateKind,
};
use disagg_core::wire::plan::{compile_checked, compile_unchecked, TransferPlanRequest};
use disagg_core::wire::ticket::{check_staging_tickets, DecodeNeeds, HandoffTicket};
use disagg_core::wire::value::{Budget, WireValue};
use disagg_core::ModeChoice;
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::args::{conv, convs, wire_to_py, Int, IntList, Kind, Opt, U32, U64};
use crate::compile::PyTransferProgram;
use crate::error::{in_handoff_metadata, py_methods, wire_err, IntoPyResult};
use crate::geometry::{PyKvGeometry, PySsmGeometry};
use crate::layout::{PyKvShardLayout, PySsmShardLayout};
use crate::pool::core_fns;
use crate::staging::source_ids_of;

convs! {
    /// A token count checked like the block ids (`BlockIdError`).
    BlockU64: Int => u64 = |f, v| v.to_u64(Kind::Block, f);
    /// A signed count checked like the block ids.
    BlockI64: Int => i64 = |f, v| v.to_i64(Kind::Block, f);
    /// Block ids checked by the core later (any 64-bit value).
    BlockI64s: IntList => Vec<i64> = |f, v| v.to_i64s(Kind::Block, f);
}

fn convert(
    obj: &Bound<'_, PyAny>,
    field: &str,
    depth: usize,
    budget: &mut Budget,
) -> PyResult<WireValue> {
    budget.node(field, depth).py()?;
    if obj.is_none() {
        return Ok(WireValue::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(WireValue::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj.extract::<i128>().map(WireValue::Int).map_err(|_| {
            crate::error::to_pyerr(Budget::int_out_of_range(field, &obj.to_string()))
        });
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(WireValue::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        let s = s.to_str()?;
        budget.string(field, s.len()).py()?;
        return Ok(WireValue::Str(s.to_owned()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        let b = b.as_bytes();
        budget.string(field, b.len()).py()?;
        return Ok(WireValue::Bytes(b.to_vec()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        budget.items(field, d.len()).py()?;
        let mut out = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = if let Ok(s) = k.cast::<PyString>() {
                s.to_str()?.to_owned()
            } else if k.is_instance_of::<PyInt>() && !k.is_instance_of::<PyBool>() {
                k.to_string()
            } else {
                return Err(wire_err(field, format!("dict key {k:.40} is not a str or an int")));
            };
            let sub = convert(&v, &format!("{field}.{key}"), depth + 1, budget)?;
            out.push((key, sub));
        }
        return Ok(WireValue::Map(out));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let n = obj.len()?;
        budget.items(field, n).py()?;
        let mut out = Vec::with_capacity(n);
        for (i, v) in obj.try_iter()?.enumerate() {
            out.push(convert(&v?, &format!("{field}[{i}]"), depth + 1, budget)?);
        }
        return Ok(WireValue::List(out));
    }
    if obj.cast::<numpy::PyUntypedArray>().is_ok_and(|a| a.ndim() == 1) {
        let ints = crate::args::array_of(obj).map_err(|what| wire_err(field, what))?;
        budget.items(field, ints.len()).py()?;
        for _ in &ints {
            budget.node(field, depth + 1).py()?;
        }
        return Ok(WireValue::List(ints.into_iter().map(WireValue::Int).collect()));
    }
    if let Ok(m) = obj.cast::<PyMapping>() {
        let d = PyDict::new(obj.py());
        for item in m.items()?.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            d.set_item(k, v)?;
        }
        return convert(d.as_any(), field, depth, budget);
    }
    if let Ok(i) = obj.extract::<i128>() {
        return Ok(WireValue::Int(i)); // a numpy integer scalar
    }
    let kind = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    Err(wire_err(field, format!("a {kind} cannot cross the wire")))
}

/// Convert a Python value into a wire value under the core's caps.
pub fn to_wire(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<WireValue> {
    convert(obj, field, 0, &mut Budget::default())
}

/// One peer buffer's metadata, parsed and validated once (see `PeerTable`).
#[pyclass(name = "Peer", module = "disagg_rs", frozen)]
pub struct PyPeer {
    inner: Arc<PeerMeta>,
    meta: Py<PyAny>,
}

py_methods!(PyPeer,
get {
    /// The transport agent name.
    agent_name: String = (agent_name.clone());
    /// The exporting process's incarnation.
    incarnation: u64 = (incarnation);
    /// The rank's global rank.
    global_rank: u32 = (layout.global_rank());
    /// Blocks (KV) or slots (SSM) of the buffer.
    num_blocks: u32 = (num_blocks);
    /// Tokens per KV block (`None` for SSM state).
    tokens_per_block: Option<u32> = (tokens_per_block);
    /// `"kv"`, `"conv"` or `"recurrent"`.
    state_kind: &'static str = (state_kind.name());
    /// The separately registered pieces of the peer's cache, `[(addr, nbytes), ...]` in
    /// registration order (one per per-layer tensor; one for a single buffer).
    buffer_regions: Vec<(u64, u64)> = (buffer.regions.pairs());
}
span {}
range {}
methods {
    /// The metadata dict in this library's schema (read-only by convention).
    #[getter]
    fn meta(&self, py: Python<'_>) -> Py<PyAny> {
        self.meta.clone_ref(py)
    }

    /// The rank's layout (`KVShardLayout` or `SSMShardLayout`).
    #[getter]
    fn layout(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match &self.inner.layout {
            PeerLayout::Kv(l) => PyKvShardLayout { inner: *l }.into_py_any(py),
            PeerLayout::Ssm(l) => PySsmShardLayout { inner: *l }.into_py_any(py),
        }
    }

    /// The compiler geometry (`KVGeometry`, `SSMGeometry` or `None`).
    #[getter]
    fn geometry(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.inner.geometry.clone() {
            None => Ok(py.None()),
            Some(PeerGeometry::Kv(inner)) => PyKvGeometry { inner }.into_py_any(py),
            Some(PeerGeometry::Ssm(inner)) => PySsmGeometry { inner }.into_py_any(py),
        }
    }

    /// Raise `MetadataError` naming `field` unless every `(addr, len, ...)` row of `rows`
    /// lies inside the peer's exported regions (its buffer and its staging region).
    fn check_addresses(&self, rows: PyReadonlyArray2<'_, u64>, field: &str) -> PyResult<()> {
        let view = rows.as_array();
        if view.ncols() < 2 {
            return Err(wire_err(field, format!("rows have {} columns, need >= 2", view.ncols())));
        }
        let rows: Vec<[u64; 3]> = view.rows().into_iter().map(|r| [r[0], r[1], 0]).collect();
        self.inner.check_addresses(&rows, field).py()
    }

    /// Direct descriptor pairs whose source side is this peer's memory and whose destination
    /// side is `local`'s, split so that every piece lies inside one registered region on each
    /// side (a merged range can run from one per-layer tensor into the next). Returns the
    /// `(src_rows, dst_rows)` arrays themselves when no row needs splitting. Raises
    /// `MetadataError` (field `src_descriptors` / `dst_descriptors`) for a byte outside
    /// every region.
    fn split_descriptors<'py>(
        &self,
        py: Python<'py>,
        src_rows: Bound<'py, PyAny>,
        dst_rows: Bound<'py, PyAny>,
        local: PyRef<'py, PyPeer>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let split = {
            let s = crate::regions::rows_arg(&src_rows, "src_rows")?;
            let d = crate::regions::rows_arg(&dst_rows, "dst_rows")?;
            let (s, d) = (s.rows()?, d.rows()?);
            let (st, dt) = (&self.inner.buffer.regions, &local.inner.buffer.regions);
            py.detach(|| disagg_core::RegionTable::split_pairs(st, dt, s, d)).py()?
        };
        match split {
            None => Ok((src_rows, dst_rows)),
            Some((s, d)) => Ok((
                crate::compile::rows_to_numpy(py, s)?.into_any(),
                crate::compile::rows_to_numpy(py, d)?.into_any(),
            )),
        }
    }

    fn __repr__(&self) -> String {
        self.inner.to_string()
    }
});

/// Peers of one backend, each parsed once and found again by content.
#[pyclass(name = "PeerTable", module = "disagg_rs")]
pub struct PyPeerTable {
    inner: PeerTable<Arc<Py<PyPeer>>>,
}

#[pymethods]
impl PyPeerTable {
    /// A table of a `backend` (`"nixl"` or `"nccl"`) backend whose peers must share this
    /// rank's facts: state kind, dtype, head dim, the layout's layer count and the
    /// compatibility hash.
    #[new]
    #[pyo3(signature = (backend, *, state_kind, dtype, head_dim, num_layers, compat_hash))]
    fn new(
        backend: &str,
        state_kind: &str,
        dtype: String,
        head_dim: Int,
        num_layers: Option<Int>,
        compat_hash: String,
    ) -> PyResult<Self> {
        let state_kind = StateKind::parse("state_kind", state_kind).py()?;
        conv!(head_dim: U32, num_layers: Opt<U32>);
        let local = LocalFacts { state_kind, dtype, head_dim, num_layers, compat_hash };
        Ok(Self { inner: PeerTable::new(backend, local) })
    }

    /// The peer parsed from metadata equal to `meta`, or `None` (never parses).
    fn lookup(&self, py: Python<'_>, meta: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyPeer>>> {
        let raw = to_wire(meta, "peer_meta")?;
        Ok(self.inner.lookup(&raw).map(|(_, p)| p.clone_ref(py)))
    }

    /// The peer of `meta`, parsed now if the table has not seen metadata equal to it.
    /// `schema` is `meta` in this library's schema when `meta` carries the reference
    /// design's fields only (default: `meta` itself). Raises `MetadataError`,
    /// `LayoutError` or `GeometryMismatchError` naming the field.
    #[pyo3(signature = (meta, schema=None))]
    fn adopt(
        &mut self,
        py: Python<'_>,
        meta: &Bound<'_, PyAny>,
        schema: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyPeer>> {
        let raw = to_wire(meta, "peer_meta")?;
        if let Some((_, p)) = self.inner.lookup(&raw) {
            return Ok(p.clone_ref(py));
        }
        let schema_val = schema.map(|s| to_wire(s, "peer_meta")).transpose()?;
        let schema_val = schema_val.unwrap_or_else(|| raw.clone());
        let mut made = None;
        let out = self.inner.adopt(raw, &schema_val, |m| {
            let meta = schema.unwrap_or(meta).clone().unbind();
            Py::new(py, PyPeer { inner: Arc::clone(m), meta }).map(Arc::new).map_err(|e| {
                made = Some(e);
                disagg_core::DisaggError::wire("peer_meta", "could not build the peer")
            })
        });
        made.map_or_else(|| Ok(out.py()?.1.clone_ref(py)), Err)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

pub(crate) fn metas<'a>(peers: &'a [PyRef<'_, PyPeer>]) -> Vec<&'a PeerMeta> {
    peers.iter().map(|p| p.inner.as_ref()).collect()
}

/// The plan request of Python arguments (peers borrowed from `srcs` and `dst`).
fn plan_request<'a>(
    srcs: &'a [PyRef<'_, PyPeer>],
    dst: &'a PyRef<'_, PyPeer>,
    src_block_ids: &Bound<'_, PyAny>,
    dst_block_ids: Option<IntList>,
    mode: &str,
    local: LocalSide,
) -> PyResult<TransferPlanRequest<'a>> {
    conv!(dst_block_ids: Opt<BlockI64s>);
    Ok(TransferPlanRequest {
        srcs: metas(srcs),
        dst: dst.inner.as_ref(),
        src_ids: source_ids_of(src_block_ids)?,
        dst_ids: dst_block_ids,
        num_tokens: None,
        local,
        mode: ModeChoice::parse(mode).py()?,
    })
}

/// The local side of a transfer check from its arguments.
pub(crate) fn local_side(
    is_dst: bool,
    local_num_blocks: Int,
    local_tokens_per_block: Option<Int>,
) -> PyResult<LocalSide> {
    conv!(local_num_blocks: U32, local_tokens_per_block: Opt<U32>);
    Ok(LocalSide { is_dst, num_blocks: local_num_blocks, tokens_per_block: local_tokens_per_block })
}

/// Compile a transfer of parsed peers. `checked`: its peers and source block ids are what
/// `check_peer_transfer` accepted (`num_tokens` is its result), so they are not scanned again;
/// otherwise the compiler validates every block id.
#[pyfunction]
#[pyo3(signature = (srcs, dst, src_block_ids, dst_block_ids, num_tokens, mode, *, checked=false))]
#[allow(clippy::too_many_arguments)]
pub fn compile_peer_transfer(
    py: Python<'_>,
    srcs: Vec<PyRef<'_, PyPeer>>,
    dst: PyRef<'_, PyPeer>,
    src_block_ids: &Bound<'_, PyAny>,
    dst_block_ids: Option<IntList>,
    num_tokens: Option<Int>,
    mode: &str,
    checked: bool,
) -> PyResult<PyTransferProgram> {
    conv!(num_tokens: Opt<BlockU64>);
    let local = LocalSide { is_dst: false, num_blocks: 0, tokens_per_block: None };
    let req = plan_request(&srcs, &dst, src_block_ids, dst_block_ids, mode, local)?;
    let compile = if checked { compile_checked } else { compile_unchecked };
    Ok(PyTransferProgram { inner: py.detach(|| compile(&req, num_tokens)).py()? })
}

/// Parse one peer's metadata exported by a `backend` backend (no table, no compatibility
/// check): `MetadataError`, `LayoutError` or `GeometryMismatchError` naming the field.
#[pyfunction]
pub fn parse_peer_meta(
    py: Python<'_>,
    meta: &Bound<'_, PyAny>,
    backend: &str,
) -> PyResult<Py<PyPeer>> {
    let inner = Arc::new(PeerMeta::parse(&to_wire(meta, "peer_meta")?, backend).py()?);
    Py::new(py, PyPeer { inner, meta: meta.clone().unbind() })
}

/// Check the peer set and block ids of one transfer (no compile); return the token count
/// (`None` for SSM state).
#[pyfunction]
#[pyo3(signature = (srcs, src_block_ids, dst_block_ids, num_tokens, *,
    local_is_dst, local_num_blocks, local_tokens_per_block))]
pub fn check_peer_transfer(
    srcs: Vec<PyRef<'_, PyPeer>>,
    src_block_ids: &Bound<'_, PyAny>,
    dst_block_ids: Option<IntList>,
    num_tokens: Option<Int>,
    local_is_dst: bool,
    local_num_blocks: Int,
    local_tokens_per_block: Option<Int>,
) -> PyResult<Option<u64>> {
    conv!(dst_block_ids: Opt<BlockI64s>, num_tokens: Opt<BlockI64>);
    let src = source_ids_of(src_block_ids)?;
    let local = local_side(local_is_dst, local_num_blocks, local_tokens_per_block)?;
    check_transfer(&metas(&srcs), &src, dst_block_ids.as_deref(), num_tokens, local).py()
}

/// Check the staging tickets of one pull against the source peers; return them by source
/// global rank. Raises `MetadataError` (field `staged`) for an unknown source, another
/// incarnation, a second ticket of one source, a negative offset or bytes outside the
/// source's staging region.
#[pyfunction]
pub fn check_staging_tickets_of<'py>(
    py: Python<'py>,
    tickets: Vec<Bound<'py, PyAny>>,
    peers: Vec<PyRef<'py, PyPeer>>,
) -> PyResult<Bound<'py, PyDict>> {
    let values = tickets
        .iter()
        .enumerate()
        .map(|(i, t)| to_wire(t, &format!("staged[{i}]")))
        .collect::<PyResult<Vec<_>>>()?;
    let by_rank: BTreeMap<u32, &PeerMeta> =
        peers.iter().map(|p| (p.inner.layout.global_rank(), p.inner.as_ref())).collect();
    let checked = check_staging_tickets(&values, &by_rank).py()?;
    let out = PyDict::new(py);
    for (rank, t) in checked {
        out.set_item(rank, wire_to_py(py, &t.to_wire())?)?;
    }
    Ok(out)
}

/// Check a handoff ticket once, when the decode receives it: `HandoffMetadataError` naming
/// the field (block ids, first tokens, lease, staging tickets and their offsets). With
/// `request_id`, also against what this decode rank needs: the state kinds it reads
/// (`sources`), whether it holds SSM state and whether it verifies integrity.
#[pyfunction]
#[pyo3(signature = (ticket, *, request_id=None, sources=Vec::new(), has_ssm=false, integrity=false))]
pub fn check_handoff_ticket(
    ticket: &Bound<'_, PyAny>,
    request_id: Option<Int>,
    sources: Vec<String>,
    has_ssm: bool,
    integrity: bool,
) -> PyResult<()> {
    let v = to_wire(ticket, "ticket").map_err(|e| in_handoff_metadata(ticket.py(), e))?;
    let parsed = HandoffTicket::parse(&v).py()?;
    conv!(request_id: Opt<U64>);
    if let Some(request_id) = request_id {
        let needs = DecodeNeeds { request_id, sources, has_ssm, integrity };
        parsed.check_for_decode(&needs).py()?;
    }
    Ok(())
}

/// Run one check of a reference-design engine (`setup`, `ssm_buffers`, `tp_agents`,
/// `prefill`, `ticket`, `decode_ready`) over its facts dict; the typed error names the field.
#[pyfunction]
pub fn check_reference(stage: &str, facts: &Bound<'_, PyAny>) -> PyResult<()> {
    let v = to_wire(facts, "facts").map_err(|e| in_handoff_metadata(facts.py(), e))?;
    disagg_core::reference::check_reference(stage, &v).py()
}

/// Check a ticket's integrity table against the `shapes` this model needs and return its
/// `chunk_tokens`; without `shapes`, only the `chunk_tokens` (None for a non-map).
#[pyfunction]
#[pyo3(signature = (wire, shapes=None))]
pub fn check_integrity_wire(
    wire: &Bound<'_, PyAny>,
    shapes: Option<Vec<(String, Vec<u64>)>>,
) -> PyResult<Option<u32>> {
    let v = to_wire(wire, "integrity")?;
    match shapes {
        Some(shapes) => disagg_core::integrity::check_table(&v, &shapes).py(),
        None => disagg_core::integrity::chunk_tokens(&v).py(),
    }
}

/// Check and plan one integrity digest (`kv` or `ssm` facts, see the core's `DigestPlan`).
#[pyfunction]
pub fn digest_plan<'py>(kind: &str, facts: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let plan = disagg_core::integrity::DigestPlan::parse(kind, &to_wire(facts, "facts")?).py()?;
    wire_to_py(facts.py(), &plan.to_wire())
}

/// The compatibility hash of a facts dict: 16 hex digits.
#[pyfunction(name = "compat_hash")]
pub fn py_compat_hash(facts: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(compat_hash(&to_wire(facts, "facts")?))
}

core_fns! {
    /// How many peer metadata dicts this process has parsed (lookups of a parsed peer do not
    /// count).
    fn peer_meta_parses() -> u64 = parse_count();
    /// How many times this process has validated a transfer's KV block ids against the
    /// buffers (once per transfer on the hot path).
    fn block_id_checks() -> u64 = block_check_count();
}
