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

/// `nixl_route::ucx_tls_allows_cuda`: whether UCX keeps a transport that moves CUDA memory.
#[pyfunction]
#[pyo3(signature = (tls))]
pub fn ucx_tls_allows_cuda(tls: Option<&str>) -> bool {
    route::ucx_tls_allows_cuda(tls)
}

/// `nixl_route::nixl_cuda_major_mismatch`: why a NIXL build's CUDA major is not torch's.
#[pyfunction]
#[pyo3(signature = (variant, torch_cuda))]
pub fn nixl_cuda_major_mismatch(variant: Option<&str>, torch_cuda: Option<&str>) -> Option<String> {
    route::nixl_cuda_major_mismatch(variant, torch_cuda)
}

fn names(types: &[Bound<'_, PyAny>]) -> PyResult<Vec<String>> {
    types.iter().map(|t| Ok(t.str()?.to_string())).collect()
}

/// `nixl_route::backend_supports_vram`: whether the memory types include GPU memory.
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

/// Raise `TransferError` (field `nixl`) for `nixl_route::cuda_support_refusal`.
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

/// `nixl_route::backend_mode`: `TransferError` (field `nixl`) without the nixl package,
/// `ArgumentError` (field `mode`) for an unknown mode.
#[pyfunction]
pub fn nixl_backend_mode(have_nixl: bool, mode: &str) -> PyResult<&'static str> {
    route::backend_mode(have_nixl, mode).map(route::TransferMode::name).map_err(unbuildable)
}

/// Raise `TransferError` when NIXL refused to post the read `label` (`nixl_route::post_refusal`).
#[pyfunction]
pub fn check_xfer_posted(state: &Bound<'_, PyAny>, label: &str) -> PyResult<()> {
    let state: Option<String> = state.extract().ok();
    route::post_refusal(state.as_deref(), label)
        .map_or(Ok(()), |msg| Err(TransferError::new_err(msg)))
}

/// `nixl_route::read_mem_types`: `(local, remote)` NIXL memory types of a read from `meta`.
#[pyfunction]
pub fn nixl_read_mem_types(meta: &Bound<'_, PyAny>, local_mem: &str) -> PyResult<(String, String)> {
    let reference_only = given(meta, "reference_only")?.map(|v| v.is_truthy()).transpose()?;
    let remote: String = meta.get_item("buffer")?.get_item("mem_type")?.str()?.to_string();
    Ok(route::read_mem_types(reference_only.unwrap_or(false), local_mem, &remote))
}

/// `nixl_route::source_read` as `(kind, give_up, slot_bytes_min)`, `kind` one of `"direct"`,
/// `"whole"` (by the device plan), `"rows"` (by the program's rows) or `"chunked"`.
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

/// `nixl_route::pull_reads`: `([(rank, reads its staged copy, staged reads left)], [ranks read
/// directly])`.
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

/// `(local_rows, remote_rows, local_mem, remote_mem, label)` of the reference design's slice
/// read (`nixl_route::slice_reads`); `local` is `(base_addr, outer_stride_bytes,
/// bytes_per_slice, device_id, heads_per_partition, head_dim, element_size,
/// tokens_per_block, buffer_info)`.
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

/// `nixl_route::ipc_bounds_hold`: whether a CUDA IPC route's kernels stay inside both buffers.
#[pyfunction]
pub fn ipc_bounds_hold(plans: Vec<(u64, u64, u64, u64)>, dst_bytes: u64) -> bool {
    route::ipc_bounds_hold(&plans, dst_bytes)
}

/// Raise `GeometryMismatchError` naming the first slice-geometry field a peer states otherwise.
#[pyfunction]
pub fn check_matched_slices(
    peer_name: &str,
    peer: Vec<(String, Option<i64>)>,
    mine: Vec<(String, Option<i64>)>,
) -> PyResult<()> {
    route::check_matched_slices(peer_name, &peer, &mine).py()
}

/// `nixl_route::NixlAgentPeers`: the rank's shared NIXL agent and its registered peers.
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
    /// The keyword arguments of `nixl_agent_config`; `TransferError` (field `nixl`) without nixl.
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
    /// `(NIXL id, [])` of a registered peer, else `(None, [name to forget first])` or `(None, [])`.
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
    /// The registered peers `current` (`{agent name: incarnation}`) no longer names as they are.
    fn stale(&self, current: BTreeMap<String, u64>) -> PyResult<Vec<String>> {
        Ok(lock(&self.inner)?.stale(&current))
    }
}
