"""Bounded, chunked two-sided transfers: a staging pool far smaller than every prompt (two
4 KiB slots), so each KV handoff moves in many chunks through reused slots; byte-exact
against the same oracle as every transport test. gloo on CPU (CI), NCCL on two GPUs (marker
``gpu``), including TP2 -> TP1, TP1 -> TP2 and hybrid SSM state."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

import transport_workers as tw
from test_transport_multiprocess import CASES, _assert_landed, _setup, _src_ids
from test_transport_multiprocess import _pool as _workers
from test_transport_multiprocess import _push_pull as _push_pull_case
from transport_workers import Case, Worker

_tags = itertools.count(1000)
POOL, CHUNK = 8192, 4096


@pytest.fixture(scope="module")
def gloo_small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Worker]]]:
    yield from _workers("gloo-small", str(tmp_path_factory.mktemp("gloo-small") / "store"))


@pytest.fixture(scope="module")
def nccl_small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Worker]]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    yield from _workers("nccl-2gpu-small", str(tmp_path_factory.mktemp("nccl-small") / "store"))


def _push_pull(pool: dict[str, list[Worker]], case: Case) -> list[dict[str, object]]:
    return _push_pull_case(pool, case, next(_tags))


def _check_chunked(case: Case, stats: list[dict[str, object]]) -> None:
    if case.kind != "kv" or "block16" in case.name or "block64" in case.name or "hnd" in case.name:
        return
    for s in stats:
        # Far more chunks than slots: every slot was reused, the pool never grew.
        assert int(s["chunks"]) > POOL // CHUNK  # type: ignore[call-overload]
        assert int(s["bytes"]) > POOL  # type: ignore[call-overload]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gloo_moves_prompts_larger_than_the_staging_pool_in_chunks_byte_exact(
    gloo_small: dict[str, list[Worker]], case: Case
) -> None:
    _check_chunked(case, _push_pull(gloo_small, case))


def test_concurrent_handoffs_started_in_opposite_orders_on_the_two_sides_all_complete(
    gloo_small: dict[str, list[Worker]],
) -> None:
    """Three handoffs share one backend, and its two-slot staging pool, on each side; the
    decode posts them in one order, the prefill in the reverse one. Each handoff's worker
    thread moves its chunks through a buffer of its own, so none waits for a slot that another
    holds while that one waits for its peer (which held both engines until the transfer timed
    out)."""
    case, key = CASES[0], "opposite-orders"
    (side,) = case.dsts
    dec, pre = gloo_small["dec"][0], gloo_small["pre"][0]
    src_metas, dst_metas = _setup(gloo_small, case, key)
    tags = [next(_tags) for _ in range(3)]
    try:
        for tag in tags:
            dec("call_as", key, f"h{tag}", "begin_pull_blocks", src_metas, _src_ids(case),
                tw.dst_ids(case, side), num_tokens=case.num_tokens, tag=tag)  # fmt: skip
        for tag in reversed(tags):
            pre("call_as", key, f"h{tag}", "begin_push_blocks", dst_metas,
                tw.src_ids(case, case.srcs[0]), src_metas=src_metas, num_tokens=case.num_tokens,
                tag=tag)  # fmt: skip
        for worker in (dec, pre):
            for tag in tags:
                worker("wait", f"h{tag}")
        _assert_landed(gloo_small, case, key)
        assert int(dec("stats", f"h{tags[0]}")["chunks"]) > POOL // CHUNK
    finally:
        for worker in (dec, pre):
            worker("close", key)


TWO_GPU_CASES = [
    c
    for c in CASES
    if c.name
    in ("tp1_to_tp1", "tp2_to_tp1", "tp1_to_tp2", "ssm_conv_tp2_to_tp1", "ssm_recurrent_tp2_to_tp1")
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TWO_GPU_CASES, ids=lambda c: c.name)
def test_nccl_between_two_gpus_moves_prompts_larger_than_the_pool_in_chunks_byte_exact(
    nccl_small: dict[str, list[Worker]], case: Case
) -> None:
    _check_chunked(case, _push_pull(nccl_small, case))


def test_the_pool_is_cut_into_whole_chunks_and_never_less_than_one_slot() -> None:
    from disagg_rs.transfer_backends import pipeline

    pool = pipeline.StagingPool(torch.device("cpu"), pool_bytes=10 << 20, chunk_bytes=4 << 20)
    # Each slot holds a chunk and its message header.
    assert (pool.slots, pool.slot_bytes) == (2, 4 << 20)
    assert pool.nbytes == 2 * ((4 << 20) + pipeline.HEADER)
    assert pipeline.StagingPool(torch.device("cpu"), 1024, 4096).slots == 1
    assert [pool.next_index() for _ in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="multiple of 256"):
        pipeline.StagingPool(torch.device("cpu"), 1 << 20, 1000)


def test_receives_are_posted_ahead_of_the_previous_landing_when_the_pool_has_two_slots() -> None:
    from disagg_rs import _core
    from disagg_rs.exceptions import ArgumentError

    def steps(sends: list[bool], slots: int) -> list[int]:
        pairs = [(send, False, 3, 1, 8, [16]) for send in sends]  # one chunk each
        order, heads, tags = _core.chunk_schedule(pairs, 256, slots, False)
        assert len(heads) == len(sends) and tags == [3] * len(sends)
        return list(order)

    # k posts chunk k, -(k + 1) lands it: receive 1 is posted before chunk 0 lands.
    assert steps([False, False, False], 2) == [0, 1, -1, 2, -2, -3]
    assert steps([False, False], 1) == [0, -1, 1, -2]
    assert steps([True, True], 2) == [0, 1]
    with pytest.raises(ArgumentError, match="slots=0"):
        steps([False], 0)


def test_a_block_larger_than_a_slot_is_refused_before_anything_is_posted() -> None:
    from disagg_rs import KVGeometry, KVShardLayout, _core, compile_kv_transfer
    from disagg_rs.exceptions import CapacityError
    from disagg_rs.transfer_backends import device_plan as dp
    from disagg_rs.transfer_backends import pipeline

    buf = torch.zeros((2, 2, 4, 16, 4, 8), dtype=torch.int16)
    lay = KVShardLayout(2, 4, global_rank=0)
    program = compile_kv_transfer(
        [(lay, KVGeometry.from_tensor(buf))], (KVShardLayout(2, 4, global_rank=1), None),
        [0, 1], None, 32, "staged",
    )  # fmt: skip
    plan = dp.DevicePlan.from_program(program, 0, src_addr=buf.data_ptr(), dst_addr=0)
    assert plan is not None
    pool = pipeline.StagingPool(torch.device("cpu"), 1024, 512)  # one block-plane is 1 KiB
    cp = pipeline.ChunkPlan(plan, torch.tensor([0, 1]), 32, peer=1, send=True)
    with pytest.raises(CapacityError, match="chunk_bytes=512"):
        pipeline.post_chunks([cp], buf, pool, None, False, _core.PeerSteps())


def test_only_kv_caches_with_one_block_size_and_contiguous_heads_move_in_chunks() -> None:
    from disagg_rs.transfer_backends import pipeline

    def meta(tpb: int = 16, head_stride: int = 16, kind: str = "kv") -> dict[str, object]:
        geometry = {"tokens_per_block": tpb, "num_heads": 4, "head_stride": head_stride,
                    "head_dim": 8, "element_size": 2}  # fmt: skip
        return {"state_kind": kind, "geometry": geometry}

    assert pipeline.chunkable([meta(), meta()])
    assert not pipeline.chunkable([meta(), meta(tpb=64)])
    assert not pipeline.chunkable([meta(), meta(head_stride=16 * 16)])
    assert not pipeline.chunkable([meta(kind="conv"), meta(kind="conv")])
    assert not pipeline.chunkable([{"state_kind": "kv", "geometry": None}])
