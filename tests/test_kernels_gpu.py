"""The compiled Triton pack/scatter kernels on a CUDA device, byte-exact against torch.

Skipped cleanly without CUDA. One command on a GPU machine:
``python -m pytest -q -m gpu tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer
from disagg_rs.transfer_backends import kernels, staging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIGS = [kernels.DEFAULT_CONFIG, kernels.KernelConfig(block=128, sub=3, num_warps=2)]


@st.composite
def fragment_lists(draw: st.DrawFn) -> tuple[int, np.ndarray]:
    """Buffer size and non-overlapping fragments ``(offset, len)`` in random order, with
    sizes from 2 bytes to 128 KiB (whole blocks), mixed within one list."""
    unit = draw(st.sampled_from([2, 4, 8, 16, 256, 1024, 32768]))
    n = draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lens = unit * rng.integers(1, 5, n)
    gaps = unit * rng.integers(0, 3, n)
    offsets = np.cumsum(gaps + lens) - lens
    order = rng.permutation(n)
    frags = np.stack([offsets[order], lens[order]], axis=1).astype(np.int64)
    return int(offsets[-1] + lens[-1] + 4096), frags


def test_cuda_tensors_take_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_STAGING_KERNEL", raising=False)
    assert kernels.path_for(torch.zeros(4, device="cuda")) == "triton"


@settings(max_examples=60)
@given(fragment_lists(), st.sampled_from([0, 0, 8, 4]), st.sampled_from(CONFIGS))
def test_kernel_matches_the_torch_path_on_random_fragment_lists(
    spec: tuple[int, np.ndarray], region_offset: int, config: kernels.KernelConfig
) -> None:
    size, frags = spec
    gen = torch.Generator(device="cuda").manual_seed(size)
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
    base = buf.data_ptr()
    packed = np.cumsum(frags[:, 1]) - frags[:, 1]
    gather = np.stack([frags[:, 0] + base, frags[:, 1], packed], axis=1).astype(np.uint64)
    total = int(frags[:, 1].sum())
    backing = torch.zeros(total + 64, dtype=torch.uint8, device="cuda")
    region = backing[region_offset : region_offset + total + 16]
    ref = torch.zeros_like(region)
    assert kernels.pack(buf, base, gather, region, config=config) == total
    staging.pack_torch(buf, base, gather, ref)
    assert torch.equal(region, ref)
    dst = torch.full((size,), 7, dtype=torch.uint8, device="cuda")
    want = dst.clone()
    scatter_list = np.stack([packed, frags[:, 0] + dst.data_ptr(), frags[:, 1]], axis=1).astype(
        np.uint64
    )
    assert kernels.scatter(region, dst, dst.data_ptr(), scatter_list, config=config) == total
    staging.scatter_torch(ref, want, dst.data_ptr(), scatter_list)
    torch.cuda.synchronize()
    assert torch.equal(dst, want)


@pytest.mark.parametrize(
    ("src_tp", "src_tpb", "dst_tpb", "kind"),
    [(2, 64, 64, "megatron"), (2, 16, 64, "nhd"), (1, 16, 64, "megatron"), (8, 64, 64, "hnd")],
)
def test_compiled_programs_land_byte_exact_through_runs_and_flat_lists(
    src_tp: int, src_tpb: int, dst_tpb: int, kind: str
) -> None:
    layers, heads, dim, tokens = 4, 8, 128, 1000
    axes = {
        "megatron": "kv layer block token head dim",
        "nhd": "layer kv block token head dim",
        "hnd": "layer kv block head token dim",
    }[kind]

    def shape(blocks: int, tpb: int, h: int) -> tuple[int, ...]:
        return {
            "megatron": (2, layers, blocks, tpb, h, dim),
            "nhd": (layers, 2, blocks, tpb, h, dim),
            "hnd": (layers, 2, blocks, h, tpb, dim),
        }[kind]

    n_src, n_dst = -(-tokens // src_tpb), -(-tokens // dst_tpb)
    src_ids = [int(x) for x in np.random.default_rng(1).permutation(n_src + 3)[:n_src]]
    dst_ids = [int(x) for x in np.random.default_rng(2).permutation(n_dst + 3)[:n_dst]]
    bufs, srcs = {}, []
    for r in range(src_tp):
        t = torch.randn(shape(n_src + 3, src_tpb, heads // src_tp), device="cuda").to(
            torch.bfloat16
        )
        bufs[r] = t
        lay = KVShardLayout(layers, heads, tp_size=src_tp, tp_rank=r, global_rank=r)
        srcs.append((lay, KVGeometry.from_tensor(t, axes)))
    dst = torch.zeros(shape(n_dst + 3, dst_tpb, heads), dtype=torch.bfloat16, device="cuda")
    flat = torch.zeros_like(dst)
    want = torch.zeros_like(dst)
    dl = KVShardLayout(layers, heads, global_rank=50)
    program = compile_kv_transfer(
        srcs, (dl, KVGeometry.from_tensor(dst, axes)), src_ids, dst_ids, tokens, "staged"
    )
    for r in program.src_ranks:
        n = program.packed_bytes(r)
        a, b, c = (torch.zeros(n, dtype=torch.uint8, device="cuda") for _ in range(3))
        base = bufs[r].data_ptr()
        kernels.pack(bufs[r], base, program.gather_runs(r), a, form="gather_runs")
        staging.pack(bufs[r], base, program.gather(r), b)
        staging.pack_torch(bufs[r], base, program.gather(r), c)
        assert torch.equal(a, c) and torch.equal(b, c)
        kernels.scatter(a, dst, dst.data_ptr(), program.scatter_runs(r), form="scatter_runs")
        staging.scatter(b, flat, dst.data_ptr(), program.scatter(r))
        staging.scatter_torch(c, want, dst.data_ptr(), program.scatter(r))
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    assert torch.equal(flat.view(torch.int16), want.view(torch.int16))
    assert bool((want != 0).any())


@pytest.mark.parametrize("chunk_bytes", [1 << 12, 3 << 16, 1 << 30])
def test_pipelined_handoff_lands_the_same_bytes_as_pack_copy_scatter(chunk_bytes: int) -> None:
    size, frag, n = 64 << 20, 1024, 20000
    rng = np.random.default_rng(chunk_bytes)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    slots = rng.permutation(size // frag)[:n].astype(np.int64) * frag
    dslots = rng.permutation(size // frag)[:n].astype(np.int64) * frag
    packed = np.arange(n, dtype=np.int64) * frag
    lens = np.full(n, frag, dtype=np.int64)
    gather = np.stack([slots, lens, packed], axis=1).astype(np.uint64)
    scatter_list = np.stack([packed, dslots, lens], axis=1).astype(np.uint64)
    total = n * frag
    src_region = torch.empty(total, dtype=torch.uint8, device="cuda")
    dst_region = torch.empty(total, dtype=torch.uint8, device="cuda")
    g = kernels.build_run_table(
        gather, "gather", 0, device="cuda", other_limit=size, packed_limit=total
    )
    s = kernels.build_run_table(
        scatter_list, "scatter", 0, device="cuda", other_limit=size, packed_limit=total
    )
    assert g is not None and s is not None
    done = kernels.pipelined_handoff(
        g, src, src_region, s, dst, dst_region, chunk_bytes=chunk_bytes
    )
    done.synchronize()
    want = torch.zeros_like(dst)
    staging.scatter_torch(src_region, want, 0, scatter_list)  # src_region holds the packing
    ref_region = torch.empty_like(src_region)
    staging.pack_torch(src, 0, gather, ref_region)
    torch.cuda.synchronize()
    assert torch.equal(src_region, ref_region)
    assert torch.equal(dst, want)


def test_offsets_past_two_to_the_31_elements_are_addressed_exactly() -> None:
    size = (9 << 30) + 4096  # > 2**31 int32 elements
    big = torch.zeros(size, dtype=torch.uint8, device="cuda")
    try:
        offs = np.array([size - 4096, 1 << 33, 12345 * 16], dtype=np.int64)
        big[int(offs[0]) : int(offs[0]) + 256] = 1
        big[int(offs[1]) : int(offs[1]) + 256] = 2
        big[int(offs[2]) : int(offs[2]) + 256] = 3
        gather = np.stack([offs, np.full(3, 256), np.arange(3) * 256], axis=1).astype(np.uint64)
        region = torch.zeros(768, dtype=torch.uint8, device="cuda")
        kernels.pack(big, 0, gather, region)
        torch.cuda.synchronize()
        assert region.view(3, 256).amax(dim=1).tolist() == [1, 2, 3]
        assert region.view(3, 256).amin(dim=1).tolist() == [1, 2, 3]
    finally:
        del big
        torch.cuda.empty_cache()
