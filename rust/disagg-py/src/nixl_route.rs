//! Bindings of `disagg_core::nixl_route`: the NIXL runtime checks, the decode's read of each
//! source, the reference design's slice reads and the rank's table of registered peers.

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::nixl_route::{
    self as route, Admission, AgentPeers, DecodePool, HeadSpan, PlanFacts, Refusal, SliceSide,
    SourceRead, Unbuildable,
};
use disagg_core::wire::ticket::StagingTicket;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMapping};

use crate::backend_rules::ipc_same_host;
use crate::error::{to_pyerr, IntoPyResult};
use crate::pool::lock;
use crate::wire::to_wire;

pyo3::import_exception!(disagg_rs.exceptions, TransferError);

fn refused(r: Refusal) -> PyErr {
    TransferError::new_err((r.detail, r.field))
}

fn refuse(r: Option<Refusal>) -> PyResult<()> {
    r.map_or(Ok(()), |r| Err(refused(r)))
}

fn unbuildable(e: Unbuildable) -> PyErr {
    match e {
        Unbuildable::Runtime(r) => refused(r),
        Unbuildable::Argument(e) => to_pyerr(e),
    }
}

/// Whether a `UCX_TLS` value leaves UCX a transport that moves CUDA memory.
///
/// Unset or empty: UCX picks (yes). An inclusion list needs `all`, `cuda` or one of
/// `cuda_copy`/`cuda_ipc`/`gdr_copy` (`rc` alone moves host memory only). A `^` exclusion
/// list fails when it removes `cuda` or all three CUDA transports.
#[pyfunction]
#[pyo3(signature = (tls))]
pub fn ucx_tls_allows_cuda(tls: Option<&str>) -> bool {
    route::ucx_tls_allows_cuda(tls)
}

/// Explain a NIXL build (`nixl_cu12` or `nixl-cu12`) whose CUDA major differs from torch's,
/// or `None` when they agree or either is unknown.
#[pyfunction]
#[pyo3(signature = (variant, torch_cuda))]
pub fn nixl_cuda_major_mismatch(variant: Option<&str>, torch_cuda: Option<&str>) -> Option<String> {
    route::nixl_cuda_major_mismatch(variant, torch_cuda)
}

fn names(types: &[Bound<'_, PyAny>]) -> PyResult<Vec<String>> {
    types.iter().map(|t| Ok(t.str()?.to_string())).collect()
}

/// Whether a NIXL backend's memory types include GPU memory. NIXL 1.5 names them
/// `"VRAM_SEG"` (older builds `"VRAM"`; some report `"cuda"`).
#[pyfunction]
pub fn backend_supports_vram(mem_types: Vec<Bound<'_, PyAny>>) -> PyResult<bool> {
    Ok(route::backend_supports_vram(&names(&mem_types)?))
}

/// `[(variable, value)]` of the UCX settings a buffer (`on_gpu`: GPU memory) needs, given
/// `UCX_TLS` and `UCX_MEMTYPE_CACHE` now; `TransferError` (field `UCX_TLS`) for a GPU buffer
/// when `tls` leaves no CUDA transport.
#[pyfunction]
#[pyo3(signature = (on_gpu, tls, memtype_cache))]
pub fn nixl_ucx_env(
    on_gpu: bool,
    tls: Option<&str>,
    memtype_cache: Option<&str>,
) -> PyResult<Vec<(&'static str, &'static str)>> {
    route::ucx_env(on_gpu, tls, memtype_cache).map_err(refused)
}

/// Raise `TransferError` (field `nixl`) for a GPU buffer (`on_gpu`) on a NIXL build of another
/// CUDA major than torch's (`torch_cuda`) or a UCX backend whose memory types (`mem_types`,
/// `None`: unknown) lack GPU memory.
#[pyfunction]
#[pyo3(signature = (on_gpu, variant, torch_cuda, mem_types))]
pub fn check_nixl_cuda_support(
    on_gpu: bool,
    variant: Option<&str>,
    torch_cuda: Option<&str>,
    mem_types: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<()> {
    let mem_types = mem_types.map(|m| names(&m)).transpose()?;
    refuse(route::cuda_support_refusal(on_gpu, variant, torch_cuda, mem_types.as_deref()))
}

/// The checked `mode` of a NIXL backend: `TransferError` (field `nixl`) without the nixl
/// package (`have_nixl`), `ArgumentError` (field `mode`) for a mode other than `"auto"`,
/// `"direct"` or `"staged"`.
#[pyfunction]
pub fn nixl_backend_mode(have_nixl: bool, mode: &str) -> PyResult<&'static str> {
    route::backend_mode(have_nixl, mode).map(route::TransferMode::name).map_err(unbuildable)
}

/// Raise `TransferError` when NIXL refused to post the read `label` (`state`: what its
/// `transfer()` returned).
#[pyfunction]
pub fn check_xfer_posted(state: &Bound<'_, PyAny>, label: &str) -> PyResult<()> {
    let state: Option<String> = state.extract().ok();
    route::post_refusal(state.as_deref(), label)
        .map_or(Ok(()), |msg| Err(TransferError::new_err(msg)))
}

/// `(local, remote)` NIXL memory types of a read from the peer of metadata `meta` into this
/// rank's buffer of `local_mem`.
#[pyfunction]
pub fn nixl_read_mem_types(meta: &Bound<'_, PyAny>, local_mem: &str) -> PyResult<(String, String)> {
    let reference_only = given(meta, "reference_only")?.map(|v| v.is_truthy()).transpose()?;
    let remote: String = meta.get_item("buffer")?.get_item("mem_type")?.str()?.to_string();
    Ok(route::read_mem_types(reference_only.unwrap_or(false), local_mem, &remote))
}

/// How the decode reads one source: `(kind, give_up, slot_bytes_min)`, `kind` one of
/// `"direct"`, `"whole"` (scattered by the device plan), `"rows"` (held whole,
/// scattered by the program's rows) or `"chunked"` (through slots of at least
/// `slot_bytes_min`); `give_up`: the source's ticket is not read (tell its stream). `plan`:
/// `(tokens_per_block, packed bytes per token, item_bytes)` of its device plan.
#[pyfunction]
#[pyo3(signature = (staged, ticket, plan, *, largest_free, alignment, share, on_gpu,
    num_tokens, dst_blocks))]
pub fn nixl_source_read(
    staged: bool,
    ticket: Option<&Bound<'_, PyAny>>,
    plan: Option<(u64, u64, u64)>,
    largest_free: u64,
    alignment: u64,
    share: u64,
    on_gpu: bool,
    num_tokens: Option<u64>,
    dst_blocks: u64,
) -> PyResult<(&'static str, bool, u64)> {
    let ticket =
        ticket.map(|t| StagingTicket::parse(&to_wire(t, "ticket")?, "ticket").py()).transpose()?;
    let plan = plan.map(|(tokens_per_block, bytes_per_token, item_bytes)| PlanFacts {
        tokens_per_block,
        bytes_per_token,
        item_bytes,
    });
    let pool = DecodePool { largest_free, alignment, share, on_gpu, num_tokens, dst_blocks };
    Ok(match route::source_read(staged, ticket.as_ref(), plan, &pool) {
        SourceRead::Direct { give_up } => ("direct", give_up, 0),
        SourceRead::Whole { by_plan: true } => ("whole", false, 0),
        SourceRead::Whole { by_plan: false } => ("rows", false, 0),
        SourceRead::Chunked { slot_bytes_min } => ("chunked", false, slot_bytes_min),
    })
}

/// Whether this rank (`on_gpu`: its buffer is GPU memory; `mine`: its CUDA IPC export) packs
/// anything for the decode of IPC export `theirs` in `mode`.
#[pyfunction]
pub fn nixl_source_packs(
    mode: &str,
    on_gpu: bool,
    mine: Option<Bound<'_, PyAny>>,
    theirs: Option<Bound<'_, PyAny>>,
) -> PyResult<bool> {
    let mode = route::backend_mode(true, mode).map_err(unbuildable)?;
    Ok(route::source_packs(mode, on_gpu, ipc_same_host(mine, theirs)?))
}

/// Whether rank `me` packs its copy for a staged pull of source ranks `sources`;
/// `CapacityError` (field `staging_bytes`) when it does without a pool (`staging_bytes` 0).
#[pyfunction]
pub fn nixl_source_stages(me: u32, sources: Vec<u32>, staging_bytes: u64) -> PyResult<bool> {
    route::source_stages(me, &sources, staging_bytes).py()
}

/// `(route, ranks read directly)` of a pull.
type PullReads = (Vec<(u32, bool, usize)>, Vec<u32>);

/// The reads of a pull: `([(rank, reads its staged copy, staged reads left including this
/// one)] in program order, [ranks read directly])`, from each source's `(rank, compiled mode, packed bytes)`, the
/// ranks whose metadata was given, the checked staging tickets by rank and this rank's
/// staging pool size (0: none). `MetadataError` for a source no metadata names or a ticket
/// whose size is not the plan's, `CapacityError` for a staged read without a pool.
#[pyfunction]
pub fn nixl_pull_route(
    sources: Vec<(u32, String, u64)>,
    known: Vec<u32>,
    tickets: BTreeMap<u32, Bound<'_, PyAny>>,
    staging_bytes: u64,
) -> PyResult<PullReads> {
    let tickets = tickets
        .iter()
        .map(|(r, t)| Ok((*r, StagingTicket::parse(&to_wire(t, "ticket")?, "ticket").py()?)))
        .collect::<PyResult<Vec<_>>>()?;
    route::pull_reads(&sources, &known, &tickets, staging_bytes).py()
}

fn field(m: &Bound<'_, PyAny>, key: &str) -> PyResult<u64> {
    m.get_item(key)?.extract()
}

/// Field `key` of mapping `m` unless it is missing or `None`.
fn given<'py>(m: &Bound<'py, PyAny>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    match m.cast::<PyMapping>()?.get_item(key) {
        Ok(v) if !v.is_none() => Ok(Some(v)),
        _ => Ok(None),
    }
}

fn rows_array(py: Python<'_>, rows: Vec<[u64; 3]>) -> PyResult<Bound<'_, PyArray2<u64>>> {
    let n = rows.len();
    let flat: Vec<u64> = rows.into_iter().flatten().collect();
    let arr = Array2::from_shape_vec((n, 3), flat)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(arr.into_pyarray(py))
}

/// A side's stated NIXL memory type: its `buffer`'s `mem_type` when it is a mapping.
fn stated_mem(buffer: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match buffer.and_then(|b| b.cast::<PyMapping>().ok()) {
        Some(b) => Ok(Some(b.get_item("mem_type")?.extract()?)),
        None => Ok(None),
    }
}

/// `(local_rows, remote_rows, local_mem, remote_mem, label)` of the reference design's read
/// of `outer = (src_start, dst_start, count)` outer slices of each block pair, whole slices
/// (`heads[2] == 0`) or heads `[h0, h0 + n)` of each token (`heads = (src_h0, dst_h0, n)`).
/// `peer` is the peer's reference metadata; `local` is `(base_addr, outer_stride_bytes,
/// bytes_per_slice, device_id, heads_per_partition, head_dim, element_size,
/// tokens_per_block, buffer_info)` of this buffer. `BlockIdError` for id lists of unequal
/// length.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn slice_reads<'py>(
    py: Python<'py>,
    peer: &Bound<'py, PyAny>,
    local: (
        u64,
        u64,
        u64,
        u64,
        Option<u64>,
        Option<u64>,
        Option<u64>,
        Option<u64>,
        Option<Bound<'py, PyAny>>,
    ),
    src_block_ids: PyReadonlyArray1<'py, u64>,
    dst_block_ids: PyReadonlyArray1<'py, u64>,
    outer: (u64, u64, u64),
    heads: (u64, u64, u64),
    peer_id: &str,
) -> PyResult<(Bound<'py, PyArray2<u64>>, Bound<'py, PyArray2<u64>>, String, String, String)> {
    let (base, stride, bps, device, hpp, head_dim, elem, tpb, buffer) = local;
    let span = HeadSpan {
        heads: heads.2,
        head_bytes: head_dim.unwrap_or(0).saturating_mul(elem.unwrap_or(0)),
        tokens_per_block: tpb.unwrap_or(0),
    };
    let peer_heads = if heads.2 == 0 { 0 } else { field(peer, "heads_per_partition")? };
    let src = SliceSide {
        base: field(peer, "base_addr")?,
        outer_stride: field(peer, "outer_stride_bytes")?,
        bytes_per_slice: field(peer, "bytes_per_slice")?,
        outer_start: outer.0,
        head_start: heads.0,
        heads_per_partition: peer_heads,
        device: given(peer, "device_id")?.map(|d| d.extract()).transpose()?.unwrap_or(0),
    };
    let dst = SliceSide {
        base,
        outer_stride: stride,
        bytes_per_slice: bps,
        outer_start: outer.1,
        head_start: heads.1,
        heads_per_partition: hpp.unwrap_or(0),
        device,
    };
    let (src_ids, dst_ids) = (src_block_ids.as_slice()?, dst_block_ids.as_slice()?);
    let (l, r) = route::slice_read_rows(&src, &dst, src_ids, dst_ids, outer.2, &span).py()?;
    let peer_buffer = given(peer, "buffer")?;
    Ok((
        rows_array(py, l)?,
        rows_array(py, r)?,
        route::slice_read_mem_type(stated_mem(buffer.as_ref())?),
        route::slice_read_mem_type(stated_mem(peer_buffer.as_ref())?),
        route::slice_read_label(peer_id, outer.0, outer.2, (heads.0, heads.2), src_ids.len()),
    ))
}

/// Whether the kernels of a CUDA IPC route stay inside both buffers: `plans` holds
/// `(tokens_per_block, source end, source buffer bytes, destination end)` of each source
/// rank's plan, `dst_bytes` the destination buffer's size.
#[pyfunction]
pub fn ipc_bounds_hold(plans: Vec<(u64, u64, u64, u64)>, dst_bytes: u64) -> bool {
    route::ipc_bounds_hold(&plans, dst_bytes)
}

/// Raise `GeometryMismatchError` naming the first slice-geometry field (`(name, value)`,
/// `None`: not given) a matched-layout peer states otherwise than this rank.
#[pyfunction]
pub fn check_matched_slices(
    peer_name: &str,
    peer: Vec<(String, Option<i64>)>,
    mine: Vec<(String, Option<i64>)>,
) -> PyResult<()> {
    route::check_matched_slices(peer_name, &peer, &mine).py()
}

/// The rank's NIXL agent as its buffer registrations share it: how many hold it, and the
/// peers registered on it (once per incarnation and metadata digest).
#[pyclass(name = "NixlAgentPeers", module = "disagg_rs", frozen)]
pub struct PyNixlAgentPeers {
    name: String,
    inner: Mutex<AgentPeers>,
}

#[pymethods]
impl PyNixlAgentPeers {
    #[new]
    fn new(agent_name: String) -> Self {
        Self { name: agent_name, inner: Mutex::new(AgentPeers::default()) }
    }
    /// Registrations holding the agent.
    #[getter]
    fn refs(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.refs())
    }
    /// The keyword arguments of `nixl_agent_config` for an agent of `backends` (one progress
    /// thread: one-sided reads need the passive peer to progress). `TransferError` (field
    /// `nixl`) without the nixl package (`have_nixl`).
    #[staticmethod]
    fn agent_options(
        py: Python<'_>,
        have_nixl: bool,
        backends: Vec<String>,
    ) -> PyResult<Bound<'_, PyDict>> {
        if !have_nixl {
            return Err(TransferError::new_err((
                "NixlTransferBackend needs the nixl Python package (pip install nixl)",
                "nixl",
            )));
        }
        let options = PyDict::new(py);
        options.set_item("enable_prog_thread", true)?;
        if let Some(b) = route::agent_backends(&backends) {
            options.set_item("backends", b.to_vec())?;
        }
        Ok(options)
    }
    /// One more registration holds the agent.
    fn retain(&self) -> PyResult<()> {
        lock(&self.inner)?.retain();
        Ok(())
    }
    /// One registration lets go; the names of every peer to forget once the last has.
    fn release(&self) -> PyResult<Vec<String>> {
        Ok(lock(&self.inner)?.release())
    }
    /// Raise `TransferError` (field `agent`) once no registration holds the agent.
    fn check_open(&self) -> PyResult<()> {
        if lock(&self.inner)?.refs() == 0 {
            return Err(TransferError::new_err((
                format!("NIXL agent '{}' is closed", self.name),
                "agent",
            )));
        }
        Ok(())
    }
    /// `(its NIXL id, [])` for a peer registered with this incarnation and metadata digest,
    /// else `(None, [name])` when an old registration must be forgotten first, or `(None, [])`.
    fn admit(
        &self,
        name: &str,
        incarnation: u64,
        digest: &str,
    ) -> PyResult<(Option<String>, Vec<String>)> {
        Ok(match lock(&self.inner)?.admit(name, incarnation, digest) {
            Admission::Known(id) => (Some(id), Vec::new()),
            Admission::Register { stale } => {
                (None, stale.then(|| name.to_owned()).into_iter().collect())
            }
        })
    }
    /// Record a peer as NIXL's registration went: `added` and `loaded` as `(True, what
    /// add_remote_agent returned: bytes or text, its name when empty)` or `(False, why it
    /// failed)`; its NIXL id. `TransferError` (field `agent_metadata`) when it failed.
    fn register(
        &self,
        name: &str,
        incarnation: u64,
        digest: &str,
        added: bool,
        loaded: &Bound<'_, PyAny>,
    ) -> PyResult<String> {
        let text = if let Ok(b) = loaded.cast::<PyBytes>() {
            Some(String::from_utf8_lossy(b.as_bytes()).into_owned())
        } else if loaded.is_none() {
            None
        } else {
            Some(loaded.str()?.to_string())
        };
        let added = if added { Ok(text) } else { Err(text.unwrap_or_default()) };
        lock(&self.inner)?.register(name, incarnation, digest, added).map_err(refused)
    }
    /// Forget the registered peers among `names`: `[(name, NIXL id)]` to remove from NIXL.
    fn forget(&self, names: Vec<String>) -> PyResult<Vec<(String, String)>> {
        Ok(lock(&self.inner)?.forget(&names))
    }
    /// `{name: (incarnation, metadata digest, NIXL id)}` of the registered peers.
    fn peers(&self) -> PyResult<BTreeMap<String, (u64, String, String)>> {
        let t = lock(&self.inner)?;
        Ok(t.peers()
            .iter()
            .map(|(n, r)| (n.clone(), (r.incarnation, r.digest.clone(), r.id.clone())))
            .collect())
    }
    /// The registered peers that `current` (`{agent name: incarnation}` of every peer the
    /// control plane names now) no longer names or names with another incarnation.
    fn stale(&self, current: BTreeMap<String, u64>) -> PyResult<Vec<String>> {
        Ok(lock(&self.inner)?.stale(&current))
    }
}
