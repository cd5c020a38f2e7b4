"""The device plan's table decided in Rust (``_core.PackedRows``): the kernel's unit, the
paged ends the IPC bounds check reads, the sides of a launch and the copies it refuses,
checked against plain numpy models of the plan's planes and strides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg_rs import _core
from disagg_rs.exceptions import ArgumentError
from disagg_rs.transfer_backends import device_plan as dp
from disagg_rs.transfer_backends import staging
from test_device_plan import _case


def _plan() -> tuple[dp.DevicePlan, torch.Tensor, list[int], list[int]]:
    bufs, dst, src_ids, dst_ids, programs = _case(2, 1, 40, 8, seed=3)
    r, program = programs[0]
    plan = dp.DevicePlan.from_program(
        program, r, src_addr=bufs[r].data_ptr(), dst_addr=dst.data_ptr()
    )
    assert plan is not None
    return plan, bufs[r], src_ids, dst_ids


def test_the_unit_and_paged_ends_match_a_numpy_model_of_the_planes() -> None:
    plan, _, _, _ = _plan()
    bits = 16 | int(np.bitwise_or.reduce(plan.planes[:, [0, 1, 3]].reshape(-1)))
    for v in plan.strides[1:]:
        bits |= v
    for extra in ([], [4096], [4096, 6], [1 << 40, 8]):
        want = bits
        for v in extra:
            want |= v
        assert plan.unit(*extra) == want & -want
    tpb = plan.tokens_per_block
    for kind, col, bs, ts in [
        ("src", 0, plan.src_block_stride, plan.src_token_stride),
        ("dst", 1, plan.dst_block_stride, plan.dst_token_stride),
    ]:
        for blocks in (1, 7):
            ends = plan.planes[:, col] + (blocks - 1) * bs + (tpb - 1) * ts + plan.planes[:, 3]
            assert plan.paged_end(kind, blocks) == int(ends.max())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError) as err:
        plan.paged_end("packed", 1)  # type: ignore[arg-type]
    assert err.value.field == "kind"


def test_the_ipc_bounds_hold_where_the_paged_ends_of_every_plan_fit_both_buffers() -> None:
    plan, _, _, _ = _plan()
    src_end, dst_end = plan.paged_end("src", 5), plan.paged_end("dst", 3)
    sizes = [(src_end, dst_end), (src_end - 1, dst_end), (src_end, dst_end - 1)]
    for src_bytes, dst_bytes in sizes:
        want = src_end <= src_bytes and dst_end <= dst_bytes
        assert _core.ipc_bounds_hold([(plan.packed, 5, src_bytes)], 3, dst_bytes) is want
    # Source ranks that cut the prompt into other blocks never share one IPC route.
    other = dp.DevicePlan(plan.planes, plan.tokens_per_block * 2, *plan.strides[1:], plan.sets)
    big = 1 << 40
    assert _core.ipc_bounds_hold([(plan.packed, 1, big), (plan.packed, 1, big)], 1, big)
    assert not _core.ipc_bounds_hold([(plan.packed, 1, big), (other.packed, 1, big)], 1, big)
    assert not _core.ipc_bounds_hold([], 1, big)


def test_a_prepared_copy_from_the_packed_region_is_refused_naming_the_side() -> None:
    plan, buf, _, _ = _plan()
    packed = torch.zeros(plan.packed_bytes(40), dtype=torch.uint8)
    with pytest.raises(ArgumentError, match="paged buffer") as err:
        dp.PreparedCopy(plan, dp.Side("packed", packed), dp.Side("dst", buf))
    assert err.value.field == "a"


def test_a_copy_with_an_unknown_side_kind_or_a_paged_side_without_ids_is_refused() -> None:
    plan, buf, src_ids, _ = _plan()
    packed = torch.zeros(plan.packed_bytes(40), dtype=torch.uint8)
    ids = torch.tensor(src_ids)
    with pytest.raises(ArgumentError) as err:
        dp.copy(plan, dp.Side("peer", buf, ids), dp.Side("packed", packed), 40)  # type: ignore[arg-type]
    assert err.value.field == "kind"
    for path in ("torch", "auto"):
        with pytest.raises(ArgumentError, match="src side needs block ids"):
            dp.copy(plan, dp.Side("src", buf), dp.Side("packed", packed), 40, path=path)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="src side needs block ids"):
            dp.copy_torch(plan, dp.Side("src", buf), dp.Side("packed", packed), 40, 0, 1)
    assert not bool(packed.any())


def test_the_torch_twin_given_its_sides_by_rust_packs_what_the_compiler_lists_pack() -> None:
    bufs, dst, src_ids, _, programs = _case(2, 1, 40, 8, seed=3)
    r, program = programs[0]
    plan = dp.DevicePlan.from_program(
        program, r, src_addr=bufs[r].data_ptr(), dst_addr=dst.data_ptr()
    )
    assert plan is not None
    want = torch.zeros(program.packed_bytes(r), dtype=torch.uint8)
    staging.pack_torch(bufs[r], bufs[r].data_ptr(), program.gather(r), want)
    got = torch.zeros_like(want)
    src = dp.Side("src", bufs[r], torch.tensor(src_ids))
    assert dp.copy(plan, src, dp.Side("packed", got), 40, path="torch") == want.numel()
    assert torch.equal(got, want)
