"""The same-host direct path (CUDA IPC + one device-plan kernel) between processes, on one
GPU and across two, against the same oracle as every transport test; NIXL over VRAM as the
fallback on two GPUs; the device-plan kernel itself on a GPU.

Skipped cleanly without CUDA (CI has none); run through the device tool on an H200 pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import transport_workers as tw
from test_transport_multiprocess import CASES, _nixl_pull_case
from transport_workers import Case, Worker

pytestmark = pytest.mark.gpu


def _has_plan(case: Case) -> bool:
    """Whether the device plan covers the case: KV, one block size, NHD caches everywhere
    (others take NIXL on the same host too)."""
    sides = (*case.srcs, *case.dsts)
    return (
        case.kind == "kv"
        and len({s.tokens_per_block for s in sides}) == 1
        and all(s.axes == sides[0].axes == "kv layer block token head dim" for s in sides)
    )


def _pool(transport: str, gpus: int) -> Iterator[dict[str, list[Worker]]]:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    workers = tw.start_workers(transport, ["pre0", "pre1", "dec0", "dec1"], "")
    try:
        yield {"pre": workers[:2], "dec": workers[2:]}
    finally:
        tw.stop_workers(workers)


@pytest.fixture(scope="module")
def ipc_one_gpu() -> Iterator[dict[str, list[Worker]]]:
    yield from _pool("nixl-ipc", 1)


@pytest.fixture(scope="module")
def ipc_two_gpus() -> Iterator[dict[str, list[Worker]]]:
    yield from _pool("nixl-2gpu-ipc", 2)


@pytest.fixture(scope="module")
def nixl_two_gpus() -> Iterator[dict[str, list[Worker]]]:
    yield from _pool("nixl-2gpu", 2)


def _assert_ipc_where_planned(
    case: Case, stats: list[dict[str, Any]], descriptors: int | None = None
) -> None:
    """Every decode read through CUDA IPC when the case has a device plan (with
    ``descriptors`` NIXL descriptors, when given), and never otherwise."""
    if _has_plan(case):
        assert all(s["modes"] == {-1: "ipc"} for s in stats)
        assert descriptors is None or all(s["descriptors"] == descriptors for s in stats)
    else:
        assert all("ipc" not in s["modes"].values() for s in stats)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_processes_sharing_one_gpu_read_each_other_through_cuda_ipc_byte_exact(
    ipc_one_gpu: dict[str, list[Worker]], case: Case, mode: str
) -> None:
    _assert_ipc_where_planned(case, _nixl_pull_case(ipc_one_gpu, case, mode), descriptors=0)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_decode_on_gpu1_reads_prefills_on_gpu0_through_cuda_ipc_byte_exact(
    ipc_two_gpus: dict[str, list[Worker]], case: Case, mode: str
) -> None:
    _assert_ipc_where_planned(case, _nixl_pull_case(ipc_two_gpus, case, mode))


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_nixl_between_two_gpus_stays_the_fallback_byte_exact(
    nixl_two_gpus: dict[str, list[Worker]], case: Case, mode: str
) -> None:
    stats = _nixl_pull_case(nixl_two_gpus, case, mode)
    assert all("ipc" not in s["modes"].values() for s in stats)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("src_tp", "tokens"), [(1, 1000), (2, 777)])
def test_the_device_plan_kernel_packs_scatters_and_copies_on_the_gpu_byte_exact(
    src_tp: int, tokens: int
) -> None:
    from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer
    from disagg_rs.transfer_backends import device_plan as dp
    from disagg_rs.transfer_backends import staging

    layers, heads, dim, tpb = 4, 8, 128, 64
    n_blk = -(-tokens // tpb)
    rng = np.random.default_rng(src_tp)
    src_ids = [int(x) for x in rng.permutation(2 * n_blk)[:n_blk]]
    dst_ids = [int(x) for x in rng.permutation(2 * n_blk)[:n_blk]]
    shape = (2, layers, 2 * n_blk, tpb)
    srcs, bufs = [], {}
    for r in range(src_tp):
        t = torch.randint(-(2**15), 2**15, (*shape, heads // src_tp, dim), dtype=torch.int16)
        bufs[r] = t.cuda()
        lay = KVShardLayout(layers, heads, tp_size=src_tp, tp_rank=r, global_rank=r)
        srcs.append((lay, KVGeometry.from_tensor(bufs[r])))
    dst = torch.zeros((*shape, heads, dim), dtype=torch.int16, device="cuda")
    program = compile_kv_transfer(
        srcs, (KVShardLayout(layers, heads, global_rank=9), KVGeometry.from_tensor(dst)),
        src_ids, dst_ids, tokens, "staged",
    )  # fmt: skip
    staged, direct = torch.zeros_like(dst), torch.zeros_like(dst)
    sid, did = torch.tensor(src_ids, device="cuda"), torch.tensor(dst_ids, device="cuda")
    for r in program.src_ranks:
        ref = torch.zeros(program.packed_bytes(r), dtype=torch.uint8, device="cuda")
        staging.pack_torch(bufs[r], bufs[r].data_ptr(), program.gather(r), ref)
        staging.scatter_torch(ref, dst, dst.data_ptr(), program.scatter(r))
        plan = dp.DevicePlan.from_program(
            program, r, src_addr=bufs[r].data_ptr(), dst_addr=dst.data_ptr()
        )
        assert plan is not None
        packed = torch.full_like(ref, 7)
        dp.copy(plan, dp.Side("src", bufs[r], sid), dp.Side("packed", packed), tokens)
        assert torch.equal(packed, ref)
        dp.copy(plan, dp.Side("packed", packed), dp.Side("dst", staged, did), tokens)
        dp.copy(plan, dp.Side("src", bufs[r], sid), dp.Side("dst", direct, did), tokens)
    assert torch.equal(staged, dst) and torch.equal(direct, dst)
    assert bool((dst != 0).any())
