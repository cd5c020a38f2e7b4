"""Hypothesis strategies for random valid parallel layouts (shared by planner tests)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import strategies as st

import disagg_rs as dr


@dataclass(frozen=True)
class Side:
    """One engine: TP, PP with an uneven split, EP replicas, shuffled global ranks."""

    tp: int
    pp: int
    ep: int
    split: tuple[int, ...]
    ranks: tuple[int, ...]


@st.composite
def sides(draw: st.DrawFn, layers: int, units: int, rank_base: int, groups: int = 0) -> Side:
    """A random valid side for a model with ``layers`` layers and ``units`` heads."""
    tps = [t for t in range(1, 17) if units % t == 0 or t % units == 0]
    if groups:
        tps = [t for t in tps if units % t == 0 and (groups % t == 0 or t % groups == 0)]
    tp = draw(st.sampled_from(tps))
    pp = draw(st.integers(1, min(3, layers)))
    ep = draw(st.integers(1, 2))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1)))
    bounds = [0, *cuts, layers]
    split = tuple(b - a for a, b in itertools.pairwise(bounds))
    n = tp * pp * ep
    ranks = tuple(draw(st.permutations(range(rank_base, rank_base + n))))
    return Side(tp, pp, ep, split, ranks)


def _slots(side: Side) -> list[tuple[int, int, int, int, int]]:
    """(ep, pp, tp, layer_start, global_rank) for every rank of a side."""
    out = []
    slot = 0
    for ep in range(side.ep):
        start = 0
        for pp in range(side.pp):
            for tp in range(side.tp):
                out.append((ep, pp, tp, start, side.ranks[slot]))
                slot += 1
            start += side.split[pp]
    return out


def _rank_kwargs(side: Side) -> list[dict[str, int]]:
    """The rank keyword arguments of every rank of ``side``, as both layout classes take them."""
    return [
        {
            "tp_size": side.tp,
            "tp_rank": tp,
            "pp_size": side.pp,
            "pp_rank": pp,
            "global_rank": rank,
            "ep_rank": ep,
            "layer_start": start,
            "num_local_layers": side.split[pp],
        }
        for ep, pp, tp, start, rank in _slots(side)
    ]


def kv_layouts(side: Side, layers: int, heads: int) -> list[dr.KVShardLayout]:
    """The KVShardLayouts of every rank of ``side``."""
    return [dr.KVShardLayout(layers, heads, **kw) for kw in _rank_kwargs(side)]


def ssm_layouts(side: Side, layers: int, dims: dr.SSMStateDims) -> list[dr.SSMShardLayout]:
    """The SSMShardLayouts of every rank of ``side`` (B/C groups may be replicated)."""
    return [
        dr.SSMShardLayout(layers, dims, replicate_groups=True, **kw) for kw in _rank_kwargs(side)
    ]


@st.composite
def kv_cases(draw: st.DrawFn) -> tuple[list[dr.KVShardLayout], list[dr.KVShardLayout]]:
    """A (sources, destinations) pair of KV layout lists for the same model."""
    layers = draw(st.integers(2, 12))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    src = draw(sides(layers, heads, 0))
    dst = draw(sides(layers, heads, 100))
    return kv_layouts(src, layers, heads), kv_layouts(dst, layers, heads)


@st.composite
def ssm_cases(draw: st.DrawFn) -> tuple[list[dr.SSMShardLayout], list[dr.SSMShardLayout]]:
    """A (sources, destinations) pair of SSM layout lists for the same model."""
    layers = draw(st.integers(2, 8))
    heads = draw(st.sampled_from([2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    dims = dr.SSMStateDims(heads, 2, 3, groups, 3)
    src = draw(sides(layers, heads, 0, groups))
    dst = draw(sides(layers, heads, 100, groups))
    return ssm_layouts(src, layers, dims), ssm_layouts(dst, layers, dims)
