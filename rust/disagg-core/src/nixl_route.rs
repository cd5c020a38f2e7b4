//! The decisions of the NIXL transport that are not part of a compiled program: whether the
//! runtime can move CUDA memory, how the decode reads each source's packed copy, the reference
//! design's slice reads as descriptor rows, and the rank's table of registered peers.
//!
//! Nothing here calls NIXL: the Python driver posts what these functions return. Ranges are
//! half-open `[lo, hi)`.

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
use crate::packed_items::{PlaneTable, SideKind};
use crate::staging::slot_plan;
use crate::wire::ticket::StagingTicket;

/// Why the NIXL runtime cannot be used as configured: the setting at fault and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The setting at fault (`UCX_TLS`, `nixl`).
    pub field: &'static str,
    /// What was found and how to fix it.
    pub detail: String,
}

/// The UCX transports that move CUDA memory.
const UCX_CUDA_TLS: [&str; 3] = ["cuda_copy", "cuda_ipc", "gdr_copy"];

/// Whether a `UCX_TLS` value leaves UCX a transport that moves CUDA memory.
///
/// Unset or empty: UCX picks (yes). An inclusion list needs `all`, `cuda` or one of
/// `cuda_copy`/`cuda_ipc`/`gdr_copy` (`rc` alone moves host memory only). A `^` exclusion
/// list fails when it removes `cuda` or all three CUDA transports.
#[must_use]
pub fn ucx_tls_allows_cuda(tls: Option<&str>) -> bool {
    let Some(tls) = tls.filter(|t| !t.is_empty()) else { return true };
    let names: Vec<String> = tls
        .trim_start_matches('^')
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.to_lowercase().trim_start_matches('\\').to_owned())
        .collect();
    let has = |n: &str| names.iter().any(|x| x == n);
    if tls.starts_with('^') {
        !has("cuda") && !UCX_CUDA_TLS.iter().all(|t| has(t))
    } else {
        has("all") || has("cuda") || UCX_CUDA_TLS.iter().any(|t| has(t))
    }
}

/// The refusal of a `UCX_TLS` value that leaves no CUDA transport for GPU buffers.
#[must_use]
pub fn ucx_tls_refusal(tls: Option<&str>) -> Option<Refusal> {
    (!ucx_tls_allows_cuda(tls)).then(|| Refusal {
        field: "UCX_TLS",
        detail: format!(
            "UCX_TLS='{}' does not enable a CUDA transport for NIXL GPU buffers; unset it to let \
             UCX choose, or include cuda_copy or cuda_ipc",
            tls.unwrap_or_default()
        ),
    })
}

/// UCX settings to make, as `(variable, value)` pairs.
pub type UcxEnv = Vec<(&'static str, &'static str)>;

/// The UCX settings a rank's buffer needs, as `(variable, value)` pairs to set: for GPU
/// memory (`on_gpu`), UCX's memory-type cache turned off unless `memtype_cache` (its value
/// now) is set (it misclassifies CUDA allocations that torch's caching allocator reuses);
/// none for host memory, which may use any transports.
///
/// # Errors
/// The refusal of a `UCX_TLS` value (`tls`) that leaves a GPU buffer no CUDA transport
/// (checked before any setting is made).
pub fn ucx_env(
    on_gpu: bool,
    tls: Option<&str>,
    memtype_cache: Option<&str>,
) -> Result<UcxEnv, Refusal> {
    if !on_gpu {
        return Ok(Vec::new());
    }
    if let Some(refused) = ucx_tls_refusal(tls) {
        return Err(refused);
    }
    Ok(memtype_cache.is_none().then_some(("UCX_MEMTYPE_CACHE", "n")).into_iter().collect())
}

/// Explain a NIXL build (`nixl_cu12` or `nixl-cu12`) whose CUDA major differs from torch's
/// (`torch_cuda`, e.g. `"13.0"`), or `None` when they agree or either is unknown.
#[must_use]
pub fn nixl_cuda_major_mismatch(variant: Option<&str>, torch_cuda: Option<&str>) -> Option<String> {
    let (variant, torch_cuda) = (variant?, torch_cuda.filter(|t| !t.is_empty())?);
    let name = variant.replace('-', "_");
    let major = torch_cuda.split('.').next().unwrap_or_default();
    (name.starts_with("nixl_cu") && name != format!("nixl_cu{major}")).then(|| {
        format!(
            "PyTorch uses CUDA {torch_cuda}, but NIXL selected {variant}. Install the matching \
             build with `pip install nixl-cu{major}`: a mismatched NIXL backend can make UCX \
             classify GPU buffers as host memory"
        )
    })
}

/// Whether a NIXL backend's memory types include GPU memory. NIXL 1.5 names them
/// `"VRAM_SEG"` (older builds `"VRAM"`; some report `"cuda"`).
#[must_use]
pub fn backend_supports_vram(mem_types: &[String]) -> bool {
    mem_types.iter().map(|t| t.to_lowercase()).any(|t| t.contains("vram") || t.contains("cuda"))
}

/// The refusal of a NIXL runtime that cannot safely register CUDA memory: a build for another
/// CUDA major than torch's, or a UCX backend that reports no GPU memory type (`mem_types`,
/// `None` when the NIXL build cannot say: registration will tell). Host buffers (`on_gpu`
/// false) are not checked.
#[must_use]
pub fn cuda_support_refusal(
    on_gpu: bool,
    variant: Option<&str>,
    torch_cuda: Option<&str>,
    mem_types: Option<&[String]>,
) -> Option<Refusal> {
    if !on_gpu {
        return None;
    }
    if let Some(detail) = nixl_cuda_major_mismatch(variant, torch_cuda) {
        return Some(Refusal { field: "nixl", detail });
    }
    let mem_types = mem_types.filter(|m| !backend_supports_vram(m))?;
    let listed: Vec<String> = mem_types.iter().map(|t| format!("'{t}'")).collect();
    Some(Refusal {
        field: "nixl",
        detail: format!(
            "The NIXL UCX backend does not report CUDA/VRAM memory support (reported memory \
             types: [{}]); install the NIXL build for this CUDA major or rebuild UCX --with-cuda",
            listed.join(", ")
        ),
    })
}

/// How a NIXL backend reads its sources (the constructor's `mode`, passed to the compiler).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferMode {
    /// The compiler's cost model picks, per source, its blocks or its packed copy.
    Auto,
    /// Every source's blocks, directly (nothing is packed).
    Direct,
    /// Every source's packed copy.
    Staged,
}

impl TransferMode {
    /// The mode's name, as the compiler takes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Direct => "direct",
            Self::Staged => "staged",
        }
    }
}

/// Why a NIXL backend cannot be built as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unbuildable {
    /// The runtime cannot serve it (no nixl package).
    Runtime(Refusal),
    /// An argument is out of range.
    Argument(DisaggError),
}

/// The checked settings of a NIXL backend, decided before anything is registered: the nixl
/// package must be installed (`have_nixl`) and `mode` one of `"auto"`, `"direct"`, `"staged"`.
///
/// # Errors
/// `Runtime` (field `nixl`) without the nixl package; `Argument` (field `mode`) naming the
/// mode given.
pub fn backend_mode(have_nixl: bool, mode: &str) -> Result<TransferMode, Unbuildable> {
    if !have_nixl {
        return Err(Unbuildable::Runtime(Refusal {
            field: "nixl",
            detail: "NixlTransferBackend needs the nixl Python package: install the NIXL runtime \
                     (pip install nixl) before starting disaggregated workers"
                .to_owned(),
        }));
    }
    [TransferMode::Auto, TransferMode::Direct, TransferMode::Staged]
        .into_iter()
        .find(|m| m.name() == mode)
        .ok_or_else(|| {
            Unbuildable::Argument(DisaggError::Argument {
                field: "mode".to_owned(),
                detail: format!("mode must be 'auto', 'direct' or 'staged', got '{mode}'"),
            })
        })
}

/// A NIXL backend's checked mode and the UCX settings its buffer needs, decided before its
/// agent exists: [`backend_mode`] of `have_nixl` and `mode`, then [`ucx_env`] of `on_gpu`,
/// `tls` and `memtype_cache`.
///
/// # Errors
/// Those of [`backend_mode`], then the refusal of [`ucx_env`] (as `Runtime`).
pub fn setup(
    have_nixl: bool,
    mode: &str,
    on_gpu: bool,
    tls: Option<&str>,
    memtype_cache: Option<&str>,
) -> Result<(TransferMode, UcxEnv), Unbuildable> {
    let mode = backend_mode(have_nixl, mode)?;
    let env = ucx_env(on_gpu, tls, memtype_cache).map_err(Unbuildable::Runtime)?;
    Ok((mode, env))
}

/// The refusal of a NIXL post: `state` is what NIXL's `transfer()` returned for the read
/// `label` (`"ERR"`: NIXL did not take it; `None`: not a state name, taken as posted).
#[must_use]
pub fn post_refusal(state: Option<&str>, label: &str) -> Option<String> {
    (state == Some("ERR")).then(|| format!("NIXL refused to post {label}"))
}

/// The NIXL memory types `(local, remote)` of a read from a peer whose buffer states
/// `remote`: a peer that exported the reference design's fields only (`reference_only`) is
/// read the reference's way, which registers GPU memory only and names the local list `VRAM`.
#[must_use]
pub fn read_mem_types(reference_only: bool, local: &str, remote: &str) -> (String, String) {
    let local = if reference_only { "VRAM" } else { local };
    (local.to_owned(), remote.to_owned())
}

/// Whether a source packs anything for a decode (`stage_blocks`): nothing in mode
/// `direct`, nor for a decode that reads this rank's GPU buffer (`on_gpu`) through CUDA IPC
/// (`same_host`: both on one host).
#[must_use]
pub fn source_packs(mode: TransferMode, on_gpu: bool, same_host: bool) -> bool {
    mode != TransferMode::Direct && !(on_gpu && same_host)
}

/// Whether rank `me` packs its copy for a staged pull whose program reads the source ranks
/// `sources`: it does when it is one of them.
///
/// # Errors
/// `Capacity` (`staging_bytes`) when it is one of them but has no staging pool
/// (`staging_bytes` 0).
pub fn source_stages(me: u32, sources: &[u32], staging_bytes: u64) -> DisaggResult<bool> {
    let packs = sources.contains(&me);
    if packs && staging_bytes == 0 {
        return Err(DisaggError::Capacity {
            resource: "staging_bytes".into(),
            detail: format!("staged pull needs staging_bytes > 0 on source rank {me}"),
        });
    }
    Ok(packs)
}

/// A source's device plan as the decode's staged read needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanFacts {
    /// Tokens per block of the plan.
    pub tokens_per_block: u64,
    /// Packed bytes per token of the plan.
    pub bytes_per_token: u64,
    /// Bytes of the plan's largest item (the smallest piece a chunk holds).
    pub item_bytes: u64,
}

impl PlanFacts {
    /// The facts of a device plan's table: its block size, the sum of its row bytes per
    /// token, and its largest row's bytes over a block.
    #[must_use]
    pub fn of(table: &PlaneTable) -> Self {
        let rows = table.rows().iter().map(|r| r.1);
        let tokens_per_block = table.tokens_per_block();
        Self {
            tokens_per_block,
            bytes_per_token: rows.clone().fold(0, u64::saturating_add),
            item_bytes: rows.max().unwrap_or(0).saturating_mul(tokens_per_block),
        }
    }
}

/// How the decode reads one source of a pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceRead {
    /// The source's blocks, directly (an empty packed copy: the blocks, of which there are
    /// none to read); `give_up`: tell its stream and drop what it announced
    /// (it sent a ticket that is not read).
    Direct {
        /// Whether the source sent a ticket that is not read.
        give_up: bool,
    },
    /// The packed copy held whole, in one read into one range of its size, scattered by the
    /// device plan (`by_plan`, one kernel) or by the program's rows.
    Whole {
        /// Whether the device plan scatters it.
        by_plan: bool,
    },
    /// The packed copy (held whole or streamed) in chunks through two or three slots of the
    /// decode's pool, each of at least `slot_bytes_min` bytes.
    Chunked {
        /// The least bytes a slot needs (one item, and a whole chunk of a stream).
        slot_bytes_min: u64,
    },
}

/// Slots of the decode's pool one chunked read cycles through.
pub const CHUNK_SLOTS: u64 = 3;

/// The decode's pool and pull as one source's staged read sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePool {
    /// The pool's largest free range now.
    pub largest_free: u64,
    /// The pool's alignment.
    pub alignment: u64,
    /// Staged reads still to post, this one included (each takes its share of the pool).
    pub share: u64,
    /// Whether the pool is GPU memory.
    pub on_gpu: bool,
    /// Tokens of the handoff, when given.
    pub num_tokens: Option<u64>,
    /// Destination block ids of the handoff.
    pub dst_blocks: u64,
}

/// How the decode reads one source: `staged` is the route's choice (`pull_route`), `ticket`
/// the source's staging ticket, `plan` its device plan. A copy that fits the pool now is read
/// whole (by its plan when the plan covers the handoff's blocks on a GPU pool); a stream, or
/// a copy the pool cannot take now, is read in chunks when the plan covers it and two slots
/// fit, else the blocks are read directly (always possible).
#[must_use]
pub fn source_read(
    staged: bool,
    ticket: Option<&StagingTicket>,
    plan: Option<PlanFacts>,
    pool: &DecodePool,
) -> SourceRead {
    let Some(t) = ticket.filter(|_| staged) else {
        return SourceRead::Direct { give_up: ticket.is_some() };
    };
    if t.nbytes == 0 {
        return SourceRead::Direct { give_up: false };
    }
    let covers = |p: &PlanFacts| {
        pool.num_tokens.is_some_and(|n| n.div_ceil(p.tokens_per_block.max(1)) == pool.dst_blocks)
    };
    let plan = plan.filter(covers);
    if t.nbytes <= pool.largest_free && t.stream.is_none() {
        return SourceRead::Whole { by_plan: pool.on_gpu && plan.is_some() };
    }
    let packed = |p: &PlanFacts| pool.num_tokens.and_then(|n| p.bytes_per_token.checked_mul(n));
    let need = plan.filter(|p| packed(p) == Some(t.nbytes)).map(|p| match &t.stream {
        Some(st) if st.chunk_bytes < p.item_bytes => u64::MAX,
        Some(st) => st.chunk_bytes,
        None => p.item_bytes,
    });
    match need.filter(|&n| {
        slot_plan(pool.largest_free, pool.alignment, n, pool.share, CHUNK_SLOTS).is_some()
    }) {
        Some(slot_bytes_min) => SourceRead::Chunked { slot_bytes_min },
        None => SourceRead::Direct { give_up: true },
    }
}

/// How the decode reads one source ([`source_read`]) and the NIXL memory types `(local,
/// remote)` of its reads ([`read_mem_types`] of `peer`: whether it exported the reference
/// design's fields only, and its buffer's memory type; `local`: this rank's).
#[must_use]
pub fn source_plan(
    staged: bool,
    ticket: Option<&StagingTicket>,
    plan: Option<PlanFacts>,
    pool: &DecodePool,
    (reference_only, remote): (bool, &str),
    local: &str,
) -> (SourceRead, (String, String)) {
    (source_read(staged, ticket, plan, pool), read_mem_types(reference_only, local, remote))
}

/// The reads of a pull as [`crate::compile::route::pull_route`] decides them, from what the
/// NIXL driver holds: each source's `(rank, compiled mode, packed bytes)` (mode `"staged"`:
/// the compiler prefers its packed copy), the staging tickets received by rank and the size
/// of this rank's staging pool (0: none). Returns the route and the ranks read directly from
/// the start (their descriptors are checked before anything is posted).
///
/// # Errors
/// As `pull_route`.
pub fn pull_reads(
    sources: &[(u32, String, u64)],
    known: &[u32],
    tickets: &[(u32, StagingTicket)],
    staging_bytes: u64,
) -> DisaggResult<(Vec<crate::compile::route::RouteStep>, Vec<u32>)> {
    let sources: Vec<_> = sources.iter().map(|(r, mode, b)| (*r, mode == "staged", *b)).collect();
    let tickets: Vec<_> = tickets.iter().map(|(r, t)| (*r, t.staged, t.nbytes)).collect();
    let route = crate::compile::route::pull_route(&sources, known, &tickets, staging_bytes > 0)?;
    let direct = route.iter().filter(|r| !r.1).map(|r| r.0).collect();
    Ok((route, direct))
}

/// One side of a reference slice read: where its buffer's slices lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceSide {
    /// Address of the buffer.
    pub base: u64,
    /// Bytes between outer slices.
    pub outer_stride: u64,
    /// Bytes of one block's slice.
    pub bytes_per_slice: u64,
    /// First outer slice read or written.
    pub outer_start: u64,
    /// First head of a head fragment.
    pub head_start: u64,
    /// Heads per token row of this side (head fragments only).
    pub heads_per_partition: u64,
    /// Device id of the buffer.
    pub device: u64,
}

/// The geometry a head fragment needs: `heads` heads of `head_bytes` each of every token of
/// `tokens_per_block` (`heads == 0`: whole slices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeadSpan {
    /// Heads per fragment (0: whole slices).
    pub heads: u64,
    /// Bytes of one head's row.
    pub head_bytes: u64,
    /// Tokens per block.
    pub tokens_per_block: u64,
}

impl SliceSide {
    /// This side from outer slice `start.0` and head `start.1` on, as the reference design
    /// states it: a side stating no heads per partition or no device has 0 of them.
    #[must_use]
    pub fn stated(
        (base, outer_stride, bytes_per_slice): (u64, u64, u64),
        (outer_start, head_start): (u64, u64),
        heads_per_partition: Option<u64>,
        device: Option<u64>,
    ) -> Self {
        let (heads_per_partition, device) = (heads_per_partition.unwrap_or(0), device.unwrap_or(0));
        Self {
            base,
            outer_stride,
            bytes_per_slice,
            outer_start,
            head_start,
            heads_per_partition,
            device,
        }
    }
}

impl HeadSpan {
    /// Fragments of `heads` heads of a side stating `head_dim`, `element_size` and
    /// `tokens_per_block` (each 0 where unstated): a head's row is `head_dim * element_size`.
    #[must_use]
    pub fn stated(
        heads: u64,
        head_dim: Option<u64>,
        element_size: Option<u64>,
        tokens_per_block: Option<u64>,
    ) -> Self {
        let head_bytes = head_dim.unwrap_or(0).saturating_mul(element_size.unwrap_or(0));
        Self { heads, head_bytes, tokens_per_block: tokens_per_block.unwrap_or(0) }
    }
}

/// `(addr, len, device)` descriptor rows.
pub type DescRows = Vec<[u64; 3]>;

/// The reference design's read of `outer` slices of each block pair `(src_ids[i],
/// dst_ids[i])` from `src` into `dst`, whole slices or a head fragment (`heads`): the local
/// (destination) and remote (source) rows, block-major then outer slice then token.
///
/// # Errors
/// `Block` (field `dst_block_ids`) when the two id lists differ in length; `Wire` (field
/// `heads_per_partition`) for a head fragment of a peer (`src`) stating no heads per
/// partition; `AddressOverflow` when an address leaves `u64`.
pub fn slice_read_rows(
    src: &SliceSide,
    dst: &SliceSide,
    src_ids: &[u64],
    dst_ids: &[u64],
    outer: u64,
    heads: &HeadSpan,
) -> DisaggResult<(DescRows, DescRows)> {
    if src_ids.len() != dst_ids.len() {
        return Err(DisaggError::block(
            "dst_block_ids",
            format!("{} source blocks but {} destination blocks", src_ids.len(), dst_ids.len()),
        ));
    }
    if heads.heads > 0 && src.heads_per_partition == 0 {
        return Err(DisaggError::wire(
            "heads_per_partition",
            "a head fragment needs the peer's heads_per_partition".to_owned(),
        ));
    }
    let tokens = if heads.heads == 0 { 1 } else { heads.tokens_per_block };
    let rows = |side: &SliceSide, ids: &[u64]| -> DisaggResult<DescRows> {
        let overflow = || DisaggError::overflow("reference slice read address exceeds u64");
        let (len, token_bytes) = if heads.heads == 0 {
            (side.bytes_per_slice, 0)
        } else {
            let len = heads.heads.checked_mul(heads.head_bytes).ok_or_else(overflow)?;
            (len, side.heads_per_partition.checked_mul(heads.head_bytes).ok_or_else(overflow)?)
        };
        let mut out = Vec::with_capacity(ids.len() * (outer * tokens) as usize);
        for &id in ids {
            for o in 0..outer {
                let slice = side
                    .outer_start
                    .checked_add(o)
                    .and_then(|o| o.checked_mul(side.outer_stride))
                    .and_then(|a| a.checked_add(id.checked_mul(side.bytes_per_slice)?))
                    .and_then(|a| a.checked_add(side.base))
                    .ok_or_else(overflow)?;
                let first = side
                    .head_start
                    .checked_mul(heads.head_bytes)
                    .and_then(|h| h.checked_add(slice))
                    .filter(|_| heads.heads > 0)
                    .unwrap_or(slice);
                for t in 0..tokens {
                    let at = t.checked_mul(token_bytes).and_then(|b| b.checked_add(first));
                    out.push([at.ok_or_else(overflow)?, len, side.device]);
                }
            }
        }
        Ok(out)
    };
    Ok((rows(dst, dst_ids)?, rows(src, src_ids)?))
}

/// The label of a reference slice read (logs and errors): the peer, the outer slices, the
/// heads of a head fragment and the block pairs.
#[must_use]
pub fn slice_read_label(
    peer: &str,
    outer_start: u64,
    outer: u64,
    heads: (u64, u64),
    blocks: usize,
) -> String {
    match heads {
        (_, 0) => format!("matched peer={peer} outer[{outer_start}:+{outer}] blocks={blocks}"),
        (h0, n) => format!(
            "reshard peer={peer} outer[{outer_start}:+{outer}] heads[{h0}:+{n}] blocks={blocks}"
        ),
    }
}

/// The NIXL memory type of a side of a reference slice read: its buffer's, or `VRAM` for a
/// side that states none (the reference design registers GPU memory only).
#[must_use]
pub fn slice_read_mem_type(stated: Option<String>) -> String {
    stated.unwrap_or_else(|| "VRAM".to_owned())
}

/// The backends a rank's NIXL agent is configured with, `None` for the default (`UCX` alone,
/// which every NIXL build's configuration takes without naming it).
///
/// # Errors
/// The refusal (field `nixl`) of an agent without the nixl package (`have_nixl` false).
pub fn agent_backends(have_nixl: bool, backends: &[String]) -> Result<Option<&[String]>, Refusal> {
    if !have_nixl {
        return Err(Refusal {
            field: "nixl",
            detail: "NixlTransferBackend needs the nixl Python package (pip install nixl)".into(),
        });
    }
    Ok((backends != ["UCX"]).then_some(backends))
}

/// [`ipc_bounds_hold`] of the device plans of a CUDA IPC route: each source rank's table
/// with its buffer's blocks and bytes, and the destination buffer's blocks and bytes.
///
/// # Errors
/// Those of [`PlaneTable::paged_end`].
pub fn ipc_plans_hold(
    plans: &[(&PlaneTable, u64, u64)],
    dst_blocks: u64,
    dst_bytes: u64,
) -> DisaggResult<bool> {
    let ends = plans
        .iter()
        .map(|&(t, src_blocks, src_bytes)| {
            // An end below the buffer's base (negative) lies outside it: it never holds.
            let end = |kind, n| t.paged_end(kind, n).map(|e| u64::try_from(e).unwrap_or(u64::MAX));
            let src_end = end(SideKind::Src, src_blocks)?;
            Ok((t.tokens_per_block(), src_end, src_bytes, end(SideKind::Dst, dst_blocks)?))
        })
        .collect::<DisaggResult<Vec<_>>>()?;
    Ok(ipc_bounds_hold(&ends, dst_bytes))
}

/// Whether the kernels of a CUDA IPC route stay inside both buffers: every source rank cuts
/// the prompt into the same blocks (`plans`: `(tokens per block, last source byte + 1, source
/// buffer bytes, last destination byte + 1)` of each rank's plan) and every byte lies inside
/// its buffer (`dst_bytes`: the destination buffer's size).
#[must_use]
pub fn ipc_bounds_hold(plans: &[(u64, u64, u64, u64)], dst_bytes: u64) -> bool {
    let one_block_size = plans.windows(2).all(|w| w[0].0 == w[1].0);
    one_block_size
        && !plans.is_empty()
        && plans
            .iter()
            .all(|&(_, src_end, src_bytes, dst_end)| src_end <= src_bytes && dst_end <= dst_bytes)
}

/// A matched-layout peer (`peer`) must have this rank's slice geometry (`mine`): the first
/// field both sides give that differs. Fields are `(name, value)`, `None` when not given.
///
/// # Errors
/// `Geometry` naming the field and both values.
pub fn check_matched_slices(
    peer_name: &str,
    peer: &[(String, Option<i64>)],
    mine: &[(String, Option<i64>)],
) -> DisaggResult<()> {
    for (key, theirs) in peer {
        let ours = mine.iter().find(|(k, _)| k == key).and_then(|(_, v)| *v);
        if let (Some(theirs), Some(ours)) = (*theirs, ours) {
            if theirs != ours {
                return Err(DisaggError::geometry(
                    key.clone(),
                    format!(
                        "matched-layout peer '{peer_name}' has {key}={theirs}, this rank {ours}"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// One peer registered with the rank's NIXL agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The peer's incarnation when registered.
    pub incarnation: u64,
    /// Digest of the agent metadata it was registered with.
    pub digest: String,
    /// The id NIXL gave it.
    pub id: String,
}

/// The NIXL agent of one rank, shared by its buffer registrations: how many hold it, and the
/// peers registered on it. A peer is registered once per (incarnation, metadata digest); a
/// new one replaces the old registration, which is forgotten first.
#[derive(Debug, Clone, Default)]
pub struct AgentPeers {
    agent: String,
    refs: u64,
    peers: BTreeMap<String, Registered>,
}

/// What [`AgentPeers::admit`] found for a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Registered with this incarnation and metadata: its NIXL id.
    Known(String),
    /// To register; `stale`: its old registration, forgotten here, to remove from NIXL first.
    Register {
        /// `(name, NIXL id)` of the old registration of the name, if any.
        stale: Vec<(String, String)>,
    },
}

impl AgentPeers {
    /// The table of the agent named `agent`, held by no registration yet.
    #[must_use]
    pub fn named(agent: &str) -> Self {
        Self { agent: agent.to_owned(), ..Self::default() }
    }

    /// Buffer registrations holding the agent.
    #[must_use]
    pub fn refs(&self) -> u64 {
        self.refs
    }

    /// Nothing while a registration holds the agent.
    ///
    /// # Errors
    /// The refusal (field `agent`) of an agent no registration holds: it is closed.
    pub fn check_open(&self) -> Result<(), Refusal> {
        if self.refs == 0 {
            let detail = format!("NIXL agent '{}' is closed", self.agent);
            return Err(Refusal { field: "agent", detail });
        }
        Ok(())
    }

    /// One more registration holds the agent.
    pub fn retain(&mut self) {
        self.refs += 1;
    }

    /// One registration lets go (nothing when none holds it); once the last has, every
    /// registered peer is forgotten (the agent goes with it): `(name, NIXL id)` of each, to
    /// remove from NIXL.
    pub fn release(&mut self) -> Vec<(String, String)> {
        if self.refs == 0 {
            return Vec::new();
        }
        self.refs -= 1;
        if self.refs > 0 {
            return Vec::new();
        }
        std::mem::take(&mut self.peers).into_iter().map(|(n, r)| (n, r.id)).collect()
    }

    /// Whether peer `name` is registered with `incarnation` and `digest`; a registration of
    /// the name with another incarnation or metadata is forgotten (to register anew).
    pub fn admit(&mut self, name: &str, incarnation: u64, digest: &str) -> Admission {
        match self.peers.get(name) {
            Some(r) if r.incarnation == incarnation && r.digest == digest => {
                Admission::Known(r.id.clone())
            }
            _ => Admission::Register { stale: self.forget(&[name.to_owned()]) },
        }
    }

    /// Record peer `name` as NIXL's registration of its metadata went (`added`: whether NIXL
    /// took it; `answer`: the id NIXL gave it, `None` or empty for none, in which case its name
    /// is used; or why NIXL refused it, `None` for no reason); the id.
    ///
    /// # Errors
    /// The refusal (field `agent_metadata`) of a registration NIXL refused: nothing is
    /// recorded.
    pub fn register(
        &mut self,
        name: &str,
        (incarnation, digest): (u64, &str),
        added: bool,
        answer: Option<String>,
    ) -> Result<String, Refusal> {
        let id = if added {
            answer
        } else {
            let why = answer.unwrap_or_default();
            let detail = format!("cannot register NIXL peer '{name}': {why}");
            return Err(Refusal { field: "agent_metadata", detail });
        };
        let id = id.filter(|i| !i.is_empty()).unwrap_or_else(|| name.to_owned());
        let entry = Registered { incarnation, digest: digest.to_owned(), id: id.clone() };
        self.peers.insert(name.to_owned(), entry);
        Ok(id)
    }

    /// Forget the peers `names` that are registered: `(name, NIXL id)` of each, to remove.
    pub fn forget(&mut self, names: &[String]) -> Vec<(String, String)> {
        names.iter().filter_map(|n| self.peers.remove(n).map(|r| (n.clone(), r.id))).collect()
    }

    /// The registered peers by name.
    #[must_use]
    pub fn peers(&self) -> &BTreeMap<String, Registered> {
        &self.peers
    }

    /// The peers registered here that `current` (name -> incarnation: every peer the
    /// control plane names now) no longer names or names with another incarnation.
    #[must_use]
    pub fn stale(&self, current: &BTreeMap<String, u64>) -> Vec<String> {
        let known = self.peers.iter().map(|(n, r)| (n.clone(), r.incarnation)).collect();
        crate::stream::stale_peers(&known, current)
    }

    /// Forget the [`Self::stale`] peers: `(name, NIXL id)` of each, to remove from NIXL.
    pub fn forget_stale(&mut self, current: &BTreeMap<String, u64>) -> Vec<(String, String)> {
        let stale = self.stale(current);
        self.forget(&stale)
    }
}

#[cfg(test)]
#[path = "nixl_route_tests.rs"]
mod tests;
