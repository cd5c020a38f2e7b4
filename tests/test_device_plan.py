"""Device plans on the CPU: the compiler's block-id-free table, the Triton kernel that walks
it (under Triton's interpreter) and its torch twin, against the compiler's own fragment
lists; chunking; the plan cache and the id uploader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer
from disagg_rs.transfer_backends import device_plan as dp
from disagg_rs.transfer_backends import staging
from kernel_cases import interpret, source_caches

pytest.importorskip("triton")

interpreter_warnings = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    interpret(monkeypatch)
    yield


def _case(
    src_tp: int, dst_tp: int, tokens: int, tpb: int, seed: int, heads: int = 4, dim: int = 8
) -> tuple[dict[int, torch.Tensor], torch.Tensor, list[int], list[int], list[tuple[int, Any]]]:
    """Source caches of ``src_tp`` ranks (random), the destination rank 0 of ``dst_tp``
    (zeros), scattered block ids, and the compiled staged programs of every destination."""
    layers = 3
    rng = np.random.default_rng(seed)
    n_blk = -(-tokens // tpb)
    src_ids = [int(x) for x in rng.permutation(n_blk + 3)[:n_blk]]
    dst_ids = [int(x) for x in rng.permutation(n_blk + 2)[:n_blk]]
    gen = torch.Generator().manual_seed(seed)
    bufs, srcs = source_caches(
        src_tp, (2, layers, n_blk + 3, tpb, heads // src_tp, dim), heads, gen
    )
    dst = torch.zeros((2, layers, n_blk + 2, tpb, heads // dst_tp, dim), dtype=torch.int16)
    dst_layout = KVShardLayout(layers, heads, tp_size=dst_tp, tp_rank=0, global_rank=50)
    program = compile_kv_transfer(
        srcs, (dst_layout, KVGeometry.from_tensor(dst)), src_ids, dst_ids, tokens, "staged"
    )
    return bufs, dst, src_ids, dst_ids, [(r, program) for r in program.src_ranks]


def _reference(program: Any, r: int, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Packed region by the compiler's flat lists and the torch path; scatters it into
    ``dst`` (the buffer the program was compiled for)."""
    packed = torch.zeros(program.packed_bytes(r), dtype=torch.uint8)
    staging.pack_torch(src, src.data_ptr(), program.gather(r), packed)
    staging.scatter_torch(packed, dst, dst.data_ptr(), program.scatter(r))
    return packed


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "tokens", "tpb"), [(1, 1, 37, 8), (2, 1, 40, 8), (1, 2, 29, 4)]
)
@interpreter_warnings
def test_pack_scatter_and_direct_copy_by_plan_match_the_compiler_lists_byte_exact(
    interpreted: None, path: str, src_tp: int, dst_tp: int, tokens: int, tpb: int
) -> None:
    bufs, dst, src_ids, dst_ids, programs = _case(src_tp, dst_tp, tokens, tpb, seed=src_tp)
    direct = dst.clone()
    staged = dst.clone()
    for r, program in programs:
        plan = dp.DevicePlan.from_program(
            program, r, src_addr=bufs[r].data_ptr(), dst_addr=dst.data_ptr()
        )
        assert plan is not None
        ref_packed = _reference(program, r, bufs[r], dst)
        assert plan.packed_bytes(tokens) == program.packed_bytes(r)
        sid, did = (torch.tensor(x) for x in (src_ids, dst_ids))
        packed = torch.full((plan.packed_bytes(tokens),), 9, dtype=torch.uint8)
        kind: Any = path
        dp.copy(plan, dp.Side("src", bufs[r], sid), dp.Side("packed", packed), tokens, path=kind)
        assert torch.equal(packed, ref_packed)
        dp.copy(plan, dp.Side("packed", packed), dp.Side("dst", staged, did), tokens, path=kind)
        dp.copy(plan, dp.Side("src", bufs[r], sid), dp.Side("dst", direct, did), tokens, path=kind)
    assert torch.equal(staged, dst)
    assert torch.equal(direct, dst)
    assert bool((dst != 0).any())


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 50), st.sampled_from([1, 3, 4]), st.integers(1, 4000), st.integers(0, 9))
def test_chunks_tile_the_packed_region_in_order_and_each_fits_its_bound(
    tokens: int, tpb: int, max_bytes: int, seed: int
) -> None:
    _, dst, _, _, programs = _case(2, 1, tokens, tpb, seed)
    r, program = programs[0]
    plan = dp.DevicePlan.from_program(program, r, src_addr=0, dst_addr=dst.data_ptr())
    assert plan is not None
    chunks = plan.chunks(tokens, max_bytes)
    assert chunks[0][0] == 0 and chunks[0][2] == 0
    assert chunks[-1][1] == plan.num_items(tokens)
    assert chunks[-1][3] == plan.packed_bytes(tokens)
    item_max = int(plan.planes[:, 3].max()) * tpb
    every = np.arange(plan.num_items(tokens) + 1)
    assert plan.item_offsets(every, tokens).tolist() == [
        plan.item_offset(int(k), tokens) for k in every
    ]
    for (a, b, x, y), nxt in zip(chunks, [*chunks[1:], None], strict=True):
        assert a < b and x < y
        assert y - x <= max(max_bytes, item_max)
        if nxt is not None:
            assert nxt[0] == b and nxt[2] == y


@pytest.mark.parametrize("path", ["triton", "torch"])
@interpreter_warnings
def test_a_chunked_pack_into_a_small_window_then_scatter_lands_every_byte(
    interpreted: None, path: str
) -> None:
    tokens = 45
    bufs, dst, src_ids, dst_ids, programs = _case(2, 1, tokens, 8, seed=7)
    got = dst.clone()
    kind: Any = path
    for r, program in programs:
        _reference(program, r, bufs[r], dst)
        plan = dp.DevicePlan.from_program(
            program, r, src_addr=bufs[r].data_ptr(), dst_addr=dst.data_ptr()
        )
        assert plan is not None
        sid, did = torch.tensor(src_ids), torch.tensor(dst_ids)
        chunks = plan.chunks(tokens, 300)
        assert len(chunks) > 3
        window = torch.zeros(max(y - x for _, _, x, y in chunks), dtype=torch.uint8)
        for a, b, x, y in chunks:
            part = window[: y - x]
            dp.copy(plan, dp.Side("src", bufs[r], sid), dp.Side("packed", part, bias=x),
                    tokens, items=(a, b), path=kind)  # fmt: skip
            dp.copy(plan, dp.Side("packed", part, bias=x), dp.Side("dst", got, did),
                    tokens, items=(a, b), path=kind)  # fmt: skip
    assert torch.equal(got, dst)
    assert bool((dst != 0).any())


def test_a_window_too_small_for_its_items_is_refused_before_any_copy() -> None:
    _, dst, src_ids, _, programs = _case(1, 1, 16, 8, seed=1)
    r, program = programs[0]
    plan = dp.DevicePlan.from_program(program, r, src_addr=0, dst_addr=dst.data_ptr())
    assert plan is not None
    small = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="packed side"):
        dp.copy(plan, dp.Side("src", dst, torch.tensor(src_ids)), dp.Side("packed", small), 16)
    with pytest.raises(ValueError, match="not inside"):
        dp.copy(plan, dp.Side("src", dst, torch.tensor(src_ids)), dp.Side("packed", small), 16,
                items=(0, 10**6))  # fmt: skip
    assert not bool(small.any())


def test_hnd_caches_and_block_size_changes_have_no_plan() -> None:
    layers, heads, dim = 2, 4, 8
    src = torch.zeros((2, layers, 4, 8, heads, dim), dtype=torch.int16)
    dst = torch.zeros((2, layers, 8, 4, heads, dim), dtype=torch.int16)
    lay = KVShardLayout(layers, heads, global_rank=0)
    dlay = KVShardLayout(layers, heads, global_rank=1)
    program = compile_kv_transfer(
        [(lay, KVGeometry.from_tensor(src))], (dlay, KVGeometry.from_tensor(dst)),
        [0, 1], [0, 1, 2, 3], 16, "staged",
    )  # fmt: skip
    assert program.device_plan(0) is None


def test_the_plan_cache_builds_once_per_key_and_caches_a_missing_plan() -> None:
    cache = dp.PlanCache(limit=2)
    built: list[str] = []

    def build(name: str) -> Any:
        built.append(name)
        return None

    for key in ("a", "a", "b", "a"):
        assert cache.get(key, lambda k=key: build(k)) is None
    assert built == ["a", "b"]
    assert (cache.hits, cache.misses) == (2, 2)
    cache.get("c", lambda: build("c"))
    assert len(cache) == 2


def test_the_id_uploader_returns_each_array_in_order_on_the_host() -> None:
    up = dp.IdUploader(torch.device("cpu"))
    a, b = up.upload([3, 1, 2], np.array([7, 8], dtype=np.int32))
    assert a.tolist() == [3, 1, 2] and b.tolist() == [7, 8]


def _prepared_matches_copy(device: str, in_place: bool = True) -> None:
    """Three handoffs through one PreparedCopy per source (ids cut at varying alignments from
    one uploader) land exactly what ``copy`` lands."""
    host_bufs, host_dst, src_ids, dst_ids, programs = _case(2, 1, 40, 8, seed=5)
    tokens = 40
    bufs = {r: b.to(device) for r, b in host_bufs.items()}
    dst = host_dst.to(device)
    up = dp.IdUploader(torch.device(device))
    up.in_place = in_place
    plans = {}
    for r, program in programs:
        # Plane offsets are relative to the buffers the program was compiled for.
        plan = dp.DevicePlan.from_program(
            program, r, src_addr=host_bufs[r].data_ptr(), dst_addr=host_dst.data_ptr()
        )
        assert plan is not None
        plans[r] = plan
    got = dst.clone().fill_(-1)
    prepared = {
        r: dp.PreparedCopy(plan, dp.Side("src", bufs[r]), dp.Side("dst", got))
        for r, plan in plans.items()
    }
    rng = np.random.default_rng(0)
    for lead in (0, 1, 3):
        want = dst.clone().fill_(-1)
        got.fill_(-1)
        perm = [int(x) for x in rng.permutation(len(dst_ids))]
        d_ids = [dst_ids[i] for i in perm]
        s_ids = [src_ids[i] for i in perm]
        views, slot = up.begin(np.zeros(lead, np.int64), d_ids, s_ids)
        for r, plan in plans.items():
            ids = [torch.tensor(x, device=device) for x in (s_ids, d_ids)]
            dp.copy(plan, dp.Side("src", bufs[r], ids[0]), dp.Side("dst", want, ids[1]), tokens)
            prepared[r](tokens, views[2], views[1])
        up.settle(slot, None)
        assert torch.equal(got, want)
        assert bool((got != -1).any())
        # The same ids read where they were written (a taken slot's view: on CUDA the
        # pinned slot itself, or its copy on the device when in-place reads are off).
        got.fill_(-1)
        n = lead + 2 * len(d_ids)
        slot, host = up.take(n)
        host[lead:n] = d_ids + s_ids
        view = up.view(slot, host, n)
        assert view.device.type == ("cpu" if up.in_place else device)
        for r in plans:
            prepared[r](tokens, view[lead + len(d_ids) :], view[lead:])
        if device == "cuda":
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
            up.settle(slot, ev)
        else:
            up.settle(slot, None)
        assert torch.equal(got, want)


def test_a_prepared_copy_lands_what_copy_lands_on_the_host() -> None:
    _prepared_matches_copy("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [True, False], ids=["ids-in-pinned-memory", "ids-copied"])
def test_a_prepared_copy_launched_again_and_again_lands_what_copy_lands_on_cuda(
    in_place: bool,
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _prepared_matches_copy("cuda", in_place)


def _prepared_pack_matches_copy(device: str, in_place: bool = True) -> None:
    """A PreparedCopy into a packed staging buffer (ids read from an id slot, the copy at a
    byte offset) packs what ``copy`` packs into a window: whole, and chunk by chunk into
    slots; offsets that break alignment or pass the buffer's end are refused, nothing
    written."""
    host_bufs, _, src_ids, _, programs = _case(2, 1, 40, 8, seed=9)
    tokens = 40
    up = dp.IdUploader(torch.device(device))
    up.in_place = in_place
    for r, program in programs:
        buf = host_bufs[r].to(device)
        plan = dp.DevicePlan.from_program(program, r, src_addr=host_bufs[r].data_ptr(), dst_addr=0)
        assert plan is not None
        nbytes = plan.packed_bytes(tokens)
        want = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        ids = torch.tensor(src_ids, device=device)
        dp.copy(plan, dp.Side("src", buf, ids), dp.Side("packed", want), tokens)
        staging = torch.zeros(nbytes + 512, dtype=torch.uint8, device=device)
        pack = dp.PreparedCopy(plan, dp.Side("src", buf), dp.Side("packed", staging))
        slot, host = up.take(len(src_ids) + 1)
        host[1 : 1 + len(src_ids)] = src_ids  # an odd start: another pointer alignment
        view = up.view(slot, host, 1 + len(src_ids))[1:]
        for bad in (8, 512 + 16):
            with pytest.raises(ValueError, match="packed bytes"):
                pack(tokens, view, None, b_offset=bad)
        assert not bool(staging.any())
        assert pack(tokens, view, None, b_offset=256) == nbytes
        assert torch.equal(staging[256 : 256 + nbytes], want)
        # Chunks, each packed into the slot at 16 or 272 by turns.
        for j, (a, b, x, y) in enumerate(plan.chunks(tokens, 200)):
            at = (16, 272)[j % 2]
            assert pack(tokens, view, None, b_offset=at, items=(a, b)) == y - x
            assert torch.equal(staging[at : at + y - x], want[x:y])
        # Consecutive chunks packed together (three per launch), each into its own slot of
        # 256 bytes, the slots taken last to first (each range's bias differs in sign).
        cuts = plan.chunks(tokens, 200)
        slots = [16 + 256 * j for j in range(3)][::-1]
        parts = [(slots[j % 3], a, b) for j, (a, b, _, _) in enumerate(cuts)]
        for first in range(0, len(parts), 3):
            staging.zero_()
            group, spans = parts[first : first + 3], cuts[first : first + 3]
            assert pack.pack(tokens, view, group) == sum(y - x for _, _, x, y in spans)
            for (at, _, _), (_, _, x, y) in zip(group, spans, strict=True):
                assert torch.equal(staging[at : at + y - x], want[x:y])
        gap = [(16, cuts[0][0], cuts[0][1]), (272, cuts[1][1], cuts[2][1])]
        with pytest.raises(ValueError, match="starts at"):
            pack.pack(tokens, view, gap)
        up.settle(slot, None)
        assert bool(want.any())


def test_a_prepared_pack_lands_what_copy_packs_on_the_host() -> None:
    _prepared_pack_matches_copy("cpu")


@interpreter_warnings
def test_a_prepared_pack_lands_what_copy_packs_in_the_kernel_on_the_host(interpreted: None) -> None:
    """The same through the kernel itself (Triton's interpreter): several chunks per launch."""
    _prepared_pack_matches_copy("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [True, False], ids=["ids-in-pinned-memory", "ids-copied"])
def test_a_prepared_pack_lands_what_copy_packs_on_cuda(in_place: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _prepared_pack_matches_copy("cuda", in_place)
    torch.cuda.synchronize()


def test_pinned_ids_are_read_in_place_unless_torch_registers_its_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    assert dp.pinned_in_place()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert dp.pinned_in_place()
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(key, "expandable_segments:True, pinned_use_cuda_host_register:True")
        assert not dp.pinned_in_place()
        assert not dp.IdUploader(torch.device("cpu")).in_place
        monkeypatch.delenv(key)


class _CountingEvent:
    """A CUDA event that counts how often it is asked whether it completed."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.event.record()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return bool(self.event.query())  # type: ignore[no-untyped-call]


@pytest.mark.gpu
def test_the_id_ring_reuses_only_finished_slots_and_asks_one_event_per_take() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    up = dp.IdUploader(torch.device("cuda"))
    torch.cuda._sleep(int(3e9))  # type: ignore[no-untyped-call]  # keeps the stream busy
    taken, events = [], []
    for _ in range(6):
        slot, _ = up.take(10)
        ev = _CountingEvent()
        up.settle(slot, ev)
        taken.append(slot)
        events.append(ev)
    # Nothing reused while the GPU still runs what read the slots; the oldest slot's event is
    # the only one asked, once per take, however many are queued.
    assert len(set(taken)) == 6
    assert [e.queries for e in events] == [5, 0, 0, 0, 0, 0]
    torch.cuda.synchronize()
    slot, host = up.take(10)
    assert slot in taken and host.size >= 10
    # A request larger than every free slot gets a new, larger one.
    big, host = up.take(up.capacity + 1)
    assert big not in taken and host.size >= up.capacity + 1
    up.settle(slot, None)
    up.settle(big, None)
    again, _ = up.take(up.capacity + 1)
    assert again == big
