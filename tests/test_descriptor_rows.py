"""Direct descriptor arrays: fresh arrays per call whose memory is recycled after Python drops
them; what a live array holds never changes, whatever is computed after it."""

from __future__ import annotations

import gc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer

LAYERS, HEADS, ROW, TPB, POOL = 3, 2, 32, 4, 64


def _geometry(base: int) -> KVGeometry:
    block = TPB * HEADS * ROW
    return KVGeometry(
        num_layers=LAYERS,
        num_blocks=POOL,
        tokens_per_block=TPB,
        num_heads=HEADS,
        head_dim=ROW // 2,
        element_size=2,
        block_stride=block,
        token_stride=HEADS * ROW,
        head_stride=ROW,
        plane_bases=[base + i * POOL * block for i in range(2 * LAYERS)],
        dtype="bfloat16",
    )


def _program(sids: list[int], dids: list[int], mode: str = "direct") -> object:
    layout = KVShardLayout(LAYERS, HEADS)
    return compile_kv_transfer(
        [(layout, _geometry(1 << 30))],
        (layout, _geometry(1 << 32)),
        sids,
        dids,
        len(sids) * TPB,
        mode,  # type: ignore[arg-type]
    )


def _oracle(sids: list[int], dids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-(plane, block) rows, merged where both sides continue (what a transport posts)."""
    block, plane = TPB * HEADS * ROW, POOL * TPB * HEADS * ROW
    src: list[list[int]] = []
    dst: list[list[int]] = []
    for p in range(2 * LAYERS):
        for s, d in zip(sids, dids, strict=True):
            a, b = (1 << 30) + p * plane + s * block, (1 << 32) + p * plane + d * block
            if src and src[-1][0] + src[-1][1] == a and dst[-1][0] + dst[-1][1] == b:
                src[-1][1] += block
                dst[-1][1] += block
            else:
                src.append([a, block])
                dst.append([b, block])
    return np.array(src, dtype=np.uint64).reshape(-1, 2), np.array(dst, np.uint64).reshape(-1, 2)


blocks = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.permutations(range(POOL)).map(lambda p: list(p[:n])),
        st.permutations(range(POOL)).map(lambda p: list(p[:n])),
    )
)


@settings(max_examples=40, deadline=None)
@given(st.lists(blocks, min_size=1, max_size=6), st.data())
def test_live_descriptor_arrays_keep_their_rows_while_dropped_ones_are_recycled(
    handoffs: list[tuple[list[int], list[int]]], data: st.DataObject
) -> None:
    live: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]] = []
    for sids, dids in handoffs:
        mode = data.draw(st.sampled_from(["direct", "staged"]))
        src, dst = _program(sids, dids, mode).direct_descriptors(0)  # type: ignore[attr-defined]
        assert src.dtype == np.uint64 and src.shape[1] == 3 and src.flags.c_contiguous
        want = _oracle(sids, dids)
        assert np.array_equal(src[:, :2], want[0]) and np.array_equal(dst[:, :2], want[1])
        live.append(((src, dst), want))
        if data.draw(st.booleans()) and len(live) > 1:
            del live[data.draw(st.integers(0, len(live) - 2))]
            gc.collect()
        for (s, d), (ws, wd) in live:
            assert np.array_equal(s[:, :2], ws) and np.array_equal(d[:, :2], wd)


def test_each_call_returns_new_writable_arrays_that_share_no_memory() -> None:
    program = _program([5, 9, 1], [2, 7, 30])
    a = program.direct_descriptors(0)  # type: ignore[attr-defined]
    b = program.direct_descriptors(0)  # type: ignore[attr-defined]
    assert all(not np.shares_memory(x, y) for x in a for y in b)
    assert not np.shares_memory(a[0], a[1])
    saved = b[0].copy()
    a[0][:] = 0  # the caller owns its arrays
    assert np.array_equal(b[0], saved)


def _head_reshard_program(mode: str) -> object:
    """TP2 -> TP1 head reshard (fragments per token) from rank 0's and rank 1's caches."""
    src = [
        (KVShardLayout(LAYERS, HEADS, 2, r, global_rank=r), _half(1 << (30 + r))) for r in (0, 1)
    ]
    return compile_kv_transfer(
        src,
        (KVShardLayout(LAYERS, HEADS), _geometry(1 << 33)),
        [3, 9],
        [4, 1],
        7,
        mode,  # type: ignore[arg-type]
    )


def _half(base: int) -> KVGeometry:
    block = TPB * (HEADS // 2) * ROW
    return KVGeometry(
        num_layers=LAYERS,
        num_blocks=POOL,
        tokens_per_block=TPB,
        num_heads=HEADS // 2,
        head_dim=ROW // 2,
        element_size=2,
        block_stride=block,
        token_stride=(HEADS // 2) * ROW,
        head_stride=ROW,
        plane_bases=[base + i * POOL * block for i in range(2 * LAYERS)],
        dtype="bfloat16",
    )


def test_direct_descriptors_equal_the_direct_program_descriptors_for_reshards_and_ssm() -> None:
    from disagg_rs import SSMGeometry, SSMShardLayout, SSMStateDims, compile_ssm_transfer

    for rank in (0, 1):
        want = _head_reshard_program("direct").descriptors(rank)  # type: ignore[attr-defined]
        for mode in ("direct", "staged"):
            got = _head_reshard_program(mode).direct_descriptors(rank)  # type: ignore[attr-defined]
            assert len(got[0]) == len(want[0]) > 2 * LAYERS
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    dims = SSMStateDims(num_heads=4, head_dim=2, d_state=2, n_groups=2, d_conv=3)
    lay = SSMShardLayout(2, dims)
    conv = np.arange(2 * 2 * dims.conv_channels * 3, dtype=np.uint16).reshape(2, 2, -1, 3)
    out = np.zeros_like(conv)
    progs = {
        m: compile_ssm_transfer(
            [(lay, SSMGeometry.from_tensors(conv=conv))],
            (lay, SSMGeometry.from_tensors(conv=out)),
            1,
            0,
            m,  # type: ignore[arg-type]
        )
        for m in ("direct", "staged")
    }
    want = progs["direct"].descriptors(0)
    for program in progs.values():
        got = program.direct_descriptors(0)
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def _reshard_16(rank: int) -> object:
    """TP2 -> TP1, 4 KV heads, 16 tokens per block, 40 tokens: per-token runs of 2 heads."""
    tpb, heads, row = 16, 4, 32

    def geo(base: int, h: int) -> KVGeometry:
        block = tpb * h * row
        return KVGeometry(
            num_layers=4,
            num_blocks=8,
            tokens_per_block=tpb,
            num_heads=h,
            head_dim=8,
            element_size=4,
            block_stride=block,
            token_stride=h * row,
            head_stride=row,
            plane_bases=[base + i * 8 * block for i in range(8)],
            dtype="int32",
        )

    src = [(KVShardLayout(4, heads, 2, r, global_rank=r), geo(1 << (30 + r), 2)) for r in (0, 1)]
    dst = (KVShardLayout(4, heads), geo(1 << 33, heads))
    return compile_kv_transfer(src, dst, [5, 0, 3], [7, 2, 4], 40, "direct")


def test_an_out_buffer_too_small_by_any_number_of_rows_raises_instead_of_truncating() -> None:
    from disagg_rs.exceptions import DisaggError

    program = _reshard_16(0)
    need = len(program.descriptors(0)[0])  # type: ignore[attr-defined]
    assert need > 100
    assert len(program.direct_descriptors(0)[0]) == need  # type: ignore[attr-defined]
    for n in range(1, need, 7):
        out = (np.zeros((n, 3), np.uint64), np.zeros((n, 3), np.uint64))
        try:
            got = program.descriptors(0, out=out)  # type: ignore[attr-defined]
        except DisaggError:
            continue
        raise AssertionError(f"out of {n} rows returned {len(got[0])} of {need} rows")
