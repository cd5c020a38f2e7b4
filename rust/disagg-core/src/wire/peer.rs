//! Peer metadata, typed and versioned, and the peer table that parses it once.
//!
//! A backend exports one metadata map per registered buffer (see `export_meta` in
//! `disagg_rs.transfer_backends`); a peer parses it here into a [`PeerMeta`]: every field
//! checked once, size-capped, the layout and the compiler geometry built, the addresses checked
//! against the exported regions. The [`PeerTable`] keeps parsed peers by content, so the same
//! metadata map seen again (at every handoff) costs a lookup, never a parse; [`parse_count`]
//! counts the parses of the whole process so a test can prove the hot path makes none.

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::compile::RegionTable;
use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{KvGeometry, SsmGeometry};
use crate::layout::{KvLayoutSpec, KvShardLayout, SsmLayoutSpec, SsmShardLayout, SsmStateDims};
use crate::wire::value::{as_uint, join, Fnv, Obj, WireValue, MAX_ITEMS};

/// Version of the metadata schema; a peer with another version is rejected.
pub const FORMAT_VERSION: u32 = 1;

/// Most peers one table keeps before it starts over (a peer's metadata does not change while
/// it lives; a table this full has seen peers come and go).
pub const MAX_TABLE_PEERS: usize = 1024;

static PARSES: AtomicU64 = AtomicU64::new(0);

/// How many peer metadata maps this process has parsed (table misses included, lookups not).
pub fn parse_count() -> u64 {
    PARSES.load(Ordering::Relaxed)
}

static LOOKUPS: AtomicU64 = AtomicU64::new(0);

/// How many peer metadata maps this process has looked up by content (each converts and
/// hashes a whole map a caller handed in; a parsed peer passed on, or a dict the binding
/// remembers by identity, costs none).
pub fn lookup_count() -> u64 {
    LOOKUPS.load(Ordering::Relaxed)
}

static BLOCK_CHECKS: AtomicU64 = AtomicU64::new(0);

/// How many times this process has validated a transfer's KV block ids against the buffers
/// (range, repeats, token capacity): once per transfer on the hot path.
pub fn block_check_count() -> u64 {
    BLOCK_CHECKS.load(Ordering::Relaxed)
}

/// Count one validation of a transfer's KV block ids (see [`block_check_count`]).
pub(crate) fn count_block_check() {
    BLOCK_CHECKS.fetch_add(1, Ordering::Relaxed);
}

/// Which state a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// The paged KV cache.
    Kv,
    /// The SSM convolution state.
    Conv,
    /// The SSM recurrent state.
    Recurrent,
}

impl StateKind {
    /// Parse the wire name.
    pub fn parse(field: &str, name: &str) -> DisaggResult<Self> {
        match name {
            "kv" => Ok(Self::Kv),
            "conv" => Ok(Self::Conv),
            "recurrent" => Ok(Self::Recurrent),
            other => Err(DisaggError::wire(
                field,
                format!("state_kind {other:?} is not 'kv', 'conv' or 'recurrent'"),
            )),
        }
    }

    /// The wire name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::Conv => "conv",
            Self::Recurrent => "recurrent",
        }
    }
}

/// A peer's layout: KV or SSM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerLayout {
    /// A KV cache shard.
    Kv(KvShardLayout),
    /// An SSM state shard.
    Ssm(SsmShardLayout),
}

impl PeerLayout {
    /// The rank's global rank.
    pub fn global_rank(&self) -> u32 {
        match self {
            Self::Kv(l) => l.ranks.global_rank,
            Self::Ssm(l) => l.ranks.global_rank,
        }
    }
}

/// A peer's descriptor-compiler geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerGeometry {
    /// KV cache geometry.
    Kv(KvGeometry),
    /// SSM state geometry.
    Ssm(SsmGeometry),
}

/// One contiguous byte range `[addr, addr + nbytes)` of a peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub nbytes: u64,
}

impl Region {
    /// One past the last byte (checked: a region that wraps is refused when parsed).
    pub fn end(&self) -> u64 {
        self.addr.saturating_add(self.nbytes)
    }

    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|e| e <= self.end())
    }

    /// Whether the two regions share a byte.
    pub fn overlaps(&self, other: &Region) -> bool {
        self.nbytes > 0 && other.nbytes > 0 && self.addr < other.end() && other.addr < self.end()
    }

    fn parse(o: &Obj<'_>, field: &str) -> DisaggResult<Self> {
        let r = Self { addr: o.u64("addr")?, nbytes: o.u64("nbytes")? };
        if r.addr.checked_add(r.nbytes).is_none() {
            return Err(DisaggError::wire(
                field,
                format!("addr={:#x} + nbytes={} exceeds u64", r.addr, r.nbytes),
            ));
        }
        Ok(r)
    }
}

/// The registered buffer as exported (`buffer` field).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferInfo {
    /// The buffer's bytes.
    pub region: Region,
    /// Device the memory lives on.
    pub device_id: u64,
    /// `"DRAM"` or `"VRAM"`.
    pub mem_type: String,
    /// Tensor shape (empty for a peer described by the reference design's fields).
    pub shape: Vec<u64>,
    /// Tensor strides in elements.
    pub strides: Vec<u64>,
    /// Bytes per element.
    pub element_size: u32,
    /// Axis names, space separated (or `"reference"` / `"outer block slice"`).
    pub axes: Vec<String>,
    /// Every separately registered piece of the cache (`regions`: `[[addr, nbytes], ...]`,
    /// one per per-layer tensor); `[region]` when the exporter registered one buffer.
    pub regions: RegionTable,
}

/// Which backend exported the metadata, with its own fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendFields {
    /// NIXL: the agent's metadata blob (base64) and the optional staging region.
    Nixl {
        /// Base64 NIXL agent metadata.
        agent_metadata: String,
        /// The staging region a source packs into, if any.
        staging: Option<Region>,
    },
    /// torch.distributed: the peer's rank in the process group.
    Nccl {
        /// Rank in the default process group.
        dist_rank: u64,
    },
}

/// One peer buffer's metadata, every field validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerMeta {
    /// Schema version (always [`FORMAT_VERSION`] once parsed).
    pub version: u32,
    /// Transport agent name.
    pub agent_name: String,
    /// Epoch of the exporting process; a new value means the peer restarted.
    pub incarnation: u64,
    /// Hash of the model-level facts both sides must share.
    pub compat_hash: String,
    /// What the buffer holds.
    pub state_kind: StateKind,
    /// The rank's shard layout.
    pub layout: PeerLayout,
    /// The layout's `num_layers` as exported (SSM: `None` when the total is unknown).
    pub layout_num_layers: Option<u32>,
    /// Blocks (KV) or slots (SSM).
    pub num_blocks: u32,
    /// Tokens per KV block (`None` for SSM state).
    pub tokens_per_block: Option<u32>,
    /// Head dim.
    pub head_dim: u32,
    /// Torch dtype name.
    pub dtype: String,
    /// The registered buffer.
    pub buffer: BufferInfo,
    /// The compiler geometry (`None` when the exporter had none).
    pub geometry: Option<PeerGeometry>,
    /// The backend and its own fields.
    pub backend: BackendFields,
}

/// The facts this rank requires every peer to share, and their hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFacts {
    /// This rank's state kind.
    pub state_kind: StateKind,
    /// This rank's dtype name.
    pub dtype: String,
    /// This rank's head dim.
    pub head_dim: u32,
    /// The model's layer count as this rank's layout exports it.
    pub num_layers: Option<u32>,
    /// [`compat_hash`] of this rank's facts.
    pub compat_hash: String,
}

/// The compatibility hash of a facts map: 16 hex digits of FNV-1a-64 over its canonical JSON.
pub fn compat_hash(facts: &WireValue) -> String {
    let mut h = Fnv::new();
    h.write(facts.canonical_json().as_bytes());
    format!("{:016x}", h.finish())
}

/// The top-level fields every metadata map must carry.
pub const REQUIRED: [&str; 13] = [
    "version",
    "backend",
    "agent_name",
    "incarnation",
    "compat_hash",
    "state_kind",
    "layout",
    "num_blocks",
    "tokens_per_block",
    "head_dim",
    "dtype",
    "buffer",
    "geometry",
];

const BUFFER_REQUIRED: [&str; 8] =
    ["addr", "nbytes", "device_id", "mem_type", "shape", "strides", "element_size", "axes"];

/// The integer fields `keys` of `o` as a layout's wire fields (absent or `None`: `None`).
fn int_fields<'k>(o: &Obj<'_>, keys: &[&'k str]) -> DisaggResult<Vec<(&'k str, Option<u32>)>> {
    keys.iter().map(|&k| Ok((k, o.opt_u32(k)?))).collect()
}

fn kv_layout(o: &Obj<'_>) -> DisaggResult<KvShardLayout> {
    let spec = KvLayoutSpec::from_wire(&int_fields(o, &KvLayoutSpec::WIRE_KEYS)?);
    KvShardLayout::new(spec.map_err(|e| e.under(o.path()))?)
}

fn ssm_layout(o: &Obj<'_>) -> DisaggResult<SsmShardLayout> {
    let path = join(o.path(), "dims");
    let d = o.obj("dims", &path)?;
    let dims = SsmStateDims::from_wire(&int_fields(&d, &SsmStateDims::WIRE_KEYS)?)
        .map_err(|e| e.under(&path))?;
    let ints = int_fields(o, SsmLayoutSpec::int_wire_keys())?;
    let spec = SsmLayoutSpec::from_wire(&ints, dims, o.flag("replicate_groups")?);
    SsmShardLayout::new(spec.map_err(|e| e.under(o.path()))?)
}

fn geometry(o: &Obj<'_>) -> DisaggResult<PeerGeometry> {
    match o.name("kind")? {
        "kv" => KvGeometry::from_wire(o).map(PeerGeometry::Kv),
        "ssm" => SsmGeometry::from_wire(o).map(PeerGeometry::Ssm),
        other => Err(DisaggError::wire(
            "geometry.kind",
            format!("geometry kind {other:?} is not 'kv' or 'ssm'"),
        )),
    }
}

/// `buffer.regions`: a list of `[addr, nbytes]` pairs.
fn region_list(v: &WireValue) -> DisaggResult<Vec<Region>> {
    let field = "buffer.regions";
    let WireValue::List(items) = v else {
        return Err(DisaggError::wire(
            field,
            format!("must be a list of [addr, nbytes], got {}", v.type_name()),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, x)| match x {
            WireValue::List(p) if p.len() == 2 => {
                match (as_uint(&p[0], u64::MAX), as_uint(&p[1], u64::MAX)) {
                    (Some(addr), Some(nbytes)) => Ok(Region { addr, nbytes }),
                    _ => Err(DisaggError::wire(
                        format!("{field}[{i}]"),
                        "addr and nbytes must be ints in [0, 2**64)",
                    )),
                }
            }
            _ => Err(DisaggError::wire(
                format!("{field}[{i}]"),
                format!("must be an [addr, nbytes] pair, got {}", x.type_name()),
            )),
        })
        .collect()
}

fn buffer(o: &Obj<'_>) -> DisaggResult<BufferInfo> {
    for key in BUFFER_REQUIRED {
        o.req(key)?;
    }
    let axes = o.str_max("axes", 1024)?;
    let region = Region::parse(o, "buffer.nbytes")?;
    let regions = match o.some("regions") {
        None => vec![region],
        Some(v) => region_list(v)?,
    };
    Ok(BufferInfo {
        regions: if region.nbytes == 0 && regions == [region] {
            // A buffer of no bytes: no plane base to check, no byte to address.
            RegionTable::empty()
        } else {
            RegionTable::new("buffer.regions", regions)?
        },
        region,
        device_id: o.u64("device_id")?,
        mem_type: o.name("mem_type")?.to_owned(),
        shape: o.uints("shape", u64::MAX)?,
        strides: o.uints("strides", u64::MAX)?,
        element_size: o.u32("element_size")?,
        axes: axes.split_whitespace().map(str::to_owned).collect(),
    })
}

/// `Peer(agent_name="p0", global_rank=0, incarnation=7, state_kind="kv")`.
impl std::fmt::Display for PeerMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (name, rank, kind) = (&self.agent_name, self.layout.global_rank(), self.state_kind);
        write!(
            f,
            "Peer(agent_name={name:?}, global_rank={rank}, incarnation={}, ",
            self.incarnation
        )?;
        write!(f, "state_kind={:?})", kind.name())
    }
}

impl PeerMeta {
    /// Parse and validate one metadata map exported by a `backend` backend (`"nixl"` or
    /// `"nccl"`). Every error is a [`DisaggError`] naming the field (`Wire` for a missing,
    /// mistyped or oversized field, `Layout`/`Geometry` for invalid values).
    pub fn parse(v: &WireValue, backend: &str) -> DisaggResult<Self> {
        PARSES.fetch_add(1, Ordering::Relaxed);
        let o = Obj::of(v, "")?;
        for key in REQUIRED {
            o.req(key)?;
        }
        let version = o.u32("version").map_err(|_| {
            DisaggError::wire("version", format!("peer metadata version is not {FORMAT_VERSION}"))
        })?;
        if version != FORMAT_VERSION {
            return Err(DisaggError::wire(
                "version",
                format!("peer metadata version {version} != supported {FORMAT_VERSION}"),
            ));
        }
        let theirs = o.name("backend")?;
        if theirs != backend {
            return Err(DisaggError::wire(
                "backend",
                format!("peer backend {theirs:?} != this backend {backend:?}"),
            ));
        }
        let state_kind = StateKind::parse("state_kind", o.name("state_kind")?)?;
        let lo = o.obj("layout", "layout")?;
        let layout = match state_kind {
            StateKind::Kv => PeerLayout::Kv(kv_layout(&lo)?),
            StateKind::Conv | StateKind::Recurrent => PeerLayout::Ssm(ssm_layout(&lo)?),
        };
        let buffer = buffer(&o.obj("buffer", "buffer")?)?;
        let geometry = match o.some("geometry") {
            None => None,
            Some(g) => Some(geometry(&Obj::of(g, "geometry")?)?),
        };
        let backend_fields = match backend {
            "nixl" => {
                let staging = match o.some("staging") {
                    None => None,
                    Some(s) => Some(Region::parse(&Obj::of(s, "staging")?, "staging")?),
                };
                if !o.has("staging") {
                    o.req("staging")?;
                }
                BackendFields::Nixl {
                    agent_metadata: o
                        .str_max("agent_metadata", super::value::MAX_STR_BYTES)?
                        .to_owned(),
                    staging,
                }
            }
            "nccl" => BackendFields::Nccl { dist_rank: o.u64("dist_rank")? },
            other => {
                return Err(DisaggError::wire("backend", format!("unknown backend {other:?}")))
            }
        };
        let meta = Self {
            version,
            agent_name: o.name("agent_name")?.to_owned(),
            incarnation: o.u64("incarnation")?,
            compat_hash: o.name("compat_hash")?.to_owned(),
            state_kind,
            layout,
            layout_num_layers: lo.opt_u32("num_layers")?,
            num_blocks: o.u32("num_blocks")?,
            tokens_per_block: o.opt_u32("tokens_per_block")?,
            head_dim: o.u32("head_dim")?,
            dtype: o.name("dtype")?.to_owned(),
            buffer,
            geometry,
            backend: backend_fields,
        };
        meta.check_regions()?;
        Ok(meta)
    }

    /// The peer's staging region (NIXL), if it has one.
    pub fn staging(&self) -> Option<Region> {
        match &self.backend {
            BackendFields::Nixl { staging, .. } => *staging,
            BackendFields::Nccl { .. } => None,
        }
    }

    /// The regions a reader may address: the buffer and the staging region.
    pub fn regions(&self) -> Vec<Region> {
        let mut out = self.buffer.regions.regions().to_vec();
        out.extend(self.staging());
        out
    }

    /// The first byte of every plane (KV) or layer (SSM) of the geometry.
    fn plane_bases(&self) -> Vec<u64> {
        match &self.geometry {
            None => Vec::new(),
            Some(PeerGeometry::Kv(g)) => g.spec().plane_bases.clone(),
            Some(PeerGeometry::Ssm(g)) => [&g.conv, &g.recurrent]
                .into_iter()
                .flatten()
                .flat_map(|p| p.layer_bases.iter().copied())
                .collect(),
        }
    }

    /// Plane bases lie in the exported buffer regions, never in the staging region, and the
    /// staging region overlaps no buffer region.
    fn check_regions(&self) -> DisaggResult<()> {
        let table = &self.buffer.regions;
        if let Some(st) = self.staging() {
            if let Some(buf) = table.regions().iter().find(|b| st.overlaps(b)) {
                return Err(DisaggError::wire(
                    "staging",
                    format!(
                        "staging [{:#x}, {:#x}) overlaps the buffer [{:#x}, {:#x})",
                        st.addr,
                        st.end(),
                        buf.addr,
                        buf.end()
                    ),
                ));
            }
        }
        for (i, b) in self.plane_bases().into_iter().enumerate() {
            if let Some(st) = self.staging() {
                if st.contains(b, 1) {
                    return Err(DisaggError::wire(
                        "geometry.plane_bases",
                        format!(
                            "plane {i} base {b:#x} lies inside the staging region [{:#x}, {:#x})",
                            st.addr,
                            st.end()
                        ),
                    ));
                }
            }
            if !table.is_empty() && table.locate(b).is_none() {
                let buf = self.buffer.region;
                return Err(DisaggError::wire(
                    "geometry.plane_bases",
                    format!(
                        "plane {i} base {b:#x} lies outside the buffer [{:#x}, {:#x}) and its \
                         {} registered regions",
                        buf.addr,
                        buf.end(),
                        table.regions().len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Check this peer against the facts this rank requires (`GeometryMismatchError` fields
    /// `state_kind`, `dtype`, `head_dim`, `num_layers`, `compat_hash`).
    pub fn check_compat(&self, local: &LocalFacts) -> DisaggResult<()> {
        let name = &self.agent_name;
        let mismatch = |field: &str, theirs: String, ours: String| {
            DisaggError::geometry(
                field,
                format!("peer {name:?} has {field}={theirs}, this rank {ours}"),
            )
        };
        if self.state_kind != local.state_kind {
            return Err(mismatch(
                "state_kind",
                self.state_kind.name().into(),
                local.state_kind.name().into(),
            ));
        }
        if self.dtype != local.dtype {
            return Err(mismatch("dtype", self.dtype.clone(), local.dtype.clone()));
        }
        if self.head_dim != local.head_dim {
            return Err(mismatch(
                "head_dim",
                self.head_dim.to_string(),
                local.head_dim.to_string(),
            ));
        }
        if self.layout_num_layers != local.num_layers {
            return Err(mismatch(
                "num_layers",
                format!("{:?}", self.layout_num_layers),
                format!("{:?}", local.num_layers),
            ));
        }
        if self.compat_hash != local.compat_hash {
            return Err(DisaggError::geometry(
                "compat_hash",
                format!(
                    "peer {name:?} compat_hash {:?} != {:?} (model-level facts differ)",
                    self.compat_hash, local.compat_hash
                ),
            ));
        }
        Ok(())
    }

    /// Every `(addr, len)` of `rows` lies inside one of the peer's exported regions; a
    /// violation names `field`, the row, the address range and the regions.
    pub fn check_addresses(&self, rows: &[[u64; 3]], field: &str) -> DisaggResult<()> {
        let regions = self.regions();
        for (i, r) in rows.iter().enumerate() {
            let (addr, len) = (r[0], r[1]);
            if !regions.iter().any(|g| g.contains(addr, len)) {
                let shown: Vec<String> =
                    regions.iter().map(|g| format!("[{:#x}, {:#x})", g.addr, g.end())).collect();
                return Err(DisaggError::wire(
                    field,
                    format!(
                        "row {i} addresses [{addr:#x}, {:#x}) outside peer {:?}'s exported \
                         regions {}",
                        addr.saturating_add(len),
                        self.agent_name,
                        shown.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Block ids of the sources: the same list for every source rank, or one list per rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceIds {
    /// One list for every source rank.
    Shared(Vec<i64>),
    /// One list per source global rank.
    PerRank(Vec<(i64, Vec<i64>)>),
}

impl SourceIds {
    /// The ids of source global rank `rank` (`None`: a per-rank mapping without it).
    #[must_use]
    pub fn of_rank(&self, rank: i64) -> Option<&[i64]> {
        match self {
            Self::Shared(ids) => Some(ids),
            Self::PerRank(map) => {
                map.iter().find(|(r, _)| *r == rank).map(|(_, ids)| ids.as_slice())
            }
        }
    }

    /// How many ids source global rank `rank` has (0: a per-rank mapping without it).
    #[must_use]
    pub fn rank_len(&self, rank: i64) -> usize {
        self.of_rank(rank).map_or(0, <[i64]>::len)
    }
}

fn check_ids(field: &str, ids: &[i64], num_blocks: u32, owner: &str) -> DisaggResult<()> {
    if ids.is_empty() {
        return Err(DisaggError::block(field, format!("{field} is empty")));
    }
    if ids.len() > MAX_ITEMS.max(num_blocks as usize) {
        return Err(DisaggError::block(
            field,
            format!("{field} holds {} ids, more than the {num_blocks} blocks", ids.len()),
        ));
    }
    // One bit per block (ids are checked against `num_blocks` first), a set past 16 M.
    let mut bits =
        vec![0_u64; if num_blocks <= 1 << 24 { (num_blocks as usize).div_ceil(64) } else { 0 }];
    let mut seen = BTreeSet::new();
    for &b in ids {
        if b < 0 || b >= i64::from(num_blocks) {
            return Err(DisaggError::block(
                field,
                format!("{field} holds block {b}, outside [0, {num_blocks}) of {owner}"),
            ));
        }
        let fresh = if bits.is_empty() {
            seen.insert(b)
        } else {
            let b = b.cast_unsigned(); // in [0, num_blocks): checked above
            let (word, bit) = ((b / 64) as usize, 1_u64 << (b % 64));
            let was = bits[word] & bit == 0;
            bits[word] |= bit;
            was
        };
        if !fresh {
            return Err(DisaggError::block(
                field,
                format!("{field} names block {b} twice ({} ids)", ids.len()),
            ));
        }
    }
    Ok(())
}

/// What the destination side of a transfer is: this rank (pull, receive) or a peer (push,
/// stage), with this rank's block count and tokens per block.
#[derive(Debug, Clone, Copy)]
pub struct LocalSide {
    /// Whether this rank is the destination.
    pub is_dst: bool,
    /// Blocks (or slots) of this rank's buffer.
    pub num_blocks: u32,
    /// Tokens per block of this rank (`None` for SSM state).
    pub tokens_per_block: Option<u32>,
}

/// Check a peer set and the block ids of one transfer, once, before anything is compiled or
/// posted; return the token count to move (`None` for SSM state).
///
/// `peers` are the source ranks' metadata. Errors: `Wire` (two peers claim one global rank),
/// `Block` (ids out of range, repeated, empty, naming ranks with no metadata, too few for
/// `num_tokens`).
pub fn check_transfer(
    peers: &[&PeerMeta],
    src: &SourceIds,
    dst: Option<&[i64]>,
    num_tokens: Option<i64>,
    local: LocalSide,
) -> DisaggResult<Option<u64>> {
    let mut ranks = BTreeSet::new();
    for p in peers {
        let r = p.layout.global_rank();
        if !ranks.insert(r) {
            return Err(DisaggError::wire(
                "global_rank",
                format!("two peer metadata dicts claim global_rank {r}"),
            ));
        }
    }
    if peers.first().is_some_and(|p| p.state_kind == StateKind::Kv) {
        count_block_check();
    }
    let mut sized: Vec<(&PeerMeta, usize)> = Vec::new();
    match src {
        SourceIds::Shared(ids) => {
            for p in peers {
                check_ids("src_block_ids", ids, p.num_blocks, &format!("{:?}", p.agent_name))?;
                sized.push((p, ids.len()));
            }
        }
        SourceIds::PerRank(map) => {
            let unknown: Vec<i64> = map
                .iter()
                .map(|(r, _)| *r)
                .filter(|r| u32::try_from(*r).map_or(true, |r| !ranks.contains(&r)))
                .collect();
            if !unknown.is_empty() {
                return Err(DisaggError::block(
                    "src_block_ids",
                    format!(
                        "src_block_ids names ranks {unknown:?} with no metadata (known {:?})",
                        ranks.iter().collect::<Vec<_>>()
                    ),
                ));
            }
            for p in peers {
                let rank = i64::from(p.layout.global_rank());
                if let Some((_, ids)) = map.iter().find(|(r, _)| *r == rank) {
                    check_ids("src_block_ids", ids, p.num_blocks, &format!("{:?}", p.agent_name))?;
                    sized.push((p, ids.len()));
                }
            }
        }
    }
    if let (Some(ids), true) = (dst, local.is_dst) {
        check_ids("dst_block_ids", ids, local.num_blocks, "this rank")?;
    }
    let Some(first) = peers.first() else {
        return Err(DisaggError::wire("peer_meta", "no peer metadata given"));
    };
    if first.state_kind != StateKind::Kv {
        if let Some(d) = dst {
            if let Some((_, n)) = sized.iter().find(|(_, n)| *n != d.len()) {
                return Err(DisaggError::block(
                    "dst_block_ids",
                    format!("SSM slots: {n} source ids vs {} destination ids", d.len()),
                ));
            }
        }
        return Ok(None);
    }
    let src_cap = sized
        .iter()
        .map(|(p, n)| *n as u64 * u64::from(p.tokens_per_block.unwrap_or(0)))
        .min()
        .unwrap_or(0);
    let dst_cap = match (dst, local.is_dst, local.tokens_per_block) {
        (Some(d), true, Some(t)) => Some(d.len() as u64 * u64::from(t)),
        _ => None,
    };
    let n = match num_tokens {
        Some(n) => n,
        None => i64::try_from(dst_cap.map_or(src_cap, |d| d.min(src_cap))).unwrap_or(i64::MAX),
    };
    let n_pos = u64::try_from(n).ok().filter(|&v| v > 0 && v <= src_cap);
    let Some(n) = n_pos else {
        return Err(DisaggError::block(
            "num_tokens",
            format!("num_tokens={n} but the source blocks hold [1, {src_cap}] tokens"),
        ));
    };
    if let Some(cap) = dst_cap {
        if n > cap {
            return Err(DisaggError::block(
                "dst_block_ids",
                format!("num_tokens={n} but dst_block_ids hold only {cap} tokens"),
            ));
        }
    }
    Ok(Some(n))
}

/// One parsed peer and what the caller attached to it.
type Entry<A> = (WireValue, Arc<PeerMeta>, A);

/// Peers parsed once, found again by content. `A` is whatever the caller keeps beside each
/// parsed peer (the bindings keep the Python object they hand out).
#[derive(Debug)]
pub struct PeerTable<A: Clone = ()> {
    backend: String,
    local: LocalFacts,
    by_key: HashMap<u64, Vec<Entry<A>>>,
    len: usize,
}

impl<A: Clone> PeerTable<A> {
    /// An empty table of a `backend` backend whose peers must share `local`'s facts.
    pub fn new(backend: &str, local: LocalFacts) -> Self {
        Self { backend: backend.to_owned(), local, by_key: HashMap::new(), len: 0 }
    }

    /// The backend name.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The facts every peer must share.
    pub fn local(&self) -> &LocalFacts {
        &self.local
    }

    /// How many distinct metadata maps the table holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The peer parsed from a map equal to `raw`, if any: no parse.
    pub fn lookup(&self, raw: &WireValue) -> Option<(Arc<PeerMeta>, A)> {
        LOOKUPS.fetch_add(1, Ordering::Relaxed);
        let key = raw.content_key();
        self.by_key
            .get(&key)?
            .iter()
            .find(|(v, _, _)| v == raw)
            .map(|(_, m, a)| (Arc::clone(m), a.clone()))
    }

    /// Parse `schema` (the peer's metadata in this library's schema: `raw` itself, or its
    /// translation from the reference design's fields), check it against this rank's facts
    /// and keep it under `raw`'s content with `attach(&meta)` beside it. Nothing is kept when
    /// a check fails.
    pub fn adopt<F>(
        &mut self,
        raw: WireValue,
        schema: &WireValue,
        attach: F,
    ) -> DisaggResult<(Arc<PeerMeta>, A)>
    where
        F: FnOnce(&Arc<PeerMeta>) -> DisaggResult<A>,
    {
        if let Some(hit) = self.lookup(&raw) {
            return Ok(hit);
        }
        let meta = PeerMeta::parse(schema, &self.backend)?;
        meta.check_compat(&self.local)?;
        let meta = Arc::new(meta);
        let extra = attach(&meta)?;
        if self.len >= MAX_TABLE_PEERS {
            self.by_key.clear();
            self.len = 0;
        }
        self.by_key.entry(raw.content_key()).or_default().push((
            raw,
            Arc::clone(&meta),
            extra.clone(),
        ));
        self.len += 1;
        Ok((meta, extra))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_rank_missing_from_per_rank_ids_has_none() {
        let per_rank = SourceIds::PerRank(vec![(0, vec![1, 2, 3]), (2, vec![4])]);
        assert_eq!((per_rank.rank_len(0), per_rank.rank_len(2), per_rank.rank_len(1)), (3, 1, 0));
        assert_eq!(SourceIds::Shared(vec![5, 6]).rank_len(7), 2);
    }

    fn s(v: &str) -> WireValue {
        WireValue::Str(v.into())
    }
    fn i(v: i128) -> WireValue {
        WireValue::Int(v)
    }
    fn map(entries: Vec<(&str, WireValue)>) -> WireValue {
        WireValue::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }
    fn set(v: &mut WireValue, key: &str, val: WireValue) {
        if let WireValue::Map(e) = v {
            e.retain(|(k, _)| k != key);
            e.push((key.to_owned(), val));
        }
    }
    fn del(v: &mut WireValue, key: &str) {
        if let WireValue::Map(e) = v {
            e.retain(|(k, _)| k != key);
        }
    }

    const BASE: i128 = 0x1000;
    // [2, 2 layers, 4 blocks, 2 tokens, 1 head, 4 dim] float32: block 32 B, plane 128 B.
    fn meta() -> WireValue {
        let bases: Vec<WireValue> = (0..4).map(|p| i(BASE + p * 128)).collect();
        map(vec![
            ("version", i(1)),
            ("backend", s("nixl")),
            ("agent_name", s("p0")),
            ("incarnation", i(7)),
            ("compat_hash", s("0123456789abcdef")),
            ("state_kind", s("kv")),
            (
                "layout",
                map(vec![
                    ("num_layers", i(2)),
                    ("num_kv_heads", i(1)),
                    ("tp_size", i(1)),
                    ("tp_rank", i(0)),
                    ("pp_size", i(1)),
                    ("pp_rank", i(0)),
                    ("global_rank", i(0)),
                ]),
            ),
            ("num_blocks", i(4)),
            ("tokens_per_block", i(2)),
            ("head_dim", i(4)),
            ("dtype", s("torch.float32")),
            (
                "buffer",
                map(vec![
                    ("addr", i(BASE)),
                    ("nbytes", i(512)),
                    ("device_id", i(0)),
                    ("mem_type", s("DRAM")),
                    ("shape", WireValue::List(vec![i(2), i(2), i(4), i(2), i(1), i(4)])),
                    ("strides", WireValue::List(vec![i(128), i(64), i(8), i(4), i(4), i(1)])),
                    ("element_size", i(4)),
                    ("axes", s("kv layer block token head dim")),
                ]),
            ),
            (
                "geometry",
                map(vec![
                    ("kind", s("kv")),
                    ("num_kv", i(2)),
                    ("num_layers", i(2)),
                    ("num_blocks", i(4)),
                    ("tokens_per_block", i(2)),
                    ("num_heads", i(1)),
                    ("head_dim", i(4)),
                    ("element_size", i(4)),
                    ("block_stride", i(32)),
                    ("token_stride", i(16)),
                    ("head_stride", i(16)),
                    ("plane_bases", WireValue::List(bases)),
                    ("device_id", i(0)),
                    ("dtype", s("float32")),
                ]),
            ),
            ("agent_metadata", s("QUJD")),
            ("staging", map(vec![("addr", i(0x10_0000)), ("nbytes", i(4096))])),
        ])
    }

    /// `ChunkFacts::of_peer` of the parsed export reads what `of_meta` reads from its dict.
    #[test]
    fn chunk_facts_of_a_parsed_peer_are_those_of_its_metadata() {
        use crate::backend_rules::ChunkFacts;
        let parsed = PeerMeta::parse(&meta(), "nixl").unwrap();
        let from_dict = ChunkFacts::of_meta(&meta()).unwrap();
        // The dict names no `regions` (0); the parse keeps the one buffer as its region.
        assert_eq!(ChunkFacts::of_peer(&parsed), ChunkFacts { regions: 1, ..from_dict });
        assert_eq!(from_dict.geometry, Some([2, 1, 16, 4, 4]));
    }

    /// A valid export with `staging` as its staging region.
    pub(crate) fn meta_with_staging(r: Region) -> WireValue {
        let mut v = meta();
        let st = map(vec![("addr", i(i128::from(r.addr))), ("nbytes", i(i128::from(r.nbytes)))]);
        set(&mut v, "staging", st);
        v
    }

    fn local() -> LocalFacts {
        LocalFacts {
            state_kind: StateKind::Kv,
            dtype: "torch.float32".into(),
            head_dim: 4,
            num_layers: Some(2),
            compat_hash: "0123456789abcdef".into(),
        }
    }

    fn field_of(e: &DisaggError) -> String {
        match e {
            DisaggError::Wire { field, .. }
            | DisaggError::Geometry { field, .. }
            | DisaggError::Block { field, .. }
            | DisaggError::Layout { field, .. } => field.clone(),
            other => other.kind().into(),
        }
    }

    /// `meta()` with its four planes in per-layer regions: planes 0 and 2 (layer 0's K and V)
    /// in one region, planes 1 and 3 in another far away.
    fn per_layer_meta(regions: &WireValue) -> WireValue {
        let far: i128 = 0x20_0000;
        let mut v = meta();
        let bases: Vec<WireValue> = [BASE, far, BASE + 128, far + 128].into_iter().map(i).collect();
        if let WireValue::Map(e) = &mut v {
            for (k, val) in e.iter_mut() {
                if k == "geometry" {
                    set(val, "plane_bases", WireValue::List(bases.clone()));
                } else if k == "buffer" {
                    set(val, "regions", regions.clone());
                }
            }
        }
        v
    }

    fn pair(a: i128, n: i128) -> WireValue {
        WireValue::List(vec![i(a), i(n)])
    }

    #[test]
    fn per_layer_regions_hold_the_plane_bases_and_every_address() {
        let regions = WireValue::List(vec![pair(BASE, 256), pair(0x20_0000, 256)]);
        let m = PeerMeta::parse(&per_layer_meta(&regions), "nixl").unwrap();
        assert_eq!(m.buffer.regions.regions().len(), 2);
        assert!(m.check_addresses(&[[0x20_0000 + 8, 64, 0]], "src").is_ok());
        assert!(m.check_addresses(&[[0x20_0000 + 250, 64, 0]], "src").is_err());
        // Without the second region, planes 1 and 3 lie outside every region.
        let e = PeerMeta::parse(&per_layer_meta(&WireValue::List(vec![pair(BASE, 256)])), "nixl")
            .unwrap_err();
        assert_eq!(field_of(&e), "geometry.plane_bases", "{e}");
        for bad in [
            WireValue::List(vec![]),
            WireValue::List(vec![pair(BASE, 256), pair(BASE + 128, 256)]),
            WireValue::List(vec![WireValue::List(vec![i(BASE)])]),
            i(3),
        ] {
            let e = PeerMeta::parse(&per_layer_meta(&bad), "nixl").unwrap_err();
            assert!(field_of(&e).starts_with("buffer.regions"), "{e}");
        }
    }

    #[test]
    fn a_valid_export_parses_into_typed_fields() {
        let m = PeerMeta::parse(&meta(), "nixl").unwrap();
        assert_eq!(m.layout.global_rank(), 0);
        assert_eq!(m.tokens_per_block, Some(2));
        assert_eq!(m.staging(), Some(Region { addr: 0x10_0000, nbytes: 4096 }));
        assert!(matches!(m.geometry, Some(PeerGeometry::Kv(_))));
        m.check_compat(&local()).unwrap();
        let shown = r#"Peer(agent_name="p0", global_rank=0, incarnation=7, state_kind="kv")"#;
        assert_eq!(m.to_string(), shown);
    }

    #[test]
    fn every_required_field_is_named_when_missing() {
        for key in REQUIRED.iter().chain(["agent_metadata", "staging"].iter()) {
            let mut v = meta();
            del(&mut v, key);
            let e = PeerMeta::parse(&v, "nixl").unwrap_err();
            assert_eq!(field_of(&e), *key, "{e}");
        }
    }

    #[test]
    fn layout_fields_are_named_under_layout() {
        let Some(WireValue::Map(layout)) = Obj::of(&meta(), "").unwrap().get("layout").cloned()
        else {
            panic!("meta() has a layout dict");
        };
        let without = |key: &str| -> Vec<(String, WireValue)> {
            layout.iter().filter(|(k, _)| k != key).cloned().collect()
        };
        let with = |key: &str, val: WireValue| {
            let mut fields = without(key);
            fields.push((key.to_owned(), val));
            fields
        };
        for (fields, want) in [
            (without("tp_size"), "layout.tp_size"),
            (without("num_kv_heads"), "layout.num_kv_heads"),
            (with("tp_size", s("x")), "layout.tp_size"),
            (with("num_heads", i(2)), "layout.num_kv_heads"),
        ] {
            let mut v = meta();
            set(&mut v, "layout", WireValue::Map(fields));
            let e = PeerMeta::parse(&v, "nixl").unwrap_err();
            assert_eq!(field_of(&e), want, "{e}");
        }
    }

    #[test]
    fn mistyped_and_negative_fields_are_named() {
        for (key, bad, want) in [
            ("incarnation", i(-1), "incarnation"),
            ("num_blocks", WireValue::Bool(true), "num_blocks"),
            ("agent_name", i(3), "agent_name"),
            ("version", i(2), "version"),
            ("backend", s("nccl"), "backend"),
            ("state_kind", s("ssd"), "state_kind"),
            ("layout", s("x"), "layout"),
            ("agent_name", s(&"x".repeat(300)), "agent_name"),
        ] {
            let mut v = meta();
            set(&mut v, key, bad);
            let e = PeerMeta::parse(&v, "nixl").unwrap_err();
            assert_eq!(field_of(&e), want, "{e}");
        }
    }

    #[test]
    fn plane_bases_inside_the_staging_region_or_outside_the_buffer_are_refused() {
        let mut v = meta();
        set(&mut v, "staging", map(vec![("addr", i(BASE + 256)), ("nbytes", i(64))]));
        let e = PeerMeta::parse(&v, "nixl").unwrap_err();
        assert_eq!(field_of(&e), "staging", "{e}");
        let mut v = meta();
        set(&mut v, "staging", map(vec![("addr", i(0)), ("nbytes", i(BASE + 1))]));
        assert!(PeerMeta::parse(&v, "nixl").is_err());
        let mut v = meta();
        if let WireValue::Map(e) = &mut v {
            for (k, b) in e.iter_mut() {
                if k == "buffer" {
                    set(b, "nbytes", i(256));
                }
            }
        }
        let e = PeerMeta::parse(&v, "nixl").unwrap_err();
        assert_eq!(field_of(&e), "geometry.plane_bases", "{e}");
        assert!(e.to_string().contains("outside the buffer"), "{e}");
    }

    #[test]
    fn descriptor_rows_outside_the_exported_regions_are_named_with_both_ranges() {
        let m = PeerMeta::parse(&meta(), "nixl").unwrap();
        m.check_addresses(&[[BASE as u64, 512, 0], [0x10_0000, 4096, 0]], "src").unwrap();
        let e = m.check_addresses(&[[BASE as u64 + 500, 16, 0]], "src").unwrap_err();
        assert_eq!(field_of(&e), "src");
        assert!(e.to_string().contains("0x11f4") && e.to_string().contains("0x1200"), "{e}");
        assert!(m.check_addresses(&[[u64::MAX, 2, 0]], "src").is_err());
    }

    #[test]
    fn compat_mismatches_name_the_fact() {
        let m = PeerMeta::parse(&meta(), "nixl").unwrap();
        let mut l = local();
        l.head_dim = 8;
        assert_eq!(field_of(&m.check_compat(&l).unwrap_err()), "head_dim");
        let mut l = local();
        l.compat_hash = "ffffffffffffffff".into();
        assert_eq!(field_of(&m.check_compat(&l).unwrap_err()), "compat_hash");
    }

    #[test]
    fn compat_hash_is_16_hex_digits_and_order_free() {
        let a = map(vec![("a", i(1)), ("b", s("x"))]);
        let b = map(vec![("b", s("x")), ("a", i(1))]);
        assert_eq!(compat_hash(&a), compat_hash(&b));
        assert_eq!(compat_hash(&a).len(), 16);
        assert_ne!(compat_hash(&a), compat_hash(&map(vec![("a", i(2)), ("b", s("x"))])));
    }

    #[test]
    fn the_table_parses_a_peer_once_and_finds_it_by_content() {
        let mut t: PeerTable = PeerTable::new("nixl", local());
        let before = parse_count();
        let (a, ()) = t.adopt(meta(), &meta(), |_| Ok(())).unwrap();
        let after_first = parse_count();
        assert!(after_first > before);
        assert!(t.lookup(&meta()).is_some());
        let (b, ()) = t.adopt(meta(), &meta(), |_| Ok(())).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(t.len(), 1);
        let mut other = meta();
        set(&mut other, "incarnation", i(8));
        assert!(t.lookup(&other).is_none());
        let mut bad = meta();
        set(&mut bad, "head_dim", i(8));
        assert!(t.adopt(bad.clone(), &bad, |_| Ok(())).is_err());
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn block_ids_and_token_counts_are_checked_once_with_named_fields() {
        let m = PeerMeta::parse(&meta(), "nixl").unwrap();
        let local = LocalSide { is_dst: true, num_blocks: 4, tokens_per_block: Some(2) };
        let ok = check_transfer(&[&m], &SourceIds::Shared(vec![0, 1]), Some(&[2, 3]), None, local);
        assert_eq!(ok.unwrap(), Some(4));
        for (src, dst, n, field) in [
            (vec![0, 4], vec![0, 1], None, "src_block_ids"),
            (vec![0, 0], vec![0, 1], None, "src_block_ids"),
            (vec![], vec![0, 1], None, "src_block_ids"),
            (vec![0, 1], vec![-1, 1], None, "dst_block_ids"),
            (vec![0, 1], vec![0], Some(4), "dst_block_ids"),
            (vec![0, 1], vec![0, 1], Some(5), "num_tokens"),
            (vec![0, 1], vec![0, 1], Some(0), "num_tokens"),
        ] {
            let e =
                check_transfer(&[&m], &SourceIds::Shared(src), Some(&dst), n, local).unwrap_err();
            assert_eq!(field_of(&e), field, "{e}");
        }
        let e =
            check_transfer(&[&m, &m], &SourceIds::Shared(vec![0]), None, None, local).unwrap_err();
        assert_eq!(field_of(&e), "global_rank");
        let e = check_transfer(&[&m], &SourceIds::PerRank(vec![(3, vec![0])]), None, None, local)
            .unwrap_err();
        assert_eq!(field_of(&e), "src_block_ids");
    }
}
