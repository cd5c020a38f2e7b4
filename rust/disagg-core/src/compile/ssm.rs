//! SSM state compilation (conv bands and the recurrent state).

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
use crate::geometry::{SsmGeometry, SsmStateKind};
use crate::layout::{SsmBand, SsmShardLayout};
use crate::reshard::plan_ssm_reshard;

use super::cost::{choose_mode, TransferMode};
use super::kv::{geometry_eq, overflow};
use super::program::{SourceProgram, TransferProgram};
use super::request::{source_geometry, SsmTransferRequest};
use super::verify::Expected;
use super::walk::{CopyBox, Work, PACKED};

/// Canonical packed order of SSM boxes: (recurrent?, source-local layer, band, first unit).
pub(super) type SsmPackKey = (u8, usize, SsmBand, u32);

pub(super) fn ssm_part_name(band: SsmBand) -> SsmStateKind {
    if band.is_conv() {
        SsmStateKind::Conv
    } else {
        SsmStateKind::Recurrent
    }
}

pub(super) fn check_ssm_geometry(
    l: &SsmShardLayout,
    g: &SsmGeometry,
    side: &str,
) -> DisaggResult<()> {
    let who = format!("{side} rank {} geometry vs layout", l.ranks.global_rank);
    geometry_eq("num_layers", &(g.num_layers() as u64), &u64::from(l.layers.len()), &who)?;
    if let Some(c) = &g.conv {
        geometry_eq("conv.num_units", &c.num_units, &l.local_conv_channels(), &who)?;
    }
    if let Some(r) = &g.recurrent {
        geometry_eq("recurrent.num_units", &r.num_units, &l.heads.len(), &who)?;
    }
    Ok(())
}

pub(super) fn check_slot(field: &str, slot: u32, g: &SsmGeometry) -> DisaggResult<()> {
    if slot >= g.num_slots() {
        return Err(DisaggError::block(
            field,
            format!("{field}={slot} must be < num_slots={}", g.num_slots()),
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_lines)]
/// Compile the SSM state transfer (conv bands x, B, C and the recurrent state) of one
/// destination rank for one slot. Validated like [`compile_kv_transfer`].
pub fn compile_ssm_transfer(req: &SsmTransferRequest) -> DisaggResult<TransferProgram> {
    let dst_l = &req.dst_layout;
    let dst_g = req.dst_geometry.as_ref();
    let dst = dst_g.zip(req.moved.dst_slot);
    let has_destination = dst.is_some();
    req.check_sides(has_destination, dst.map(|(g, _)| g), check_ssm_geometry)?;
    if let Some((d, slot)) = dst {
        check_slot("dst_slot", slot, d)?;
    }
    let layouts: Vec<SsmShardLayout> = req.srcs.iter().map(|(l, _)| *l).collect();
    let plan = plan_ssm_reshard(&layouts, std::slice::from_ref(dst_l))?;
    // The parts moved are those the destination geometry registers (or, without one, the
    // first source's): a backend buffer may hold only the conv or only the recurrent state.
    let reference = dst_g.or(req.srcs.first().map(|(_, g)| g));
    let moved = |kind: SsmStateKind| reference.is_some_and(|g| g.part(kind).is_some());
    // Boxes per source with their canonical packed-order key: conv before recurrent, then
    // source-local layer, then band (x, B, C) and channel, so the [x | B | C] pieces of one
    // layer sit next to each other on both sides and merge.
    let mut by_src: BTreeMap<u32, Vec<(SsmPackKey, CopyBox)>> = BTreeMap::new();
    for t in plan.transfers.iter().filter(|t| moved(ssm_part_name(t.band))) {
        let g =
            source_geometry(req.srcs.iter().map(|(l, g)| (l.ranks.global_rank, g)), t.src_rank)?;
        let kind = ssm_part_name(t.band);
        let part_of = |geo: &SsmGeometry, side: &str| {
            geo.part(kind).cloned().ok_or_else(|| {
                DisaggError::geometry(
                    kind.name(),
                    format!(
                        "{side} geometry has no {} part but the plan moves band {}",
                        kind.name(),
                        t.band.name()
                    ),
                )
            })
        };
        let sp = part_of(g, "source")?;
        let dp = dst_g.map(|d| part_of(d, "destination")).transpose()?;
        if let Some(dp) = &dp {
            let who = format!(
                "{} part, source rank {} vs destination rank {}",
                kind.name(),
                t.src_rank,
                dst_l.ranks.global_rank
            );
            geometry_eq("unit_bytes", &sp.unit_bytes, &dp.unit_bytes, &who)?;
            geometry_eq("element_size", &sp.element_size, &dp.element_size, &who)?;
            if let (Some(a), Some(b)) = (&sp.dtype, &dp.dtype) {
                geometry_eq("dtype", a, b, &who)?;
            }
        }
        let src_slot = *req.moved.src_slots.of_rank(t.src_rank).ok_or_else(|| {
            DisaggError::block("src_slot", format!("no slot for source global_rank={}", t.src_rank))
        })?;
        check_slot("src_slot", src_slot, g)?;
        let boxes = by_src.entry(t.src_rank).or_default();
        let units = u64::from(t.src_local.len());
        for l in 0..t.layers.len() {
            let sl = (t.src_local_layers().lo + l) as usize;
            let dl = (t.dst_local_layers().lo + l) as usize;
            let src_addr = sp.layer_bases[sl]
                + u64::from(src_slot) * sp.slot_stride
                + u64::from(t.src_local.lo) * sp.unit_stride;
            let dst_addr = match (&dp, req.moved.dst_slot) {
                (Some(dp), Some(slot)) => {
                    dp.layer_bases[dl]
                        + u64::from(slot) * dp.slot_stride
                        + u64::from(t.dst_local.lo) * dp.unit_stride
                }
                _ => 0,
            };
            let dst_stride = dp.as_ref().map_or(0, |d| d.unit_stride);
            let key = (u8::from(kind == SsmStateKind::Recurrent), sl, t.band, t.src_local.lo);
            boxes.push((
                key,
                CopyBox {
                    base: [src_addr, dst_addr, 0],
                    row: sp.unit_bytes,
                    dims: [[units, sp.unit_stride, dst_stride, sp.unit_bytes], [1, 0, 0, 0]],
                },
            ));
        }
    }
    let mut sources = Vec::with_capacity(by_src.len());
    for (src_rank, mut keyed) in by_src {
        keyed.sort_by_key(|(k, _)| *k);
        let mut packed_bytes = 0u64;
        let mut boxes = Vec::with_capacity(keyed.len());
        for (_, mut b) in keyed {
            b.base[PACKED] = packed_bytes;
            let size = b.dims[0][0].checked_mul(b.row).ok_or_else(|| overflow("packed size"))?;
            packed_bytes =
                packed_bytes.checked_add(size).ok_or_else(|| overflow("packed offset"))?;
            boxes.push(b);
        }
        let Some((_, g)) = req.srcs.iter().find(|(l, _)| l.ranks.global_rank == src_rank) else {
            continue;
        };
        let mut sp = SourceProgram {
            src_rank,
            src_device: g.device_id,
            mode: TransferMode::Staged,
            packed_bytes,
            work: Work::Boxes(boxes),
        };
        sp.mode = choose_mode(req.mode, &req.cost, &sp);
        sources.push(sp);
    }
    let expected = match (dst_g, req.moved.dst_slot) {
        (Some(d), Some(slot)) => Expected::Ssm { geometry: d.clone(), layout: *dst_l, slot },
        _ => Expected::None,
    };
    Ok(TransferProgram {
        dst_rank: dst_l.ranks.global_rank,
        dst_device: dst_g.map_or(0, |d| d.device_id),
        sources,
        has_destination,
        device_plans: true,
        expected,
    })
}
