"""Two-sided transfers over NCCL between two GPUs (two spawned processes, one GPU each).

Skipped cleanly without two CUDA GPUs; run through the device tool on an H200 pair. The
same cases and oracle as the CPU tests, buffers on the GPUs, pack and scatter on the GPUs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import transport_workers as tw
from test_transport_multiprocess import CASES
from transport_workers import Case, Worker

pytestmark = pytest.mark.gpu

ONE_TO_ONE = [c for c in CASES if len(c.srcs) == 1 and len(c.dsts) == 1]
_tags = itertools.count(1)


@pytest.fixture(scope="module")
def nccl_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    store = str(tmp_path_factory.mktemp("nccl") / "store")
    workers = tw.start_workers("nccl", ["pre0", "dec0"], store)
    try:
        yield workers
    finally:
        tw.stop_workers(workers)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("case", ONE_TO_ONE, ids=lambda c: c.name)
def test_nccl_push_and_pull_between_gpus_land_every_byte(
    nccl_pool: list[Worker], case: Case
) -> None:
    pre, dec = nccl_pool
    key, tag = case.name, next(_tags)
    src, dst = case.srcs[0], case.dsts[0]
    num_tokens = case.num_tokens if case.kind == "kv" else None
    ms = pre("setup", key, case, src, "src")
    md = dec("setup", key, case, dst, "dst")
    try:
        dec.send(
            "call",
            key,
            "begin_pull_blocks",
            ms,
            tw.src_ids(case, src),
            tw.dst_ids(case, dst),
            num_tokens=num_tokens,
            tag=tag,
        )
        pre.send(
            "call",
            key,
            "begin_push_blocks",
            md,
            tw.src_ids(case, src),
            num_tokens=num_tokens,
            tag=tag,
        )
        dec.result()
        pre.result()
        dec.send("wait", key)
        pre.send("wait", key)
        dec.result()
        pre.result()
        assert np.array_equal(dec("buffer", key), tw.expected_dst(case, dst).numpy())
    finally:
        pre("close", key)
        dec("close", key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pack_and_scatter_run_on_gpu_buffers_byte_exact() -> None:
    from disagg_rs.transfer_backends import staging

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 2**31 - 1, (4, 64, 256), generator=gen, dtype=torch.int32).cuda()
    rows = torch.randperm(4 * 64, generator=gen)[:100].numpy().astype(np.int64)
    row_bytes = 256 * 4
    lens = np.full(rows.size, row_bytes, dtype=np.int64)
    packed = np.arange(rows.size, dtype=np.int64) * row_bytes
    base = src.data_ptr()
    gather = np.stack([rows * row_bytes + base, lens, packed], 1).astype(np.uint64)
    region = torch.empty(rows.size * row_bytes, dtype=torch.uint8, device="cuda")
    staging.pack(src, base, gather, region)
    dst = torch.zeros_like(src)
    scatter = np.stack([packed, rows * row_bytes + dst.data_ptr(), lens], 1).astype(np.uint64)
    staging.scatter(region, dst, dst.data_ptr(), scatter)
    flat_src, flat_dst = src.view(-1, 256), dst.view(-1, 256)
    index = torch.from_numpy(rows).cuda()
    assert torch.equal(flat_dst[index], flat_src[index])
    mask = torch.ones(flat_dst.shape[0], dtype=torch.bool, device="cuda")
    mask[index] = False
    assert bool((flat_dst[mask] == 0).all())
