"""The optional integrity digest (issue 9, item 5; ``disagg_rs.integrity``).

Properties: the digest depends on logical position and values only (the same state in two
TP/PP splits, block sizes and cache layouts gives the same table), and one flipped byte changes
exactly the entry of its cell. Handoffs: real NIXL through the reference engines (in-process
and the multi-process demo) with ``verify_integrity=True`` answer like the colocated run; a
corrupted source fails the import with ``IntegrityError`` naming the cell, frees everything,
quarantines nothing; a verifying decode refuses a ticket without a table, changing nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disagg_rs import (
    KVGeometry,
    KVShardLayout,
    SSMGeometry,
    SSMShardLayout,
    SSMStateDims,
    integrity,
)
from disagg_rs.exceptions import IntegrityError, MetadataError
from disagg_rs.integrity import (
    IntegrityTable,
    chunk_tokens_for,
    conv_pieces,
    kv_entries,
    kv_pieces,
    recurrent_pieces,
)
from disagg_rs.reference import EngineConfig, ModelConfig, ReferenceEngine
from disagg_rs.reference.engine import encode_text
from disagg_rs.reference.handoff import HandoffReferenceEngine

DTYPES = [torch.float64, torch.bfloat16, torch.float16, torch.float32, torch.uint8]


# -- placing one logical state into a rank's physical layout --------------------------------------


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (NaN patterns included)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def _place_kv(
    state: torch.Tensor,
    layout: KVShardLayout,
    cache_layout: str,
    block_size: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, KVGeometry, list[int]]:
    """Write this rank's part of the logical ``state [2, L, N, H, d]`` into a fresh buffer of
    ``cache_layout`` with shuffled block ids; returns (buffer, geometry, block ids)."""
    n_tokens, d = state.shape[2], state.shape[4]
    (l0, l1), (h0, h1) = layout.layers, layout.heads
    local = state[:, l0:l1, :, h0:h1]
    n_layers, n_heads = l1 - l0, h1 - h0
    needed = -(-n_tokens // block_size)
    num_blocks = needed + 3
    ids = torch.randperm(num_blocks, generator=gen)[:needed]
    pos = torch.arange(n_tokens)
    blk, off = ids[pos // block_size], pos % block_size
    fill = _random_bytes((num_blocks * block_size * n_heads * 2 * n_layers, d), state.dtype, gen)
    buf = fill.reshape(-1)  # garbage outside the request's cells must not matter
    if cache_layout == "megatron":
        cache = buf.view(2, n_layers, num_blocks, block_size, n_heads, d)
        cache[:, :, blk, off] = local
        return buf, KVGeometry.from_tensor(cache), ids.tolist()
    per = buf.numel() // n_layers
    shape = (2, num_blocks, block_size, n_heads, d)
    if cache_layout == "hnd":
        shape = (2, num_blocks, n_heads, block_size, d)
    tensors = [buf[i * per : (i + 1) * per].view(shape) for i in range(n_layers)]
    for i, t in enumerate(tensors):
        if cache_layout == "nhd":
            t[:, blk, off] = local[:, i]
        else:
            t.transpose(2, 3)[:, blk, off] = local[:, i]
    axes = "kv block head token dim" if cache_layout == "hnd" else "kv block token head dim"
    return buf, KVGeometry.from_layer_tensors(tensors, axes=axes), ids.tolist()


def _kv_layouts(
    num_layers: int, num_heads: int, tp: int, split: int | None, first_rank: int
) -> list[KVShardLayout]:
    """TP ``tp`` x (PP1, or PP2 with stage 0 owning layers ``[0, split)``)."""
    windows = [(0, num_layers)] if split is None else [(0, split), (split, num_layers)]
    out = []
    for p, (lo, hi) in enumerate(windows):
        for t in range(tp):
            window = {} if split is None else {"layer_start": lo, "num_local_layers": hi - lo}
            out.append(
                KVShardLayout(
                    num_layers,
                    num_heads,
                    tp_size=tp,
                    tp_rank=t,
                    pp_size=len(windows),
                    pp_rank=p,
                    global_rank=first_rank + len(out),
                    **window,
                )
            )
    return out


def _kv_table(
    state: torch.Tensor,
    layouts: list[KVShardLayout],
    cache_layout: str,
    block: int,
    seed: int,
    chunk: int | None = None,
) -> IntegrityTable:
    gen = torch.Generator().manual_seed(seed)
    pieces = []
    for lay in layouts:
        buf, geo, ids = _place_kv(state, lay, cache_layout, block, gen)
        before = buf.clone()
        pieces += kv_pieces(buf, geo, lay, ids, state.shape[2], chunk)
        assert torch.equal(before.view(torch.uint8), buf.view(torch.uint8))
    chunks = -(-state.shape[2] // chunk) if chunk else 1
    return IntegrityTable.merge(IntegrityTable.shapes(layouts[0], None, chunks), pieces)


def _tp_sizes(num_heads: int) -> st.SearchStrategy[int]:
    """Divisors of ``num_heads`` and GQA replication (multiples of it)."""
    divisors = [t for t in range(1, num_heads + 1) if num_heads % t == 0]
    return st.sampled_from([*divisors, num_heads * 2])


@st.composite
def _kv_case(draw: st.DrawFn) -> dict[str, Any]:
    num_heads = draw(st.sampled_from([1, 2, 4]))
    num_layers = draw(st.integers(1, 4))
    sides = []
    for _ in range(2):
        split = draw(st.none() | st.integers(1, num_layers - 1)) if num_layers > 1 else None
        sides.append(
            {
                "tp": draw(_tp_sizes(num_heads)),
                "split": split,
                "cache_layout": draw(st.sampled_from(["megatron", "nhd", "hnd"])),
                "block": draw(st.sampled_from([1, 3, 16, 64])),
            }
        )
    return {
        "num_heads": num_heads,
        "num_layers": num_layers,
        "num_tokens": draw(st.integers(1, 80)),
        "head_dim": draw(st.sampled_from([1, 2, 3, 8])),
        "dtype": draw(st.sampled_from(DTYPES)),
        "sides": sides,
        "seed": draw(st.integers(0, 2**31)),
    }


@given(_kv_case(), st.data())
def test_kv_digest_depends_on_logical_cells_only_and_a_flipped_byte_changes_its_cell(
    case: dict[str, Any], data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (2, case["num_layers"], case["num_tokens"], case["num_heads"], case["head_dim"])
    state = _random_bytes(shape, case["dtype"], gen)
    chunk = data.draw(st.none() | st.integers(1, 32))  # None: one chunk of the whole prompt
    tables = []
    for i, side in enumerate(case["sides"]):
        layouts = _kv_layouts(
            case["num_layers"], case["num_heads"], side["tp"], side["split"], i * 64
        )
        table = _kv_table(state, layouts, side["cache_layout"], side["block"], i, chunk)
        tables.append((layouts, side, table))
    (_, _, src_table), (dst_layouts, dst, dst_table) = tables
    assert np.array_equal(src_table.tables["kv"], dst_table.tables["kv"])

    # One flipped byte (in the logical state, so every holder sees it) changes exactly the
    # entry of its (token chunk, kv, layer, head) cell.
    cell = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    raw = state.clone().view(torch.uint8)
    byte = data.draw(st.integers(0, state.element_size() - 1))
    bit = data.draw(st.integers(0, 7))
    raw[cell[:4]][cell[4] * state.element_size() + byte] ^= 1 << bit
    flipped = _kv_table(
        raw.view(state.dtype), dst_layouts, dst["cache_layout"], dst["block"], 9, chunk
    )
    diff = np.argwhere(flipped.tables["kv"] != dst_table.tables["kv"]).tolist()
    assert diff == [[cell[2] // chunk if chunk else 0, cell[0], cell[1], cell[3]]]


def _place_ssm(
    conv: torch.Tensor, rec: torch.Tensor, layout: SSMShardLayout, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's conv ``[L, slots, C_local, d_conv]`` and recurrent state, at a random slot."""
    (l0, l1), (h0, h1) = layout.layers, layout.heads
    slots = 3
    slot = int(torch.randint(0, slots, (1,), generator=gen))
    c = _random_bytes((l1 - l0, slots, layout.local_conv_channels, conv.shape[-1]), conv.dtype, gen)
    r = _random_bytes((l1 - l0, slots, h1 - h0, *rec.shape[2:]), rec.dtype, gen)
    for band in ("x", "B", "C"):
        (g_lo, g_hi), (c_lo, c_hi) = layout.band_span(band)  # type: ignore[arg-type]
        c[:, slot, c_lo:c_hi] = conv[l0:l1, g_lo:g_hi]
    r[:, slot] = rec[l0:l1, h0:h1]
    return c, r, slot


def _ssm_table(
    conv: torch.Tensor, rec: torch.Tensor, layouts: list[SSMShardLayout], seed: int
) -> IntegrityTable:
    gen = torch.Generator().manual_seed(seed)
    pieces = []
    for lay in layouts:
        c, r, slot = _place_ssm(conv, rec, lay, gen)
        before = (c.clone(), r.clone())
        geo = SSMGeometry.from_tensors(conv=c, recurrent=r).to_dict()
        pieces += conv_pieces(c, geo, lay, slot) + recurrent_pieces(r, geo, lay, slot)
        # The digest reads the state in place and must never write it.
        assert torch.equal(before[0].view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(before[1].view(torch.uint8), r.view(torch.uint8))
    return IntegrityTable.merge(IntegrityTable.shapes(None, layouts[0]), pieces)


@given(
    st.sampled_from([(4, 1), (4, 2), (8, 2), (8, 4)]),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([torch.float64, torch.bfloat16]),
    st.integers(0, 2**31),
    st.data(),
)
def test_ssm_digest_is_keyed_by_band_units_that_no_tp_split_cuts(
    heads_groups: tuple[int, int],
    num_layers: int,
    src_tp: int,
    dst_tp: int,
    dtype: torch.dtype,
    seed: int,
    data: st.DataObject,
) -> None:
    heads, groups = heads_groups
    if heads % src_tp or heads % dst_tp:
        return  # SSM heads must divide by tp (groups may be replicated)
    dims = SSMStateDims(num_heads=heads, head_dim=2, d_state=3, n_groups=groups, d_conv=4)
    gen = torch.Generator().manual_seed(seed)
    conv = _random_bytes((num_layers, dims.conv_channels, dims.d_conv), dtype, gen)
    rec = _random_bytes((num_layers, heads, dims.head_dim, dims.d_state), dtype, gen)

    def layouts(tp: int, first: int) -> list[SSMShardLayout]:
        return [
            SSMShardLayout(
                num_layers,
                dims,
                tp_size=tp,
                tp_rank=t,
                global_rank=first + t,
                replicate_groups=True,
            )
            for t in range(tp)
        ]

    src = _ssm_table(conv, rec, layouts(src_tp, 0), 1)
    dst = _ssm_table(conv, rec, layouts(dst_tp, 32), 2)
    for name in ("conv", "recurrent"):
        assert np.array_equal(src.tables[name], dst.tables[name])

    # A flipped conv channel byte changes exactly its unit: x head, B group or C group.
    layer = data.draw(st.integers(0, num_layers - 1))
    channel = data.draw(st.integers(0, dims.conv_channels - 1))
    flipped = conv.clone()
    flipped.view(torch.uint8)[layer, channel, 0] ^= 1
    x_end = heads * dims.head_dim
    unit = (
        channel // dims.head_dim if channel < x_end else heads + (channel - x_end) // dims.d_state
    )
    table = _ssm_table(flipped, rec, layouts(dst_tp, 32), 3)
    assert np.argwhere(table.tables["conv"] != dst.tables["conv"]).tolist() == [[layer, unit]]
    assert np.array_equal(table.tables["recurrent"], dst.tables["recurrent"])


def test_the_wire_table_round_trips_and_a_bad_shape_or_length_is_a_metadata_error() -> None:
    layout = KVShardLayout(3, 2)
    state = _random_bytes((2, 3, 10, 2, 4), torch.float32, torch.Generator().manual_seed(0))
    table = _kv_table(state, [layout], "megatron", 4, 0)
    shapes = IntegrityTable.shapes(layout, None)
    back = IntegrityTable.from_wire(table.to_wire(), shapes)
    assert np.array_equal(back.tables["kv"], table.tables["kv"])
    wire = table.to_wire()
    with pytest.raises(MetadataError) as info:
        IntegrityTable.from_wire({"kv": {**wire["kv"], "shape": [2, 3, 3]}}, shapes)
    assert info.value.field == "integrity.kv.shape" and "[2, 3, 3]" in str(info.value)
    with pytest.raises(MetadataError) as info:
        IntegrityTable.from_wire({"kv": {**wire["kv"], "data": b"\0" * 8}}, shapes)
    assert info.value.field == "integrity.kv.data"
    with pytest.raises(MetadataError):
        IntegrityTable.from_wire(b"junk", shapes)


def test_ssm_layers_anywhere_in_memory_digest_like_equally_spaced_ones() -> None:
    # Equally spaced layers are digested through one strided view, others stacked: store the
    # layers in reverse order (negative spacing) and point the geometry at them accordingly.
    dims = SSMStateDims(num_heads=4, head_dim=2, d_state=3, n_groups=2, d_conv=4)
    layout = SSMShardLayout(5, dims, tp_size=2, tp_rank=1)
    gen = torch.Generator().manual_seed(9)
    conv = _random_bytes((5, 3, dims.conv_channels // 2, 4), torch.float32, gen)
    rec = _random_bytes((5, 3, 2, 2, 3), torch.float32, gen)
    geo = SSMGeometry.from_tensors(conv=conv, recurrent=rec)
    conv_r, rec_r = conv.flip(0).contiguous(), rec.flip(0).contiguous()
    wire = SSMGeometry.from_tensors(conv=conv_r, recurrent=rec_r).to_dict()
    for part in ("conv", "recurrent"):
        wire[part]["layer_bases"] = wire[part]["layer_bases"][::-1]
    geo_r = SSMGeometry.from_dict(wire)
    for fn, a, b in ((conv_pieces, conv, conv_r), (recurrent_pieces, rec, rec_r)):
        straight, reverse = fn(a, geo, layout, 2), fn(b, geo_r, layout, 2)
        assert [p.entries.tolist() for p in straight] == [p.entries.tolist() for p in reverse]


@pytest.mark.parametrize("planes_per_batch", [2, 3, 8, 100])
def test_planes_digested_in_batches_equal_one_plane_at_a_time(
    planes_per_batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPUs digest many (kv, layer) planes per batch of kernels; CPUs one at a time.
    layout = KVShardLayout(4, 4, tp_size=2, tp_rank=1)
    cpu = _random_bytes((2, 4, 9, 8, 2, 64), torch.bfloat16, torch.Generator().manual_seed(5))
    ids = [5, 0, 7, 1, 8, 2, 6, 3]
    one = kv_entries(cpu, KVGeometry.from_tensor(cpu), layout, ids, 60)
    plane_bytes = 60 * 2 * 64 * 2
    monkeypatch.setattr(integrity, "_CHUNK_BYTES_DEFAULT", planes_per_batch * plane_bytes)
    assert torch.equal(kv_entries(cpu, KVGeometry.from_tensor(cpu), layout, ids, 60), one)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_digest_is_the_same_on_cpu_and_cuda() -> None:
    layout = KVShardLayout(4, 4, tp_size=2, tp_rank=1)
    gen = torch.Generator().manual_seed(3)
    cpu = _random_bytes((2, 4, 9, 8, 2, 64), torch.bfloat16, gen)
    gpu = cpu.cuda()
    ids = [5, 0, 7, 1, 8, 2, 6, 3]  # 8 blocks of 8 tokens cover the 60
    a = kv_entries(cpu, KVGeometry.from_tensor(cpu), layout, ids, 60)
    b = kv_entries(gpu, KVGeometry.from_tensor(gpu), layout, ids, 60)
    assert b.is_cuda and torch.equal(a, b.cpu())


# -- through the reference engines --------------------------------------------------------------

PROMPT = encode_text("integrity: a prompt that spans a few blocks of both paged caches....")
MAX_NEW = 4


class _Pair:
    """A prefill (block 16) and a decode (block 64, NHD) hybrid reference engine in this
    process, NIXL over loopback, both with ``verify_integrity`` unless told otherwise."""

    def __init__(self, model: ModelConfig, *, prefill_verifies: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        cfg = {"num_blocks": 24, "num_ssm_slots": 3}
        self.pre = HandoffReferenceEngine(
            model,
            EngineConfig(role="prefill", block_size_tokens=16, **cfg),  # type: ignore[arg-type]
        )
        self.dec = HandoffReferenceEngine(
            model,
            EngineConfig(role="decode", ranks=(1,), block_size_tokens=64, **cfg),  # type: ignore[arg-type]
            event_loop=self.loop,
        )
        self.pre.handoff_now_ns = self.dec.handoff_now_ns = time.monotonic_ns()
        self.pre.verify_integrity = prefill_verifies
        self.dec.verify_integrity = True
        self.pre.setup_kv_transfer("prefill", "nixl")
        self.dec.setup_kv_transfer("decode", "nixl")

    def ticket(self, rid: int) -> tuple[Any, dict[str, Any]]:
        self.pre.add_request(rid, PROMPT, MAX_NEW)
        (h,) = self.pre.step().handoffs
        ticket = self.pre.capture_handoff_ticket(h)
        ticket["prefill_meta"] = self.pre.handoff_static_meta
        return h, ticket

    def submit(self, rid: int, ticket: dict[str, Any]) -> asyncio.Future[Any] | None:
        return self.dec.add_request_with_kv_handoff(
            rid, PROMPT, MAX_NEW, ticket, ticket["src_block_ids"]
        )

    def run(self) -> dict[int, list[int]]:
        """Poll, admit and step the decode until idle (real transfers: bounded wall time)."""
        done: dict[int, list[int]] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.dec.handoff_now_ns = time.monotonic_ns()
            self.dec.poll_kv_imports()
            self.dec.admit_kv_imports()
            if self.dec.has_work:
                for f in self.dec.step().finished:
                    done[f.request_id] = f.tokens
            elif self.dec.pending_kv_import_count == 0:
                return done
        raise AssertionError("decode did not settle")

    def assert_everything_free(self) -> None:
        dec = self.dec
        assert dec.leaked_blocks() == 0
        assert dec.ssm_slot_pool is not None
        assert dec.ssm_slot_pool.num_free == dec.ssm_slot_pool.num_slots
        assert dec.num_quarantined_kv_imports == 0 and dec.pending_kv_import_count == 0
        dec.import_ledger.check()

    def close(self) -> None:
        self.dec.close_kv_transfer()
        self.pre.close_kv_transfer()
        self.loop.close()


@pytest.fixture
def pair() -> Iterator[_Pair]:
    p = _Pair(ModelConfig())
    yield p
    p.close()


def _colocated(model: ModelConfig) -> list[int]:
    engine = ReferenceEngine(model, EngineConfig(num_blocks=24, num_ssm_slots=3))
    return engine.generate({0: PROMPT}, MAX_NEW)[0]


def test_a_verified_hybrid_handoff_across_block_sizes_answers_like_the_colocated_run(
    pair: _Pair,
) -> None:
    _, ticket = pair.ticket(1)
    assert set(ticket["integrity"]) == {"kv", "conv", "recurrent", "chunk_tokens"}
    assert ticket["integrity"]["chunk_tokens"] == chunk_tokens_for(len(PROMPT))
    future = pair.submit(1, ticket)
    assert pair.run()[1] == _colocated(ModelConfig())
    assert future is not None and future.result() == 1
    assert pair.dec.handoff_stats["integrity_failures"] == 0
    assert pair.dec.handoff_stats["integrity_ns"] > 0
    pair.pre.release_handoff_blocks(1)


def _corrupt(pair: _Pair, h: Any, table: str) -> tuple[str, str | None, int, int]:
    """Flip one byte of the prefill's source state after the ticket was captured; returns
    the expected (table, kv, layer, unit) of the mismatch."""
    pre: Any = pair.pre
    if table == "kv":
        # Megatron [2, L, B, T, H, d]: V, attention layer 1, token 35 = block 2, offset 3, head 1.
        pre.kv_cache[1, 1, h.block_ids[2], 3, 1].view(torch.uint8)[5] ^= 0x10
        return "kv", "V", 1, 1
    if table == "conv":
        # Conv [L, slots, C, d_conv]: SSM layer 2, channel 40 = B band (x is 4 heads x 8 ch),
        # group (40 - 32) // 8 = 1 -> unit 4 + 1 = 5.
        pre.ssm_conv_state[2, h.ssm_slot, 40].view(torch.uint8)[0] ^= 1
        return "conv", None, 2, 5
    pre.ssm_recurrent_state[0, h.ssm_slot, 3].view(torch.uint8)[7] ^= 0x80
    return "recurrent", None, 0, 3


@pytest.mark.parametrize("table", ["kv", "conv", "recurrent"])
def test_a_corrupted_source_fails_the_import_naming_the_cell_and_frees_everything(
    pair: _Pair, table: str
) -> None:
    h, ticket = pair.ticket(1)
    want = _corrupt(pair, h, table)
    future = pair.submit(1, ticket)
    assert pair.run() == {}
    assert future is not None and future.done()
    err = future.exception()
    assert isinstance(err, IntegrityError) and err.field == "integrity"
    m = err.mismatch
    assert (m.table, m.kv, m.layer, m.unit) == want
    assert m.expected != m.got and f"0x{m.expected:016x}" in str(err)
    assert m.describe() in str(err)  # the error's message names the cell as ``describe`` does
    assert not pair.dec.has_work  # never admitted
    assert pair.dec.handoff_stats["imports_admitted"] == 0
    assert pair.dec.handoff_stats["integrity_failures"] == 1
    assert pair.dec.drain_handoff_outcomes() == [(1, True)]
    pair.assert_everything_free()
    pair.pre.release_handoff_blocks(1)


def test_a_verifying_decode_reuses_its_prefix_cache_in_whole_chunks_and_checks_the_rest(
    pair: _Pair,
) -> None:
    # The decode's cached prefix was not moved (and, prefilled in another batch, may differ in
    # its last bits): the ledger reuses it in whole digest chunks and those chunks are skipped;
    # every transferred token is still checked.
    chunk = chunk_tokens_for(len(PROMPT))
    assert len(PROMPT) > chunk and chunk % 64 == 0  # a whole decode block, plus a tail
    expected = _colocated(ModelConfig())
    for rid in (1, 2):
        _, ticket = pair.ticket(rid)
        pair.submit(rid, ticket)
        assert pair.run()[rid] == expected
        pair.pre.release_handoff_blocks(rid)
    assert pair.dec.handoff_request_stats[1]["token_start"] == 0
    assert pair.dec.handoff_request_stats[2]["token_start"] == chunk
    assert pair.dec.handoff_stats["integrity_failures"] == 0
    h, ticket = pair.ticket(3)
    pre: Any = pair.pre  # Megatron [2, L, B, T, H, d]: K, layer 0, token `chunk`, head 0
    pre.kv_cache[0, 0, h.block_ids[chunk // 16], 0, 0].view(torch.uint8)[0] ^= 1
    future = pair.submit(3, ticket)
    assert pair.run() == {}
    assert future is not None and isinstance(future.exception(), IntegrityError)
    m = future.exception().mismatch  # type: ignore[union-attr]
    assert (m.table, m.kv, m.layer, m.unit, m.tokens) == ("kv", "K", 0, 0, (chunk, 2 * chunk))
    assert f"tokens=[{chunk}, {2 * chunk})" in str(future.exception())
    pair.assert_everything_free()
    pair.pre.release_handoff_blocks(3)


def test_a_verifying_decode_refuses_a_ticket_without_a_table_and_changes_nothing() -> None:
    p = _Pair(ModelConfig(), prefill_verifies=False)
    try:
        _, ticket = p.ticket(1)
        assert "integrity" not in ticket
        free = p.dec.block_pool.num_free
        with pytest.raises(MetadataError) as info:
            p.submit(1, ticket)
        assert info.value.field == "integrity" and "no integrity table" in str(info.value)
        assert p.dec.block_pool.num_free == free
        assert p.dec.pending_kv_import_count == 0 and p.dec.pending_kv_import(1) is None
        assert p.dec.num_decode_requests == 0
        # The same request id is still usable (nothing was recorded).
        p.dec.verify_integrity = False
        p.submit(1, ticket)
        assert p.run()[1] == _colocated(ModelConfig())
        p.pre.release_handoff_blocks(1)
    finally:
        p.close()


def test_a_table_in_the_ticket_of_a_non_verifying_decode_is_ignored(pair: _Pair) -> None:
    h, ticket = pair.ticket(1)
    _corrupt(pair, h, "kv")  # would fail a verifying decode
    pair.dec.verify_integrity = False
    pair.submit(1, ticket)
    answers = pair.run()
    assert 1 in answers and pair.dec.handoff_stats["integrity_ns"] == 0
    pair.pre.release_handoff_blocks(1)


# -- the multi-process demo (coordinator over ZeroMQ, spawned engines) ----------------------------


@pytest.mark.parametrize(
    "case",
    [
        pytest.param({}, id="nixl-tp2-to-tp1-hybrid"),
        pytest.param(
            {"prefill_tp": 1, "prefill_block_size": 16, "decode_block_size": 64},
            id="nixl-block16-to-block64-hybrid",
        ),
        pytest.param({"prefill_tp": 1, "decode_tp": 2}, id="nixl-tp1-to-tp2-hybrid"),
    ],
)
def test_verified_demo_handoffs_answer_like_the_colocated_run(case: dict[str, object]) -> None:
    from disagg_rs.tools.demo import DemoOptions, run_demo

    opts = {"requests": 3, "max_new_tokens": 6, "timeout_s": 120.0, "quiet": True}
    result = run_demo(DemoOptions(**{**opts, **case}, verify_integrity=True))  # type: ignore[arg-type]
    assert result.failures == [] and result.exit_code == 0, result.failures
    assert result.answers == result.expected
    workers = [w for w in result.workers if w.get("stats") is not None]
    decode = [w for w in workers if w["role"] == "decode"]
    assert decode and all(w["stats"]["integrity_ns"] > 0 for w in decode)
    assert all(w["stats"]["integrity_failures"] == 0 for w in decode)
    assert all(w["leaked_blocks"] == 0 and w["pinned"] == 0 for w in workers)
