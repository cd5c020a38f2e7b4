"""Test-side state copy between reference engines, with plain torch indexing.

The real transports come from the transfer backends; these helpers only read what an engine
exposes for them (cache tensors, layout name, shard layouts, SSM slot tensors) and move one
request's state through global coordinates: each rank's slice is placed into a global tensor by
its layout's ``[lo, hi)`` ranges, then the destination rank cuts its own slice out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg_rs.reference import ReferenceEngine


@dataclass
class Piece:
    """One rank's slice of one request's state, with where it sits globally."""

    kv_layers: tuple[int, int] | None
    kv_heads: tuple[int, int] | None
    kv: torch.Tensor | None  # [L_local, 2, n, H_local, d]
    ssm_layers: tuple[int, int] | None
    conv_bands: list[tuple[tuple[int, int], tuple[int, int]]]
    heads: tuple[int, int] | None
    conv: torch.Tensor | None  # [L_local, C_local, K]
    recurrent: torch.Tensor | None  # [L_local, H_local, p, n]
    first_token: int | None = None  # set by harnesses that ship it with the state


def _token_index(
    engine: ReferenceEngine, block_ids: list[int], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n)
    bs = engine.block_size_tokens
    return torch.tensor(block_ids)[pos // bs], pos % bs


def _kv_planes(engine: ReferenceEngine) -> list[torch.Tensor]:
    """Per local layer, a ``[2, B, T, H, d]`` view of the cache, whatever the layout."""
    cache = engine.kv_cache
    layout = engine.kv_cache_layout
    if layout == "megatron":
        assert isinstance(cache, torch.Tensor)
        return [cache[:, i] for i in range(cache.shape[1])]
    assert isinstance(cache, list)
    if layout == "nhd":
        return list(cache)
    return [t.transpose(2, 3) for t in cache]  # hnd [2, B, H, T, d] -> [2, B, T, H, d]


def read_piece(engine: ReferenceEngine, block_ids: list[int], n: int, slot: int | None) -> Piece:
    """This rank's slice of a request's first ``n`` tokens of KV and its SSM slot."""
    kv_layout, ssm_layout = engine.kv_layout, engine.ssm_layout
    kv = None
    if kv_layout is not None:
        blk, off = _token_index(engine, block_ids, n)
        kv = torch.stack([plane[:, blk, off] for plane in _kv_planes(engine)]).clone()
    conv = rec = None
    bands: list[tuple[tuple[int, int], tuple[int, int]]] = []
    if ssm_layout is not None:
        assert slot is not None and engine.ssm_conv_state is not None
        assert engine.ssm_recurrent_state is not None
        conv = engine.ssm_conv_state[:, slot].clone()
        rec = engine.ssm_recurrent_state[:, slot].clone()
        bands = [ssm_layout.band_span(b) for b in ("x", "B", "C")]
    return Piece(
        kv_layers=kv_layout.layers if kv_layout else None,
        kv_heads=kv_layout.heads if kv_layout else None,
        kv=kv,
        ssm_layers=ssm_layout.layers if ssm_layout else None,
        conv_bands=bands,
        heads=ssm_layout.heads if ssm_layout else None,
        conv=conv,
        recurrent=rec,
    )


@dataclass
class GlobalState:
    """One request's whole state in global coordinates."""

    kv: torch.Tensor  # [A, 2, n, Hkv, d]
    conv: torch.Tensor | None  # [S, C, K]
    recurrent: torch.Tensor | None  # [S, H, p, n]


def assemble(engine: ReferenceEngine, pieces: list[Piece], n: int) -> GlobalState:
    """Put every rank's piece at its global place (replicas write the same values)."""
    m = engine.model
    kv = torch.full(
        (m.num_attention_layers, 2, n, m.num_kv_heads, m.head_dim),
        float("nan"),
        dtype=torch.float64,
    )
    conv = rec = None
    if m.num_ssm_layers:
        dims = m.ssm_dims
        conv = torch.full(
            (m.num_ssm_layers, dims.conv_channels, m.ssm_d_conv), float("nan"), dtype=torch.float64
        )
        rec = torch.full(
            (m.num_ssm_layers, m.ssm_num_heads, m.ssm_head_dim, m.ssm_d_state),
            float("nan"),
            dtype=torch.float64,
        )
    for p in pieces:
        if p.kv is not None and p.kv_layers and p.kv_heads:
            (l0, l1), (h0, h1) = p.kv_layers, p.kv_heads
            kv[l0:l1, :, :, h0:h1] = p.kv
        if p.conv is not None and p.recurrent is not None and p.ssm_layers and p.heads:
            assert conv is not None and rec is not None
            l0, l1 = p.ssm_layers
            for (g0, g1), (c0, c1) in p.conv_bands:
                conv[l0:l1, g0:g1] = p.conv[:, c0:c1]
            rec[l0:l1, p.heads[0] : p.heads[1]] = p.recurrent
    assert not torch.isnan(kv).any(), "some KV cell has no source rank"
    assert conv is None or not torch.isnan(conv).any(), "some conv channel has no source rank"
    assert rec is None or not torch.isnan(rec).any(), "some SSM head has no source rank"
    return GlobalState(kv, conv, rec)


def write_state(
    engine: ReferenceEngine,
    state: GlobalState,
    block_ids: list[int],
    slot: int | None,
    token_start: int = 0,
) -> None:
    """Cut this rank's slice out of ``state`` and write it into its cache and SSM slot; KV
    positions ``[token_start, n)`` only (earlier ones are a cached prefix already there)."""
    n = state.kv.shape[2]
    kv_layout, ssm_layout = engine.kv_layout, engine.ssm_layout
    if kv_layout is not None:
        blk, off = _token_index(engine, block_ids, n)
        blk, off = blk[token_start:], off[token_start:]
        (l0, l1), (h0, h1) = kv_layout.layers, kv_layout.heads
        for i, plane in enumerate(_kv_planes(engine)):
            plane[:, blk, off] = state.kv[l0 + i, :, token_start:, h0:h1].to(plane.device)
    if ssm_layout is not None:
        assert slot is not None and state.conv is not None and state.recurrent is not None
        assert engine.ssm_conv_state is not None and engine.ssm_recurrent_state is not None
        l0, l1 = ssm_layout.layers
        for b in ("x", "B", "C"):
            (g0, g1), (c0, c1) = ssm_layout.band_span(b)
            engine.ssm_conv_state[:, slot, c0:c1] = state.conv[l0:l1, g0:g1].to(
                engine.ssm_conv_state.device
            )
        h0, h1 = ssm_layout.heads
        engine.ssm_recurrent_state[:, slot] = state.recurrent[l0:l1, h0:h1].to(
            engine.ssm_recurrent_state.device
        )


def manual_handoff(
    prefill: ReferenceEngine,
    decode: ReferenceEngine,
    prompts: dict[int, list[int]],
    max_new_tokens: int,
    gather: Callable[[Piece], list[Piece]],
) -> dict[int, list[int]]:
    """Run every prompt on ``prefill``, copy each finished prompt's state into ``decode`` and
    admit it there (one admission per decode step, so imports join a running batch), then
    decode to the end. ``gather`` collects one piece from every prefill rank."""
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, max_new_tokens)
    handoffs = []
    while prefill.has_work:
        handoffs += prefill.step().handoffs
    results: dict[int, list[int]] = {}
    bs = decode.block_size_tokens
    for h in handoffs:
        n = len(h.prompt)
        state = assemble(prefill, gather(read_piece(prefill, h.block_ids, n, h.ssm_slot)), n)
        blocks = decode.block_pool.allocate(-(-n // bs))
        slot = decode.ssm_slot_pool.allocate() if decode.ssm_slot_pool is not None else None
        write_state(decode, state, blocks, slot)
        while not decode.batch_room(1):
            for f in decode.step().finished:
                results[f.request_id] = f.tokens
        done = decode.admit(h.request_id, h.prompt, [h.first_token], blocks, slot, h.max_new_tokens)
        if done is not None:
            results[done.request_id] = done.tokens
        prefill.release_pinned(h)
        for f in decode.step().finished:
            results[f.request_id] = f.tokens
    while decode.has_work:
        for f in decode.step().finished:
            results[f.request_id] = f.tokens
    return results
