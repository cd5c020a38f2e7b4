//! Shard layouts: which slice of the global KV cache or SSM state one rank holds.
//!
//! All ranges are half-open `[lo, hi)` in global coordinates. Constructors validate every field
//! and name the field and both values on failure, so an invalid layout never exists.

use std::fmt;

use crate::args::{named, Int, Kind};
use crate::error::{DisaggError, DisaggResult};

/// A half-open range `[lo, hi)` of layers, heads, groups or channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Span {
    /// First index in the range.
    pub lo: u32,
    /// One past the last index.
    pub hi: u32,
}

impl Span {
    /// `[lo, hi)`; callers guarantee `lo <= hi`.
    pub const fn new(lo: u32, hi: u32) -> Self {
        Self { lo, hi }
    }

    /// Number of indices in the range.
    pub const fn len(self) -> u32 {
        self.hi.saturating_sub(self.lo)
    }

    /// Whether the range holds no index.
    pub const fn is_empty(self) -> bool {
        self.hi <= self.lo
    }

    /// Whether `other` lies entirely inside `self`.
    pub const fn contains_span(self, other: Span) -> bool {
        self.lo <= other.lo && other.hi <= self.hi
    }

    /// The overlap of two ranges, if any.
    pub fn intersect(self, other: Span) -> Option<Span> {
        let lo = self.lo.max(other.lo);
        let hi = self.hi.min(other.hi);
        (lo < hi).then_some(Span { lo, hi })
    }

    /// The range shifted down by `origin` (global -> local coordinates).
    #[must_use]
    pub const fn relative_to(self, origin: u32) -> Span {
        Span { lo: self.lo - origin, hi: self.hi - origin }
    }

    /// `(global, local)` of each index held, the first held being local 0.
    pub fn local_map(self) -> impl Iterator<Item = (u32, u32)> {
        (self.lo..self.hi).map(move |g| (g, g - self.lo))
    }
}

/// Where one rank sits in its engine: its tensor- and pipeline-parallel coordinates (which
/// shard it holds), its global rank (the tie-breaker that picks one replica as the source) and
/// its expert- and expert-tensor-parallel coordinates (replicas of one shard hold identical
/// state). KV and SSM layouts carry the same coordinates and check them alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RankCoords {
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Tensor-parallel rank, `< tp_size`.
    pub tp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Pipeline-parallel rank, `< pp_size`.
    pub pp_rank: u32,
    /// Rank in the engine's world.
    pub global_rank: u32,
    /// Expert-parallel coordinate of this replica.
    pub ep_rank: u32,
    /// Expert-tensor-parallel coordinate of this replica.
    pub etp_rank: u32,
}

impl RankCoords {
    /// Rank `(tp_rank, pp_rank)` of a `tp_size x pp_size` grid, EP/ETP replica 0.
    #[must_use]
    pub const fn grid(
        tp_size: u32,
        tp_rank: u32,
        pp_size: u32,
        pp_rank: u32,
        global_rank: u32,
    ) -> Self {
        Self { tp_size, tp_rank, pp_size, pp_rank, global_rank, ep_rank: 0, etp_rank: 0 }
    }

    /// The only rank of an engine with one rank (TP1, PP1, rank 0).
    #[must_use]
    pub const fn single() -> Self {
        Self::grid(1, 0, 1, 0, 0)
    }

    /// The checks every shard layout makes of its place in the TP x PP grid: both ranks below
    /// their sizes and no more pipeline stages than layers (when the layer total is known).
    fn check(&self, num_layers: Option<u32>) -> DisaggResult<()> {
        rank_below("tp_rank", self.tp_rank, "tp_size", self.tp_size)?;
        rank_below("pp_rank", self.pp_rank, "pp_size", self.pp_size)?;
        match num_layers {
            Some(total) if self.pp_size > total => Err(DisaggError::layout(
                "pp_size",
                format!("pp_size={} exceeds num_layers={total}", self.pp_size),
            )),
            _ => Ok(()),
        }
    }

    /// The pipeline window of this rank's stage: explicit, or an even split of `num_layers`.
    /// `num_layers` is `None` when the model's total is unknown (only an explicit window is
    /// possible then). Returns the window and whether it differs from the even split.
    fn layer_window(
        &self,
        num_layers: Option<u32>,
        layer_start: Option<u32>,
        num_local_layers: Option<u32>,
    ) -> DisaggResult<(Span, bool)> {
        let (pp_size, pp_rank) = (self.pp_size, self.pp_rank);
        match (layer_start, num_local_layers) {
            (Some(start), Some(count)) => {
                Kind::Layout.at_least_one(&[("num_local_layers", count)])?;
                let end = start.checked_add(count).ok_or_else(|| {
                    DisaggError::layout(
                        "num_local_layers",
                        format!("layer_start={start} + num_local_layers={count} exceeds 2**32"),
                    )
                })?;
                let Some(total) = num_layers else {
                    return Ok((Span::new(start, end), true));
                };
                if end > total {
                    return Err(DisaggError::layout(
                        "num_local_layers",
                        format!(
                            "layer_start={start} + num_local_layers={count} exceeds \
                             num_layers={total}"
                        ),
                    ));
                }
                let window = Span::new(start, end);
                Ok((window, even_window(total, pp_size, pp_rank) != Some(window)))
            }
            (None, None) => {
                let Some(num_layers) = num_layers else {
                    return Err(DisaggError::layout(
                        "layer_start",
                        "layer_start=None and num_layers=None: give the model's layer count or an \
                         explicit layer window",
                    ));
                };
                if !num_layers.is_multiple_of(pp_size) {
                    return Err(DisaggError::layout(
                        "num_layers",
                        format!(
                            "num_layers={num_layers} is not divisible by pp_size={pp_size}; \
                             give layer_start and num_local_layers for an uneven window"
                        ),
                    ));
                }
                let per = num_layers / pp_size;
                Ok((Span::new(pp_rank * per, (pp_rank + 1) * per), false))
            }
            (Some(start), None) => Err(DisaggError::layout(
                "num_local_layers",
                format!("layer_start={start} given but num_local_layers=None; set both or neither"),
            )),
            (None, Some(count)) => Err(DisaggError::layout(
                "layer_start",
                format!("num_local_layers={count} given but layer_start=None; set both or neither"),
            )),
        }
    }

    /// Decode the wire fields: the TP/PP fields and `global_rank` are required, the EP/ETP
    /// coordinates default to 0.
    pub fn from_wire(f: &WireFields<'_>) -> DisaggResult<Self> {
        Ok(Self {
            tp_size: wire_need(f, "tp_size")?,
            tp_rank: wire_need(f, "tp_rank")?,
            pp_size: wire_need(f, "pp_size")?,
            pp_rank: wire_need(f, "pp_rank")?,
            global_rank: wire_need(f, "global_rank")?,
            ep_rank: wire_get(f, "ep_rank").unwrap_or(0),
            etp_rank: wire_get(f, "etp_rank").unwrap_or(0),
        })
    }
}

/// Everything needed to build a [`KvShardLayout`]; `layer_start` and `num_local_layers` are set
/// together (an explicit, possibly uneven pipeline window) or not at all (even split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayoutSpec {
    /// Layers of the whole model that hold KV cache.
    pub num_layers: u32,
    /// KV heads of the whole model.
    pub num_kv_heads: u32,
    /// This rank's coordinates.
    pub ranks: RankCoords,
    /// Expert-parallel size (attention KV is replicated, never split, across EP ranks).
    pub ep_size: u32,
    /// Expert-tensor-parallel size (a replica dimension for attention KV, like EP).
    pub etp_size: u32,
    /// First global layer of this stage (explicit window).
    pub layer_start: Option<u32>,
    /// Number of layers of this stage (explicit window).
    pub num_local_layers: Option<u32>,
}

impl Default for KvLayoutSpec {
    /// Zero model sizes (to be filled in), one EP and one ETP replica, even layer split.
    fn default() -> Self {
        Self {
            num_layers: 0,
            num_kv_heads: 0,
            ranks: RankCoords::grid(0, 0, 0, 0, 0),
            ep_size: 1,
            etp_size: 1,
            layer_start: None,
            num_local_layers: None,
        }
    }
}

/// The KV cache slice one rank holds: a layer window and a head range.
///
/// Beyond the reference design, `tp_size > num_kv_heads` is allowed when it is a multiple:
/// each group of `tp_size / num_kv_heads` consecutive ranks holds the same single head (GQA
/// replication). Replicas are never read twice: planners source each cell from the holder with
/// the smallest global rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShardLayout {
    /// Layers of the whole model.
    pub num_layers: u32,
    /// KV heads of the whole model.
    pub num_kv_heads: u32,
    /// This rank's coordinates.
    pub ranks: RankCoords,
    /// Expert-parallel size.
    pub ep_size: u32,
    /// Expert-tensor-parallel size.
    pub etp_size: u32,
    /// Global layers held, `[lo, hi)`.
    pub layers: Span,
    /// Global KV heads held, `[lo, hi)`.
    pub heads: Span,
    /// Whether the layer window differs from the even split (kept for the wire round trip). An
    /// explicit window equal to the even split is stored as the even split, so a layout rebuilt
    /// from its own fields compares equal however the window was spelled.
    pub explicit_window: bool,
}

fn rank_below(rank_field: &str, rank: u32, size_field: &str, size: u32) -> DisaggResult<()> {
    if rank >= size {
        return Err(DisaggError::layout(
            rank_field,
            format!("{rank_field}={rank} must be < {size_field}={size}"),
        ));
    }
    Ok(())
}

/// The even split of `num_layers` for `pp_rank`, if `pp_size` divides it.
fn even_window(num_layers: u32, pp_size: u32, pp_rank: u32) -> Option<Span> {
    if pp_size == 0 || !num_layers.is_multiple_of(pp_size) {
        return None;
    }
    let per = num_layers / pp_size;
    Some(Span::new(pp_rank * per, (pp_rank + 1) * per))
}

/// The units (heads or groups) rank `tp_rank` of `tp_size` holds out of `units`: an even split
/// when `tp_size` divides `units`, one replicated unit when `units` divides `tp_size`.
fn unit_share(units_field: &str, units: u32, tp_size: u32, tp_rank: u32) -> DisaggResult<Span> {
    if tp_size <= units {
        if !units.is_multiple_of(tp_size) {
            return Err(DisaggError::layout(
                units_field,
                format!("{units_field}={units} is not divisible by tp_size={tp_size}"),
            ));
        }
        let per = units / tp_size;
        Ok(Span::new(tp_rank * per, (tp_rank + 1) * per))
    } else {
        if !tp_size.is_multiple_of(units) {
            return Err(DisaggError::layout(
                "tp_size",
                format!(
                    "tp_size={tp_size} exceeds {units_field}={units} but is not a multiple of it \
                     (replication needs whole groups of ranks per unit)"
                ),
            ));
        }
        let unit = tp_rank / (tp_size / units);
        Ok(Span::new(unit, unit + 1))
    }
}

impl KvShardLayout {
    /// Validate `spec` and build the layout.
    pub fn new(spec: KvLayoutSpec) -> DisaggResult<Self> {
        let r = spec.ranks;
        Kind::Layout.at_least_one(&[
            ("num_layers", spec.num_layers),
            ("num_kv_heads", spec.num_kv_heads),
            ("tp_size", r.tp_size),
            ("pp_size", r.pp_size),
            ("ep_size", spec.ep_size),
            ("etp_size", spec.etp_size),
        ])?;
        r.check(Some(spec.num_layers))?;
        let heads = unit_share("num_kv_heads", spec.num_kv_heads, r.tp_size, r.tp_rank)?;
        let (layers, explicit_window) =
            r.layer_window(Some(spec.num_layers), spec.layer_start, spec.num_local_layers)?;
        Ok(Self {
            num_layers: spec.num_layers,
            num_kv_heads: spec.num_kv_heads,
            ranks: r,
            ep_size: spec.ep_size,
            etp_size: spec.etp_size,
            layers,
            heads,
            explicit_window,
        })
    }

    /// The spec this layout was built from (`new(l.spec()) == l`).
    pub fn spec(&self) -> KvLayoutSpec {
        KvLayoutSpec {
            num_layers: self.num_layers,
            num_kv_heads: self.num_kv_heads,
            ranks: self.ranks,
            ep_size: self.ep_size,
            etp_size: self.etp_size,
            layer_start: self.explicit_window.then_some(self.layers.lo),
            num_local_layers: self.explicit_window.then_some(self.layers.len()),
        }
    }

    /// Ranks holding the same head (1 unless `tp_size > num_kv_heads`).
    pub fn gqa_replication(&self) -> u32 {
        if self.ranks.tp_size > self.num_kv_heads {
            self.ranks.tp_size / self.num_kv_heads
        } else {
            1
        }
    }

    /// The attention shard this rank holds, `(tp_rank, pp_rank)`: ranks sharing it are EP/ETP
    /// replicas holding identical KV (the reference design's `kv_shard_key`).
    pub fn kv_shard_key(&self) -> (u32, u32) {
        (self.ranks.tp_rank, self.ranks.pp_rank)
    }

    /// The layouts of one engine's `tp_size x pp_size` ranks (even layer split, no EP/ETP
    /// replicas), pipeline-major: rank `(pp, tp)` has global rank `rank0 + pp * tp_size + tp`.
    pub fn engine(
        num_layers: u32,
        num_kv_heads: u32,
        tp_size: u32,
        pp_size: u32,
        rank0: u32,
    ) -> DisaggResult<Vec<Self>> {
        (0..pp_size)
            .flat_map(|p| (0..tp_size).map(move |t| (p, t)))
            .map(|(pp_rank, tp_rank)| {
                Self::new(KvLayoutSpec {
                    num_layers,
                    num_kv_heads,
                    ranks: RankCoords::grid(
                        tp_size,
                        tp_rank,
                        pp_size,
                        pp_rank,
                        rank0 + pp_rank * tp_size + tp_rank,
                    ),
                    ..KvLayoutSpec::default()
                })
            })
            .collect()
    }
}

/// Global dimensions of one Mamba2-style SSM layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SsmStateDims {
    /// SSM heads (`nheads`).
    pub num_heads: u32,
    /// Channels per head (`headdim`, p).
    pub head_dim: u32,
    /// State size per group (`d_state`, n).
    pub d_state: u32,
    /// B/C groups (`ngroups`).
    pub n_groups: u32,
    /// Convolution kernel width (`d_conv`).
    pub d_conv: u32,
}

impl SsmStateDims {
    /// Validate and build.
    pub fn new(
        num_heads: u32,
        head_dim: u32,
        d_state: u32,
        n_groups: u32,
        d_conv: u32,
    ) -> DisaggResult<Self> {
        Kind::Layout.at_least_one(&named!(num_heads, head_dim, d_state, n_groups, d_conv))?;
        if !num_heads.is_multiple_of(n_groups) {
            return Err(DisaggError::layout(
                "n_groups",
                format!("num_heads={num_heads} is not divisible by n_groups={n_groups}"),
            ));
        }
        let dims = Self { num_heads, head_dim, d_state, n_groups, d_conv };
        dims.conv_channels()?;
        Ok(dims)
    }

    /// Width of the x band: `num_heads * head_dim`.
    pub fn x_channels(&self) -> DisaggResult<u32> {
        self.num_heads
            .checked_mul(self.head_dim)
            .ok_or_else(|| DisaggError::overflow("num_heads * head_dim exceeds u32"))
    }

    /// Width of the B (and of the C) band: `n_groups * d_state`.
    pub fn bc_channels(&self) -> DisaggResult<u32> {
        self.n_groups
            .checked_mul(self.d_state)
            .ok_or_else(|| DisaggError::overflow("n_groups * d_state exceeds u32"))
    }

    /// All conv channels: `[x | B | C]`.
    pub fn conv_channels(&self) -> DisaggResult<u32> {
        let bc = self.bc_channels()?;
        self.x_channels()?
            .checked_add(bc)
            .and_then(|c| c.checked_add(bc))
            .ok_or_else(|| DisaggError::overflow("conv channel count exceeds u32"))
    }
}

/// Which part of the SSM state a transfer moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SsmBand {
    /// Conv-state channels of the x band (head-sharded).
    X,
    /// Conv-state channels of the B band (group-sharded).
    B,
    /// Conv-state channels of the C band (group-sharded).
    C,
    /// The recurrent state, sharded by head.
    Recurrent,
}

impl SsmBand {
    /// All bands in plan order.
    pub const ALL: [SsmBand; 4] = [SsmBand::X, SsmBand::B, SsmBand::C, SsmBand::Recurrent];

    /// The wire and Python name of the band.
    pub fn name(self) -> &'static str {
        match self {
            Self::X => "x",
            Self::B => "B",
            Self::C => "C",
            Self::Recurrent => "recurrent",
        }
    }

    /// Parse a band name.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "x" => Ok(Self::X),
            "B" => Ok(Self::B),
            "C" => Ok(Self::C),
            "recurrent" => Ok(Self::Recurrent),
            other => Err(DisaggError::layout(
                "band",
                format!("band={other:?} is not one of 'x', 'B', 'C', 'recurrent'"),
            )),
        }
    }

    /// Whether the band lives in the conv state (as opposed to the recurrent state).
    pub fn is_conv(self) -> bool {
        !matches!(self, Self::Recurrent)
    }
}

/// Where one band sits: its global range and this rank's local range, in channels for the conv
/// bands and in heads for the recurrent state. Both `[lo, hi)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BandSpan {
    /// Global channels (conv) or heads (recurrent).
    pub global: Span,
    /// Offsets in this rank's local conv channels (conv) or local heads (recurrent).
    pub local: Span,
}

/// Everything needed to build a [`SsmShardLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsmLayoutSpec {
    /// SSM layers of the whole model; `None` when unknown (the reference design's layouts carry
    /// only the stage window), which requires an explicit window.
    pub num_layers: Option<u32>,
    /// Global per-layer dimensions.
    pub dims: SsmStateDims,
    /// This rank's coordinates.
    pub ranks: RankCoords,
    /// First global SSM layer of this stage (explicit window).
    pub layer_start: Option<u32>,
    /// Number of SSM layers of this stage (explicit window).
    pub num_local_layers: Option<u32>,
    /// Opt-in for `tp_size > n_groups`: each group of `tp_size / n_groups` ranks holds a full
    /// copy of one B/C group. Off by default because Mamba mixers split the groups across TP
    /// ranks and reject fewer groups than ranks; a layout that replicates them must say so.
    pub replicate_groups: bool,
}

/// The SSM state one rank holds: a layer window, a head range (x band and recurrent state) and
/// a group range (B and C bands). The local conv channels are packed `[x | B | C]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SsmShardLayout {
    /// SSM layers of the whole model, `None` when unknown.
    pub num_layers: Option<u32>,
    /// Global per-layer dimensions.
    pub dims: SsmStateDims,
    /// This rank's coordinates.
    pub ranks: RankCoords,
    /// Global SSM layers held.
    pub layers: Span,
    /// Global SSM heads held.
    pub heads: Span,
    /// Global B/C groups held.
    pub groups: Span,
    /// Whether the layer window differs from the even split (or the total is unknown).
    pub explicit_window: bool,
    /// Whether B/C groups may be replicated across TP ranks (`tp_size > n_groups`).
    pub replicate_groups: bool,
}

impl SsmShardLayout {
    /// Validate `spec` and build the layout.
    pub fn new(spec: SsmLayoutSpec) -> DisaggResult<Self> {
        if let Some(total) = spec.num_layers {
            Kind::Layout.at_least_one(&[("num_layers", total)])?;
        }
        let r = spec.ranks;
        Kind::Layout.at_least_one(&named!(r; tp_size, pp_size))?;
        r.check(spec.num_layers)?;
        let dims = spec.dims;
        if !dims.num_heads.is_multiple_of(r.tp_size) {
            return Err(DisaggError::layout(
                "num_heads",
                format!(
                    "SSM num_heads={} is not divisible by tp_size={}",
                    dims.num_heads, r.tp_size
                ),
            ));
        }
        if dims.n_groups < r.tp_size && !spec.replicate_groups {
            return Err(DisaggError::layout(
                "n_groups",
                format!(
                    "ngroups={} < tp_size={}: Mamba mixers split the B/C groups across TP ranks; \
                     pass replicate_groups=True if each rank holds a full copy of its group",
                    dims.n_groups, r.tp_size
                ),
            ));
        }
        let heads = unit_share("num_heads", dims.num_heads, r.tp_size, r.tp_rank)?;
        let groups = unit_share("n_groups", dims.n_groups, r.tp_size, r.tp_rank)?;
        let (layers, explicit_window) =
            r.layer_window(spec.num_layers, spec.layer_start, spec.num_local_layers)?;
        Ok(Self {
            num_layers: spec.num_layers,
            dims,
            ranks: r,
            layers,
            heads,
            groups,
            explicit_window,
            replicate_groups: spec.replicate_groups,
        })
    }

    /// The spec this layout was built from.
    pub fn spec(&self) -> SsmLayoutSpec {
        SsmLayoutSpec {
            num_layers: self.num_layers,
            dims: self.dims,
            ranks: self.ranks,
            layer_start: self.explicit_window.then_some(self.layers.lo),
            num_local_layers: self.explicit_window.then_some(self.layers.len()),
            replicate_groups: self.replicate_groups,
        }
    }

    /// The SSM shard this rank holds, `(tp_rank, first layer)`: ranks sharing it hold
    /// identical state (the reference design's `shard_key`).
    pub fn shard_key(&self) -> (u32, u32) {
        (self.ranks.tp_rank, self.layers.lo)
    }

    /// The reference design's band triple `(global_total, local_size, local_offset)`: the
    /// band's global width, this rank's width of it and where it starts in the local packing
    /// (channels for x, B, C; heads for the recurrent state, whose offset is always 0).
    pub fn band_extent(&self, band: SsmBand) -> (u32, u32, u32) {
        let d = self.dims;
        let total = match band {
            SsmBand::X => d.num_heads * d.head_dim,
            SsmBand::B | SsmBand::C => d.n_groups * d.d_state,
            SsmBand::Recurrent => d.num_heads,
        };
        let local = self.band(band).local;
        (total, local.len(), local.lo)
    }

    /// Local conv channels of this rank: `[x_local | B_local | C_local]`.
    pub fn local_conv_channels(&self) -> u32 {
        // Cannot overflow: bounded by the global count checked in `SsmStateDims::new`.
        self.heads.len() * self.dims.head_dim + 2 * self.groups.len() * self.dims.d_state
    }

    /// Global and local position of `band` on this rank.
    pub fn band(&self, band: SsmBand) -> BandSpan {
        let d = self.dims;
        let x_global = d.num_heads * d.head_dim;
        let bc_global = d.n_groups * d.d_state;
        let x_local = self.heads.len() * d.head_dim;
        let bc_local = self.groups.len() * d.d_state;
        match band {
            SsmBand::X => BandSpan {
                global: Span::new(self.heads.lo * d.head_dim, self.heads.hi * d.head_dim),
                local: Span::new(0, x_local),
            },
            SsmBand::B => BandSpan {
                global: Span::new(
                    x_global + self.groups.lo * d.d_state,
                    x_global + self.groups.hi * d.d_state,
                ),
                local: Span::new(x_local, x_local + bc_local),
            },
            SsmBand::C => BandSpan {
                global: Span::new(
                    x_global + bc_global + self.groups.lo * d.d_state,
                    x_global + bc_global + self.groups.hi * d.d_state,
                ),
                local: Span::new(x_local + bc_local, x_local + 2 * bc_local),
            },
            SsmBand::Recurrent => {
                BandSpan { global: self.heads, local: Span::new(0, self.heads.len()) }
            }
        }
    }
}

/// One record's wire fields by name, as the bindings read them from a dict: `None` for a
/// field that is absent or null.
pub type WireFields<'a> = [(&'a str, Option<u32>)];

fn wire_get(f: &WireFields<'_>, key: &str) -> Option<u32> {
    f.iter().find(|(k, _)| *k == key).and_then(|(_, v)| *v)
}

fn wire_need(f: &WireFields<'_>, key: &str) -> DisaggResult<u32> {
    wire_get(f, key).ok_or_else(|| DisaggError::wire(key, "missing required field"))
}

/// A required field under either of two spellings (ours, the reference design's); both
/// present must agree.
fn wire_either(f: &WireFields<'_>, ours: &str, theirs: &str) -> DisaggResult<u32> {
    match (wire_get(f, ours), wire_get(f, theirs)) {
        (Some(a), Some(b)) if a != b => Err(DisaggError::wire(
            ours,
            format!("{ours}={a} disagrees with its alias {theirs}={b}"),
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => {
            Err(DisaggError::wire(ours, format!("missing required field (or {theirs})")))
        }
    }
}

impl KvLayoutSpec {
    /// Keys a KV layout's wire dict may carry: the reference design's dataclass fields in its
    /// order (the first 13, with `num_heads`), then our `num_kv_heads`.
    pub const WIRE_KEYS: [&'static str; 14] = [
        "num_layers",
        "num_heads",
        "tp_size",
        "tp_rank",
        "pp_size",
        "pp_rank",
        "global_rank",
        "ep_size",
        "ep_rank",
        "etp_size",
        "etp_rank",
        "layer_start",
        "num_local_layers",
        "num_kv_heads",
    ];

    /// Our wire fields, in wire order; [`KvLayoutSpec::from_wire`] round-trips them.
    pub fn wire_fields(&self) -> [(&'static str, Option<u32>); 13] {
        [
            ("num_layers", Some(self.num_layers)),
            ("num_kv_heads", Some(self.num_kv_heads)),
            ("tp_size", Some(self.ranks.tp_size)),
            ("tp_rank", Some(self.ranks.tp_rank)),
            ("pp_size", Some(self.ranks.pp_size)),
            ("pp_rank", Some(self.ranks.pp_rank)),
            ("global_rank", Some(self.ranks.global_rank)),
            ("ep_size", Some(self.ep_size)),
            ("ep_rank", Some(self.ranks.ep_rank)),
            ("etp_size", Some(self.etp_size)),
            ("etp_rank", Some(self.ranks.etp_rank)),
            ("layer_start", self.layer_start),
            ("num_local_layers", self.num_local_layers),
        ]
    }

    /// Decode wire fields (ours or the reference design's names): the EP/ETP replica fields
    /// default to a single replica, the window to the even split.
    pub fn from_wire(f: &WireFields<'_>) -> DisaggResult<Self> {
        Ok(Self {
            num_layers: wire_need(f, "num_layers")?,
            num_kv_heads: wire_either(f, "num_kv_heads", "num_heads")?,
            ranks: RankCoords::from_wire(f)?,
            ep_size: wire_get(f, "ep_size").unwrap_or(1),
            etp_size: wire_get(f, "etp_size").unwrap_or(1),
            layer_start: wire_get(f, "layer_start"),
            num_local_layers: wire_get(f, "num_local_layers"),
        })
    }
}

impl SsmStateDims {
    /// Keys an SSM dims wire dict may carry: ours and the reference design's.
    pub const WIRE_KEYS: [&'static str; 8] =
        ["num_heads", "nheads", "head_dim", "headdim", "d_state", "n_groups", "ngroups", "d_conv"];

    /// Our wire fields, in wire order.
    pub fn wire_fields(&self) -> [(&'static str, u32); 5] {
        [
            ("num_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("d_state", self.d_state),
            ("n_groups", self.n_groups),
            ("d_conv", self.d_conv),
        ]
    }

    /// Decode and validate wire fields (ours or the reference design's names).
    pub fn from_wire(f: &WireFields<'_>) -> DisaggResult<Self> {
        Self::new(
            wire_either(f, "num_heads", "nheads")?,
            wire_either(f, "head_dim", "headdim")?,
            wire_need(f, "d_state")?,
            wire_either(f, "n_groups", "ngroups")?,
            wire_need(f, "d_conv")?,
        )
    }
}

impl fmt::Display for SsmStateDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SSMStateDims(nheads={}, headdim={}, d_state={}, ngroups={}, d_conv={})",
            self.num_heads, self.head_dim, self.d_state, self.n_groups, self.d_conv
        )
    }
}

impl SsmLayoutSpec {
    /// One rank holding every layer of a `num_layers`-layer model (TP1, PP1, rank 0, even
    /// window, no group replication); set the parallel fields to shard it.
    #[must_use]
    pub fn single_rank(num_layers: u32, dims: SsmStateDims) -> Self {
        Self {
            num_layers: Some(num_layers),
            dims,
            ranks: RankCoords::single(),
            layer_start: None,
            num_local_layers: None,
            replicate_groups: false,
        }
    }

    /// Keys an SSM layout's wire dict may carry (`num_layers` there is the model's total):
    /// the integer keys first (see [`SsmLayoutSpec::int_wire_keys`]), then `dims` and
    /// `replicate_groups`.
    pub const WIRE_KEYS: [&'static str; 12] = [
        "num_layers",
        "tp_size",
        "tp_rank",
        "pp_size",
        "pp_rank",
        "global_rank",
        "ep_rank",
        "etp_rank",
        "layer_start",
        "num_local_layers",
        "dims",
        "replicate_groups",
    ];

    /// The integer keys among [`SsmLayoutSpec::WIRE_KEYS`] (its first ten), in wire order.
    #[must_use]
    pub fn int_wire_keys() -> &'static [&'static str] {
        &Self::WIRE_KEYS[..10]
    }

    /// Our integer wire fields, in wire order (`dims` and `replicate_groups` travel beside
    /// them).
    pub fn wire_fields(&self) -> [(&'static str, Option<u32>); 10] {
        [
            ("num_layers", self.num_layers),
            ("tp_size", Some(self.ranks.tp_size)),
            ("tp_rank", Some(self.ranks.tp_rank)),
            ("pp_size", Some(self.ranks.pp_size)),
            ("pp_rank", Some(self.ranks.pp_rank)),
            ("global_rank", Some(self.ranks.global_rank)),
            ("ep_rank", Some(self.ranks.ep_rank)),
            ("etp_rank", Some(self.ranks.etp_rank)),
            ("layer_start", self.layer_start),
            ("num_local_layers", self.num_local_layers),
        ]
    }

    /// Every keyword of the `SSMShardLayout` constructor: the wire keys, then `total_layers`.
    pub const CALL_KEYS: [&'static str; 13] = {
        let mut keys = ["total_layers"; 13];
        let mut i = 0;
        while i < Self::WIRE_KEYS.len() {
            keys[i] = Self::WIRE_KEYS[i];
            i += 1;
        }
        keys
    };

    /// The reference design's dataclass fields, then ours (so `asdict` round-trips a layout);
    /// the first six are the reference design's positional order.
    pub const DATACLASS_FIELDS: [&'static str; 12] = [
        "global_rank",
        "tp_size",
        "tp_rank",
        "layer_start",
        "num_layers",
        "dims",
        "pp_size",
        "pp_rank",
        "ep_rank",
        "etp_rank",
        "total_layers",
        "replicate_groups",
    ];

    /// Positional order of our call form.
    pub const OUR_POSITIONAL: [&'static str; 7] =
        ["num_layers", "dims", "tp_size", "tp_rank", "pp_size", "pp_rank", "global_rank"];

    /// The positional order of a constructor call with `n_positional` arguments. Our form puts
    /// the dims second where the reference design's puts an int (`tp_size`); with one
    /// positional argument it is our `num_layers` unless `num_layers` is also a keyword.
    pub fn call_order(
        n_positional: usize,
        second_is_dims: bool,
        num_layers_keyword: bool,
    ) -> &'static [&'static str] {
        let ours = match n_positional {
            0 => true,
            1 => !num_layers_keyword,
            _ => second_is_dims,
        };
        if ours {
            &Self::OUR_POSITIONAL
        } else {
            &Self::DATACLASS_FIELDS[..6]
        }
    }

    /// The spec of a constructor call from its integer arguments by name (absent: not given).
    /// `num_layers` is the stage's count exactly when `layer_start` is given without
    /// `num_local_layers` (the reference design's form; the model's total may then come as
    /// `total_layers`); otherwise it is the model's total, and so is `total_layers`, so the
    /// two must agree. Sizes default to 1, ranks to 0, `global_rank` to
    /// `pp_rank * tp_size + tp_rank`. A missing stage count is an `Argument` error.
    pub fn from_call(
        f: &WireFields<'_>,
        dims: SsmStateDims,
        replicate_groups: bool,
    ) -> DisaggResult<Self> {
        let get = |key: &str| wire_get(f, key);
        let (num_layers, total_layers) = (get("num_layers"), get("total_layers"));
        let (layer_start, num_local_layers) = (get("layer_start"), get("num_local_layers"));
        let (total, local) = if layer_start.is_some() && num_local_layers.is_none() {
            let n = num_layers.ok_or_else(|| {
                DisaggError::argument("num_layers", "missing required argument num_layers")
            })?;
            (total_layers, Some(n))
        } else {
            match (num_layers, total_layers) {
                (Some(n), Some(t)) if n != t => {
                    return Err(DisaggError::layout(
                        "total_layers",
                        format!("num_layers={n} and total_layers={t} both name the model's total"),
                    ))
                }
                // Without a total only an explicit window works; `new` says so if it is missing.
                (n, t) => (n.or(t), num_local_layers),
            }
        };
        let (tp_size, tp_rank, pp_rank) =
            (get("tp_size").unwrap_or(1), get("tp_rank").unwrap_or(0), get("pp_rank").unwrap_or(0));
        let default_rank = || {
            let r = u64::from(pp_rank) * u64::from(tp_size) + u64::from(tp_rank);
            Int::from(r).to_u32(Kind::Layout, "global_rank")
        };
        let global_rank = get("global_rank").map_or_else(default_rank, Ok)?;
        Ok(Self {
            num_layers: total,
            dims,
            ranks: RankCoords {
                tp_size,
                tp_rank,
                pp_size: get("pp_size").unwrap_or(1),
                pp_rank,
                global_rank,
                ep_rank: get("ep_rank").unwrap_or(0),
                etp_rank: get("etp_rank").unwrap_or(0),
            },
            layer_start,
            num_local_layers: local,
            replicate_groups,
        })
    }

    /// Decode the integer wire fields around already decoded `dims` and `replicate_groups`.
    pub fn from_wire(
        f: &WireFields<'_>,
        dims: SsmStateDims,
        replicate_groups: bool,
    ) -> DisaggResult<Self> {
        Ok(Self {
            num_layers: wire_get(f, "num_layers"),
            dims,
            ranks: RankCoords::from_wire(f)?,
            layer_start: wire_get(f, "layer_start"),
            num_local_layers: wire_get(f, "num_local_layers"),
            replicate_groups,
        })
    }
}

impl fmt::Display for RankCoords {
    /// `global_rank=G, tp=RANK/SIZE, pp=RANK/SIZE`, as the layouts' reprs show it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "global_rank={}, tp={}/{}, pp={}/{}",
            self.global_rank, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size
        )
    }
}

impl fmt::Display for KvShardLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KVShardLayout({}, layers=[{}, {}) of {}, heads=[{}, {}) of {}",
            self.ranks,
            self.layers.lo,
            self.layers.hi,
            self.num_layers,
            self.heads.lo,
            self.heads.hi,
            self.num_kv_heads,
        )?;
        let (ep_rank, etp_rank) = (self.ranks.ep_rank, self.ranks.etp_rank);
        if self.ep_size != 1 || self.etp_size != 1 || ep_rank != 0 || etp_rank != 0 {
            write!(f, ", ep={ep_rank}/{}, etp={etp_rank}/{}", self.ep_size, self.etp_size)?;
        }
        f.write_str(")")
    }
}

impl fmt::Display for SsmShardLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.num_layers.map_or_else(|| "?".to_owned(), |n| n.to_string());
        write!(
            f,
            "SSMShardLayout({}, layers=[{}, {}) of {total}, heads=[{}, {}), groups=[{}, {}), \
             dims={})",
            self.ranks,
            self.layers.lo,
            self.layers.hi,
            self.heads.lo,
            self.heads.hi,
            self.groups.lo,
            self.groups.hi,
            self.dims
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(tp: u32, rank: u32) -> KvLayoutSpec {
        KvLayoutSpec {
            num_layers: 8,
            num_kv_heads: 4,
            ranks: RankCoords::grid(tp, rank, 1, 0, rank),
            ..KvLayoutSpec::default()
        }
    }

    fn ssm_spec(window: Option<(u32, u32)>) -> SsmLayoutSpec {
        SsmLayoutSpec {
            num_layers: window.is_none().then_some(4),
            ranks: RankCoords::grid(2, 1, 1, 0, 1),
            layer_start: window.map(|w| w.0),
            num_local_layers: window.map(|w| w.1),
            ..SsmLayoutSpec::single_rank(4, SsmStateDims::new(8, 4, 16, 2, 4).unwrap())
        }
    }

    #[test]
    fn a_span_maps_each_global_index_to_its_local_one() {
        assert_eq!(Span::new(3, 6).local_map().collect::<Vec<_>>(), vec![(3, 0), (4, 1), (5, 2)]);
        assert_eq!(Span::new(2, 2).local_map().count(), 0);
    }

    #[test]
    fn kv_and_ssm_layouts_check_their_grid_place_alike() {
        let msg = |e: DisaggError| e.to_string();
        let mut k = kv(2, 1);
        (k.ranks.pp_size, k.ranks.pp_rank) = (9, 0);
        let want = "invalid layout field `pp_size`: pp_size=9 exceeds num_layers=8";
        assert_eq!(msg(KvShardLayout::new(k).unwrap_err()), want);
        let mut s = ssm_spec(None);
        (s.num_layers, s.ranks.pp_size) = (Some(8), 9);
        assert_eq!(msg(SsmShardLayout::new(s).unwrap_err()), want);
        // Without a layer total only the ranks are checked; the explicit window decides.
        let mut s = ssm_spec(Some((2, 1)));
        s.ranks.pp_size = 9;
        assert_eq!(SsmShardLayout::new(s).unwrap().layers, Span::new(2, 3));
        s.ranks.tp_rank = 2;
        let want = "invalid layout field `tp_rank`: tp_rank=2 must be < tp_size=2";
        assert_eq!(msg(SsmShardLayout::new(s).unwrap_err()), want);
        k = kv(2, 2);
        assert_eq!(msg(KvShardLayout::new(k).unwrap_err()), want);
    }

    #[test]
    fn an_engine_s_layouts_are_pipeline_major_and_numbered_from_its_first_rank() {
        let ls = KvShardLayout::engine(8, 4, 2, 2, 10).unwrap();
        let coords: Vec<_> =
            ls.iter().map(|l| (l.ranks.pp_rank, l.ranks.tp_rank, l.ranks.global_rank)).collect();
        assert_eq!(coords, [(0, 0, 10), (0, 1, 11), (1, 0, 12), (1, 1, 13)]);
        let mut first = kv(2, 0);
        (first.ranks.pp_size, first.ranks.global_rank) = (2, 10);
        assert_eq!(ls[0], KvShardLayout::new(first).unwrap());
        assert_eq!(ls[3].layers, Span { lo: 4, hi: 8 });
        let e = KvShardLayout::engine(8, 4, 2, 9, 0).unwrap_err();
        assert!(matches!(&e, DisaggError::Layout { field, .. } if field == "pp_size"), "{e}");
    }

    #[test]
    fn kv_wire_fields_round_trip_with_window_and_replicas() {
        let mut s = kv(2, 1);
        (s.layer_start, s.num_local_layers, s.ep_size, s.ranks.ep_rank) = (Some(2), Some(6), 2, 1);
        let l = KvShardLayout::new(s).unwrap();
        let f = l.spec().wire_fields();
        assert!(f.iter().all(|(k, _)| KvLayoutSpec::WIRE_KEYS.contains(k)));
        assert_eq!(KvShardLayout::new(KvLayoutSpec::from_wire(&f).unwrap()).unwrap(), l);
    }

    #[test]
    fn kv_wire_accepts_the_reference_head_name_and_defaults_replicas() {
        let mut f = kv(2, 1).wire_fields().to_vec();
        f.retain(|(k, _)| !k.starts_with("ep_") && !k.starts_with("etp_"));
        f[1].0 = "num_heads";
        let s = KvLayoutSpec::from_wire(&f).unwrap();
        assert_eq!(s, kv(2, 1));
        f.push(("num_kv_heads", Some(8)));
        let e = KvLayoutSpec::from_wire(&f).unwrap_err();
        assert_eq!(e.kind(), "Wire");
        assert!(
            e.to_string().contains("num_kv_heads=8 disagrees with its alias num_heads=4"),
            "{e}"
        );
    }

    #[test]
    fn kv_wire_names_a_missing_required_field() {
        let f = [("num_layers", Some(8)), ("num_kv_heads", Some(4)), ("tp_size", None)];
        let e = KvLayoutSpec::from_wire(&f).unwrap_err();
        assert_eq!(e.kind(), "Wire");
        assert!(e.to_string().contains("tp_size"), "{e}");
        assert!(e.to_string().contains("missing required field"), "{e}");
    }

    #[test]
    fn ssm_wire_fields_round_trip_with_and_without_a_total() {
        for w in [None, Some((1, 2))] {
            let l = SsmShardLayout::new(ssm_spec(w)).unwrap();
            let s = l.spec();
            let keys: Vec<&str> = s.wire_fields().iter().map(|f| f.0).collect();
            assert_eq!(keys, SsmLayoutSpec::int_wire_keys());
            assert!(keys.iter().all(|k| SsmLayoutSpec::WIRE_KEYS.contains(k)));
            let dims: Vec<_> = s.dims.wire_fields().iter().map(|&(k, v)| (k, Some(v))).collect();
            let back = SsmLayoutSpec::from_wire(
                &s.wire_fields(),
                SsmStateDims::from_wire(&dims).unwrap(),
                s.replicate_groups,
            )
            .unwrap();
            assert_eq!(SsmShardLayout::new(back).unwrap(), l);
        }
    }

    #[test]
    fn ssm_dims_wire_takes_the_reference_names() {
        let f = [
            ("nheads", Some(8)),
            ("headdim", Some(4)),
            ("d_state", Some(16)),
            ("ngroups", Some(2)),
            ("d_conv", Some(4)),
        ];
        assert_eq!(
            SsmStateDims::from_wire(&f).unwrap(),
            SsmStateDims::new(8, 4, 16, 2, 4).unwrap()
        );
        let e = SsmStateDims::from_wire(&f[..4]).unwrap_err();
        assert!(e.to_string().contains("d_conv"), "{e}");
    }

    #[test]
    fn reprs_name_the_window_heads_and_replicas() {
        let mut s = kv(2, 1);
        assert_eq!(
            KvShardLayout::new(s).unwrap().to_string(),
            "KVShardLayout(global_rank=1, tp=1/2, pp=0/1, layers=[0, 8) of 8, heads=[2, 4) of 4)"
        );
        (s.ep_size, s.ranks.ep_rank) = (2, 1);
        assert!(KvShardLayout::new(s).unwrap().to_string().ends_with("of 4, ep=1/2, etp=0/1)"));
        let l = SsmShardLayout::new(ssm_spec(Some((1, 2)))).unwrap();
        assert_eq!(
            l.to_string(),
            "SSMShardLayout(global_rank=1, tp=1/2, pp=0/1, layers=[1, 3) of ?, heads=[4, 8), \
             groups=[1, 2), dims=SSMStateDims(nheads=8, headdim=4, d_state=16, ngroups=2, d_conv=4))"
        );
    }

    #[test]
    fn even_tp_splits_heads() {
        let l = KvShardLayout::new(kv(2, 1)).unwrap();
        assert_eq!(l.heads, Span::new(2, 4));
        assert_eq!(l.layers, Span::new(0, 8));
    }

    #[test]
    fn gqa_replication_gives_one_head_per_group_of_ranks() {
        let l = KvShardLayout::new(kv(8, 5)).unwrap();
        assert_eq!(l.heads, Span::new(2, 3));
        assert_eq!(l.gqa_replication(), 2);
    }

    #[test]
    fn tp_rank_out_of_range_names_both_values() {
        let e = KvShardLayout::new(kv(2, 2)).unwrap_err();
        assert_eq!(e.kind(), "Layout");
        assert!(e.to_string().contains("tp_rank=2"), "{e}");
        assert!(e.to_string().contains("tp_size=2"), "{e}");
    }

    #[test]
    fn a_stage_window_is_explicit_with_both_fields_or_the_even_split() {
        let r = RankCoords::grid(1, 0, 2, 1, 1);
        let err = |total, start, count| r.layer_window(total, start, count).unwrap_err();
        assert!(err(Some(8), Some(2), None).to_string().contains("num_local_layers"));
        assert!(err(Some(8), Some(2), Some(7)).to_string().contains("num_layers=8"));
        assert!(err(None, None, None).to_string().contains("num_layers=None"));
        assert_eq!(r.layer_window(Some(8), None, None).unwrap(), (Span::new(4, 8), false));
        assert_eq!(r.layer_window(Some(8), Some(2), Some(6)).unwrap(), (Span::new(2, 8), true));
        // Without the model's total only an explicit window works.
        assert_eq!(r.layer_window(None, Some(6), Some(2)).unwrap(), (Span::new(6, 8), true));
    }

    #[test]
    fn layouts_keep_their_explicit_window_through_their_spec() {
        let mut k = kv(1, 0);
        (k.layer_start, k.num_local_layers) = (Some(2), Some(6));
        let l = KvShardLayout::new(k).unwrap();
        assert_eq!((l.layers, KvShardLayout::new(l.spec()).unwrap()), (Span::new(2, 8), l));
        let mut s = ssm(1, 0, 2, false);
        s.num_layers = None;
        assert!(SsmShardLayout::new(s).unwrap_err().to_string().contains("num_layers=None"));
        (s.layer_start, s.num_local_layers) = (Some(6), Some(2));
        let l = SsmShardLayout::new(s).unwrap();
        assert_eq!((l.layers, SsmShardLayout::new(l.spec()).unwrap()), (Span::new(6, 8), l));
    }

    #[test]
    fn ssm_bands_pack_x_then_b_then_c() {
        let dims = SsmStateDims::new(8, 4, 16, 2, 4).unwrap();
        let l = SsmShardLayout::new(SsmLayoutSpec {
            ranks: RankCoords::grid(2, 1, 1, 0, 1),
            ..SsmLayoutSpec::single_rank(2, dims)
        })
        .unwrap();
        assert_eq!(l.band(SsmBand::X).global, Span::new(16, 32));
        assert_eq!(l.band(SsmBand::X).local, Span::new(0, 16));
        assert_eq!(l.band(SsmBand::B).global, Span::new(32 + 16, 32 + 32));
        assert_eq!(l.band(SsmBand::B).local, Span::new(16, 32));
        assert_eq!(l.band(SsmBand::C).global, Span::new(64 + 16, 64 + 32));
        assert_eq!(l.band(SsmBand::C).local, Span::new(32, 48));
        assert_eq!(l.local_conv_channels(), 48);
        assert_eq!(l.band(SsmBand::Recurrent).global, Span::new(4, 8));
    }

    fn ssm(tp: u32, rank: u32, groups: u32, replicate: bool) -> SsmLayoutSpec {
        SsmLayoutSpec {
            ranks: RankCoords::grid(tp, rank, 1, 0, rank),
            replicate_groups: replicate,
            ..SsmLayoutSpec::single_rank(4, SsmStateDims::new(8, 4, 16, groups, 4).unwrap())
        }
    }

    #[test]
    fn an_explicit_window_equal_to_the_even_split_is_the_even_split() {
        let mut s = kv(1, 0);
        (s.ranks.pp_size, s.ranks.pp_rank) = (2, 1);
        let even = KvShardLayout::new(s).unwrap();
        s.layer_start = Some(4);
        s.num_local_layers = Some(4);
        assert_eq!(KvShardLayout::new(s).unwrap(), even);
        s.num_local_layers = Some(3);
        assert!(KvShardLayout::new(s).unwrap().explicit_window);
    }

    #[test]
    fn fewer_ssm_groups_than_ranks_needs_the_replication_opt_in() {
        let e = SsmShardLayout::new(ssm(4, 0, 2, false)).unwrap_err();
        assert_eq!(e.kind(), "Layout");
        assert!(e.to_string().contains("ngroups=2 < tp_size=4"), "{e}");
        assert!(e.to_string().contains("replicate_groups"), "{e}");
        let l = SsmShardLayout::new(ssm(4, 3, 2, true)).unwrap();
        assert_eq!(l.groups, Span::new(1, 2));
    }

    #[test]
    fn band_extent_is_total_local_size_and_local_offset() {
        let l = SsmShardLayout::new(ssm(2, 1, 2, false)).unwrap();
        assert_eq!(l.band_extent(SsmBand::X), (32, 16, 0));
        assert_eq!(l.band_extent(SsmBand::B), (32, 16, 16));
        assert_eq!(l.band_extent(SsmBand::C), (32, 16, 32));
        assert_eq!(l.band_extent(SsmBand::Recurrent), (8, 4, 0));
        assert_eq!(l.shard_key(), (1, 0));
    }

    #[test]
    fn an_ssm_call_reads_num_layers_as_the_stage_count_only_with_a_bare_layer_start() {
        let dims = SsmStateDims::new(8, 4, 16, 2, 4).unwrap();
        let call = |f: &[(&str, Option<u32>)]| SsmLayoutSpec::from_call(f, dims, false);
        // Ours: num_layers is the model's total, the window the even split.
        let s =
            call(&[("num_layers", Some(8)), ("pp_size", Some(2)), ("pp_rank", Some(1))]).unwrap();
        assert_eq!((s.num_layers, s.num_local_layers, s.ranks.global_rank), (Some(8), None, 1));
        // The reference design's: layer_start alone makes num_layers the stage's count.
        let f = [("num_layers", Some(3)), ("layer_start", Some(5)), ("total_layers", Some(8))];
        let s = call(&f).unwrap();
        assert_eq!((s.num_layers, s.layer_start, s.num_local_layers), (Some(8), Some(5), Some(3)));
        let e = call(&[("layer_start", Some(5))]).unwrap_err();
        assert_eq!((e.kind(), e.to_string().contains("num_layers")), ("Argument", true));
        let e = call(&[("num_layers", Some(8)), ("total_layers", Some(6))]).unwrap_err();
        assert!(matches!(e, DisaggError::Layout { ref field, .. } if field == "total_layers"));
        // The default global rank is pp_rank * tp_size + tp_rank, refused past u32.
        let f = [("num_layers", Some(8)), ("tp_size", Some(4)), ("tp_rank", Some(3))];
        assert_eq!(
            call(&[&f[..], &[("pp_rank", Some(2))]].concat()).unwrap().ranks.global_rank,
            11
        );
        let f = [("tp_size", Some(u32::MAX)), ("pp_rank", Some(2)), ("num_layers", Some(8))];
        assert!(
            matches!(call(&f).unwrap_err(), DisaggError::Layout { ref field, .. } if field == "global_rank")
        );
    }

    #[test]
    fn an_ssm_call_form_is_ours_unless_an_int_stands_where_our_dims_go() {
        let order = SsmLayoutSpec::call_order;
        assert_eq!(order(0, false, false)[0], "num_layers");
        assert_eq!(order(1, false, false)[0], "num_layers");
        assert_eq!(order(1, false, true)[0], "global_rank");
        assert_eq!(order(2, true, false)[1], "dims");
        assert_eq!(
            order(6, false, false),
            ["global_rank", "tp_size", "tp_rank", "layer_start", "num_layers", "dims"]
        );
        assert!(SsmLayoutSpec::DATACLASS_FIELDS
            .iter()
            .all(|k| SsmLayoutSpec::CALL_KEYS.contains(k)));
    }
}
