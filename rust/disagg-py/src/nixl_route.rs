//! Bindings of `disagg_core::nixl_route`: the NIXL runtime checks, the decode's read of each
//! source, the reference design's slice reads and the rank's table of registered peers.

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::compile::route::RouteStep;
use disagg_core::nixl_route::{
    self as route, Admission, AgentPeers, DecodePool, HeadSpan, PlanFacts, Refusal, SliceSide,
    SourceRead, Unbuildable,
};
use disagg_core::wire::ticket::StagingTicket;
use numpy::{PyArray2, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMapping};

use crate::args::Raw;
use crate::backend_rules::ipc_same_host;
use crate::error::{to_pyerr, IntoPyResult};
use crate::packed_items::PyPackedRows;
use crate::pool::{core_fns, core_methods, lock, lock_with, Out};
use crate::rows::to_numpy;
use crate::wire::to_wire;

pyo3::import_exception!(disagg_rs.exceptions, TransferError);

fn refused(r: Refusal) -> PyErr {
    TransferError::new_err((r.detail, r.field))
}

impl<T> Out for Result<T, Refusal> {
    type Py = T;
    fn out(self) -> PyResult<T> {
        self.map_err(refused)
    }
}

impl<T> Out for Result<T, Unbuildable> {
    type Py = T;
    fn out(self) -> PyResult<T> {
        self.map_err(|e| match e {
            Unbuildable::Runtime(r) => refused(r),
            Unbuildable::Argument(e) => to_pyerr(e),
        })
    }
}

/// Names of memory types (NIXL's, each read as `str()` gives it).
pub struct Names(Vec<String>);

impl<'a, 'py> FromPyObject<'a, 'py> for Names {
    type Error = PyErr;
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.try_iter()?.map(|t| Ok(t?.str()?.to_string())).collect::<PyResult<_>>().map(Self)
    }
}

fn ticket(t: &Bound<'_, PyAny>) -> PyResult<StagingTicket> {
    StagingTicket::parse(&to_wire(t, "ticket")?, "ticket").py()
}

core_fns! {
    /// `nixl_route::ucx_tls_allows_cuda`.
    #[pyo3(signature = (tls))]
    fn ucx_tls_allows_cuda(tls: Raw<Option<String>>) -> bool
        = route::ucx_tls_allows_cuda(tls.as_deref());
    /// `nixl_route::nixl_cuda_major_mismatch`.
    #[pyo3(signature = (variant, torch_cuda))]
    fn nixl_cuda_major_mismatch(variant: Raw<Option<String>>, torch_cuda: Raw<Option<String>>)
        -> Option<String>
        = route::nixl_cuda_major_mismatch(variant.as_deref(), torch_cuda.as_deref());
    /// `nixl_route::backend_supports_vram`.
    fn backend_supports_vram(mem_types: Raw<Names>) -> bool
        = route::backend_supports_vram(&mem_types.0);
    /// `nixl_route::ucx_env`: `[(variable, value)]` to set, `TransferError` (field `UCX_TLS`).
    #[pyo3(signature = (on_gpu, tls, memtype_cache))]
    fn nixl_ucx_env(on_gpu: Raw<bool>, tls: Raw<Option<String>>,
        memtype_cache: Raw<Option<String>>) -> Vec<(&'static str, &'static str)>
        = route::ucx_env(on_gpu, tls.as_deref(), memtype_cache.as_deref());
    /// `nixl_route::cuda_support_refusal` raised as `TransferError` (field `nixl`).
    #[pyo3(signature = (on_gpu, variant, torch_cuda, mem_types))]
    fn check_nixl_cuda_support(on_gpu: Raw<bool>, variant: Raw<Option<String>>,
        torch_cuda: Raw<Option<String>>, mem_types: Raw<Option<Names>>) -> ()
        = route::cuda_support_refusal(on_gpu, variant.as_deref(), torch_cuda.as_deref(),
            mem_types.as_ref().map(|m| m.0.as_slice())).map_or(Ok(()), Err);
    /// `nixl_route::backend_mode`'s name: `TransferError` (`nixl`), `ArgumentError` (`mode`).
    fn nixl_backend_mode(have_nixl: Raw<bool>, mode: Raw<String>) -> &'static str
        = route::backend_mode(have_nixl, &mode).map(route::TransferMode::name);
    /// `nixl_route::source_stages`: `CapacityError` (field `staging_bytes`).
    fn nixl_source_stages(me: Raw<u32>, sources: Raw<Vec<u32>>, staging_bytes: Raw<u64>) -> bool
        = route::source_stages(me, &sources, staging_bytes);
    /// `nixl_route::check_matched_slices`: `GeometryMismatchError` naming the field.
    fn check_matched_slices(peer_name: Raw<String>, peer: Raw<Vec<(String, Option<i64>)>>,
        mine: Raw<Vec<(String, Option<i64>)>>) -> ()
        = route::check_matched_slices(&peer_name, &peer, &mine);
}

/// Raise `TransferError` when NIXL refused to post the read `label` (`nixl_route::post_refusal`).
#[pyfunction]
pub fn check_xfer_posted(state: &Bound<'_, PyAny>, label: &str) -> PyResult<()> {
    let state: Option<String> = state.extract().ok();
    route::post_refusal(state.as_deref(), label).map_or(Ok(()), |m| Err(TransferError::new_err(m)))
}

/// `nixl_route::read_mem_types`: `(local, remote)` NIXL memory types of a read from `meta`.
#[pyfunction]
pub fn nixl_read_mem_types(meta: &Bound<'_, PyAny>, local_mem: &str) -> PyResult<(String, String)> {
    let reference_only = meta.get_item("reference_only").map_or(Ok(false), |v| v.is_truthy())?;
    let remote = meta.get_item("buffer")?.get_item("mem_type")?.str()?.to_string();
    Ok(route::read_mem_types(reference_only, local_mem, &remote))
}

/// `nixl_route::source_read` (`plan`: the device plan's table) as `(kind, give_up,
/// slot_bytes_min)`, `kind` one of `"direct"`, `"whole"` (by the device plan), `"rows"` (by
/// the program's rows) or `"chunked"`.
#[pyfunction]
#[pyo3(signature = (staged, ticket, plan, *, largest_free, alignment, share, on_gpu,
    num_tokens, dst_blocks))]
pub fn nixl_source_read(
    staged: bool,
    ticket: Option<&Bound<'_, PyAny>>,
    plan: Option<Bound<'_, PyPackedRows>>,
    largest_free: u64,
    alignment: u64,
    share: u64,
    on_gpu: bool,
    num_tokens: Option<u64>,
    dst_blocks: u64,
) -> PyResult<(&'static str, bool, u64)> {
    let ticket = ticket.map(self::ticket).transpose()?;
    let plan = plan.map(|t| PlanFacts::of(&t.get().table));
    let pool = DecodePool { largest_free, alignment, share, on_gpu, num_tokens, dst_blocks };
    Ok(match route::source_read(staged, ticket.as_ref(), plan, &pool) {
        SourceRead::Direct { give_up } => ("direct", give_up, 0),
        SourceRead::Whole { by_plan: true } => ("whole", false, 0),
        SourceRead::Whole { by_plan: false } => ("rows", false, 0),
        SourceRead::Chunked { slot_bytes_min } => ("chunked", false, slot_bytes_min),
    })
}

/// Whether this rank (`on_gpu`: its buffer is GPU memory; `mine`: its CUDA IPC export) packs
/// anything for the decode of IPC export `theirs` in `mode` (`nixl_route::source_packs`).
#[pyfunction]
pub fn nixl_source_packs(
    mode: &str,
    on_gpu: bool,
    mine: Option<Bound<'_, PyAny>>,
    theirs: Option<Bound<'_, PyAny>>,
) -> PyResult<bool> {
    let mode = route::backend_mode(true, mode).out()?;
    Ok(route::source_packs(mode, on_gpu, ipc_same_host(mine, theirs)?))
}

/// `nixl_route::pull_reads`: `([(rank, reads its staged copy, staged reads left)], [ranks read
/// directly])`.
#[pyfunction]
pub fn nixl_pull_route(
    sources: Vec<(u32, String, u64)>,
    known: Vec<u32>,
    tickets: BTreeMap<u32, Bound<'_, PyAny>>,
    staging_bytes: u64,
) -> PyResult<(Vec<RouteStep>, Vec<u32>)> {
    let tickets: Vec<_> =
        tickets.iter().map(|(r, t)| Ok((*r, ticket(t)?))).collect::<PyResult<_>>()?;
    route::pull_reads(&sources, &known, &tickets, staging_bytes).py()
}

/// `nixl_route::ipc_plans_hold` of `[(a plan's table, source blocks, source buffer bytes)]`.
#[pyfunction]
pub fn ipc_bounds_hold(
    plans: Vec<(Bound<'_, PyPackedRows>, u64, u64)>,
    dst_blocks: u64,
    dst_bytes: u64,
) -> PyResult<bool> {
    let plans: Vec<_> =
        plans.iter().map(|(t, blocks, bytes)| (&t.get().table, *blocks, *bytes)).collect();
    route::ipc_plans_hold(&plans, dst_blocks, dst_bytes).py()
}

/// The reference design's fields of one side of a slice read (a missing optional: `None`).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct SliceFields<'py> {
    base_addr: u64,
    outer_stride_bytes: u64,
    bytes_per_slice: u64,
    #[pyo3(default)]
    device_id: Option<u64>,
    #[pyo3(default)]
    heads_per_partition: Option<u64>,
    #[pyo3(default)]
    head_dim: Option<u64>,
    #[pyo3(default)]
    element_size: Option<u64>,
    #[pyo3(default)]
    tokens_per_block: Option<u64>,
    #[pyo3(default)]
    buffer: Option<Bound<'py, PyAny>>,
}

impl SliceFields<'_> {
    /// This side from outer slice `outer_start` and head `head_start` on.
    fn side(&self, outer_start: u64, head_start: u64) -> SliceSide {
        let buffer = (self.base_addr, self.outer_stride_bytes, self.bytes_per_slice);
        let start = (outer_start, head_start);
        SliceSide::stated(buffer, start, self.heads_per_partition, self.device_id)
    }

    /// `nixl_route::slice_read_mem_type` of the `mem_type` its `buffer` states, if a mapping.
    fn mem_type(&self) -> PyResult<String> {
        let stated = match self.buffer.as_ref().and_then(|b| b.cast::<PyMapping>().ok()) {
            Some(b) => Some(b.get_item("mem_type")?.extract()?),
            None => None,
        };
        Ok(route::slice_read_mem_type(stated))
    }
}

/// `(local_rows, remote_rows, local_mem, remote_mem, label)` of the reference design's slice
/// read (`nixl_route::slice_read_rows`, its label); the head fragment's geometry is `local`'s.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn slice_reads<'py>(
    py: Python<'py>,
    peer: SliceFields<'py>,
    local: SliceFields<'py>,
    src_block_ids: PyReadonlyArray1<'py, u64>,
    dst_block_ids: PyReadonlyArray1<'py, u64>,
    outer: (u64, u64, u64),
    heads: (u64, u64, u64),
    peer_id: &str,
) -> PyResult<(Bound<'py, PyArray2<u64>>, Bound<'py, PyArray2<u64>>, String, String, String)> {
    let span =
        HeadSpan::stated(heads.2, local.head_dim, local.element_size, local.tokens_per_block);
    let (src, dst) = (peer.side(outer.0, heads.0), local.side(outer.1, heads.1));
    let (src_ids, dst_ids) = (src_block_ids.as_slice()?, dst_block_ids.as_slice()?);
    let (l, r) = route::slice_read_rows(&src, &dst, src_ids, dst_ids, outer.2, &span).py()?;
    let (nl, nr) = (l.len(), r.len());
    Ok((
        to_numpy(py, l.into_flattened(), nl)?,
        to_numpy(py, r.into_flattened(), nr)?,
        local.mem_type()?,
        peer.mem_type()?,
        route::slice_read_label(peer_id, outer.0, outer.2, (heads.0, heads.2), src_ids.len()),
    ))
}

/// `(name, NIXL id)` of each peer the table forgot, to remove from NIXL.
type Forgotten = Vec<(String, String)>;

/// `nixl_route::AgentPeers`: the rank's shared NIXL agent and its registered peers.
#[pyclass(name = "NixlAgentPeers", module = "disagg_rs", frozen)]
pub struct PyNixlAgentPeers {
    inner: Mutex<AgentPeers>,
}

core_methods!(PyNixlAgentPeers, lock_with, inner,
calls {
    /// Registrations holding the agent.
    #[getter] fn refs() -> u64 = refs();
    /// One more registration holds the agent.
    fn retain() -> () = retain();
    /// Raise `TransferError` (field `agent`) once no registration holds the agent.
    fn check_open() -> () = check_open();
}
methods {
    #[new]
    fn new(agent_name: &str) -> Self {
        Self { inner: Mutex::new(AgentPeers::named(agent_name)) }
    }
    /// The keyword arguments of `nixl_agent_config`; `TransferError` (field `nixl`) without nixl.
    #[staticmethod]
    fn agent_options(py: Python<'_>, have_nixl: bool, backends: Vec<String>)
        -> PyResult<Bound<'_, PyDict>> {
        let options = PyDict::new(py);
        options.set_item("enable_prog_thread", true)?;
        if let Some(b) = route::agent_backends(have_nixl, &backends).out()? {
            options.set_item("backends", b.to_vec())?;
        }
        Ok(options)
    }
    /// `AgentPeers::release`: `[(name, NIXL id)]` of the peers forgotten.
    fn release(&self) -> PyResult<Forgotten> {
        Ok(lock(&self.inner)?.release())
    }
    /// `(NIXL id, [])` of a registered peer, else `(None, [(name, NIXL id) forgotten])`.
    fn admit(&self, name: &str, incarnation: u64, digest: &str)
        -> PyResult<(Option<String>, Forgotten)> {
        Ok(match lock(&self.inner)?.admit(name, incarnation, digest) {
            Admission::Known(id) => (Some(id), Vec::new()),
            Admission::Register { stale } => (None, stale),
        })
    }
    /// Record a peer as NIXL's registration went: `added` and `loaded` as `(True, what
    /// add_remote_agent returned: bytes or text, its name when empty)` or `(False, why it
    /// failed)`; its NIXL id. `TransferError` (field `agent_metadata`) when it failed.
    fn register(&self, name: &str, incarnation: u64, digest: &str, added: bool,
        loaded: &Bound<'_, PyAny>) -> PyResult<String> {
        let text = if let Ok(b) = loaded.cast::<PyBytes>() {
            Some(String::from_utf8_lossy(b.as_bytes()).into_owned())
        } else if loaded.is_none() {
            None
        } else {
            Some(loaded.str()?.to_string())
        };
        lock(&self.inner)?.register(name, (incarnation, digest), added, text).out()
    }
    /// `{name: (incarnation, metadata digest, NIXL id)}` of the registered peers.
    fn peers(&self) -> PyResult<BTreeMap<String, (u64, String, String)>> {
        let t = lock(&self.inner)?;
        Ok(t.peers()
            .iter()
            .map(|(n, r)| (n.clone(), (r.incarnation, r.digest.clone(), r.id.clone())))
            .collect())
    }
    /// `AgentPeers::forget_stale` of `current` (`{agent name: incarnation}`).
    fn forget_stale(&self, current: BTreeMap<String, u64>) -> PyResult<Forgotten> {
        Ok(lock(&self.inner)?.forget_stale(&current))
    }
});
