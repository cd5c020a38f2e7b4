//! The hot path of a transfer in one call: parsed peers and block ids in, the compiled
//! transfer program out. The peers were parsed once (see [`crate::wire::peer::PeerTable`]);
//! the block ids are checked here, once, and the program is compiled from the layouts and
//! geometries the parse built.

use std::collections::BTreeMap;

use crate::compile::{
    compile_kv_transfer, compile_kv_transfer_checked, compile_ssm_transfer, CostModel, KvTokens,
    KvTransferRequest, ModeChoice, SrcBlockIds, SrcSlots, SsmSlots, SsmTransferRequest,
    TransferProgram,
};
use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{KvGeometry, SsmGeometry};
use crate::layout::{KvShardLayout, SsmShardLayout};
use crate::wire::peer::{check_transfer, LocalSide, PeerGeometry, PeerLayout, PeerMeta, SourceIds};

/// What one transfer moves: the peers, the block ids and the token count.
#[derive(Debug, Clone)]
pub struct TransferPlanRequest<'a> {
    /// The source ranks' metadata.
    pub srcs: Vec<&'a PeerMeta>,
    /// The destination rank's metadata.
    pub dst: &'a PeerMeta,
    /// Source block ids (KV) or slots (SSM, one per source).
    pub src_ids: SourceIds,
    /// Destination block ids or slot; `None` on the source side of a staged transfer.
    pub dst_ids: Option<Vec<i64>>,
    /// Tokens to move (`None`: as many as the blocks hold).
    pub num_tokens: Option<i64>,
    /// This rank's side.
    pub local: LocalSide,
    /// `"auto"`, `"direct"` or `"staged"`.
    pub mode: ModeChoice,
}

/// The layout and geometry `pick` finds in a peer's metadata: `WireError` when it exported no
/// geometry, `GeometryMismatchError` when it holds another kind of state than `what`.
fn side<L, G>(
    meta: &PeerMeta,
    what: &str,
    pick: impl FnOnce(&PeerLayout, &PeerGeometry) -> Option<(L, G)>,
) -> DisaggResult<(L, G)> {
    let Some(geometry) = &meta.geometry else {
        return Err(DisaggError::wire(
            "geometry",
            format!("peer {:?} exported no compiler geometry", meta.agent_name),
        ));
    };
    pick(&meta.layout, geometry).ok_or_else(|| {
        DisaggError::geometry("state_kind", format!("peer {:?} is not {what}", meta.agent_name))
    })
}

fn kv_side(meta: &PeerMeta) -> DisaggResult<(KvShardLayout, KvGeometry)> {
    side(meta, "a KV cache", |l, g| match (l, g) {
        (PeerLayout::Kv(l), PeerGeometry::Kv(g)) => Some((*l, g.clone())),
        _ => None,
    })
}

fn ssm_side(meta: &PeerMeta) -> DisaggResult<(SsmShardLayout, SsmGeometry)> {
    side(meta, "SSM state", |l, g| match (l, g) {
        (PeerLayout::Ssm(l), PeerGeometry::Ssm(g)) => Some((*l, g.clone())),
        _ => None,
    })
}

/// The one slot of an SSM handoff.
pub fn one_slot(field: &str, ids: &[i64]) -> DisaggResult<u32> {
    match ids {
        [s] => u32::try_from(*s).map_err(|_| {
            DisaggError::block(field, format!("{field} holds slot {s}, not in [0, 2**32)"))
        }),
        _ => Err(DisaggError::block(
            field,
            format!("{field}: SSM state moves one slot per handoff, got {}", ids.len()),
        )),
    }
}

fn u32s(ids: &[i64]) -> Vec<u32> {
    // Checked by `check_transfer`: every id is in [0, num_blocks) with num_blocks a u32.
    ids.iter().map(|&b| u32::try_from(b).unwrap_or(u32::MAX)).collect()
}

/// Check the peers and block ids once, then compile the transfer. Returns the token count
/// moved (`None` for SSM state) and the program.
pub fn plan_transfer(
    req: &TransferPlanRequest<'_>,
) -> DisaggResult<(Option<u64>, TransferProgram)> {
    let num_tokens =
        check_transfer(&req.srcs, &req.src_ids, req.dst_ids.as_deref(), req.num_tokens, req.local)?;
    Ok((num_tokens, compile_checked(req, num_tokens)?))
}

/// Compile a transfer whose peers and block ids [`check_transfer`] accepted, moving
/// `num_tokens` tokens (KV; `None` for SSM state): the source block ids are not scanned
/// again (nor the destination's, when this rank is the destination).
pub fn compile_checked(
    req: &TransferPlanRequest<'_>,
    num_tokens: Option<u64>,
) -> DisaggResult<TransferProgram> {
    compile_program(req, num_tokens, true)
}

/// Compile a transfer whose block ids nothing checked yet: the compiler validates them all.
pub fn compile_unchecked(
    req: &TransferPlanRequest<'_>,
    num_tokens: Option<u64>,
) -> DisaggResult<TransferProgram> {
    compile_program(req, num_tokens, false)
}

fn compile_program(
    req: &TransferPlanRequest<'_>,
    num_tokens: Option<u64>,
    checked: bool,
) -> DisaggResult<TransferProgram> {
    let cost = CostModel::default();
    let kv = req.dst.state_kind == crate::wire::peer::StateKind::Kv;
    let mut program = match (kv, num_tokens) {
        (true, None) => {
            return Err(DisaggError::block("num_tokens", "a KV transfer needs a token count"))
        }
        (true, Some(n)) => {
            let srcs = req.srcs.iter().map(|m| kv_side(m)).collect::<DisaggResult<Vec<_>>>()?;
            let (dst_layout, dst_geometry) = kv_side(req.dst)?;
            let src_block_ids = match &req.src_ids {
                SourceIds::Shared(ids) => SrcBlockIds::Shared(u32s(ids)),
                SourceIds::PerRank(m) => SrcBlockIds::PerRank(
                    m.iter()
                        .map(|(r, ids)| (u32::try_from(*r).unwrap_or(u32::MAX), u32s(ids)))
                        .collect::<BTreeMap<_, _>>(),
                ),
            };
            let kv_req = KvTransferRequest {
                srcs,
                dst_layout,
                dst_geometry: Some(dst_geometry),
                moved: KvTokens {
                    src_block_ids,
                    dst_block_ids: req.dst_ids.as_deref().map(u32s),
                    num_tokens: n,
                    token_start: 0,
                },
                mode: req.mode,
                cost,
            };
            if checked {
                compile_kv_transfer_checked(&kv_req, req.local.is_dst)?
            } else {
                compile_kv_transfer(&kv_req)?
            }
        }
        (false, _) => {
            let srcs = req.srcs.iter().map(|m| ssm_side(m)).collect::<DisaggResult<Vec<_>>>()?;
            let (dst_layout, dst_geometry) = ssm_side(req.dst)?;
            let src_slots = match &req.src_ids {
                SourceIds::Shared(ids) => SrcSlots::Shared(one_slot("src_block_ids", ids)?),
                SourceIds::PerRank(m) => SrcSlots::PerRank(
                    m.iter()
                        .map(|(r, ids)| {
                            Ok((
                                u32::try_from(*r).unwrap_or(u32::MAX),
                                one_slot("src_block_ids", ids)?,
                            ))
                        })
                        .collect::<DisaggResult<BTreeMap<_, _>>>()?,
                ),
            };
            let dst_slot =
                req.dst_ids.as_deref().map(|ids| one_slot("dst_block_ids", ids)).transpose()?;
            compile_ssm_transfer(&SsmTransferRequest {
                srcs,
                dst_layout,
                dst_geometry: Some(dst_geometry),
                moved: SsmSlots { src_slots, dst_slot },
                mode: req.mode,
                cost,
            })?
        }
    };
    // A plan relative to one buffer base cannot address per-layer tensors.
    program.device_plans =
        req.srcs.iter().chain([&req.dst]).all(|m| m.buffer.regions.regions().len() <= 1);
    Ok(program)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::peer::{tests::meta_with_staging, Region};

    #[test]
    fn one_call_checks_the_ids_and_compiles_a_matched_pull() {
        let v = meta_with_staging(Region { addr: 1 << 20, nbytes: 4096 });
        let peer = PeerMeta::parse(&v, "nixl").unwrap();
        let local = LocalSide { is_dst: true, num_blocks: 4, tokens_per_block: Some(2) };
        let req = TransferPlanRequest {
            srcs: vec![&peer],
            dst: &peer,
            src_ids: SourceIds::Shared(vec![0, 1]),
            dst_ids: Some(vec![2, 3]),
            num_tokens: None,
            local,
            mode: ModeChoice::parse("direct").unwrap(),
        };
        let (n, program) = plan_transfer(&req).unwrap();
        assert_eq!(n, Some(4));
        let (src_rows, _) = program.direct_descriptors(0).unwrap();
        peer.check_addresses(&src_rows, "src").unwrap();
        let bad = TransferPlanRequest { src_ids: SourceIds::Shared(vec![0, 9]), ..req.clone() };
        let e = plan_transfer(&bad).unwrap_err();
        assert!(matches!(&e, DisaggError::Block { field, .. } if field == "src_block_ids"), "{e}");
        // Compiled without a check first, the compiler validates the ids itself.
        for ids in [vec![0, 9], vec![-1, 1]] {
            let bad = TransferPlanRequest { src_ids: SourceIds::Shared(ids), ..req.clone() };
            let e = compile_unchecked(&bad, Some(4)).unwrap_err();
            assert!(matches!(&e, DisaggError::Block { field, .. } if field == "src_block_ids"));
        }
        assert!(compile_unchecked(&req, Some(4)).is_ok());
    }

    #[test]
    fn an_ssm_handoff_moves_exactly_one_slot() {
        assert_eq!(one_slot("s", &[3]).unwrap(), 3);
        assert!(one_slot("s", &[1, 2]).is_err());
        assert!(one_slot("s", &[-1]).is_err());
    }
}
