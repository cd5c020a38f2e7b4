//! Bindings of `disagg_core::nixl_route`: the NIXL runtime checks, the decode's read of each
//! source, the reference design's slice reads and the rank's table of registered peers.

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::compile::route::RouteStep;
use disagg_core::nixl_route::{
    self as route, Admission, AgentPeers, DecodePool, HeadSpan, PlanFacts, Refusal, Registered,
    SliceSide, SourceRead, TransferMode, Unbuildable,
};
use disagg_core::wire::ticket::StagingTicket;
use numpy::{PyArray2, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::args::{convs, Raw};
use crate::backend_rules::ipc_same_host;
use crate::error::{to_pyerr, IntoPyResult};
use crate::packed_items::PyPackedRows;
use crate::pool::{core_fns, core_methods, lock, lock_with, outs, Out};
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

convs! {
    /// A backend's mode by name (`ArgumentError` naming `mode`).
    Mode: String => TransferMode = |_f, v| route::backend_mode(true, &v).out();
}

/// A staging ticket, parsed by the core.
#[derive(FromPyObject)]
pub struct Ticket(#[pyo3(from_py_with = ticket)] StagingTicket);

fn ticket(t: &Bound<'_, PyAny>) -> PyResult<StagingTicket> {
    StagingTicket::parse(&to_wire(t, "ticket")?, "ticket").py()
}

/// The `(local, remote)` NIXL memory types of a read.
type Mems = (String, String);

/// What the decode's read of a source needs of the source's metadata.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct PeerMem {
    #[pyo3(default)]
    reference_only: bool,
    buffer: Stated,
}

outs! {
    (SourceRead, Mems) => (&'static str, bool, u64, Mems) = |v| {
        let (kind, give_up, slot_bytes_min) = match v.0 {
            SourceRead::Direct { give_up } => ("direct", give_up, 0),
            SourceRead::Whole { by_plan: true } => ("whole", false, 0),
            SourceRead::Whole { by_plan: false } => ("rows", false, 0),
            SourceRead::Chunked { slot_bytes_min } => ("chunked", false, slot_bytes_min),
        };
        (kind, give_up, slot_bytes_min, v.1)
    };
    (Vec<RouteStep>, Vec<u32>) => (Vec<RouteStep>, Vec<u32>) = |v| v;
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
    /// `nixl_route::setup`: `(mode name, [(variable, value)] to set)`.
    #[pyo3(signature = (have_nixl, mode, on_gpu, tls, memtype_cache))]
    fn nixl_setup(have_nixl: Raw<bool>, mode: Raw<String>, on_gpu: Raw<bool>,
        tls: Raw<Option<String>>, memtype_cache: Raw<Option<String>>)
        -> (&'static str, Vec<(&'static str, &'static str)>)
        = route::setup(have_nixl, &mode, on_gpu, tls.as_deref(), memtype_cache.as_deref())
            .map(|(m, env)| (m.name(), env));
    /// `nixl_route::cuda_support_refusal` raised as `TransferError` (field `nixl`).
    #[pyo3(signature = (on_gpu, variant, torch_cuda, mem_types))]
    fn check_nixl_cuda_support(on_gpu: Raw<bool>, variant: Raw<Option<String>>,
        torch_cuda: Raw<Option<String>>, mem_types: Raw<Option<Names>>) -> ()
        = route::cuda_support_refusal(on_gpu, variant.as_deref(), torch_cuda.as_deref(),
            mem_types.as_ref().map(|m| m.0.as_slice())).map_or(Ok(()), Err);
    /// `nixl_route::source_stages`: `CapacityError` (field `staging_bytes`).
    fn nixl_source_stages(me: Raw<u32>, sources: Raw<Vec<u32>>, staging_bytes: Raw<u64>) -> bool
        = route::source_stages(me, &sources, staging_bytes);
    /// `nixl_route::source_plan` (`plan`: the device plan's table; `peer`: its metadata) as
    /// `(kind, give_up, slot_bytes_min, (local, remote) memory types)`, `kind` one of
    /// `"direct"`, `"whole"` (by the device plan), `"rows"` (by the program's rows) or
    /// `"chunked"`.
    #[pyo3(signature = (staged, ticket, plan, peer, *, largest_free, alignment, share, on_gpu,
        num_tokens, dst_blocks, local_mem))]
    fn nixl_source_read(staged: Raw<bool>, ticket: Raw<Option<Ticket>>,
        plan: Raw<Option<Bound<'_, PyPackedRows>>>, peer: Raw<PeerMem>, largest_free: Raw<u64>,
        alignment: Raw<u64>, share: Raw<u64>, on_gpu: Raw<bool>, num_tokens: Raw<Option<u64>>,
        dst_blocks: Raw<u64>, local_mem: Raw<String>) -> (&'static str, bool, u64, Mems)
        = route::source_plan(staged, ticket.map(|t| t.0).as_ref(),
            plan.map(|t| PlanFacts::of(&t.get().table)),
            &DecodePool { largest_free, alignment, share, on_gpu, num_tokens, dst_blocks },
            (peer.reference_only, &peer.buffer.mem_type), &local_mem);
    /// `nixl_route::pull_reads`: `([(rank, reads its staged copy, staged reads left)], [ranks
    /// read directly])`.
    fn nixl_pull_route(sources: Raw<Vec<(u32, String, u64)>>, known: Raw<Vec<u32>>,
        tickets: Raw<BTreeMap<u32, Ticket>>, staging_bytes: Raw<u64>) -> (Vec<RouteStep>, Vec<u32>)
        = route::pull_reads(&sources, &known,
            &tickets.into_iter().map(|(r, t)| (r, t.0)).collect::<Vec<_>>(), staging_bytes);
    /// `nixl_route::ipc_plans_hold` of `[(a plan's table, source blocks, source buffer bytes)]`.
    fn ipc_bounds_hold(plans: Raw<Vec<(Bound<'_, PyPackedRows>, u64, u64)>>, dst_blocks: Raw<u64>,
        dst_bytes: Raw<u64>) -> bool
        = route::ipc_plans_hold(&plans.iter().map(|(t, n, b)| (&t.get().table, *n, *b))
            .collect::<Vec<_>>(), dst_blocks, dst_bytes);
    /// Whether this rank (`on_gpu`: its buffer is GPU memory; `mine`: its CUDA IPC export)
    /// packs anything for the decode of IPC export `theirs` in `mode` (`nixl_route::source_packs`).
    fn nixl_source_packs(mode: Mode, on_gpu: Raw<bool>, mine: Raw<Option<Bound<'_, PyAny>>>,
        theirs: Raw<Option<Bound<'_, PyAny>>>) -> bool
        = route::source_packs(mode, on_gpu, ipc_same_host(mine, theirs)?);
    /// Raise `TransferError` when NIXL refused to post the read `label` (`post_refusal`).
    fn check_xfer_posted(state: Raw<Bound<'_, PyAny>>, label: Raw<String>) -> ()
        = route::post_refusal(state.extract::<String>().ok().as_deref(), &label)
            .map_or(Ok(()), |m| Err(TransferError::new_err(m)))?;
    /// `nixl_route::check_matched_slices`: `GeometryMismatchError` naming the field.
    fn check_matched_slices(peer_name: Raw<String>, peer: Raw<Vec<(String, Option<i64>)>>,
        mine: Raw<Vec<(String, Option<i64>)>>) -> ()
        = route::check_matched_slices(&peer_name, &peer, &mine);
}

/// The reference design's fields of one side of a slice read (a missing optional: `None`).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct SliceFields {
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
    buffer: Option<Stated>,
}

/// What a side's `buffer` states.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct Stated {
    mem_type: String,
}

impl SliceFields {
    /// This side from outer slice `outer_start` and head `head_start` on.
    fn side(&self, outer_start: u64, head_start: u64) -> SliceSide {
        let buffer = (self.base_addr, self.outer_stride_bytes, self.bytes_per_slice);
        let start = (outer_start, head_start);
        SliceSide::stated(buffer, start, self.heads_per_partition, self.device_id)
    }
}

/// `(local_rows, remote_rows, local_mem, remote_mem, label)` of the reference design's slice
/// read (`nixl_route::slice_read_rows`, its label); the head fragment's geometry is `local`'s.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn slice_reads<'py>(
    py: Python<'py>,
    peer: SliceFields,
    local: SliceFields,
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
        route::slice_read_mem_type(local.buffer.map(|b| b.mem_type)),
        route::slice_read_mem_type(peer.buffer.map(|b| b.mem_type)),
        route::slice_read_label(peer_id, outer.0, outer.2, (heads.0, heads.2), src_ids.len()),
    ))
}

/// `(name, NIXL id)` of each peer the table forgot, to remove from NIXL.
type Forgotten = Vec<(String, String)>;

outs! {
    Forgotten => Forgotten = |v| v;
    Admission => (Option<String>, Forgotten) = |a| match a {
        Admission::Known(id) => (Some(id), Vec::new()),
        Admission::Register { stale } => (None, stale),
    };
    BTreeMap<String, Registered> => BTreeMap<String, (u64, String, String)>
        = |t| t.into_iter().map(|(n, r)| (n, (r.incarnation, r.digest, r.id))).collect();
}

/// `nixl_route::AgentPeers`: the rank's shared NIXL agent and its registered peers.
#[pyclass(name = "NixlAgentPeers", module = "disagg_rs", frozen)]
pub struct PyNixlAgentPeers {
    inner: Mutex<AgentPeers>,
}

core_methods!(PyNixlAgentPeers, lock_with, inner,
ctors {
    #[new]
    fn new(agent_name: Raw<String>) = Mutex::new(AgentPeers::named(&agent_name));
}
calls {
    /// Registrations holding the agent.
    #[getter] fn refs() -> u64 = refs();
    /// One more registration holds the agent.
    fn retain() -> () = retain();
    /// Raise `TransferError` (field `agent`) once no registration holds the agent.
    fn check_open() -> () = check_open();
    /// `AgentPeers::release`: `[(name, NIXL id)]` of the peers forgotten.
    fn release() -> Forgotten = release();
    /// `(NIXL id, [])` of a registered peer, else `(None, [(name, NIXL id) forgotten])`.
    fn admit(name: Raw<String>, incarnation: Raw<u64>, digest: Raw<String>)
        -> (Option<String>, Forgotten) = admit(&name, incarnation, &digest);
    /// `{name: (incarnation, metadata digest, NIXL id)}` of the registered peers.
    fn peers() -> BTreeMap<String, (u64, String, String)> = peers().clone();
    /// `AgentPeers::forget_stale` of `current` (`{agent name: incarnation}`).
    fn forget_stale(current: Raw<BTreeMap<String, u64>>) -> Forgotten = forget_stale(&current);
}
methods {
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
});
