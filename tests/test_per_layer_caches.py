"""Per-layer KV caches, as real engines allocate them, hand off byte-exact over real NIXL and
real gloo: the reference engine's ``nhd`` ``[2, B, T, H, d]`` and ``hnd`` ``[2, B, H, T, d]``
tensors per layer, and separate K and V tensors per layer, each tensor one registered region.

Three spawned ranks of one gloo world: ranks 0 and 1 are a TP2 prefill, rank 2 a TP1 decode
(a head reshard), with block sizes that differ in either direction and a partial last block.
The decode's whole cache, every layer tensor, must equal a cache written with the expected
values: moved positions hold the prefill's bytes and nothing else was touched. The reference
engines run end to end with per-layer caches in ``test_end_to_end.py``; the last tests here
check the region bookkeeping done in Rust (split descriptors, row grouping, geometry checks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import disagg_rs
from _reference_worker import spawn_gloo_world
from disagg_rs import _core
from disagg_rs.exceptions import GeometryMismatchError, MetadataError
from disagg_rs.reference.cache import PagedKVCache

os.environ.setdefault("UCX_LOG_LEVEL", "error")

LAYERS, HEADS, HEAD_DIM, BLOCKS, TOKENS = 3, 4, 8, 12, 37
AXES = {"nhd": "kv block token head dim", "hnd": "kv block head token dim"}
SPLIT_AXES = {"nhd": "block token head dim", "hnd": "block head token dim"}


@dataclass(frozen=True)
class Case:
    """One handoff: transport, mode and each side's layout and tokens per block."""

    backend: str  # "nixl" or "nccl" (gloo)
    mode: str  # NIXL: "direct" or "staged"; gloo: "push"
    src_layout: str
    dst_layout: str
    src_tokens: int
    dst_tokens: int
    split_kv: bool = False  # separate K and V tensors per layer
    dst_staging: int = 1 << 20  # the decode's staging pool (bytes)
    posted: str | None = None  # how the decode read, when not ``mode``


def _values() -> torch.Tensor:
    """The prompt's KV state ``[2, L, N, H_global, d]`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn((2, LAYERS, TOKENS, HEADS, HEAD_DIM), generator=g, dtype=torch.float64)


def _block_ids(tokens_per_block: int, seed: int) -> list[int]:
    n = -(-TOKENS // tokens_per_block)
    return [int(b) for b in np.random.default_rng(seed).permutation(BLOCKS)[:n]]


def _write(cache: PagedKVCache, ids: list[int], heads: slice) -> None:
    pos = torch.arange(TOKENS)
    blocks = torch.tensor(ids)[pos // cache.block_size_tokens]
    offsets = pos % cache.block_size_tokens
    vals = _values()
    for layer in range(LAYERS):
        cache.write(layer, blocks, offsets, vals[0, layer, :, heads], vals[1, layer, :, heads])


def _tensors(cache: PagedKVCache, split_kv: bool) -> Any:
    if split_kv:
        return [(t[0], t[1]) for t in cache.per_layer]
    return cache.per_layer


def _handoff(rank: int, case: Case) -> dict[str, Any]:
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    prefill = rank < 2
    layout = case.src_layout if prefill else case.dst_layout
    tpb = case.src_tokens if prefill else case.dst_tokens
    tp = 2 if prefill else 1
    heads = HEADS // tp
    cache = PagedKVCache(layout, LAYERS, BLOCKS, tpb, heads, HEAD_DIM)  # type: ignore[arg-type]
    src_ids, dst_ids = _block_ids(case.src_tokens, 1), _block_ids(case.dst_tokens, 2)
    if prefill:
        _write(cache, src_ids, slice(rank * heads, (rank + 1) * heads))
    kwargs: dict[str, Any] = {
        "tp_size": tp,
        "tp_rank": rank if prefill else 0,
        "num_kv_heads_global": HEADS,
        "heads_per_partition": heads,
        "head_dim": HEAD_DIM,
        "tokens_per_block": tpb,
        "global_rank": rank if prefill else 0,
        "num_layers_global": LAYERS,
        "axes": (SPLIT_AXES if case.split_kv else AXES)[layout],
    }
    if case.backend == "nixl":
        from disagg_rs.transfer_backends.nixl import NixlTransferBackend

        backend: Any = NixlTransferBackend(
            f"r{rank}",
            _tensors(cache, case.split_kv),
            BLOCKS,
            staging_bytes=1 << 20 if prefill else case.dst_staging,
            mode=case.mode,
            **kwargs,
        )
    else:
        from disagg_rs.transfer_backends.nccl import NcclTransferBackend

        backend = NcclTransferBackend(f"r{rank}", _tensors(cache, case.split_kv), BLOCKS, **kwargs)
    meta = backend.export_meta()
    metas: list[Any] = [None] * 3
    dist.all_gather_object(metas, meta)
    out: dict[str, Any] = {"regions": len(meta["buffer"]["regions"])}
    if case.backend == "nixl":
        ticket = (
            backend.stage_blocks(metas[2], src_ids, src_metas=metas[:2], num_tokens=TOKENS)
            if prefill
            else None
        )
        tickets: list[Any] = [None] * 3
        dist.all_gather_object(tickets, ticket)
        if not prefill:
            handle = backend.begin_pull_blocks(
                metas[:2], src_ids, dst_ids, num_tokens=TOKENS, staged=tickets[:2]
            )
            handle.wait()
            out["stats"] = dict(handle.stats)
        dist.barrier()  # the prefill's memory stays registered until the decode has read it
    elif prefill:
        backend.begin_push_blocks(metas[2], src_ids, src_metas=metas[:2], num_tokens=TOKENS).wait()
    else:
        backend.begin_pull_blocks(metas[:2], src_ids, dst_ids, num_tokens=TOKENS).wait()
    if not prefill:
        want = PagedKVCache(layout, LAYERS, BLOCKS, tpb, heads, HEAD_DIM)  # type: ignore[arg-type]
        _write(want, dst_ids, slice(0, HEADS))
        out["equal"] = [
            torch.equal(a, b) for a, b in zip(cache.per_layer, want.per_layer, strict=True)
        ]
        out["moved_any"] = any(bool(t.abs().sum() > 0) for t in cache.per_layer)
    backend.close()
    return out


CASES = [
    Case("nixl", "direct", "nhd", "nhd", 16, 16),
    Case("nixl", "staged", "hnd", "hnd", 16, 64),
    Case("nixl", "direct", "hnd", "nhd", 8, 16, split_kv=True),
    # The decode's pool cannot take the packed copy (and per-layer tensors do not move in
    # chunks): the decode reads the source's blocks directly, split at the tensor boundaries.
    Case("nixl", "staged", "nhd", "hnd", 16, 8, dst_staging=4096, posted="direct"),
    Case("nccl", "push", "nhd", "nhd", 16, 16),
    Case("nccl", "push", "hnd", "hnd", 64, 16),
    Case("nccl", "push", "nhd", "hnd", 16, 8, split_kv=True),
]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            c,
            id=f"{'gloo' if c.backend == 'nccl' else 'nixl-' + c.mode}-{c.src_layout}"
            f"{c.src_tokens}-to-{c.dst_layout}{c.dst_tokens}{'-split-kv' if c.split_kv else ''}"
            f"{'-pool-full' if c.posted else ''}",
        )
        for c in CASES
    ],
)
def test_a_tp2_per_layer_cache_lands_byte_exact_in_a_tp1_per_layer_cache(case: Case) -> None:
    results = spawn_gloo_world(3, _handoff, case, timeout_s=180.0)
    decode = results[2]
    # One region per registered tensor: a tensor per layer, or K and V apart.
    assert all(r["regions"] == LAYERS * (2 if case.split_kv else 1) for r in results)
    assert decode["moved_any"]
    assert decode["equal"] == [True] * LAYERS
    if case.backend == "nixl":
        modes = set(decode["stats"]["modes"].values())
        assert modes == {case.posted or case.mode}, decode["stats"]


# -- region bookkeeping (Rust) ------------------------------------------------------------------


def _meta(tensors: Any, axes: str) -> dict[str, Any]:
    from disagg_rs.transfer_backends.base import TransferBackendBase

    backend = TransferBackendBase(
        "probe", tensors, 4, tp_size=1, tp_rank=0, head_dim=8, global_rank=0, axes=axes
    )
    return backend.export_meta() | {"backend": "nixl", "agent_metadata": "", "staging": None}


def test_a_descriptor_running_from_one_layer_tensor_into_the_next_is_split_there() -> None:
    whole = torch.zeros(2 * 2 * 4 * 2 * 8, dtype=torch.float64)
    # Two layer tensors back to back in memory, as an allocator may place them.
    layers = [whole[:128].view(2, 4, 2, 1, 8), whole[128:].view(2, 4, 2, 1, 8)]
    peer = _core.parse_peer_meta(_meta(layers, "kv block token head dim"), "nixl")
    assert len(peer.buffer_regions) == 2
    a0 = layers[0].data_ptr()
    src = np.array([[a0 + 64 * 8, 2 * 64 * 8, 0]], dtype=np.uint64)
    dst = np.array([[a0, 2 * 64 * 8, 0]], dtype=np.uint64)
    s, d = peer.split_descriptors(src, dst, peer)
    assert s.tolist() == [[a0 + 512, 512, 0], [a0 + 1024, 512, 0]]
    assert d.tolist() == [[a0, 512, 0], [a0 + 512, 512, 0]]
    inside = np.array([[a0, 64, 0]], dtype=np.uint64)
    same = peer.split_descriptors(inside, inside, peer)
    assert same[0] is inside and same[1] is inside
    outside = np.array([[a0 + 4096, 64, 0]], dtype=np.uint64)
    with pytest.raises(MetadataError) as exc:
        peer.split_descriptors(outside, inside, peer)
    assert exc.value.field == "src_descriptors"


def test_gather_rows_are_grouped_by_the_tensor_they_lie_in() -> None:
    regions = [(4096, 256), (0, 128)]
    rows = np.array([[0, 64, 0], [4096, 300, 64], [100, 28, 364]], dtype=np.uint64)
    with pytest.raises(MetadataError):
        _core.rows_by_region(rows, "gather", regions)
    rows[1, 1] = 256
    groups = _core.rows_by_region(rows, "gather", regions)
    assert [(i, g.tolist()) for i, g in groups] == [
        (0, [[4096, 256, 64]]),
        (1, [[0, 64, 0], [100, 28, 364]]),
    ]


def test_per_layer_tensors_of_unequal_shapes_or_devices_are_refused() -> None:
    a = torch.zeros((2, 4, 2, 1, 8), dtype=torch.float64)
    b = torch.zeros((2, 4, 2, 1, 8), dtype=torch.float32)
    with pytest.raises(GeometryMismatchError):
        disagg_rs.KVGeometry.from_layer_tensors([a, b])
    with pytest.raises(GeometryMismatchError):
        disagg_rs.KVGeometry.from_layer_tensors([(a[0], a[1]), a])
    g = disagg_rs.KVGeometry.from_layer_tensors(
        [(a[0], a[1]), (a[0].clone(), a[1].clone())], axes="block token head dim"
    )
    assert (g.num_kv, g.num_layers) == (2, 2)
