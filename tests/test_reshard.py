"""Reshard planners against oracles: a plain-Python planner, and a global tensor of unique values
split by the source layouts, moved by the plan, compared with a direct split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

import disagg_rs as dr
from layout_strategies import kv_cases, ssm_cases
from oracle_planner import Holding, Rect, plan_rects

SENTINEL = -1


def _kv_holding(layout: dr.KVShardLayout) -> Holding:
    return Holding(layout.global_rank, *layout.layers, *layout.heads)


@given(kv_cases())
def test_kv_plan_equals_the_plain_python_planner(case) -> None:
    srcs, dsts = case
    plan = dr.plan_kv_reshard(srcs, dsts)
    expected = plan_rects([_kv_holding(s) for s in srcs], [_kv_holding(d) for d in dsts])
    got = [Rect(t.src_rank, t.dst_rank, *t.layers, *t.heads) for t in plan]
    assert got == expected


@given(kv_cases())
def test_applying_the_kv_plan_reproduces_a_direct_split(case) -> None:
    srcs, dsts = case
    layers, heads = srcs[0].num_layers, srcs[0].num_kv_heads
    tokens, head_dim = 3, 2
    # [kv, layer, head, token, dim] of unique values.
    glob = np.arange(2 * layers * heads * tokens * head_dim, dtype=np.int64).reshape(
        2, layers, heads, tokens, head_dim
    )

    def split(layout: dr.KVShardLayout) -> np.ndarray:
        (l0, l1), (h0, h1) = layout.layers, layout.heads
        return glob[:, l0:l1, h0:h1].copy()

    src_mem = {s.global_rank: split(s) for s in srcs}
    dst_mem = {d.global_rank: np.full_like(split(d), SENTINEL) for d in dsts}
    plan = dr.plan_kv_reshard(srcs, dsts)
    plan.verify()
    for t in plan:
        (sl0, sl1), (sh0, sh1) = t.src_local_layers(), t.src_local_heads()
        (dl0, dl1), (dh0, dh1) = t.dst_local_layers(), t.dst_local_heads()
        target = dst_mem[t.dst_rank][:, dl0:dl1, dh0:dh1]
        assert (target == SENTINEL).all(), f"{t} overwrites cells already written"
        target[...] = src_mem[t.src_rank][:, sl0:sl1, sh0:sh1]
    for d in dsts:
        np.testing.assert_array_equal(dst_mem[d.global_rank], split(d))


@given(ssm_cases())
def test_applying_the_ssm_plan_reproduces_a_direct_split(case) -> None:
    srcs, dsts = case
    dims = srcs[0].dims
    layers, d_conv = srcs[0].total_layers, dims.d_conv
    conv = np.arange(layers * dims.conv_channels * d_conv, dtype=np.int64).reshape(
        layers, dims.conv_channels, d_conv
    )
    rec = -np.arange(
        1, 1 + layers * dims.num_heads * dims.head_dim * dims.d_state, dtype=np.int64
    ).reshape(layers, dims.num_heads, dims.head_dim, dims.d_state)

    def conv_split(layout: dr.SSMShardLayout) -> np.ndarray:
        l0, l1 = layout.layers
        bands = [conv[l0:l1, slice(*layout.band_span(b)[0])] for b in ("x", "B", "C")]
        return np.concatenate(bands, axis=1)

    def rec_split(layout: dr.SSMShardLayout) -> np.ndarray:
        (l0, l1), (h0, h1) = layout.layers, layout.heads
        return rec[l0:l1, h0:h1].copy()

    src_conv = {s.global_rank: conv_split(s) for s in srcs}
    src_rec = {s.global_rank: rec_split(s) for s in srcs}
    dst_conv = {d.global_rank: np.full_like(conv_split(d), SENTINEL) for d in dsts}
    dst_rec = {d.global_rank: np.full_like(rec_split(d), SENTINEL) for d in dsts}
    plan = dr.plan_ssm_reshard(srcs, dsts)
    plan.verify()
    for t in plan:
        sl, dl = slice(*t.src_local_layers()), slice(*t.dst_local_layers())
        src, dst = (src_conv, dst_conv) if t.state_kind == "conv" else (src_rec, dst_rec)
        target = dst[t.dst_rank][dl, slice(*t.dst_local)]
        assert (target == SENTINEL).all(), f"{t} overwrites cells already written"
        target[...] = src[t.src_rank][sl, slice(*t.src_local)]
    for d in dsts:
        np.testing.assert_array_equal(dst_conv[d.global_rank], conv_split(d))
        np.testing.assert_array_equal(dst_rec[d.global_rank], rec_split(d))


def test_tp8_to_tp4_pp2_plan_has_one_transfer_per_source_head_and_stage() -> None:
    srcs = [dr.KVShardLayout(80, 8, tp_size=8, tp_rank=r) for r in range(8)]
    dsts = [
        dr.KVShardLayout(
            80, 8, tp_size=4, tp_rank=r % 4, pp_size=2, pp_rank=r // 4, global_rank=8 + r
        )
        for r in range(8)
    ]
    plan = dr.plan_kv_reshard(srcs, dsts)
    assert len(plan) == 16
    assert {t.layers for t in plan} == {(0, 40), (40, 80)}
    assert plan.bytes_per_token(128, 2) == 2 * 80 * 8 * 128 * 2
    assert [t.dst_rank for t in plan.for_src(0)] == [8, 12]
    assert sum(len(plan.for_dst(d.global_rank)) for d in dsts) == len(plan)
    assert plan[-1] == plan.transfers[-1]
    with pytest.raises(IndexError):
        plan[16]


def test_gqa_replicas_are_read_once_from_the_smallest_rank() -> None:
    srcs = [dr.KVShardLayout(4, 2, tp_size=4, tp_rank=r) for r in range(4)]
    dst = [dr.KVShardLayout(4, 2, global_rank=9)]
    plan = dr.plan_kv_reshard(srcs, dst)
    assert [(t.src_rank, t.heads) for t in plan] == [(0, (0, 1)), (2, (1, 2))]
    assert srcs[1].gqa_replication == 2


def test_ep_replicas_are_read_once_from_the_smallest_rank() -> None:
    srcs = [dr.KVShardLayout(4, 2, global_rank=r, ep_rank=r) for r in (5, 3)]
    plan = dr.plan_kv_reshard(srcs, [dr.KVShardLayout(4, 2, global_rank=10)])
    assert [t.src_rank for t in plan] == [3]


def test_missing_pipeline_stage_is_a_coverage_error_naming_the_gap() -> None:
    srcs = [dr.KVShardLayout(8, 2, pp_size=2, pp_rank=0)]
    with pytest.raises(dr.PlanCoverageError, match="layer 4"):
        dr.plan_kv_reshard(srcs, [dr.KVShardLayout(8, 2, global_rank=5)])


def test_mixed_models_are_rejected_naming_both_values() -> None:
    with pytest.raises(dr.LayoutError, match="num_kv_heads=2 and num_kv_heads=4") as info:
        dr.plan_kv_reshard([dr.KVShardLayout(8, 2)], [dr.KVShardLayout(8, 4, global_rank=1)])
    assert info.value.field == "num_kv_heads"


def test_duplicate_global_ranks_are_rejected() -> None:
    srcs = [dr.KVShardLayout(8, 2, tp_size=2, tp_rank=r, global_rank=0) for r in range(2)]
    with pytest.raises(dr.LayoutError, match="global_rank=0 appears twice"):
        dr.plan_kv_reshard(srcs, [dr.KVShardLayout(8, 2, global_rank=3)])


def test_empty_layout_lists_are_rejected() -> None:
    with pytest.raises(dr.LayoutError, match="srcs"):
        dr.plan_kv_reshard([], [dr.KVShardLayout(8, 2)])


def test_ssm_plan_moves_x_b_c_and_recurrent_bands() -> None:
    dims = dr.SSMStateDims(num_heads=4, head_dim=2, d_state=3, n_groups=2, d_conv=4)
    srcs = [dr.SSMShardLayout(2, dims, tp_size=2, tp_rank=r) for r in range(2)]
    plan = dr.plan_ssm_reshard(srcs, [dr.SSMShardLayout(2, dims, global_rank=7)])
    plan.verify()
    assert sorted({t.band for t in plan}) == ["B", "C", "recurrent", "x"]
    # 2 sources x 4 bands, each over layers [0, 2): 8 ranges, 16 single-layer records.
    assert len(plan.ranges) == 8
    assert len(plan) == 16
    assert all(r.layers == (0, 2) for r in plan.ranges)
    x1 = next(t for t in plan if t.band == "x" and t.src_rank == 1)
    assert x1.global_range == (4, 8)
    assert x1.src_local == (0, 4)
    assert x1.dst_local == (4, 8)
