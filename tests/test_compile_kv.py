"""KV descriptor compiler against the byte-level oracle (see tests/_compile_oracle.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _compile_oracle import (
    KINDS,
    KvRank,
    apply_program,
    global_tensor,
    kv_layouts,
    megatron_geometry,
)
from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer
from disagg_rs.exceptions import (
    AddressOverflowError,
    BlockIdError,
    GeometryMismatchError,
    MetadataError,
)

SENTINEL = {np.uint16: 0xFFFF, np.uint32: 0xFFFFFFFF}


def tp_choices(heads: int) -> list[int]:
    """TP sizes the layouts accept: divisors of the head count and GQA multiples of it."""
    return [tp for tp in (1, 2, 4, 8) if heads % tp == 0 or tp % heads == 0]


def run_scenario(
    *,
    layers: int,
    heads: int,
    src_tp: int,
    src_pp: int,
    dst_tp: int,
    dst_pp: int,
    src_kind: str,
    dst_kind: str,
    src_tpb: int,
    dst_tpb: int,
    num_tokens: int,
    token_start: int,
    head_dim: int,
    dtype: Any,
    mode: str,
    draw_ids: Any,
) -> None:
    """Split a global tensor by the source layouts, compile and apply one program per
    destination rank, and compare every destination buffer with a direct split."""
    sentinel = SENTINEL[dtype]
    g = global_tensor(1 if src_kind == "mla" else 2, layers, num_tokens, heads, head_dim, dtype)
    src_layouts = kv_layouts(src_tp, src_pp, layers, heads)
    dst_layouts = kv_layouts(dst_tp, dst_pp, layers, heads, rank0=100)
    n_src_blocks = -(-num_tokens // src_tpb)
    n_dst_blocks = -(-num_tokens // dst_tpb)
    # Each PP stage allocates its own blocks; TP ranks of one stage share ids.
    stage_ids = {p: draw_ids(n_src_blocks, f"src{p}") for p in range(src_pp)}
    srcs = []
    for lay in src_layouts:
        ids = stage_ids[lay.pp_rank]
        r = KvRank(lay, src_kind, max(ids) + 1, src_tpb, head_dim, dtype, sentinel - 1)
        r.write(g, ids, 0, num_tokens)
        srcs.append((r, ids))
    src_ids = {r.layout.global_rank: ids for r, ids in srcs}
    src_ranges = {r.layout.global_rank: r.ranges() for r, _ in srcs}
    src_pairs = [(r.layout, r.geometry) for r, _ in srcs]
    before = {r.layout.global_rank: r.snapshot() for r, _ in srcs}
    for lay in dst_layouts:
        dst_ids = draw_ids(n_dst_blocks, f"dst{lay.pp_rank}")
        dst = KvRank(lay, dst_kind, max(dst_ids) + 1, dst_tpb, head_dim, dtype, sentinel)
        want = KvRank(lay, dst_kind, max(dst_ids) + 1, dst_tpb, head_dim, dtype, sentinel)
        want.write(g, dst_ids, token_start, num_tokens)
        program = compile_kv_transfer(
            src_pairs,
            (lay, dst.geometry),
            src_ids,
            dst_ids,
            num_tokens,
            mode=mode,  # type: ignore[arg-type]
            token_start=token_start,
        )
        program.verify()
        apply_program(program, src_ranges, dst.ranges())
        for got, exp in zip(dst.buffers, want.buffers, strict=True):
            np.testing.assert_array_equal(got, exp)
        # The prefill side packs without the decode's blocks: identical packed layout.
        prefill = compile_kv_transfer(
            src_pairs, (lay, None), src_ids, None, num_tokens, "staged", token_start=token_start
        )
        for r in program.src_ranks:
            assert prefill.packed_bytes(r) == program.packed_bytes(r)
            np.testing.assert_array_equal(prefill.gather(r), program.gather(r))
    for r, _ in srcs:
        for a, b in zip(r.buffers, before[r.layout.global_rank], strict=True):
            np.testing.assert_array_equal(a, b)  # sources are never written


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.sampled_from([2, 4]))
    heads = draw(st.sampled_from([1, 2, 4]))
    num_tokens = draw(st.integers(1, 24))
    ids_style = draw(st.sampled_from(["contiguous", "random"]))

    def draw_ids(n: int, label: str) -> list[int]:
        if ids_style == "contiguous":
            start = draw(st.integers(0, 3), label=label)
            return list(range(start, start + n))
        return draw(st.permutations(range(n + 3)), label=label)[:n]

    return {
        "layers": layers,
        "heads": heads,
        "src_tp": draw(st.sampled_from(tp_choices(heads))),
        "src_pp": draw(st.sampled_from([1, 2])),
        "dst_tp": draw(st.sampled_from(tp_choices(heads))),
        "dst_pp": draw(st.sampled_from([1, 2])),
        "src_kind": draw(st.sampled_from(KINDS)),
        "dst_kind": draw(st.sampled_from(KINDS)),
        "src_tpb": draw(st.sampled_from([1, 2, 4, 8])),
        "dst_tpb": draw(st.sampled_from([1, 2, 4, 8])),
        "num_tokens": num_tokens,
        "token_start": draw(st.integers(0, num_tokens)),
        "head_dim": draw(st.sampled_from([1, 3])),
        "dtype": draw(st.sampled_from([np.uint16, np.uint32])),
        "mode": draw(st.sampled_from(["direct", "staged", "auto"])),
        "draw_ids": draw_ids,
    }


@given(scenarios())
def test_every_destination_byte_equals_a_direct_split_of_the_global_tensor(
    s: dict[str, Any],
) -> None:
    run_scenario(**s)


@given(
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 3, 8]),
    st.sampled_from([1, 3, 8]),
    st.integers(1, 20),
    st.sampled_from(["direct", "staged", "auto"]),
    st.data(),
)
def test_mla_latent_bytes_equal_a_direct_split_for_any_tp_pp_and_block_sizes(
    src_tp: int,
    src_pp: int,
    dst_tp: int,
    dst_pp: int,
    src_tpb: int,
    dst_tpb: int,
    num_tokens: int,
    mode: str,
    data: st.DataObject,
) -> None:
    def draw_ids(n: int, label: str) -> list[int]:
        return data.draw(st.permutations(range(n + 2)), label=label)[:n]

    run_scenario(
        layers=2,
        heads=1,
        src_tp=src_tp,
        src_pp=src_pp,
        dst_tp=dst_tp,
        dst_pp=dst_pp,
        src_kind="mla",
        dst_kind="mla",
        src_tpb=src_tpb,
        dst_tpb=dst_tpb,
        num_tokens=num_tokens,
        token_start=data.draw(st.integers(0, num_tokens), label="token_start"),
        head_dim=5,
        dtype=np.uint16,
        mode=mode,
        draw_ids=draw_ids,
    )


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize(("src_tpb", "dst_tpb"), [(4, 16), (16, 4)])
def test_block_size_mismatch_maps_token_positions_including_a_partial_tail(
    mode: str, src_tpb: int, dst_tpb: int
) -> None:
    ids = iter(range(1000))

    def draw_ids(n: int, _: str) -> list[int]:
        return [next(ids) * 2 % 97 for _ in range(n)]

    run_scenario(
        layers=2,
        heads=2,
        src_tp=1,
        src_pp=1,
        dst_tp=1,
        dst_pp=1,
        src_kind="megatron",
        dst_kind="nhd",
        src_tpb=src_tpb,
        dst_tpb=dst_tpb,
        num_tokens=37,
        token_start=0,
        head_dim=4,
        dtype=np.uint16,
        mode=mode,
        draw_ids=draw_ids,
    )


def test_mla_latent_moves_between_tp_replicas_and_block_sizes() -> None:
    layers, tokens, d = 4, 13, 5
    g = global_tensor(1, layers, tokens, 1, d, np.uint32)
    src_layouts = kv_layouts(2, 2, layers, 1)  # GQA-style replication of the single latent
    dst_layout = kv_layouts(1, 1, layers, 1, rank0=50)[0]
    src_ids = [3, 1, 4, 0]
    srcs = []
    for lay in src_layouts:
        r = KvRank(lay, "mla", 5, 4, d, np.uint32, 7)
        r.write(g, src_ids, 0, tokens)
        srcs.append(r)
    dst = KvRank(dst_layout, "mla", 4, 8, d, np.uint32, SENTINEL[np.uint32])
    want = KvRank(dst_layout, "mla", 4, 8, d, np.uint32, SENTINEL[np.uint32])
    want.write(g, [2, 0], 0, tokens)
    program = compile_kv_transfer(
        [(r.layout, r.geometry) for r in srcs], (dst_layout, dst.geometry), src_ids, [2, 0], tokens
    )
    # One representative per replica set: the smallest global rank of each PP stage.
    assert program.src_ranks == [0, 2]
    program.verify()
    apply_program(program, {r.layout.global_rank: r.ranges() for r in srcs}, dst.ranges())
    np.testing.assert_array_equal(dst.buffers[0], want.buffers[0])


def test_contiguous_block_runs_need_one_descriptor_per_plane() -> None:
    lay = KVShardLayout(80, 8)
    src = megatron_geometry(80, 600, 64, 8, 128, 1 << 40)
    dst = megatron_geometry(80, 600, 64, 8, 128, 1 << 44)
    program = compile_kv_transfer(
        [(lay, src)], (lay, dst), list(range(10, 138)), list(range(300, 428)), 8192, "direct"
    )
    s, d = program.descriptors(0)
    assert len(s) == len(d) == 2 * 80
    assert int(s[:, 1].sum()) == 2 * 80 * 8192 * 8 * 128 * 2
    assert program.stats["descriptors"] == 160
    assert program.mode(0) == "direct"


def test_auto_mode_stages_a_fragmented_head_reshard_and_keeps_a_matched_one_direct() -> None:
    src_l = kv_layouts(8, 1, 4, 8)
    dst_l = kv_layouts(4, 1, 4, 8, rank0=8)[0]
    srcs = [
        (lay, megatron_geometry(4, 256, 16, 1, 128, (i + 1) << 36)) for i, lay in enumerate(src_l)
    ]
    dst = megatron_geometry(4, 256, 16, 2, 128, 1 << 44)
    ids = list(range(0, 256, 2))
    reshard = compile_kv_transfer(srcs, (dst_l, dst), ids, ids, 2048, "auto")
    assert [reshard.mode(r) for r in reshard.src_ranks] == ["staged", "staged"]
    assert reshard.stats["sources"][0]["descriptors"] == 1
    # 160 large descriptors cost less than packing 2.7 GB twice at gather speed.
    lay = KVShardLayout(80, 8)
    g1 = megatron_geometry(80, 600, 64, 8, 128, 1 << 40)
    g2 = megatron_geometry(80, 600, 64, 8, 128, 1 << 44)
    run = list(range(128))
    matched = compile_kv_transfer([(lay, g1)], (lay, g2), run, run, 8192, "auto")
    assert matched.mode(0) == "direct"


def test_block_ids_accept_numpy_arrays_and_per_stage_dicts() -> None:
    lay = KVShardLayout(2, 2)
    g = megatron_geometry(2, 8, 4, 2, 8, 4096)
    h = megatron_geometry(2, 8, 4, 2, 8, 1 << 30)
    a = compile_kv_transfer([(lay, g)], (lay, h), np.array([1, 5], np.int32), np.arange(2), 8)
    b = compile_kv_transfer([(lay, g)], (lay, h), {0: [1, 5]}, [0, 1], 8)
    for x, y in zip(a.descriptors(0), b.descriptors(0), strict=True):
        np.testing.assert_array_equal(x, y)


def small(layers: int = 2, heads: int = 2) -> tuple[KVShardLayout, KVGeometry, KVGeometry]:
    lay = KVShardLayout(layers, heads)
    return (
        lay,
        megatron_geometry(layers, 8, 4, heads, 8, 4096),
        megatron_geometry(layers, 8, 4, heads, 8, 1 << 30),
    )


def test_a_block_id_out_of_range_names_the_list_and_the_bound() -> None:
    lay, g, h = small()
    with pytest.raises(BlockIdError, match=r"src_block_ids\[1\]=8 must be < num_blocks=8") as e:
        compile_kv_transfer([(lay, g)], (lay, h), [0, 8], [0, 1], 8)
    assert e.value.field == "src_block_ids"
    with pytest.raises(BlockIdError, match="dst_block_ids"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, 1], [0, 9], 8)
    with pytest.raises(BlockIdError, match=r"must be in \[0, 2\*\*32\)"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, -1], [0, 1], 8)


def test_duplicate_destination_blocks_are_rejected() -> None:
    lay, g, h = small()
    with pytest.raises(BlockIdError, match="name the same block"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, 1], [3, 3], 8)


def test_a_block_list_that_does_not_match_num_tokens_names_both_values() -> None:
    lay, g, h = small()
    with pytest.raises(BlockIdError, match=r"len\(src_block_ids\)=2 but num_tokens=9"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, 1], [0, 1, 2], 9)
    with pytest.raises(BlockIdError, match=r"len\(dst_block_ids\)=3 but num_tokens=8"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, 1], [0, 1, 2], 8)
    with pytest.raises(BlockIdError, match="token_start=9 must be <= num_tokens=8"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, 1], [0, 1], 8, token_start=9)


def test_head_dim_element_size_and_dtype_mismatches_are_geometry_errors() -> None:
    lay, g, _ = small()
    with pytest.raises(GeometryMismatchError, match="head_dim=8 != head_dim=4"):
        compile_kv_transfer(
            [(lay, g)], (lay, megatron_geometry(2, 8, 4, 2, 4, 0)), [0, 1], [0, 1], 8
        )
    with pytest.raises(GeometryMismatchError, match="element_size=2 != element_size=4"):
        compile_kv_transfer(
            [(lay, g)], (lay, megatron_geometry(2, 8, 4, 2, 8, 0, item=4)), [0, 1], [0, 1], 8
        )
    d = megatron_geometry(2, 8, 4, 2, 8, 1 << 30).to_dict()
    d["dtype"] = "float16"
    with pytest.raises(GeometryMismatchError, match="dtype") as e:
        compile_kv_transfer([(lay, g)], (lay, KVGeometry.from_dict(d)), [0, 1], [0, 1], 8)
    assert e.value.field == "dtype"
    with pytest.raises(GeometryMismatchError, match="num_heads"):
        compile_kv_transfer([(KVShardLayout(2, 4), g)], (lay, g), [0, 1], [0, 1], 8)


def test_a_geometry_past_the_end_of_memory_is_an_overflow_error() -> None:
    with pytest.raises(AddressOverflowError):
        megatron_geometry(2, 8, 4, 2, 8, 2**64 - 4096)


def test_direct_and_auto_modes_need_destination_blocks() -> None:
    lay, g, h = small()
    with pytest.raises(BlockIdError, match="only mode='staged'"):
        compile_kv_transfer([(lay, g)], (lay, h), [0, 1], None, 8, "auto")
    prefill = compile_kv_transfer([(lay, g)], (lay, None), [0, 1], None, 8, "staged")
    assert prefill.gather(0).shape[1] == 3
    with pytest.raises(BlockIdError, match="needs destination addresses"):
        prefill.scatter(0)


def test_geometry_round_trips_through_a_plain_dict_and_pickle() -> None:
    import json
    import pickle

    g = megatron_geometry(2, 8, 4, 2, 8, 4096)
    d = json.loads(json.dumps(g.to_dict()))
    assert KVGeometry.from_dict(d) == g
    assert pickle.loads(pickle.dumps(g)) == g
    d["surprise"] = 1
    with pytest.raises(MetadataError, match="surprise"):
        KVGeometry.from_dict(d)


def test_from_tensor_reads_torch_tensors_in_bytes() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros((2, 3, 5, 4, 2, 8), dtype=torch.bfloat16)
    g = KVGeometry.from_tensor(t)
    assert (g.num_layers, g.num_blocks, g.tokens_per_block, g.num_heads, g.head_dim) == (
        3,
        5,
        4,
        2,
        8,
    )
    assert g.element_size == 2 and g.dtype == "bfloat16"
    assert g.strides == (4 * 2 * 8 * 2, 2 * 8 * 2, 8 * 2)
    assert g.plane_bases[1] - g.plane_bases[0] == 5 * 4 * 2 * 8 * 2
    hnd = KVGeometry.from_layer_tensors(
        [torch.zeros((2, 5, 2, 4, 8), dtype=torch.float16) for _ in range(3)],
        axes="kv block head token dim",
        device_id=3,
    )
    assert hnd.strides == (2 * 4 * 8 * 2, 8 * 2, 4 * 8 * 2) and hnd.device_id == 3
    with pytest.raises(GeometryMismatchError, match="dim axis must be contiguous"):
        KVGeometry.from_tensor(t.transpose(4, 5).contiguous().transpose(4, 5))


def test_lists_can_be_written_into_reused_caller_arrays() -> None:
    src_l = kv_layouts(2, 1, 2, 4)
    dst_l = KVShardLayout(2, 4, global_rank=9)
    srcs = [(lay, megatron_geometry(2, 16, 4, 2, 8, (i + 1) << 32)) for i, lay in enumerate(src_l)]
    dst = megatron_geometry(2, 16, 4, 4, 8, 1 << 40)
    program = compile_kv_transfer(srcs, (dst_l, dst), [5, 1, 7], [2, 9, 4], 11, "direct")
    buf_s, buf_d = np.zeros((500, 3), np.uint64), np.zeros((500, 3), np.uint64)
    for r in program.src_ranks:
        want_s, want_d = program.descriptors(r)
        got_s, got_d = program.descriptors(r, out=(buf_s, buf_d))
        assert len(got_s) == program.row_count(r, "descriptors") == len(want_s)
        np.testing.assert_array_equal(got_s, want_s)
        np.testing.assert_array_equal(got_d, want_d)
        for which in ("gather", "scatter"):
            want = getattr(program, which)(r)
            got = getattr(program, which)(r, out=buf_s)
            assert program.row_count(r, which) == len(want)
            np.testing.assert_array_equal(got, want)
    tiny = np.zeros((1, 3), np.uint64)
    with pytest.raises(ValueError, match="out has 1 rows but the list needs"):
        program.gather(0, out=tiny)
    with pytest.raises(TypeError):
        program.gather(0, out=np.zeros((4, 3), np.int64))


def expand_runs(runs: np.ndarray[Any, Any]) -> list[tuple[int, int, int]]:
    """(a, b, len) fragments of strided runs, in order."""
    out = []
    for a, b, n, count, sa, sb in runs.tolist():
        out += [(a + k * sa, b + k * sb, n) for k in range(count)]
    return out


@pytest.mark.parametrize(("src_tp", "dst_kind"), [(4, "hnd"), (1, "nhd"), (2, "megatron")])
def test_strided_runs_expand_to_the_same_bytes_as_the_flat_lists(
    src_tp: int, dst_kind: str
) -> None:
    g = global_tensor(2, 2, 21, 4, 3, np.uint32)
    srcs = []
    ids = [4, 0, 2, 5, 1, 3]
    for lay in kv_layouts(src_tp, 1, 2, 4):
        r = KvRank(lay, "megatron", 6, 4, 3, np.uint32, 5)
        r.write(g, ids, 0, 21)
        srcs.append(r)
    dst_l = KVShardLayout(2, 4, global_rank=50)
    dst = KvRank(dst_l, dst_kind, 4, 8, 3, np.uint32, 0)
    program = compile_kv_transfer(
        [(r.layout, r.geometry) for r in srcs], (dst_l, dst.geometry), ids, [3, 1, 0], 21, "staged"
    )
    for r in program.src_ranks:
        gather = [(a, off, n) for a, n, off in program.gather(r).tolist()]
        runs = expand_runs(program.gather_runs(r))
        assert sum(n for *_, n in runs) == program.packed_bytes(r)
        assert _same_bytes(gather, runs)
        assert _same_bytes(
            [tuple(x) for x in program.scatter(r).tolist()], expand_runs(program.scatter_runs(r))
        )


def _same_bytes(a: list[Any], b: list[Any]) -> bool:
    """Both lists map the same bytes (merging may differ)."""

    def bytes_of(frags: list[Any]) -> set[tuple[int, int]]:
        return {(x + k, y + k) for x, y, n in frags for k in range(n)}

    return bytes_of(a) == bytes_of(b)
