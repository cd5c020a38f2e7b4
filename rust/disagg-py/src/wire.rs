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
use disagg_core::wire::ticket::{check_staging_tickets, DecodeNeeds, HandoffTicket, StagingTicket};
use disagg_core::wire::value::{Budget, WireValue};
use disagg_core::{DisaggError, ModeChoice};
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{
    IntoPyDict, PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple,
};
use pyo3::IntoPyObjectExt;

use crate::args::{conv, convs, wire_to_py, Conv, Int, IntList, Kind, Opt, Raw, U32, U64};
use crate::compile::PyTransferProgram;
use crate::error::{in_handoff_metadata, py_methods, wire_err, IntoPyResult};
use crate::geometry::{PyKvGeometry, PySsmGeometry};
use crate::layout::{PyKvShardLayout, PySsmShardLayout};
use crate::pool::{core_fns, Out};
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
        d.update(m)?;
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
    pub(crate) inner: Arc<PeerMeta>,
    pub(crate) meta: Py<PyAny>,
}

py_methods!(PyPeer,
get {
    agent_name: String = (agent_name.clone());
    incarnation: u64 = (incarnation);
    global_rank: u32 = (layout.global_rank());
    num_blocks: u32 = (num_blocks);
    tokens_per_block: Option<u32> = (tokens_per_block);
    state_kind: &'static str = (state_kind.name());
    /// `[(addr, nbytes), ...]` of the registered pieces of the cache, in registration order.
    buffer_regions: Vec<(u64, u64)> = (buffer.regions.pairs());
}
span {}
range {}
methods {
    /// The metadata dict in this library's schema.
    #[getter]
    fn meta(&self, py: Python<'_>) -> Py<PyAny> {
        self.meta.clone_ref(py)
    }

    #[getter]
    fn layout(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match &self.inner.layout {
            PeerLayout::Kv(l) => PyKvShardLayout { inner: *l }.into_py_any(py),
            PeerLayout::Ssm(l) => PySsmShardLayout { inner: *l }.into_py_any(py),
        }
    }

    #[getter]
    fn geometry(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.inner.geometry.clone() {
            None => Ok(py.None()),
            Some(PeerGeometry::Kv(inner)) => PyKvGeometry { inner }.into_py_any(py),
            Some(PeerGeometry::Ssm(inner)) => PySsmGeometry { inner }.into_py_any(py),
        }
    }

    /// `PeerMeta::check_addresses` of the `(addr, len, ...)` rows.
    fn check_addresses(&self, rows: PyReadonlyArray2<'_, u64>, field: &str) -> PyResult<()> {
        let view = rows.as_array();
        if view.ncols() < 2 {
            return Err(wire_err(field, format!("rows have {} columns, need >= 2", view.ncols())));
        }
        let rows: Vec<[u64; 3]> = view.rows().into_iter().map(|r| [r[0], r[1], 0]).collect();
        self.inner.check_addresses(&rows, field).py()
    }

    /// `RegionTable::split_pairs` of rows from this peer into `local` (the arrays themselves
    /// when no row needs splitting).
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

/// `disagg_core::wire::peer::PeerTable` of parsed `Peer` objects.
#[pyclass(name = "PeerTable", module = "disagg_rs")]
pub struct PyPeerTable {
    pub(crate) inner: PeerTable<Arc<Py<PyPeer>>>,
}

#[pymethods]
impl PyPeerTable {
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

    /// The peer parsed from metadata equal to `meta`, or `None`.
    fn lookup(&self, py: Python<'_>, meta: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyPeer>>> {
        let raw = to_wire(meta, "peer_meta")?;
        Ok(self.inner.lookup(&raw).map(|(_, p)| p.clone_ref(py)))
    }

    /// `PeerTable::adopt`; `schema` is `meta` in this library's schema (default: `meta`).
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

pub(crate) fn local_side(
    is_dst: bool,
    local_num_blocks: Int,
    local_tokens_per_block: Option<Int>,
) -> PyResult<LocalSide> {
    conv!(local_num_blocks: U32, local_tokens_per_block: Opt<U32>);
    Ok(LocalSide { is_dst, num_blocks: local_num_blocks, tokens_per_block: local_tokens_per_block })
}

/// `disagg_core::wire::plan::compile_checked` (`checked`: the ids passed
/// `check_peer_transfer`, whose token count is `num_tokens`), else `compile_unchecked`.
#[pyfunction]
#[pyo3(signature = (srcs, dst, src_block_ids, dst_block_ids, num_tokens, mode, *, checked=false))]
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
    conv!(num_tokens: Opt<BlockU64>, dst_block_ids: Opt<BlockI64s>);
    let req = TransferPlanRequest {
        srcs: metas(&srcs),
        dst: dst.inner.as_ref(),
        src_ids: source_ids_of(src_block_ids)?,
        dst_ids: dst_block_ids,
        num_tokens: None,
        local: LocalSide { is_dst: false, num_blocks: 0, tokens_per_block: None },
        mode: ModeChoice::parse(mode).py()?,
    };
    let compile = if checked { compile_checked } else { compile_unchecked };
    Ok(PyTransferProgram { inner: py.detach(|| compile(&req, num_tokens)).py()? })
}

/// `PeerMeta::parse` of one peer's metadata (no table, no compatibility check).
#[pyfunction]
pub fn parse_peer_meta(
    py: Python<'_>,
    meta: &Bound<'_, PyAny>,
    backend: &str,
) -> PyResult<Py<PyPeer>> {
    let inner = Arc::new(PeerMeta::parse(&to_wire(meta, "peer_meta")?, backend).py()?);
    Py::new(py, PyPeer { inner, meta: meta.clone().unbind() })
}

/// `disagg_core::wire::peer::check_transfer`: the token count (`None` for SSM state).
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

/// `disagg_core::wire::ticket::check_staging_tickets`: the tickets by source global rank.
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
    let py_ticket = |(rank, t): (u32, StagingTicket)| Ok((rank, wire_to_py(py, &t.to_wire())?));
    checked.into_iter().map(py_ticket).collect::<PyResult<Vec<_>>>()?.into_py_dict(py)
}

convs! {
    /// A Python value as a wire value (`MetadataError` naming the argument).
    Wire: Py<PyAny> => WireValue = |f, v| Python::attach(|py| to_wire(v.bind(py), f));
    /// A handoff's own metadata as a wire value (`HandoffMetadataError` naming the argument).
    HandoffWire: Py<PyAny> => WireValue = |f, v| Python::attach(|py| {
        to_wire(v.bind(py), f).map_err(|e| in_handoff_metadata(py, e))
    });
    /// A ticket's integrity table as a wire value (`MetadataError` naming `integrity`).
    IntegrityWire: Py<PyAny> => WireValue = |_f, v| Wire::conv("integrity", v);
}

impl Out for Result<WireValue, DisaggError> {
    type Py = Py<PyAny>;
    fn out(self) -> PyResult<Py<PyAny>> {
        let v = self.py()?;
        Python::attach(|py| Ok(wire_to_py(py, &v)?.unbind()))
    }
}

impl Out for Result<Vec<WireValue>, DisaggError> {
    type Py = Vec<Py<PyAny>>;
    fn out(self) -> PyResult<Vec<Py<PyAny>>> {
        self.py()?.into_iter().map(|v| Ok::<_, DisaggError>(v).out()).collect()
    }
}

core_fns! {
    /// `HandoffTicket::parse`, then with `request_id` `check_for_decode` against this rank's
    /// `sources`, `has_ssm` and `integrity`.
    #[pyo3(signature = (ticket, *, request_id=None, sources=Vec::new(), has_ssm=false,
        integrity=false))]
    fn check_handoff_ticket(ticket: HandoffWire, request_id: Raw<Option<Int>>,
        sources: Raw<Vec<String>>, has_ssm: Raw<bool>, integrity: Raw<bool>) -> () = {
        let parsed = HandoffTicket::parse(&ticket).py()?;
        let needs = Opt::<U64>::conv("request_id", request_id)?
            .map(|request_id| DecodeNeeds { request_id, sources, has_ssm, integrity });
        parsed.check_needs(needs.as_ref())
    };
    /// `disagg_core::reference::check_reference` of one `stage` over its facts dict.
    fn check_reference(stage: Raw<String>, facts: HandoffWire) -> ()
        = disagg_core::reference::check_reference(&stage, &facts);
    /// `integrity::check_table` against `shapes`, else `integrity::chunk_tokens`.
    #[pyo3(signature = (wire, shapes=None))]
    fn check_integrity_wire(wire: IntegrityWire, shapes: Raw<Option<Vec<(String, Vec<u64>)>>>)
        -> Option<u32> = disagg_core::integrity::check_wire(&wire, shapes.as_deref());
    /// `disagg_core::integrity::DigestPlan::parse` of `kv` or `ssm` facts.
    fn digest_plan(kind: Raw<String>, facts: Wire) -> Py<PyAny>
        = disagg_core::integrity::DigestPlan::parse(&kind, &facts).map(|p| p.to_wire());
    /// `disagg_core::wire::peer::compat_hash`: 16 hex digits.
    #[pyo3(name = "compat_hash")]
    fn py_compat_hash(facts: Wire) -> String = compat_hash(&facts);
    /// Peer metadata dicts parsed by this process (lookups of a parsed peer do not count).
    fn peer_meta_parses() -> u64 = parse_count();
    /// Peer metadata dicts looked up by content (`disagg_core::wire::peer::lookup_count`).
    fn peer_meta_lookups() -> u64 = disagg_core::wire::peer::lookup_count();
    /// Transfers whose KV block ids this process validated against the buffers.
    fn block_id_checks() -> u64 = block_check_count();
}
