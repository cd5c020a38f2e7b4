"""One launch for every source rank, on the CPU: the merged device plan of a TP2 -> TP1 pull
(Triton's interpreter and the torch twin) against each rank's own plan, and the Rust id
writer behind it against ``check_peer_transfer`` (same errors, the slot untouched on error,
the ids laid out where the kernel reads them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs import _core, exceptions
from disagg_rs.transfer_backends import device_plan as dp
from disagg_rs.transfer_backends import nixl
from kernel_cases import interpret

pytest.importorskip("triton")

LAYERS, HEADS, TPB, DIM, BLOCKS = 2, 4, 4, 8, 12


@pytest.fixture(scope="module")
def tp2() -> Iterator[tuple[Any, list[Any], list[dict[str, Any]]]]:
    """A TP1 decode and the two ranks of a TP2 prefill (host memory, random contents)."""
    gen = torch.Generator().manual_seed(3)

    def cache(heads: int) -> torch.Tensor:
        shape = (2, LAYERS, BLOCKS, TPB, heads, DIM)
        return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)

    kw: dict[str, Any] = {"num_kv_heads_global": HEADS}
    dec = nixl.NixlTransferBackend("route-dec", torch.zeros_like(cache(HEADS)), BLOCKS, **kw)
    # Both prefill ranks on one agent: rank 0 makes it, rank 1 registers on it.
    rank = [{"tp_size": 2, "tp_rank": r, "global_rank": r, **kw} for r in (0, 1)]
    root = nixl.NixlTransferBackend("route-pre", cache(HEADS // 2), BLOCKS, **rank[0])
    other = root.new_registered_buffer(
        memory_buffer=cache(HEADS // 2), expected_num_blocks=BLOCKS, **rank[1]
    )
    srcs = [root, other]
    yield dec, srcs, [s.export_meta() for s in srcs]
    for b in (other, root, dec):
        b.close()


def _plans(dec: Any, metas: list[dict[str, Any]], ids: Any) -> dict[int, dp.DevicePlan]:
    """Each source rank's own device plan, as the compiler emits it."""
    sids, dids, n = ids
    peers, _ = dec._resolve_peers(metas, sids)
    by_rank = {p.global_rank: p.meta for p in peers}
    program = dec._compile(peers, dec._own_peer, sids, dids, n, "staged")
    plans: dict[int, dp.DevicePlan] | None = dec._pull_plans(peers, by_rank, program)
    assert plans is not None and sorted(plans) == [0, 1]
    return plans


def _route(dec: Any, srcs: list[Any], metas: list[dict[str, Any]], ids: Any) -> dp.PullRoute:
    plans = _plans(dec, metas, ids)
    bufs = {s.layout.global_rank: s.memory_buffer for s in srcs}
    return dp.PullRoute(plans, bufs, dec.memory_buffer, dp.IdUploader(torch.device("cpu")))


def _ids(seed: int, n_tok: int) -> tuple[dict[int, list[int]], list[int], int]:
    rng = np.random.default_rng(seed)
    n_blk = -(-n_tok // TPB)
    sids = {r: [int(x) for x in rng.permutation(BLOCKS)[:n_blk]] for r in (0, 1)}
    return sids, [int(x) for x in rng.permutation(BLOCKS)[:n_blk]], n_tok


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_one_merged_launch_lands_what_each_ranks_own_plan_lands(
    tp2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dec, srcs, metas = tp2
    # Host tensors: the merged kernel reads across the two buffers under the interpreter.
    interpret(monkeypatch)
    ids = _ids(0, 37)
    route = _route(dec, srcs, metas, ids)
    assert len(route.copies) == 1  # both ranks share strides: one plan, one launch
    for seed, n_tok in [(1, 37), (2, 48), (3, 1)]:
        sids, dids, _ = ids = _ids(seed, n_tok)
        peers, _ = dec._resolve_peers(metas, sids)
        dec.memory_buffer.fill_(-1)
        got = route.run(
            peers,
            sids,
            np.asarray(dids),
            n_tok,
            local_num_blocks=BLOCKS,
            local_tokens_per_block=TPB,
        )
        assert got is not None and got[1] == 2 * LAYERS * TPB * HEADS * DIM * 2 * n_tok // TPB
        landed = dec.memory_buffer.clone()
        # Oracle: each rank's own plan (checked against the compiler's lists elsewhere).
        want = torch.full_like(landed, -1)
        for r, plan in _plans(dec, metas, ids).items():
            dp.copy(
                plan,
                dp.Side("src", srcs[r].memory_buffer, torch.tensor(sids[r])),
                dp.Side("dst", want, torch.tensor(dids)),
                n_tok,
                path="torch",
            )
        assert torch.equal(landed, want)
        assert bool((landed != -1).any())


_ID = st.integers(-1, BLOCKS)


@settings(max_examples=60, deadline=None)
@given(
    src=st.lists(st.lists(_ID, min_size=1, max_size=5), min_size=2, max_size=2),
    dst=st.lists(_ID, min_size=1, max_size=5),
    n_tok=st.one_of(st.none(), st.integers(-1, 24)),
    per_rank=st.booleans(),
    arrays=st.booleans(),
)
def test_the_rust_id_writer_raises_what_the_id_check_raises_and_lays_out_what_it_accepts(
    tp2: Any,
    src: list[list[int]],
    dst: list[int],
    n_tok: int | None,
    per_rank: bool,
    arrays: bool,
) -> None:
    dec, _, metas = tp2
    conv: Any = (lambda x: np.asarray(x, dtype=np.int64)) if arrays else list
    sids: Any = {0: conv(src[0]), 1: conv(src[1])} if per_rank else conv(src[0])
    dids = conv(dst)
    peers, _ = dec._resolve_peers(metas, sids)
    want: Any
    try:
        want = dec._validate_peers(peers, sids, dids, n_tok, local_is_dst=True)
    except exceptions.DisaggError as exc:
        want = exc
    out = np.full(64, -7, dtype=np.int64)
    kw: dict[str, Any] = {"local_num_blocks": BLOCKS, "local_tokens_per_block": TPB}
    try:
        got: Any = _core.write_pull_ids(
            out, peers, [0, 1], sids, dids, n_tok, **kw, tokens_per_block=TPB
        )
    except exceptions.DisaggError as exc:
        got = exc
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
        assert (out == -7).all()  # nothing written before the checks passed
        return
    assert not isinstance(got, Exception)
    n_blk = -(-want // TPB)
    by_rank = [src[0], src[1] if per_rank else src[0]]
    if len(dst) != n_blk or any(len(x) != n_blk for x in by_rank):
        assert got is None  # left to the general path
        assert (out == -7).all()
        return
    stride = n_blk + n_blk % 2
    assert got == (want, n_blk, stride, 3 * stride)
    expect = np.full(64, -7, dtype=np.int64)
    for j, ids in enumerate([dst, *by_rank]):
        expect[j * stride : j * stride + n_blk] = ids
    assert (out == expect).all()
    assert _core.pull_ids_len(dids, 2) == 3 * stride


def test_a_source_packs_through_its_route_byte_exact_whatever_its_id_ring_holds() -> None:
    """``stage_blocks`` packs through the source's prepared route (ids checked once, in
    Rust, and read from an id slot) what the compiler's own gather lists pack, also when
    the handoff has more blocks than the id ring's slots hold (a slot of its size then)."""
    gen = torch.Generator().manual_seed(5)
    shape = (2, LAYERS, BLOCKS, TPB, HEADS // 2, DIM)
    kw: dict[str, Any] = {"num_kv_heads_global": HEADS, "mode": "staged", "staging_bytes": 1 << 20}
    dec = nixl.NixlTransferBackend(
        "pack-dec", torch.zeros((2, LAYERS, BLOCKS, TPB, HEADS, DIM), dtype=torch.int16), BLOCKS,
        **kw,
    )  # fmt: skip
    rank = [{"tp_size": 2, "tp_rank": r, "global_rank": r, **kw} for r in (0, 1)]
    caches = [torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen) for _ in "ab"]
    root = nixl.NixlTransferBackend("pack-pre", caches[0], BLOCKS, **rank[0])
    other = root.new_registered_buffer(
        memory_buffer=caches[1], expected_num_blocks=BLOCKS, **rank[1]
    )
    try:
        metas, dst_meta = [s.export_meta() for s in (root, other)], dec.export_meta()
        sids, _, n_tok = _ids(11, 30)
        for src in (root, other):
            me = src.layout.global_rank
            program = src._compile(metas, dst_meta, sids, None, n_tok, "staged")
            want = torch.zeros(int(program.packed_bytes(me)), dtype=torch.uint8)
            src.pack_rows(program.gather(me), want)
            for capacity in (4096, 4096, 1):
                src._ids.capacity = capacity
                checks = _core.block_id_checks()
                ticket = src.stage_blocks(dst_meta, sids, src_metas=metas, num_tokens=n_tok)
                if capacity > 1:  # the ids fit the ring's slot: checked once
                    assert _core.block_id_checks() - checks == 1
                at, nbytes = ticket["offset"], ticket["nbytes"]
                assert ticket["staged"] and nbytes == want.numel()
                assert src.staging_buffer is not None
                assert torch.equal(src.staging_buffer[at : at + nbytes], want)
                src.release_staged(ticket)
            routes = [v[1] for v in src._plans._plans.values() if isinstance(v, tuple)]
            assert any(isinstance(r, dp.PackRoute) for r in routes), "packed by the route"
            assert bool(want.any())
    finally:
        for b in (other, root, dec):
            b.close()
