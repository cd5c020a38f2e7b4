"""Helpers shared by the reshard planners and the transports (the reference design's ``utils``).

Ranges are half-open ``[lo, hi)``. ``transfers_for_src`` / ``transfers_for_dst`` filter a plan
to one rank's transfers; on the plans ``plan_kv_reshard`` and ``plan_ssm_reshard`` return, the
filtering runs in Rust (``plan.for_src`` / ``plan.for_dst``) and keeps plan order.

``transfer_peer_records`` flattens flat, TP-wrapped (``{"tp_metas": [...]}``) and PP-wrapped
(``{"pp_metas": [...]}``) peer metadata into ``(meta, block_ids)`` records;
``transfer_block_count`` counts a handoff's blocks; ``drop_transfer_prefix_blocks`` removes a
cached prefix. They parse block ids once, in Rust (``BlockIdError`` for a negative id,
``MetadataError`` for a metadata entry that is not a dict).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from disagg_rs._core import (
    KVReshardPlan,
    SSMReshardPlan,
    drop_transfer_prefix_blocks,
    transfer_block_count,
    transfer_peer_records,
)

__all__ = [
    "drop_transfer_prefix_blocks",
    "intersect",
    "transfer_block_count",
    "transfer_peer_records",
    "transfers_for_dst",
    "transfers_for_src",
]


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The overlap of two half-open ranges ``[lo, hi)``, or ``None`` if they are disjoint."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def transfers_for_src(plan: Iterable[Any], src_rank: int) -> list[Any]:
    """The transfers of ``plan`` that ``src_rank`` sends, in plan order (KV or SSM plans, or
    any iterable of records with a ``src_rank`` field)."""
    if isinstance(plan, (KVReshardPlan, SSMReshardPlan)):
        return list(plan.for_src(src_rank))
    return [t for t in plan if t.src_rank == src_rank]


def transfers_for_dst(plan: Iterable[Any], dst_rank: int) -> list[Any]:
    """The transfers of ``plan`` that ``dst_rank`` receives, in plan order (KV or SSM plans, or
    any iterable of records with a ``dst_rank`` field)."""
    if isinstance(plan, (KVReshardPlan, SSMReshardPlan)):
        return list(plan.for_dst(dst_rank))
    return [t for t in plan if t.dst_rank == dst_rank]
