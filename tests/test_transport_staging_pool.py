"""A NIXL staging region is a fixed pool whatever the prompt size: a packed copy that does not
fit the prefill's pool is streamed through a few slots of it (or, when no slot holds one item,
not made: the decode reads those blocks directly); one that does not fit the decode's pool is
read through a few slots of it in chunks, each scattered while the next is read; and every
byte still lands where the global-tensor oracle says.

Real NIXL agents in spawned processes (UCX loopback), no mocks: host memory, and (marker
``gpu``) VRAM with every rank on GPU 0 and the same-host CUDA IPC path turned off, so the
bytes go through NIXL as they would across hosts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import transport_workers as tw
from transport_workers import Case, Side, Worker

pytestmark = pytest.mark.slow

CASE = Case("tp2_to_tp1", (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)), (Side(),))
#: Each source packs 40 tokens x 4 layers x 2 x 2 heads x 8 x 4 bytes = 20,480 bytes.
SMALL, LARGE = 4096, 1 << 20
#: Smaller than two items (one block of one plane row): no chunk fits, the blocks are read.
TINY = 512


@pytest.fixture(scope="module", params=["nixl", pytest.param("nixl-cuda", marks=pytest.mark.gpu)])
def pool(request: pytest.FixtureRequest) -> Iterator[list[Worker]]:
    if request.param == "nixl-cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    before = os.environ.get("DISAGG_CUDA_IPC")
    os.environ["DISAGG_CUDA_IPC"] = "0"  # spawned workers inherit it: NIXL moves the bytes
    try:
        workers = tw.start_workers(request.param, ["pre0", "pre1", "dec0"], "")
    finally:
        if before is None:
            del os.environ["DISAGG_CUDA_IPC"]
        else:
            os.environ["DISAGG_CUDA_IPC"] = before
    try:
        yield workers
    finally:
        tw.stop_workers(workers)


def _handoff(workers: list[Worker], key: str, src_pool: int, dst_pool: int) -> dict[str, Any]:
    """Set up, stage, pull, wait and check one handoff; return the tickets and the stats."""
    pre, dec = workers[:2], workers[2]
    src_metas = [
        pre[i]("setup", key, CASE, s, "src", mode="staged", staging_bytes=src_pool)
        for i, s in enumerate(CASE.srcs)
    ]
    dst_meta = dec("setup", key, CASE, CASE.dsts[0], "dst", mode="staged", staging_bytes=dst_pool)
    try:
        n = CASE.num_tokens
        tickets = [
            tw.stage(pre[i], key, dst_meta, tw.src_ids(CASE, s), src_metas=src_metas, num_tokens=n)
            for i, s in enumerate(CASE.srcs)
        ]
        src_ids = {s.global_rank: tw.src_ids(CASE, s) for s in CASE.srcs}
        dst_ids = tw.dst_ids(CASE, CASE.dsts[0])
        tw.pull(dec, key, src_metas, src_ids, dst_ids, num_tokens=n, staged=tickets)
        tw.drive(dec, pre, key)  # a streamed copy advances as the prefill polls
        dec("wait", key)
        stats = dec("stats", key)
        got = dec("buffer", key)
        assert np.array_equal(got, tw.expected_dst(CASE, CASE.dsts[0]).numpy())
        for i, t in enumerate(tickets):
            pre[i]("call", key, "release_staged", t)
        return {"tickets": tickets, "stats": stats}
    finally:
        for i in range(len(CASE.srcs)):
            pre[i]("close", key)
        dec("close", key)


@pytest.mark.parametrize(
    ("key", "src_pool", "dst_pool", "staged", "mode", "min_descriptors"),
    [
        pytest.param("fits", LARGE, LARGE, True, "staged", 0, id="fits_both_pools_moves_packed"),
        pytest.param(
            "src-small", SMALL, LARGE, True, "streamed", 2 * (20480 // 1024),
            id="larger_than_prefill_pool_streamed_through_its_slots",
        ),
        pytest.param(
            "src-tiny", TINY, LARGE, False, "direct", 0,
            id="prefill_pool_smaller_than_one_item_read_directly",
        ),
        # A stream's chunk must fit two slots per source of the decode's pool too.
        pytest.param(
            "both-small", SMALL, TINY, False, "direct", 0,
            id="decode_pool_too_small_for_a_stream_reads_the_blocks_directly",
        ),
        # Each source's 20,480 packed bytes go through a 4,096-byte pool: many reads each.
        pytest.param(
            "dst-small", LARGE, SMALL, True, "chunked", 2 * (20480 // SMALL),
            id="packed_copy_larger_than_decode_pool_read_in_chunks",
        ),
        pytest.param(
            "dst-tiny", LARGE, TINY, True, "direct", 0,
            id="decode_pool_smaller_than_one_item_reads_the_blocks_directly",
        ),
    ],
)  # fmt: skip
def test_a_handoff_lands_byte_exact_packed_chunked_or_direct_as_the_pools_allow(
    pool: list[Worker],
    key: str,
    src_pool: int,
    dst_pool: int,
    staged: bool,
    mode: str,
    min_descriptors: int,
) -> None:
    out = _handoff(pool, key, src_pool, dst_pool)
    assert all(t["staged"] is staged for t in out["tickets"])
    assert set(out["stats"]["modes"].values()) == {mode}
    assert out["stats"]["descriptors"] >= min_descriptors
