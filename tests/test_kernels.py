"""Pack/scatter kernels on the CPU: dispatch, run tables, and the Triton kernel body itself.

The kernel runs here under Triton's interpreter (``TRITON_INTERPRET=1``, host tensors), the
same code that compiles for the GPU, and must match the torch path byte for byte on random
fragment lists and on real compiled programs. ``test_kernels_gpu.py`` repeats the
comparison on a CUDA device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer
from disagg_rs.transfer_backends import kernels, staging
from kernel_cases import fragments, interpret, source_caches

pytest.importorskip("triton")

# Triton's interpreter turns its 1-element scalar arrays into loop bounds with int(), which
# numpy deprecates; the warning is the interpreter's, not ours.
interpreter_warnings = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)

# Small launch shape so a handful of fragments spans several programs and inner steps.
TINY = kernels.KernelConfig(block=64, sub=2, num_warps=1)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the Triton kernel on host tensors through the interpreter."""
    interpret(monkeypatch)
    monkeypatch.setenv("DISAGG_STAGING_KERNEL", "triton")
    yield


@st.composite
def fragment_lists(draw: st.DrawFn) -> tuple[int, np.ndarray, int]:
    """Buffer size, non-overlapping fragments ``(offset, len)`` in random order, and a byte
    offset for the staging region (exercises the unit falling back below 16 bytes)."""
    _, end, frags = fragments(draw, [1, 2, 4, 8, 16, 48, 256], 12, 4)
    return end + 64, frags, draw(st.sampled_from([0, 0, 4, 8, 1]))


def _gather_list(frags: np.ndarray, base: int) -> np.ndarray:
    packed = np.cumsum(frags[:, 1]) - frags[:, 1]
    return np.stack([frags[:, 0] + base, frags[:, 1], packed], axis=1).astype(np.uint64)


# -- dispatch ------------------------------------------------------------------------------


def test_host_tensors_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_STAGING_KERNEL", raising=False)
    assert kernels.path_for(torch.zeros(4)) == "torch"


def test_the_environment_forces_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_STAGING_KERNEL", "triton")
    assert kernels.path_for(torch.zeros(4)) == "triton"
    monkeypatch.setenv("DISAGG_STAGING_KERNEL", "torch")
    assert kernels.path_for(torch.zeros(4)) == "torch"


def test_staging_on_host_tensors_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_STAGING_KERNEL", raising=False)
    buf = torch.arange(256, dtype=torch.uint8)
    gather = np.array([[64, 16, 0], [0, 32, 16]], dtype=np.uint64)
    a, b = torch.zeros(48, dtype=torch.uint8), torch.zeros(48, dtype=torch.uint8)
    assert staging.pack(buf, 0, gather, a) == staging.pack_torch(buf, 0, gather, b) == 48
    assert torch.equal(a, b)


# -- run tables ----------------------------------------------------------------------------


def test_run_table_unit_is_the_widest_power_of_two_dividing_every_offset() -> None:
    gather = np.array([[1024, 256, 0], [4096, 512, 256]], dtype=np.uint64)
    table = kernels.build_run_table(
        gather, "gather", 0, device="cpu", other_limit=8192, packed_limit=768
    )
    assert table is not None
    assert (table.unit, table.total_bytes, table.n_runs) == (16, 768, 2)
    assert table.packed_start.tolist() == [0, 16, 48]
    assert table.other_start.tolist() == [64, 256]
    odd = kernels.build_run_table(
        gather, "gather", 0, device="cpu", other_limit=8192, packed_limit=768, align=(4100,)
    )
    assert odd is not None and odd.unit == 4


def test_run_table_sorts_runs_by_packed_offset() -> None:
    scatter = np.array([[256, 0, 256], [0, 4096, 256]], dtype=np.uint64)
    table = kernels.build_run_table(
        scatter, "scatter", 0, device="cpu", other_limit=8192, packed_limit=512
    )
    assert table is not None
    assert table.other_start.tolist() == [256, 0]


@interpreter_warnings
def test_non_canonical_packing_has_no_run_table_and_takes_the_torch_path(
    interpreted: None,
) -> None:
    gather = np.array([[0, 16, 32], [64, 16, 0]], dtype=np.uint64)  # a hole at [16, 32)
    assert (
        kernels.build_run_table(gather, "gather", 0, device="cpu", other_limit=128, packed_limit=48)
        is None
    )
    buf = torch.arange(128, dtype=torch.uint8)
    out, ref = torch.zeros(48, dtype=torch.uint8), torch.zeros(48, dtype=torch.uint8)
    kernels.pack(buf, 0, gather, out)
    staging.pack_torch(buf, 0, gather, ref)
    assert torch.equal(out, ref)


def test_run_table_rejects_a_fragment_past_the_buffer() -> None:
    gather = np.array([[120, 16, 0]], dtype=np.uint64)
    with pytest.raises(ValueError, match="past the buffer's 128 bytes"):
        kernels.build_run_table(gather, "gather", 0, device="cpu", other_limit=128, packed_limit=16)
    with pytest.raises(ValueError, match="below the buffer"):
        kernels.build_run_table(
            gather, "gather", 200, device="cpu", other_limit=128, packed_limit=16
        )
    with pytest.raises(ValueError, match="staging region's 8 bytes"):
        kernels.build_run_table(
            np.array([[0, 16, 0]], dtype=np.uint64),
            "gather",
            0,
            device="cpu",
            other_limit=128,
            packed_limit=8,
        )


@interpreter_warnings
def test_a_copy_range_outside_the_packed_total_is_refused(interpreted: None) -> None:
    gather = np.array([[0, 32, 0]], dtype=np.uint64)
    table = kernels.build_run_table(
        gather, "gather", 0, device="cpu", other_limit=64, packed_limit=32
    )
    assert table is not None
    buf, out = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[0, 48\) is not inside \[0, 32\)"):
        kernels.copy_runs(table, buf, out, gather=True, packed_hi=48)
    with pytest.raises(ValueError, match="16-byte units"):
        kernels.copy_runs(table, buf, out, gather=True, packed_lo=8)
    assert kernels.copy_runs(table, buf, out, gather=True, packed_lo=16, packed_hi=16) == 0


def test_expanded_runs_list_every_fragment_in_run_order() -> None:
    runs = np.array([[100, 0, 8, 3, 32, 8], [7, 24, 4, 1, 0, 0]], dtype=np.uint64)
    want = [(100 + 32 * k, 8 * k, 8) for k in range(3)] + [(7, 24, 4)]
    assert [tuple(r) for r in kernels.expand_runs(runs).tolist()] == want


# -- the kernel body, interpreted ----------------------------------------------------------


@interpreter_warnings
@given(fragment_lists(), st.integers(0, 2**40))
def test_kernel_pack_and_scatter_match_the_torch_path_byte_exact(
    spec: tuple[int, np.ndarray, int], base: int
) -> None:
    size, frags, region_offset = spec
    with pytest.MonkeyPatch.context() as mp:
        interpret(mp)
        mp.setenv("DISAGG_STAGING_KERNEL", "triton")
        gen = torch.Generator().manual_seed(size)
        buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        gather = _gather_list(frags, base)
        total = int(frags[:, 1].sum())
        backing = torch.zeros(total + 24, dtype=torch.uint8)
        region = backing[region_offset : region_offset + total + 8]
        ref = torch.zeros_like(region)
        assert kernels.pack(buf, base, gather, region, config=TINY) == total
        staging.pack_torch(buf, base, gather, ref)
        assert torch.equal(region, ref)
        dst = torch.full((size,), 7, dtype=torch.uint8)
        want = dst.clone()
        scatter_list = gather[:, [2, 0, 1]]
        assert kernels.scatter(region, dst, base, scatter_list, config=TINY) == total
        staging.scatter_torch(ref, want, base, scatter_list)
        assert torch.equal(dst, want)


@interpreter_warnings
@pytest.mark.parametrize(
    ("src_tp", "src_tpb", "dst_tpb"), [(2, 16, 16), (2, 4, 16), (1, 16, 4), (4, 8, 8)]
)
def test_kernel_runs_of_compiled_programs_land_the_same_bytes_as_the_flat_torch_path(
    interpreted: None, src_tp: int, src_tpb: int, dst_tpb: int
) -> None:
    layers, heads, dim, tokens = 2, 8, 16, 37
    n_src, n_dst = -(-tokens // src_tpb), -(-tokens // dst_tpb)
    src_ids = list(np.random.default_rng(src_tp).permutation(n_src + 2)[:n_src])
    dst_ids = list(np.random.default_rng(dst_tpb).permutation(n_dst + 1)[:n_dst])
    gen = torch.Generator().manual_seed(src_tp * 100 + src_tpb)
    shape = (2, layers, n_src + 2, src_tpb, heads // src_tp, dim)
    bufs, srcs = source_caches(src_tp, shape, heads, gen)
    dst = torch.zeros((2, layers, n_dst + 1, dst_tpb, heads, dim), dtype=torch.int16)
    want = torch.zeros_like(dst)
    dst_layout = KVShardLayout(layers, heads, global_rank=50)
    program = compile_kv_transfer(
        srcs, (dst_layout, KVGeometry.from_tensor(dst)), src_ids, dst_ids, tokens, "staged"
    )
    for r in program.src_ranks:
        n = program.packed_bytes(r)
        region, ref = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        base = bufs[r].data_ptr()
        kernels.pack(bufs[r], base, program.gather_runs(r), region, form="gather_runs", config=TINY)
        staging.pack_torch(bufs[r], base, program.gather(r), ref)
        assert torch.equal(region, ref)
        # The 64-bit fragment index (runs past 2**31 units) gives the same bytes.
        table = kernels.build_run_table(
            program.gather_runs(r), "gather_runs", base, device="cpu",
            other_limit=bufs[r].numel() * 2, packed_limit=n,
        )  # fmt: skip
        assert table is not None and table.div_bits in (0, 32)
        wide = torch.zeros_like(region)
        kernels.copy_runs(dataclasses.replace(table, div_bits=64), bufs[r], wide, gather=True)
        assert torch.equal(wide, ref)
        kernels.scatter(
            region, dst, dst.data_ptr(), program.scatter_runs(r), form="scatter_runs", config=TINY
        )
        staging.scatter_torch(ref, want, dst.data_ptr(), program.scatter(r))
    assert torch.equal(dst, want)
    assert bool((dst != 0).any())


def _imported_modules(module: str) -> set[str]:
    """Modules of ``disagg_rs.transfer_backends`` that ``module`` imports (any position)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(f"disagg_rs.transfer_backends.{module}")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "disagg_rs.transfer_backends":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("disagg_rs.transfer_backends."):
                found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.rsplit(".", 1)[1]
                for a in node.names
                if a.name.startswith("disagg_rs.transfer_backends.")
            )
    return found


def test_copy_modules_import_in_one_direction_without_a_cycle() -> None:
    assert _imported_modules("torch_copy") & {"kernels", "staging", "device_plan"} == set()
    assert "staging" not in _imported_modules("kernels")
    assert "staging" not in _imported_modules("device_plan")
    assert staging.pack is kernels.pack and staging.scatter is kernels.scatter
