"""In-process tests of the transport pieces: staging, arena, handles, registration, metadata."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disagg_rs import exceptions
from disagg_rs.transfer_backends import construct_kv_transfer_backend_class, staging
from disagg_rs.transfer_backends.nccl import NcclTransferBackend, NcclTransferHandle
from disagg_rs.transfer_backends.nixl import (
    NixlPullHandle,
    NixlTransferBackend,
    StagingArena,
    _PullPart,
    nixl_cuda_major_mismatch,
    ucx_tls_allows_cuda,
)
from kernel_cases import fragments
from transport_workers import reference_compiler

# -- staging -------------------------------------------------------------------------------


@st.composite
def fragment_lists(draw: st.DrawFn) -> tuple[int, np.ndarray]:
    """A buffer size and non-overlapping fragments ``(offset, len)`` in random order."""
    unit, end, frags = fragments(draw, [1, 2, 4, 8, 16, 256], 24, 6)
    return end + unit * 2, frags


def _gather_list(frags: np.ndarray, base: int) -> np.ndarray:
    packed = np.cumsum(frags[:, 1]) - frags[:, 1]
    return np.stack([frags[:, 0] + base, frags[:, 1], packed], axis=1).astype(np.uint64)


@given(fragment_lists(), st.integers(0, 2**40))
def test_pack_copies_each_fragment_to_its_packed_offset(
    spec: tuple[int, np.ndarray], base: int
) -> None:
    size, frags = spec
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8)
    gather = _gather_list(frags, base)
    out = torch.zeros(int(frags[:, 1].sum()) + 3, dtype=torch.uint8)
    assert staging.pack(buf, base, gather, out) == int(frags[:, 1].sum())
    want = bytearray(out.numel())
    for src, length, packed in gather.tolist():  # the oracle may loop
        want[packed : packed + length] = bytes(buf[src - base : src - base + length].tolist())
    assert bytes(out.tolist()) == bytes(want)


@given(fragment_lists())
def test_scatter_after_pack_restores_exactly_the_fragments(spec: tuple[int, np.ndarray]) -> None:
    size, frags = spec
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    gather = _gather_list(frags, 0)
    packed = torch.empty(int(frags[:, 1].sum()), dtype=torch.uint8)
    staging.pack(src, 0, gather, packed)
    dst = torch.full((size,), 7, dtype=torch.uint8)
    scatter = gather[:, [2, 0, 1]]
    staging.scatter(packed, dst, 0, scatter)
    mask = torch.zeros(size, dtype=torch.bool)
    for off, length in frags.tolist():
        mask[off : off + length] = True
    assert torch.equal(dst[mask], src[mask])
    assert bool((dst[~mask] == 7).all())


def test_pack_works_on_typed_multidimensional_buffers() -> None:
    buf = torch.arange(2 * 3 * 4, dtype=torch.int32).view(2, 3, 4)
    # Rows 1 and 0 of plane 1 (16 bytes each), packed back to back.
    gather = np.array([[4 * (12 + 4), 16, 0], [4 * 12, 16, 16]], dtype=np.uint64)
    out = torch.empty(8, dtype=torch.int32)
    staging.pack(buf, 0, gather, out)
    assert out.tolist() == [16, 17, 18, 19, 12, 13, 14, 15]


def test_pack_rejects_a_fragment_past_the_buffer() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="past the buffer"):
        staging.pack(buf, 0, np.array([[60, 8, 0]], dtype=np.uint64), torch.empty(8))


# -- staging arena ---------------------------------------------------------------------------


def test_staging_arena_reuses_freed_ranges_and_refuses_when_full() -> None:
    arena = StagingArena(1024)
    a = arena.alloc(100)
    b = arena.alloc(300)
    assert (a, b) == (0, 256)
    arena.free(a)
    assert arena.alloc(200) == 0
    with pytest.raises(exceptions.CapacityError) as info:
        arena.alloc(600)
    assert info.value.field == "staging_bytes"
    arena.free(12345)  # unknown offset: no-op
    assert arena.in_use == 256 + 512


# -- handles -------------------------------------------------------------------------------


class ScriptedAgent:
    """Plays back NIXL transfer states per transfer (stands in for a remote that misbehaves)."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = script
        self.released: list[str] = []

    def check_xfer_state(self, xfer: str) -> str:
        states = self.script[xfer]
        return states.pop(0) if len(states) > 1 else states[0]

    def release_xfer_handle(self, xfer: str) -> None:
        self.released.append(xfer)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pull_handle_raises_an_error_only_after_every_part_is_terminal() -> None:
    agent = ScriptedAgent({"a": ["ERR"], "b": ["PROC", "PROC", "DONE"]})
    landed: list[str] = []
    parts = [
        _PullPart(0, "a", context="a"),
        _PullPart(1, "b", on_done=lambda: landed.append("b"), context="b"),
    ]
    handle = NixlPullHandle(agent, parts, 10.0, VirtualClock(), None)
    assert handle.poll() is False  # "a" failed but "b" may still write
    assert handle.poll() is False
    with pytest.raises(exceptions.TransferError, match="ERR"):
        handle.poll()
    assert landed == ["b"]
    assert sorted(agent.released) == ["a", "b"]


def test_pull_handle_times_out_on_the_virtual_clock_and_settles_later() -> None:
    clock = VirtualClock()
    agent = ScriptedAgent({"a": ["PROC"]})
    handle = NixlPullHandle(agent, [_PullPart(0, "a", context="a")], 5.0, clock, None)
    assert handle.poll() is False
    clock.now = 5.5
    with pytest.raises(exceptions.TransferTimeout) as info:
        handle.poll()
    assert info.value.destinations_may_be_written
    agent.script["a"] = ["DONE"]
    assert handle.poll() is True  # a late completion still drains the handle


def test_pull_handle_with_a_posting_error_and_no_parts_fails_at_once() -> None:
    handle = NixlPullHandle(ScriptedAgent({}), [], 5.0, VirtualClock(), "post failed")
    with pytest.raises(exceptions.TransferError, match="post failed"):
        handle.poll()


class ScriptedWork:
    def __init__(self, completes_after: int) -> None:
        self.left = completes_after

    def is_completed(self) -> bool:
        self.left -= 1
        return self.left < 0

    def wait(self) -> bool:
        return True


def test_nccl_handle_scatters_once_after_completion() -> None:
    landed: list[int] = []
    handle = NcclTransferHandle(
        [ScriptedWork(1)], [], [lambda: landed.append(1)], 5.0, VirtualClock()
    )
    assert handle.poll() is False
    assert handle.poll() is True
    assert handle.poll() is True
    assert landed == [1]


# -- UCX sanity checks and registry ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "ok"),
    [
        (None, True),
        ("", True),
        ("tcp,self,sm", False),
        ("tcp,cuda_copy,cuda_ipc", True),
        ("rc,sm", False),  # rc moves host memory only
        ("rc", False),
        ("all", True),
        ("rc,cuda_copy", True),
        ("^cuda_copy,cuda_ipc,cuda", False),
        ("^cuda_copy,cuda_ipc,gdr_copy", False),
        ("^cuda_copy,cuda_ipc", True),  # gdr_copy is left
        ("^ib", True),
    ],
)
def test_ucx_tls_without_a_cuda_transport_is_refused_for_gpu_buffers(
    tls: str | None, ok: bool
) -> None:
    assert ucx_tls_allows_cuda(tls) is ok


def test_nixl_cuda_major_mismatch_is_explained() -> None:
    assert nixl_cuda_major_mismatch("nixl-cu12", "13.0") is not None
    assert nixl_cuda_major_mismatch("nixl-cu13", "13.0") is None
    assert nixl_cuda_major_mismatch("nixl-cu13", None) is None


def test_backend_registry_names_both_backends_and_refuses_others() -> None:
    assert construct_kv_transfer_backend_class("nixl") is NixlTransferBackend
    assert construct_kv_transfer_backend_class("nccl") is NcclTransferBackend
    with pytest.raises(ValueError, match="unknown transfer backend"):
        construct_kv_transfer_backend_class("carrier-pigeon")


# -- real NIXL agent in this process: registration and metadata --------------------------------


def _kv(blocks: int = 4) -> torch.Tensor:
    return torch.zeros(2, 2, blocks, 16, 2, 8, dtype=torch.bfloat16)


@pytest.fixture
def backend() -> Any:
    b = NixlTransferBackend("unit", _kv(), 4, compiler=reference_compiler, staging_bytes=4096)
    yield b
    b.close()


def test_buffers_share_one_agent_and_close_deregisters_once(backend: Any) -> None:
    import disagg_rs

    layout = disagg_rs.SSMShardLayout(2, disagg_rs.SSMStateDims(4, 2, 3, 2, 4))
    conv = backend.new_registered_buffer(
        memory_buffer=torch.zeros(2, 3, layout.local_conv_channels, 4),
        expected_num_blocks=3,
        ssm_layout=layout,
        ssm_state_kind="conv",
    )
    assert conv.export_meta()["state_kind"] == "conv"
    ctx = backend._ctx
    assert conv.agent is backend.agent
    assert ctx.refs == 2
    conv.close()
    conv.close()  # idempotent
    assert ctx.refs == 1


def test_export_meta_is_json_and_msgpack_safe_and_versioned(backend: Any) -> None:
    meta = backend.export_meta()
    assert json.loads(json.dumps(meta)) == meta
    assert msgpack.unpackb(msgpack.packb(meta)) == meta
    assert meta["version"] == 1
    assert meta["layout"]["num_kv_heads"] == 2
    assert len(meta["compat_hash"]) == 16
    assert meta["incarnation"] == backend.incarnation


def test_an_unknown_mode_is_refused_before_the_shared_agent_is_held(backend: Any) -> None:
    with pytest.raises(exceptions.ArgumentError, match="got 'fast'") as info:
        backend.new_registered_buffer(memory_buffer=_kv(), expected_num_blocks=4, mode="fast")
    assert isinstance(info.value, ValueError) and info.value.field == "mode"
    assert backend._ctx.refs == 1
    staged = backend.new_registered_buffer(
        memory_buffer=_kv(), expected_num_blocks=4, mode="staged"
    )
    assert staged.mode == "staged" and backend._ctx.refs == 2
    staged.close()


def test_a_head_dim_that_disagrees_with_the_buffer_is_refused_at_construction() -> None:
    with pytest.raises(exceptions.GeometryMismatchError) as info:
        NixlTransferBackend("bad", _kv(), 4, head_dim=64)
    assert info.value.field == "head_dim"


def test_ssm_state_needs_a_kind(backend: Any) -> None:
    import disagg_rs

    layout = disagg_rs.SSMShardLayout(2, disagg_rs.SSMStateDims(4, 2, 3))
    with pytest.raises(exceptions.LayoutError):
        backend.new_registered_buffer(
            memory_buffer=torch.zeros(2, 3, 8, 4), expected_num_blocks=3, ssm_layout=layout
        )


def test_backends_default_to_the_rust_compiler_and_export_its_geometry() -> None:
    import disagg_rs
    from disagg_rs.transfer_backends.base import rust_program_compiler

    b = NixlTransferBackend("rust-default", _kv(), 4)
    try:
        meta = b.export_meta()
        assert b.compiler is rust_program_compiler
        assert disagg_rs.KVGeometry.from_dict(meta["geometry"]) == disagg_rs.KVGeometry.from_tensor(
            b.memory_buffer
        )
        program = rust_program_compiler([meta], meta, [0, 1], [2, 3], 20, "auto")
        assert isinstance(program, disagg_rs.TransferProgram)
        program.verify()
    finally:
        b.close()


def test_vram_support_is_recognised_under_both_nixl_spellings() -> None:
    from disagg_rs.transfer_backends.nixl import backend_supports_vram

    assert backend_supports_vram(["DRAM_SEG", "VRAM_SEG"])  # NIXL 1.5.1 on an H200
    assert backend_supports_vram(["DRAM", "VRAM"])
    assert not backend_supports_vram(["DRAM_SEG"])


def test_a_head_fragment_slice_read_reads_each_token_and_needs_the_peers_heads() -> None:
    from disagg_rs import _core

    peer: dict[str, Any] = {"base_addr": 4096, "outer_stride_bytes": 1024, "device_id": 1,
                            "bytes_per_slice": 256, "heads_per_partition": 4}  # fmt: skip
    local = {"base_addr": 0, "outer_stride_bytes": 512, "bytes_per_slice": 128, "device_id": 0,
             "heads_per_partition": 2, "head_dim": 8, "element_size": 2, "tokens_per_block": 4,
             "buffer": {"mem_type": "DRAM"}}  # fmt: skip
    ids = np.asarray([1], dtype=np.uint64)
    args = (ids, ids, (0, 0, 1), (2, 0, 2), "p")
    local_rows, remote_rows, local_mem, remote_mem, label = _core.slice_reads(peer, local, *args)
    # Heads 2..4 of each token of the peer's block 1 (16 bytes a head, 4 heads a token) into
    # heads 0..2 of the same token here (2 heads a token).
    assert remote_rows.tolist() == [[4096 + 256 + 32 + 64 * t, 32, 1] for t in range(4)]
    assert local_rows.tolist() == [[128 + 32 * t, 32, 0] for t in range(4)]
    assert (local_mem, remote_mem) == ("DRAM", "VRAM")
    assert label == "reshard peer=p outer[0:+1] heads[2:+2] blocks=1"
    del peer["heads_per_partition"]
    with pytest.raises(exceptions.MetadataError) as err:
        _core.slice_reads(peer, local, *args)
    assert err.value.field == "heads_per_partition"
