"""The reference design's public surface (Megatron-LM's disaggregation package), kept working
under ``disagg_rs``: an engine written against it runs with only its import paths changed.

Each section covers one part of the surface; our own names are checked to be aliases of the same
implementation (same objects, same errors), never a second code path.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import disagg_rs as dr
from disagg_rs import kv_reshard, ssm_reshard, utils
from disagg_rs.exceptions import LayoutError
from layout_strategies import kv_cases, ssm_cases
from oracle_planner import Holding, plan_rects

# --- reshard surface ---

SENTINEL = -1
DIMS = ssm_reshard.SSMStateDims(8, 4, 2, 2, 3)  # nheads, headdim, d_state, ngroups, d_conv
#: The reference design's ``KVShardLayout`` dataclass fields in its (positional) order, each
#: with a sample value (no explicit layer window: derived from the PP split).
KV_FIELD_SAMPLES: tuple[tuple[str, int | None], ...] = (
    ("num_layers", 12),
    ("num_heads", 8),
    ("tp_size", 2),
    ("tp_rank", 1),
    ("pp_size", 3),
    ("pp_rank", 2),
    ("global_rank", 7),
    ("ep_size", 2),
    ("ep_rank", 1),
    ("etp_size", 3),
    ("etp_rank", 2),
    ("layer_start", None),
    ("num_local_layers", None),
)
KV_LAYOUT_FIELDS = [name for name, _ in KV_FIELD_SAMPLES]


def test_the_reference_modules_export_the_package_classes() -> None:
    assert kv_reshard.KVShardLayout is dr.KVShardLayout
    assert kv_reshard.KVReshardTransfer is dr.KVReshardTransfer
    assert kv_reshard.plan_kv_reshard is dr.plan_kv_reshard
    assert ssm_reshard.SSMStateDims is dr.SSMStateDims
    assert ssm_reshard.SSMShardLayout is dr.SSMShardLayout
    assert ssm_reshard.SSMReshardTransfer is dr.SSMReshardTransfer
    assert ssm_reshard.plan_ssm_reshard is dr.plan_ssm_reshard


# KVShardLayout


def test_kv_layout_takes_every_reference_field_positionally_and_by_keyword() -> None:
    names = list(kv_reshard.KVShardLayout.__dataclass_fields__)
    assert names == KV_LAYOUT_FIELDS
    values = [value for _, value in KV_FIELD_SAMPLES]
    positional = kv_reshard.KVShardLayout(*values)  # type: ignore[arg-type]
    keywords = kv_reshard.KVShardLayout(**dict(KV_FIELD_SAMPLES))  # type: ignore[arg-type]
    assert positional == keywords
    assert [getattr(keywords, n) for n in names[2:11]] == list(values[2:11])
    assert (keywords.ep_size, keywords.ep_rank, keywords.etp_size, keywords.etp_rank) == (
        2,
        1,
        3,
        2,
    )


def test_num_kv_heads_is_an_alias_of_num_heads() -> None:
    ours = dr.KVShardLayout(12, num_kv_heads=8, tp_size=2, tp_rank=1, global_rank=1)
    theirs = dr.KVShardLayout(12, num_heads=8, tp_size=2, tp_rank=1, global_rank=1)
    assert ours == theirs and hash(ours) == hash(theirs)
    assert ours.num_heads == ours.num_kv_heads == 8
    with pytest.raises(TypeError, match="not both"):
        dr.KVShardLayout(12, 8, num_kv_heads=8)
    with pytest.raises(TypeError, match="num_heads"):
        dr.KVShardLayout(12)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 3), (4, 2), (8, 4)])
def test_kv_layout_methods_give_the_even_split_of_layers_and_heads(tp: int, pp: int) -> None:
    layers, heads = 12, 8
    for p in range(pp):
        for t in range(tp):
            lay = dr.KVShardLayout(layers, heads, tp, t, pp, p, p * tp + t)
            per_l, per_h = layers // pp, heads // tp
            assert lay.layer_range() == (p * per_l, (p + 1) * per_l) == lay.layers
            assert lay.head_range() == (t * per_h, (t + 1) * per_h) == lay.heads
            assert lay.local_num_layers() == per_l == lay.num_local_layers
            assert lay.local_num_heads() == per_h == lay.heads_per_partition
            assert lay.kv_shard_key() == (t, p)


def test_an_explicit_window_equal_to_the_even_split_is_the_same_layout() -> None:
    even = dr.KVShardLayout(12, 8, 1, 0, 2, 1, 1)
    spelled = dr.KVShardLayout(12, 8, 1, 0, 2, 1, 1, layer_start=6, num_local_layers=6)
    assert spelled == even and hash(spelled) == hash(even)
    assert not spelled.explicit_window
    assert dr.KVShardLayout(12, 8, 1, 0, 2, 1, 1, layer_start=5, num_local_layers=7).explicit_window


def test_kv_layout_is_a_dataclass_that_round_trips_through_asdict_and_replace() -> None:
    lay = dr.KVShardLayout(12, 8, 2, 1, 3, 2, 7, ep_size=2, ep_rank=1)
    assert [f.name for f in dataclasses.fields(lay)] == KV_LAYOUT_FIELDS
    assert dataclasses.is_dataclass(lay)
    assert dr.KVShardLayout(**dataclasses.asdict(lay)) == lay
    moved = dataclasses.replace(lay, tp_rank=0)
    assert moved.head_range() == (0, 4) and moved.global_rank == 7
    assert dr.KVShardLayout.from_dict(dataclasses.asdict(lay)) == lay
    assert pickle.loads(pickle.dumps(lay)) == lay
    uneven = dr.KVShardLayout(12, 8, 1, 0, 2, 0, 0, layer_start=0, num_local_layers=5)
    assert dr.KVShardLayout(**dataclasses.asdict(uneven)) == uneven


def test_kv_layout_errors_are_value_errors_naming_the_field() -> None:
    with pytest.raises(LayoutError, match="num_local_layers") as e:
        dr.KVShardLayout(12, 8, 1, 0, 2, 0, 0, layer_start=0)
    assert isinstance(e.value, ValueError)
    with pytest.raises(LayoutError, match="ep_size=0"):
        dr.KVShardLayout(12, 8, ep_size=0)
    with pytest.raises(LayoutError, match="num_kv_heads=8 is not divisible by tp_size=3"):
        dr.KVShardLayout(12, 8, 3, 0)


# KVReshardTransfer


def test_kv_transfer_fields_and_slices_follow_the_reference_records() -> None:
    srcs = [dr.KVShardLayout(12, 8, 4, t, 2, p, p * 4 + t) for p in range(2) for t in range(4)]
    dst = dr.KVShardLayout(12, 8, 2, 1, 3, 1, 20)
    plan = dr.plan_kv_reshard(srcs, [dst])
    by_rank = {s.global_rank: s for s in srcs}
    assert len(plan) == 4  # layers [4, 8) cross the stage cut at 6; heads [4, 8) are 2 sources
    for t in plan:
        src = by_rank[t.src_rank]
        assert (t.global_layer_lo, t.global_layer_hi) == t.layers
        assert (t.global_head_lo, t.global_head_hi) == t.heads
        assert t.src_layer_slice(src) == slice(*t.src_local_layers())
        assert t.src_head_slice(src) == slice(*t.src_local_heads())
        assert t.dst_layer_slice(dst) == slice(*t.dst_local_layers())
        assert t.dst_head_slice(dst) == slice(*t.dst_local_heads())
        lo = src.layer_range()[0]
        assert t.src_layer_slice(src) == slice(t.global_layer_lo - lo, t.global_layer_hi - lo)


def test_a_slice_against_a_layout_that_does_not_hold_the_range_is_a_layout_error() -> None:
    srcs = [dr.KVShardLayout(4, 4, 2, t) for t in range(2)]
    plan = dr.plan_kv_reshard(srcs, [dr.KVShardLayout(4, 4, global_rank=9)])
    second = plan.for_src(1)[0]
    with pytest.raises(LayoutError, match="global_rank=0 holds heads"):
        second.src_head_slice(srcs[0])


@st.composite
def _expert_replicated_kv(draw: st.DrawFn) -> tuple[list[Any], list[Any]]:
    """Sources replicated over EP and ETP with shuffled global ranks, any destination TP/PP."""
    layers, heads = 6, 4
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    ep, etp = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    coords = [
        (p, t, e, et) for p in range(pp) for t in range(tp) for e in range(ep) for et in range(etp)
    ]
    ranks = draw(st.permutations(range(len(coords))))
    srcs = [
        dr.KVShardLayout(layers, heads, tp, t, pp, p, rank, ep, e, etp, et)
        for (p, t, e, et), rank in zip(coords, ranks, strict=True)
    ]
    dtp, dpp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    dsts = [
        dr.KVShardLayout(layers, heads, dtp, t, dpp, p, 100 + p * dtp + t)
        for p in range(dpp)
        for t in range(dtp)
    ]
    return srcs, dsts


@given(_expert_replicated_kv())
def test_ep_and_etp_replicas_are_read_once_from_the_smallest_global_rank(case) -> None:
    srcs, dsts = case
    plan = dr.plan_kv_reshard(srcs, dsts)
    smallest: dict[tuple[int, int], int] = {}
    for s in srcs:
        key = s.kv_shard_key()
        smallest[key] = min(smallest.get(key, s.global_rank), s.global_rank)
    by_rank = {s.global_rank: s for s in srcs}
    assert {t.src_rank for t in plan} <= set(smallest.values())
    for t in plan:
        assert t.src_rank == smallest[by_rank[t.src_rank].kv_shard_key()]


def _apply_kv_with_reference_slices(srcs: list[Any], dsts: list[Any]) -> None:
    """The reference design's test recipe with numpy: a global tensor of unique values, split by
    the sources, moved with ``transfers_for_dst`` and the ``*_slice`` helpers into
    sentinel-filled destinations, compared with a direct split."""
    layers, heads = srcs[0].num_layers, srcs[0].num_heads
    glob = np.arange(2 * layers * heads * 3, dtype=np.int64).reshape(2, layers, 3, heads)

    def split(lay: Any) -> np.ndarray:
        (l0, l1), (h0, h1) = lay.layer_range(), lay.head_range()
        return glob[:, l0:l1, :, h0:h1].copy()

    src_mem = {s.global_rank: split(s) for s in srcs}
    by_rank = {s.global_rank: s for s in srcs}
    plan = kv_reshard.plan_kv_reshard(srcs, dsts)
    for d in dsts:
        out = np.full((2, d.local_num_layers(), 3, d.local_num_heads()), SENTINEL)
        for t in utils.transfers_for_dst(plan, d.global_rank):
            s = by_rank[t.src_rank]
            target = out[:, t.dst_layer_slice(d), :, t.dst_head_slice(d)]
            assert (target == SENTINEL).all(), f"{t} overwrites cells already written"
            target[...] = src_mem[t.src_rank][:, t.src_layer_slice(s), :, t.src_head_slice(s)]
        np.testing.assert_array_equal(out, split(d))


@given(kv_cases())
def test_reference_style_kv_records_equal_the_oracle_and_rebuild_a_direct_split(case) -> None:
    srcs, dsts = case
    plan = dr.plan_kv_reshard(srcs, dsts)
    hold = [Holding(x.global_rank, *x.layer_range(), *x.head_range()) for x in (*srcs, *dsts)]
    oracle = plan_rects(hold[: len(srcs)], hold[len(srcs) :])
    got = [
        (
            *(t.src_rank, t.dst_rank, t.global_layer_lo, t.global_layer_hi),
            *(t.global_head_lo, t.global_head_hi),
        )
        for t in plan
    ]
    assert got == [(r.src, r.dst, r.l0, r.l1, r.u0, r.u1) for r in oracle]
    _apply_kv_with_reference_slices(srcs, dsts)


@given(_expert_replicated_kv())
def test_expert_replicated_sources_rebuild_a_direct_split(case) -> None:
    _apply_kv_with_reference_slices(*case)


# SSMStateDims


def test_ssm_dims_take_the_reference_names_and_ours_as_aliases() -> None:
    ref = ssm_reshard.SSMStateDims(nheads=8, headdim=4, d_state=2, ngroups=2, d_conv=3)
    ours = dr.SSMStateDims(num_heads=8, head_dim=4, d_state=2, n_groups=2, d_conv=3)
    assert ref == ours == DIMS and hash(ref) == hash(ours)
    assert (ref.nheads, ref.headdim, ref.ngroups) == (ref.num_heads, ref.head_dim, ref.n_groups)
    assert dataclasses.asdict(ref) == {
        "nheads": 8,
        "headdim": 4,
        "d_state": 2,
        "ngroups": 2,
        "d_conv": 3,
    }
    assert dr.SSMStateDims(**dataclasses.asdict(ref)) == ref
    assert dr.SSMStateDims.from_dict(dataclasses.asdict(ref)) == ref
    with pytest.raises(TypeError, match="not both"):
        dr.SSMStateDims(8, 4, 2, ngroups=2, n_groups=2)
    with pytest.raises(TypeError, match="d_state"):
        dr.SSMStateDims(8, 4)


# SSMShardLayout


def test_ssm_layout_takes_the_reference_form_positionally_and_by_keyword() -> None:
    positional = ssm_reshard.SSMShardLayout(3, 2, 1, 4, 4, DIMS)
    keywords = ssm_reshard.SSMShardLayout(
        global_rank=3, tp_size=2, tp_rank=1, layer_start=4, num_layers=4, dims=DIMS
    )
    assert positional == keywords
    assert keywords.num_layers == 4 and keywords.layer_range() == (4, 8)
    assert keywords.total_layers is None
    assert keywords.shard_key() == (1, 4)
    assert keywords.layer_map == {4: 0, 5: 1, 6: 2, 7: 3}


def test_the_reference_form_and_ours_build_the_same_layout() -> None:
    ref = dr.SSMShardLayout(3, 2, 1, 4, 4, DIMS, total_layers=8, pp_size=2, pp_rank=1)
    ours = dr.SSMShardLayout(8, DIMS, 2, 1, 2, 1, 3)
    assert ref == ours and hash(ref) == hash(ours)
    assert ours.num_layers == ours.num_local_layers == 4  # the stage's count, as upstream
    assert ours.total_layers == 8


def test_ssm_layout_properties_and_band_follow_the_reference_design() -> None:
    lay = dr.SSMShardLayout(0, 2, 1, 0, 4, DIMS)
    assert (lay.d_inner, lay.d_inner_local, lay.nheads_local, lay.ngroups_local) == (32, 16, 4, 1)
    assert lay.conv_dim_local == lay.local_conv_channels == 16 + 2 * 2
    assert lay.conv_bands == ("x", "B", "C")
    assert lay.band("x") == (32, 16, 0)
    assert lay.band("B") == (4, 2, 16)
    assert lay.band("C") == (4, 2, 18)
    assert lay.band("recurrent") == (8, 4, 0)
    assert lay.band_span("B") == ((34, 36), (16, 18))
    with pytest.raises(LayoutError, match="band"):
        lay.band("z")  # type: ignore[arg-type]


def test_ssm_layouts_of_either_form_round_trip_through_asdict_pickle_and_the_wire() -> None:
    for lay in (
        dr.SSMShardLayout(1, 2, 1, 0, 4, DIMS),
        dr.SSMShardLayout(8, DIMS, 2, 1, 2, 1, 3, ep_rank=1),
        dr.SSMShardLayout(8, DIMS, 1, 0, 2, 1, layer_start=3, num_local_layers=5),
    ):
        as_dict = dataclasses.asdict(lay)
        assert isinstance(as_dict["dims"], dict)
        assert dr.SSMShardLayout(**as_dict) == lay
        assert dataclasses.replace(lay) == lay
        assert dr.SSMShardLayout.from_dict(lay.to_dict()) == lay
        assert dr.SSMShardLayout(**lay.to_dict()) == lay
        assert pickle.loads(pickle.dumps(lay)) == lay


def test_ssm_layout_rejects_fewer_groups_than_tp_ranks_unless_replication_is_opted_in() -> None:
    dims = dr.SSMStateDims(8, 4, 2, 2, 3)
    with pytest.raises(LayoutError, match="ngroups=2 < tp_size=4") as e:
        dr.SSMShardLayout(0, 4, 0, 0, 1, dims)
    assert isinstance(e.value, ValueError) and e.value.field == "n_groups"
    with pytest.raises(LayoutError, match="replicate_groups=True"):
        dr.SSMShardLayout(1, dims, tp_size=4)
    lay = dr.SSMShardLayout(1, dims, tp_size=4, tp_rank=3, replicate_groups=True)
    assert lay.replicate_groups and lay.groups == (1, 2) and lay.heads == (6, 8)
    assert dr.SSMShardLayout.from_dict(lay.to_dict()) == lay
    assert dr.SSMShardLayout(**dataclasses.asdict(lay)) == lay
    wire = lay.to_dict()
    del wire["replicate_groups"]
    with pytest.raises(LayoutError, match="ngroups=2 < tp_size=4"):
        dr.SSMShardLayout.from_dict(wire)


def test_ssm_layout_arguments_that_cannot_mean_one_layout_are_type_errors() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        dr.SSMShardLayout(4, DIMS, bogus=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="multiple values"):
        dr.SSMShardLayout(4, DIMS, num_layers=4)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="at most 6 positional"):
        dr.SSMShardLayout(0, 1, 0, 0, 4, DIMS, 1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="dims"):
        dr.SSMShardLayout(0, 1, 0, 0, 4, 5)  # type: ignore[call-overload]
    with pytest.raises(LayoutError, match="num_layers=4 and total_layers=8"):
        dr.SSMShardLayout(4, DIMS, total_layers=8)


# SSMReshardTransfer and the plan


def test_iterating_an_ssm_plan_gives_single_layer_records_with_the_reference_fields() -> None:
    srcs = [dr.SSMShardLayout(r, 2, r, 0, 4, DIMS) for r in range(2)]
    dst = dr.SSMShardLayout(5, 1, 0, 0, 4, DIMS)
    plan = ssm_reshard.plan_ssm_reshard(srcs, [dst])
    assert len(plan) == 2 * 4 * 4 and len(plan.ranges) == 2 * 4
    assert list(plan) == plan.transfers
    x1 = next(t for t in plan if t.band == "x" and t.src_rank == 1 and t.global_layer == 2)
    assert (x1.src_layer, x1.dst_layer, x1.is_conv) == (2, 2, True)
    assert (x1.src_lo, x1.src_hi, x1.dst_lo, x1.dst_hi) == (0, 16, 16, 32)
    c0 = next(t for t in plan if t.band == "C" and t.src_rank == 0 and t.global_layer == 0)
    assert (c0.src_lo, c0.src_hi, c0.dst_lo, c0.dst_hi) == (18, 20, 36, 38)
    rec = next(t for t in plan if t.band == "recurrent" and t.src_rank == 1)
    assert not rec.is_conv and (rec.dst_lo, rec.dst_hi) == (4, 8)
    with pytest.raises(LayoutError, match="spans layers"):
        _ = plan.ranges[0].global_layer


def test_ssm_replicas_are_read_once_from_the_smallest_global_rank() -> None:
    replicas = [dr.SSMShardLayout(g, 1, 0, 0, 4, DIMS) for g in (7, 3, 5)]
    plan = dr.plan_ssm_reshard(replicas, [dr.SSMShardLayout(9, 1, 0, 0, 4, DIMS)])
    assert {t.src_rank for t in plan} == {3}


def _expected_ssm_records(srcs: list[Any], dsts: list[Any]) -> list[tuple[Any, ...]]:
    """The reference design's per-layer records, from the oracle planner's rectangles and the
    [x | B | C] packing written out by hand."""
    dims = srcs[0].dims
    p, n = dims.headdim, dims.d_state

    def hold(ls: list[Any], by_groups: bool) -> list[Holding]:
        return [
            Holding(x.global_rank, *x.layers, *(x.groups if by_groups else x.heads)) for x in ls
        ]

    def local(lay: Any, band: str, u0: int, u1: int) -> tuple[int, int]:
        h0, g0 = lay.heads[0], lay.groups[0]
        x_local = (lay.heads[1] - h0) * p
        bc_local = (lay.groups[1] - g0) * n
        if band == "x":
            return (u0 - h0) * p, (u1 - h0) * p
        if band == "recurrent":
            return u0 - h0, u1 - h0
        base = x_local + (bc_local if band == "C" else 0)
        return base + (u0 - g0) * n, base + (u1 - g0) * n

    by_rank = {x.global_rank: x for x in (*srcs, *dsts)}
    out = []
    for band, by_groups in (("x", False), ("B", True), ("C", True), ("recurrent", False)):
        for r in plan_rects(hold(srcs, by_groups), hold(dsts, by_groups)):
            s, d = by_rank[r.src], by_rank[r.dst]
            for g in range(r.l0, r.l1):
                out.append(
                    (
                        *(r.src, r.dst, band, g, g - s.layers[0], g - d.layers[0]),
                        *local(s, band, r.u0, r.u1),
                        *local(d, band, r.u0, r.u1),
                    )
                )
    return sorted(out)


@given(ssm_cases())
def test_reference_style_ssm_records_equal_the_oracle_and_rebuild_a_direct_split(case) -> None:
    srcs, dsts = case
    plan = ssm_reshard.plan_ssm_reshard(srcs, dsts)
    got = sorted(
        (
            *(t.src_rank, t.dst_rank, t.band, t.global_layer, t.src_layer, t.dst_layer),
            *(t.src_lo, t.src_hi, t.dst_lo, t.dst_hi),
        )
        for t in plan
    )
    assert got == _expected_ssm_records(srcs, dsts)

    # The reference design's recipe: shard a global state of unique values, apply the records
    # with the reference field names, compare with a direct shard.
    dims = srcs[0].dims
    layers = srcs[0].total_layers
    x_w, bc_w = dims.nheads * dims.headdim, dims.ngroups * dims.d_state
    conv = np.arange(layers * dims.conv_channels * 2, dtype=np.int64).reshape(layers, -1, 2)
    rec = -np.arange(1, 1 + layers * dims.nheads * 3, dtype=np.int64).reshape(layers, -1, 3)

    def shard(lay: Any) -> tuple[np.ndarray, np.ndarray]:
        (l0, l1), (h0, h1), (g0, g1) = lay.layer_range(), lay.heads, lay.groups
        p, n = dims.headdim, dims.d_state
        x = conv[l0:l1, h0 * p : h1 * p]
        b = conv[l0:l1, x_w + g0 * n : x_w + g1 * n]
        c = conv[l0:l1, x_w + bc_w + g0 * n : x_w + bc_w + g1 * n]
        return np.concatenate([x, b, c], axis=1), rec[l0:l1, h0:h1].copy()

    src_mem = {s.global_rank: shard(s) for s in srcs}
    out = {
        d.global_rank: (
            np.full((d.num_layers, d.conv_dim_local, 2), SENTINEL),
            np.full((d.num_layers, d.nheads_local, 3), SENTINEL),
        )
        for d in dsts
    }
    for t in plan:
        k = 0 if t.is_conv else 1
        target = out[t.dst_rank][k][t.dst_layer, t.dst_lo : t.dst_hi]
        assert (target == SENTINEL).all(), f"{t} overwrites cells already written"
        target[...] = src_mem[t.src_rank][k][t.src_layer, t.src_lo : t.src_hi]
    for d in dsts:
        want = shard(d)
        np.testing.assert_array_equal(out[d.global_rank][0], want[0])
        np.testing.assert_array_equal(out[d.global_rank][1], want[1])


# utils


def test_intersect_is_the_overlap_of_half_open_ranges() -> None:
    assert utils.intersect((0, 4), (2, 8)) == (2, 4)
    assert utils.intersect((0, 4), (4, 8)) is None
    assert utils.intersect((3, 5), (0, 9)) == (3, 5)


def _assert_rank_filters_keep_plan_order(plan, srcs, dsts) -> None:
    """`transfers_for_src`/`_dst` of the plan and of a list of it are the plan's own filter."""
    for side, layouts, pick in (
        ("src", srcs, utils.transfers_for_src),
        ("dst", dsts, utils.transfers_for_dst),
    ):
        for lay in layouts:
            want = [t for t in plan if getattr(t, f"{side}_rank") == lay.global_rank]
            assert pick(plan, lay.global_rank) == want
            assert pick(list(plan), lay.global_rank) == want


@given(kv_cases())
def test_transfers_for_src_and_dst_filter_a_kv_plan_in_plan_order(case) -> None:
    _assert_rank_filters_keep_plan_order(dr.plan_kv_reshard(*case), *case)


@given(ssm_cases())
def test_transfers_for_src_and_dst_filter_an_ssm_plan_into_single_layer_records(case) -> None:
    plan = dr.plan_ssm_reshard(*case)
    _assert_rank_filters_keep_plan_order(plan, *case)
    assert all(t.layers[1] - t.layers[0] == 1 for t in plan)


def test_peer_records_flatten_flat_tp_and_pp_wrapped_metadata() -> None:
    a, b, c = {"agent": "a"}, {"agent": "b", "block_ids": [7, 8]}, {"agent": "c"}
    assert utils.transfer_peer_records(a, [1, 2]) == [(a, [1, 2])]
    assert utils.transfer_peer_records({"tp_metas": [a, b]}, (3, 4)) == [(a, [3, 4]), (b, [7, 8])]
    staged = {"pp_metas": [{"tp_metas": [a, c], "block_ids": [5]}, {**b}]}
    assert utils.transfer_peer_records(staged, [9]) == [(a, [5]), (c, [5]), (b, [7, 8])]
    assert utils.transfer_block_count(staged, [9]) == 1
    assert utils.transfer_block_count({"tp_metas": []}, [1, 2]) == 0
    assert utils.transfer_block_count(a, np.arange(4)) == 4


def test_peer_records_reject_entries_that_are_not_dicts_and_negative_block_ids() -> None:
    with pytest.raises(dr.exceptions.MetadataError, match="must be dictionaries") as e:
        utils.transfer_peer_records({"tp_metas": [{"agent": "a"}, "b"]}, [1])
    assert isinstance(e.value, ValueError)
    with pytest.raises(dr.exceptions.BlockIdError, match="-1"):
        utils.transfer_peer_records({"agent": "a"}, [0, -1])


def test_dropping_a_cached_prefix_trims_every_block_list_and_leaves_the_input_alone() -> None:
    meta = {"pp_metas": [{"tp_metas": [{"block_ids": [1, 2, 3]}], "block_ids": [4, 5, 6]}]}
    original = repr(meta)
    trimmed, src = utils.drop_transfer_prefix_blocks(meta, [7, 8, 9], 2)
    assert trimmed == {"pp_metas": [{"tp_metas": [{"block_ids": [3]}], "block_ids": [6]}]}
    assert src == [9]
    assert repr(meta) == original
    same, src = utils.drop_transfer_prefix_blocks(meta, [7, 8], 0)
    assert same is meta and src == [7, 8]
    assert utils.drop_transfer_prefix_blocks({"block_ids": [1, 2]}, [], 1) == (
        {"block_ids": [2]},
        [],
    )
    with pytest.raises(dr.exceptions.BlockIdError, match="cannot remove 4 blocks from a 3-block"):
        utils.drop_transfer_prefix_blocks(meta, [7, 8, 9], 4)
    with pytest.raises(dr.exceptions.ArgumentError, match="prefix_count=-1"):
        utils.drop_transfer_prefix_blocks(meta, [7], -1)
