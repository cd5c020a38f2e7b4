//! What the compiler is asked: the KV and SSM transfer requests.

use std::collections::BTreeMap;

use crate::args::{Int, IntList, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{KvGeometry, SsmGeometry};
use crate::layout::{KvShardLayout, SsmShardLayout};

use super::cost::{check_mode_needs, CostModel, ModeChoice};

/// A value for every source rank, or one per source global rank (pipeline stages allocate
/// independently).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerSource<T> {
    /// The same value on every source rank.
    Shared(T),
    /// A value per source global rank.
    PerRank(BTreeMap<u32, T>),
}

/// Source block ids: one list for every source rank, or one list per source global rank.
pub type SrcBlockIds = PerSource<Vec<u32>>;

/// Source SSM slot ids: one slot for every source rank, or one per source global rank.
pub type SrcSlots = PerSource<u32>;

impl<T> PerSource<T> {
    /// The values as given: `shared` for every source, else `per_rank` (global rank, value)
    /// pairs; `read` converts a value, and errors name `field`, `field (dict key)` or
    /// `field[rank]`.
    fn read<G>(
        shared: Option<&G>,
        per_rank: &[(Int, G)],
        field: &str,
        read: impl Fn(&G, &str) -> DisaggResult<T>,
    ) -> DisaggResult<Self> {
        if let Some(value) = shared {
            return Ok(Self::Shared(read(value, field)?));
        }
        let mut out = BTreeMap::new();
        for (k, v) in per_rank {
            let rank = k.to_u32(Kind::Block, &format!("{field} (dict key)"))?;
            out.insert(rank, read(v, &format!("{field}[{rank}]"))?);
        }
        Ok(Self::PerRank(out))
    }

    /// The value of source `rank`; `None` when a per-rank map does not name it.
    pub(super) fn of_rank(&self, rank: u32) -> Option<&T> {
        match self {
            Self::Shared(v) => Some(v),
            Self::PerRank(m) => m.get(&rank),
        }
    }
}

impl SrcBlockIds {
    /// Source block ids as given: one list for every source, or (`per_rank`) one list per
    /// source global rank; errors name the key or `src_block_ids[rank]`.
    pub fn given(shared: Option<&IntList>, per_rank: &[(Int, IntList)]) -> DisaggResult<Self> {
        Self::read(shared, per_rank, "src_block_ids", |v, f| v.to_u32s(Kind::Block, f))
    }

    pub(super) fn for_rank(&self, rank: u32, field: &str) -> DisaggResult<&[u32]> {
        match self {
            Self::Shared(v) => Ok(v),
            Self::PerRank(m) => m.get(&rank).map(Vec::as_slice).ok_or_else(|| {
                DisaggError::block(
                    field,
                    format!("no list for source global_rank={rank}; given ranks {:?}", m.keys()),
                )
            }),
        }
    }
}

impl SrcSlots {
    /// Source slots as given: one slot for every source, or (`per_rank`) one slot per source
    /// global rank; errors name the key or `src_slot[rank]`.
    pub fn given(shared: Option<&Int>, per_rank: &[(Int, Int)]) -> DisaggResult<Self> {
        Self::read(shared, per_rank, "src_slot", |v, f| v.to_u32(Kind::Block, f))
    }
}

/// The geometry of source rank `rank` among `srcs` (global rank and geometry of each source).
pub(super) fn source_geometry<'a, G: 'a>(
    mut srcs: impl Iterator<Item = (u32, &'a G)>,
    rank: u32,
) -> DisaggResult<&'a G> {
    srcs.find(|(r, _)| *r == rank).map(|(_, g)| g).ok_or_else(|| {
        DisaggError::layout("srcs", format!("plan names source rank {rank} not in srcs"))
    })
}

/// What a compiler is asked, for either kind of state: the source ranks and the destination
/// rank (layouts `L`, geometries `G`), what moves between them (`M`) and how.
#[derive(Debug, Clone)]
pub struct TransferRequest<L, G, M> {
    /// Source ranks with their geometries (any order; ranks that send nothing are ignored).
    pub srcs: Vec<(L, G)>,
    /// The destination rank this program is for.
    pub dst_layout: L,
    /// Its geometry; `None` allows only the gather side (what a prefill needs to pack).
    pub dst_geometry: Option<G>,
    /// The KV blocks and token range, or the SSM slots, that move.
    pub moved: M,
    /// Direct, staged or auto.
    pub mode: ModeChoice,
    /// Constants of the auto decision.
    pub cost: CostModel,
}

impl<L, G, M> TransferRequest<L, G, M> {
    /// The checks both compilers open with, in the order their errors are reported: without a
    /// destination (`has_destination`: its geometry and its blocks or slot) only
    /// `mode='staged'` compiles; then every source geometry, and the destination's `dst_geometry`
    /// when given, must fit its layout (`fits`).
    pub(super) fn check_sides(
        &self,
        has_destination: bool,
        dst_geometry: Option<&G>,
        fits: impl Fn(&L, &G, &str) -> DisaggResult<()>,
    ) -> DisaggResult<()> {
        check_mode_needs(self.mode, has_destination)?;
        for (l, g) in &self.srcs {
            fits(l, g, "source")?;
        }
        dst_geometry.map_or(Ok(()), |g| fits(&self.dst_layout, g, "destination"))
    }
}

/// The KV blocks and tokens a [`KvTransferRequest`] moves.
#[derive(Debug, Clone)]
pub struct KvTokens {
    /// Source block ids covering token positions `[0, num_tokens)`.
    pub src_block_ids: SrcBlockIds,
    /// Destination block ids covering `[0, num_tokens)`; `None` allows only the gather side.
    pub dst_block_ids: Option<Vec<u32>>,
    /// Tokens of the prompt state.
    pub num_tokens: u64,
    /// First token position moved (a cached prefix on the destination is skipped).
    pub token_start: u64,
}

/// The SSM slots an [`SsmTransferRequest`] moves.
#[derive(Debug, Clone)]
pub struct SsmSlots {
    /// Source slot: one for every source rank, or one per source global rank.
    pub src_slots: SrcSlots,
    /// Destination slot; `None` allows only the gather side.
    pub dst_slot: Option<u32>,
}

/// Everything `compile_kv_transfer` needs; see the module docs for the packed order.
pub type KvTransferRequest = TransferRequest<KvShardLayout, KvGeometry, KvTokens>;

/// Everything `compile_ssm_transfer` needs.
pub type SsmTransferRequest = TransferRequest<SsmShardLayout, SsmGeometry, SsmSlots>;

#[cfg(test)]
mod given_tests {
    use super::*;
    use crate::args::Given;

    fn field(e: DisaggError) -> String {
        match e {
            DisaggError::Block { field, .. } | DisaggError::ArgumentType { field, .. } => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn source_ids_and_slots_are_shared_or_per_rank_and_errors_name_the_rank() {
        let ids: IntList = Given(Ok(vec![1, 2]));
        assert_eq!(SrcBlockIds::given(Some(&ids), &[]), Ok(SrcBlockIds::Shared(vec![1, 2])));
        let per = [(Int::of(3), ids.clone())];
        let want = SrcBlockIds::PerRank(BTreeMap::from([(3, vec![1, 2])]));
        assert_eq!(SrcBlockIds::given(None, &per), Ok(want));
        let bad = [(Int::of(3), Given(Ok(vec![-1])))];
        assert_eq!(field(SrcBlockIds::given(None, &bad).unwrap_err()), "src_block_ids[3]");
        let key = [(Int::of(-3), ids)];
        assert_eq!(field(SrcBlockIds::given(None, &key).unwrap_err()), "src_block_ids (dict key)");
        assert_eq!(SrcSlots::given(Some(&Int::of(5)), &[]), Ok(SrcSlots::Shared(5)));
        let slots = [(Int::of(1), Int::of(-1))];
        assert_eq!(field(SrcSlots::given(None, &slots).unwrap_err()), "src_slot[1]");
        let slots = [(Given(Err("a str ('x')".into())), Int::of(1))];
        assert_eq!(field(SrcSlots::given(None, &slots).unwrap_err()), "src_slot (dict key)");
    }
}
