"""The reference design's handoff lifecycle names in disagg_rs: ``pending_handoff_imports``,
``decode_admission``, ``HandoffCompletionTracker`` and the mixin's lifecycle methods, on both
kinds of engine the mixin serves (a ledger-driven engine and a reference-design engine with its
own allocator). Transport-free: the transports have their own multi-process tests
(test_engine_contract.py runs this lifecycle over real NIXL and gloo)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _reference_worker import spawn_gloo_world
from disagg_rs import BlockPool, PinLedger
from disagg_rs._core import CompletionTracker
from disagg_rs.decode_admission import (
    additional_decode_blocks,
    admit_prefilled_decode,
    can_admit_prefilled_decode,
)
from disagg_rs.engine_protocol import HandoffHost
from disagg_rs.exceptions import (
    BlockIdError,
    HandoffMetadataError,
    HandoffStateError,
    MetadataError,
    ResetRefusedError,
)
from disagg_rs.handoff_completion_tracker import HandoffCompletionTracker
from disagg_rs.inference_state_handoff import (
    InferenceStateHandoffMixin,
    compute_block_hashes_batched,
    drop_transfer_prefix_blocks,
    get_pg_rank,
    get_pg_size,
    transfer_block_count,
    with_push_destination,
)
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport, PendingSSMImport
from toy_engine import ExpectingEngine

BS = 4


@dataclasses.dataclass
class Sampling:
    num_tokens_to_generate: int
    termination_id: int | None = None
    stop_word_ids: list[list[int]] = dataclasses.field(default_factory=list)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


# -- records --------------------------------------------------------------------------------------
def test_pending_records_are_keyword_only_with_the_reference_defaults(
    loop: asyncio.AbstractEventLoop,
) -> None:
    fut = loop.create_future()
    with pytest.raises(TypeError):
        PendingSSMImport({}, 3)  # type: ignore[misc]
    p = PendingKvImport(
        request_id=1,
        prompt=[1, 2],
        sampling_params=None,
        local_blocks=[4],
        hashes=[],
        cached_prefix_block_count=0,
        handle=None,
        future=fut,
    )
    assert (p.ssm, p.resume_tokens, p.continuation_blocks, p.local_error) == (None, [], [], None)
    assert p.destinations_safe and not p.terminal_state_reported and not p.cancel_requested
    d = DeferredKvHandoff(
        request_id=1,
        prompt=[1],
        sampling_params=None,
        kv_meta={},
        src_block_ids=[0],
        hashes=[],
        num_blocks=1,
        future=fut,
    )
    assert d.num_blocks == 1


# -- decode admission -----------------------------------------------------------------------------
@given(
    prompt=st.integers(0, 200),
    inputs=st.integers(0, 8),
    bs=st.integers(1, 64),
    mtp=st.booleans(),
)
def test_additional_decode_blocks_cover_exactly_the_tokens_after_the_prompt(
    prompt: int, inputs: int, bs: int, mtp: bool
) -> None:
    extra = additional_decode_blocks(prompt, inputs, bs, mtp)
    drafts = max(0, inputs - 2) if mtp else 0
    total = prompt + inputs + drafts
    prompt_blocks = -(-prompt // bs)
    # The fewest blocks that hold every token, minus those the prompt already has.
    assert (prompt_blocks + extra) * bs >= total
    assert prompt_blocks + extra == 0 or (prompt_blocks + extra - 1) * bs < max(total, 1)


def test_additional_decode_blocks_reject_a_zero_block_size() -> None:
    with pytest.raises(MetadataError, match="block_size=0"):
        additional_decode_blocks(3, 1, 0)


# Per-request int32 context tensors that start at zero.
_ZERO_REQUEST_FIELDS = (
    "kv_length_offsets",
    "query_lengths",
    "output_lengths",
    "kv_block_counts",
    "last_kv_block_offset",
)


def _context(rows: int = 2, tokens: int = 8, spec: int = 1, hybrid: bool = False) -> Any:
    types = [("temperature", torch.float32)]
    return SimpleNamespace(
        block_size_tokens=BS,
        num_speculative_tokens=spec,
        num_prefill_requests=0,
        chunked_prefill_request_id=-1,
        total_request_count=0,
        max_requests=rows,
        active_token_count=0,
        max_tokens=tokens,
        is_hybrid_model=hybrid,
        request_metadata_types=types,
        request_metadata={"temperature": torch.zeros(rows)},
        request_to_kv_block_ids=torch.full((rows, 4), -1, dtype=torch.int32),
        request_ids=torch.full((rows,), -1, dtype=torch.int64),
        request_in_prefill_status_tensor=torch.ones(rows, dtype=torch.int32),
        request_last_kv_block_id=torch.full((rows,), -1, dtype=torch.int32),
        token_to_block_idx=torch.full((tokens,), -1, dtype=torch.int32),
        **{
            f"request_{name}": torch.zeros(rows, dtype=torch.int32) for name in _ZERO_REQUEST_FIELDS
        },
        **{
            f"token_to_{name}": torch.zeros(tokens, dtype=dtype)
            for name, dtype in (
                ("input_ids", torch.int64),
                ("pos_ids", torch.int64),
                ("request_idx", torch.int32),
                ("position_in_request", torch.int64),
                ("local_position_within_kv_block", torch.int32),
            )
        },
        mamba_metadata=SimpleNamespace(request_to_mamba_state_idx=torch.full((rows,), -1)),
    )


class _Request:
    def __init__(self, rid: int, prompt_len: int, n: int = 5) -> None:
        self.request_id = rid
        self.prompt_tokens = torch.arange(prompt_len)
        self.remaining_prompt_tokens = self.prompt_tokens.clone()
        self.sampling_params = Sampling(n)
        self.tracked_metadata = [0.5]
        self.events: list[str] = []

    @staticmethod
    def get_metadata_types() -> list[tuple[str, torch.dtype]]:
        return [("temperature", torch.float32)]

    def add_event_add_context(self) -> None:
        self.events.append("add_context")


def test_admitting_prefilled_state_writes_one_decode_row_and_the_query_tokens() -> None:
    ctx = _context()
    req = _Request(7, prompt_len=5)
    # 5 prompt tokens + 2 inputs at block size 4: blocks [3, 9] for the prompt, [12]? no: 7
    # tokens fit in 2 blocks, so no continuation block.
    assert additional_decode_blocks(5, 2, BS) == 0
    admit_prefilled_decode(ctx, req, [3, 9], [], [40, 41])
    assert ctx.total_request_count == 1 and ctx.active_token_count == 2
    assert ctx.request_to_kv_block_ids[0].tolist() == [3, 9, -1, -1]
    assert ctx.token_to_pos_ids[:2].tolist() == [5, 6]
    assert ctx.token_to_block_idx[:2].tolist() == [9, 9]
    assert ctx.request_output_lengths[0].item() == 10
    assert ctx.request_last_kv_block_offset[0].item() == 2
    assert len(req.remaining_prompt_tokens) == 0 and req.events == ["add_context"]
    assert ctx.request_metadata["temperature"][0].item() == 0.5


@pytest.mark.parametrize(
    "case, error, match",
    [
        ({"blocks": [3]}, BlockIdError, "prompt_block_ids"),
        ({"more": [4]}, BlockIdError, "continuation_block_ids"),
        ({"inputs": [40]}, MetadataError, "num_speculative_tokens"),
        ({"hybrid": True}, MetadataError, "ssm_state_idx"),
        ({"full": True}, HandoffStateError, "cannot take request 7"),
    ],
    ids=["prompt-blocks", "continuation-blocks", "input-count", "hybrid-slot", "batch-full"],
)
def test_admission_validates_everything_before_the_context_changes(
    case: dict[str, Any], error: type[Exception], match: str
) -> None:
    ctx = _context(hybrid=bool(case.get("hybrid")))
    if case.get("full"):
        ctx.total_request_count = ctx.max_requests
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(ctx).items()}
    with pytest.raises(error, match=match):
        admit_prefilled_decode(
            ctx,
            _Request(7, 5),
            case.get("blocks", [3, 9]),
            case.get("more", []),
            case.get("inputs", [40, 41]),
        )
    for k, v in vars(ctx).items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k
        elif not isinstance(v, dict | SimpleNamespace):
            assert v == before[k], k


def test_a_decode_only_context_refuses_prefill_work_and_reports_room() -> None:
    ctx = _context(tokens=3)
    assert can_admit_prefilled_decode(ctx, 3)
    assert not can_admit_prefilled_decode(ctx, 4)
    ctx.num_prefill_requests = 1
    with pytest.raises(HandoffStateError, match="decode-only engine"):
        can_admit_prefilled_decode(ctx, 1)


# -- completion tracker ---------------------------------------------------------------------------
def _tracker(world: int) -> HandoffCompletionTracker:
    t = object.__new__(HandoffCompletionTracker)
    t.rank, t.world_size, t.is_coordinator = 0, world, True
    t._reports = {}
    t._failure_notified = set()
    t._socket = None
    return t


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    reports=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.booleans()), max_size=30),
)
def test_the_tracker_decides_like_an_all_ok_or_first_failure_oracle(
    world: int, reports: list[tuple[int, int, bool]]
) -> None:
    tracker = _tracker(world)
    seen: dict[tuple[int, int], bool] = {}
    decided: dict[int, bool] = {}
    got: list[tuple[int, bool]] = []
    for rid, rank, failed in reports:
        rank %= world
        if decided.get(rid):
            tracker._record(rid, rank, failed)  # absorbed after a failure decision
            continue
        if (rid, rank) in seen and seen[(rid, rank)] != failed and rid not in decided:
            with pytest.raises(HandoffStateError):
                tracker._record(rid, rank, failed)
            continue
        if rid in decided:
            continue  # a decided success was forgotten; a new report would open a new round
        tracker._record(rid, rank, failed)
        seen[(rid, rank)] = failed
        if failed:
            decided[rid] = True
            got.append((rid, True))
        elif all(seen.get((rid, r)) is False for r in range(world)):
            decided[rid] = False
            got.append((rid, False))
    assert tracker.drain_completed() == got
    assert tracker.drain_completed() == []
    assert set(tracker._reports) == {rid for rid, _ in seen if rid not in decided}


def test_the_tracker_votes_in_the_rust_quorum() -> None:
    tracker = _tracker(2)
    tracker._record(5, 0, False)
    quorum = tracker.__dict__["_quorum"]
    assert isinstance(quorum, CompletionTracker) and quorum.num_open == 1
    assert quorum.world_size == 2 and quorum.open_ids() == [5]
    with pytest.raises(HandoffStateError, match="_reports"):
        tracker._reports = {1: "x"}


# -- module helpers -------------------------------------------------------------------------------
def test_process_group_helpers_without_a_group_are_one_rank() -> None:
    assert (get_pg_size(None), get_pg_rank(None)) == (1, 0)


def test_prompt_hashes_fall_back_to_the_pool_chain() -> None:
    tokens = list(range(11))
    assert compute_block_hashes_batched(torch.tensor(tokens), BS) == BlockPool(1, BS).block_hashes(
        tokens
    )


def test_the_cached_prefix_is_left_out_of_every_stage_and_rank_list() -> None:
    meta = {
        "pp_metas": [{"tp_metas": {}, "block_ids": [1, 2, 3]}, {"block_ids": [4, 5, 6]}],
        "tp_metas": [{"block_ids": [7, 8, 9]}, {"rank": 1}],
    }
    assert transfer_block_count(meta, [0]) == 3
    assert transfer_block_count({"tp_metas": [{"block_ids": [1, 2]}]}, [0]) == 2
    assert transfer_block_count({}, [0, 1, 2, 3]) == 4
    trimmed, src = drop_transfer_prefix_blocks(meta, [1, 2, 3], 2)
    assert src == [3]
    assert [s["block_ids"] for s in trimmed["pp_metas"]] == [[3], [6]]
    assert trimmed["tp_metas"] == [{"block_ids": [9]}, {"rank": 1}]
    assert meta["pp_metas"][0]["block_ids"] == [1, 2, 3]  # the ticket itself is unchanged
    assert drop_transfer_prefix_blocks(meta, [1, 2, 3], 0) == (meta, [1, 2, 3])


# -- a ledger-driven engine (transport-free: no backend is set up) --------------------------------
class ToyBatch:
    def __init__(self, host: ToyHost) -> None:
        self.host = host

    def can_admit(self, num_requests: int) -> int:
        return min(num_requests, self.host.room)

    def admit(self, request_id: int, block_ids: Any, ssm_slot: int | None) -> None:
        self.host.expected.pop(request_id)
        self.host.admitted[request_id] = list(block_ids)


class _Scheduler:
    def schedule_waiting_requests(self) -> None:
        self.scheduled += 1  # type: ignore[attr-defined]


class ToyHost(ExpectingEngine, InferenceStateHandoffMixin, _Scheduler):
    """The smallest engine providing ``engine_protocol.HandoffHost``."""

    def __init__(
        self,
        role: str,
        loop: asyncio.AbstractEventLoop | None,
        *,
        num_blocks: int = 16,
        spec: int = 0,
    ) -> None:
        self._initialize_disaggregation_state()
        self.num_speculative_tokens = spec
        ledger = self.make_handoff_ledger(role, num_blocks, BS, 0, num_speculative_tokens=spec)
        self.attach_handoff_ledger(ledger)
        self.block_pool = ledger.block_pool
        self.ssm_slot_pool = None
        self.block_size_tokens = BS
        self.num_speculative_tokens = spec
        self.config = SimpleNamespace(eos_token=None)
        self.model = SimpleNamespace(head_dim=2)
        self.num_waiting = 0
        self.kv_cache = None
        self.kv_cache_layout = "megatron"
        self.kv_layout = None
        self.ssm_layout = None
        self.ssm_conv_state = None
        self.ssm_recurrent_state = None
        self.handoff_mp_rank = 0
        self._loop = loop
        self.decode_batch = ToyBatch(self)
        self.room = 4
        self.scheduled = 0
        self.expected: dict[int, Any] = {}
        self.admitted: dict[int, list[int]] = {}
        self.completed: dict[int, Any] = {}
        self.aborted: list[int] = []
        self._kv_transfer_role = role

    def abort(self, request_id: int) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)

    def finish_without_forward(self, request_id: int, tokens: list[int]) -> None:
        self.completed[request_id] = tokens

    def submit(self, rid: int, prompt: list[int], sampling: Any, token: int = 9) -> Any:
        ticket = {"resume_tokens": [token], "prefill_meta": {"ranks": []}}
        src = list(range(-(-len(prompt) // BS)))
        return self.add_request_with_kv_handoff(rid, prompt, sampling, ticket, src)


def test_the_toy_engine_satisfies_the_protocol_the_mixin_is_checked_against(
    loop: asyncio.AbstractEventLoop,
) -> None:
    assert isinstance(ToyHost("decode", loop), HandoffHost)
    # An engine without an event loop is not (yet) a handoff engine: its property raises.
    assert not isinstance(ToyHost("decode", None), HandoffHost)


def test_a_handoff_returns_a_future_on_an_engine_with_a_loop_and_none_without(
    loop: asyncio.AbstractEventLoop,
) -> None:
    with_loop, without = ToyHost("decode", loop), ToyHost("decode", None)
    fut = with_loop.submit(1, [1] * 6, Sampling(4))
    assert isinstance(fut, asyncio.Future) and not fut.done()
    assert without.submit(1, [1] * 6, Sampling(4)) is None
    with_loop._poll_pending_kv_imports()
    assert with_loop._admit_pending_kv_imports() == 1
    assert fut.result() == 1


@pytest.mark.parametrize(
    "sampling, finishes",
    [
        (Sampling(1), True),
        (Sampling(4, termination_id=9), True),
        (Sampling(4, stop_word_ids=[[3, 4], [9]]), True),
        (Sampling(4, stop_word_ids=[[8, 9]]), False),
        (4, False),
    ],
    ids=["limit", "termination", "stop-word", "longer-stop-word", "bare-int"],
)
def test_the_handed_off_token_is_checked_against_the_limit_termination_and_stop_words(
    loop: asyncio.AbstractEventLoop, sampling: Any, finishes: bool
) -> None:
    host = ToyHost("decode", loop)
    fut = host.submit(3, [1] * 6, sampling, token=9)
    host._poll_pending_kv_imports()
    host._admit_pending_kv_imports()
    assert fut.done()
    assert (3 in host.completed) == finishes and (3 in host.admitted) != finishes
    if finishes:
        assert host.completed[3] == [9]
        assert host.block_pool.num_free == host.block_pool.num_blocks


def test_speculative_lookahead_blocks_are_reserved_with_the_prompt(
    loop: asyncio.AbstractEventLoop,
) -> None:
    host = ToyHost("decode", loop, spec=3)
    host.submit(1, [1] * 6, Sampling(8))
    host._poll_pending_kv_imports()
    host._admit_pending_kv_imports()
    # 6 prompt tokens + 1 handed-off token + 3 lookahead tokens = 10 -> 3 blocks of 4.
    assert len(host.admitted[1]) == 3


def test_a_decode_ledger_without_the_engines_lookahead_is_refused(
    loop: asyncio.AbstractEventLoop,
) -> None:
    host = ToyHost("decode", loop, spec=2)
    ledger = host.make_handoff_ledger("decode", 8, BS, 0)
    with pytest.raises(HandoffStateError, match="num_speculative_tokens=2"):
        host.attach_handoff_ledger(ledger)


def test_scheduling_a_decode_admits_then_refuses_only_waiting_prompts_and_chains(
    loop: asyncio.AbstractEventLoop,
) -> None:
    host = ToyHost("decode", loop)
    host.submit(1, [1] * 6, Sampling(4))
    host._poll_pending_kv_imports()
    host.schedule_waiting_requests()
    assert 1 in host.admitted and host.scheduled == 1
    host.num_waiting = 2
    with pytest.raises(HandoffStateError, match="2 waiting"):
        host.schedule_waiting_requests()
    assert host.scheduled == 1
    prefill = ToyHost("prefill", None)
    prefill.num_waiting = 2
    prefill.schedule_waiting_requests()
    assert prefill.scheduled == 1


def test_reset_cancels_deferred_handoffs_and_fails_the_rest(
    loop: asyncio.AbstractEventLoop,
) -> None:
    host = ToyHost("decode", loop, num_blocks=3)
    first = host.submit(1, [1] * 8, Sampling(4))  # 3 blocks: fills the pool
    queued = host.submit(2, [1] * 8, Sampling(4))
    assert host.pending_kv_import_count == 2 and host._import_ledger is not None
    assert host._import_ledger.deferred_ids() == [2]
    host._poll_pending_kv_imports()  # the first import's (empty) transfer is terminal: ready
    host._reset_pending_kv_imports()
    assert queued.cancelled()
    assert isinstance(first.exception(), RuntimeError)
    assert host.pending_kv_import_count == 0
    assert host.block_pool.num_free == 3 and host.expected == {}


def _pin_one(host: ToyHost, rid: int = 4) -> list[int]:
    blocks = host.block_pool.allocate(2)
    record = SimpleNamespace(request_id=rid, block_ids=blocks, ssm_slot=None, first_token=1)
    record.prompt = [1] * 6
    host._capture_handoff_meta(record, None)
    return blocks


def test_pinned_blocks_are_a_view_of_the_pin_ledger_and_block_a_reset() -> None:
    host = ToyHost("prefill", None)
    blocks = _pin_one(host)
    assert isinstance(host._pin_ledger, PinLedger)
    assert dict(host._pinned_handoff_blocks) == {4: blocks}
    with pytest.raises(ResetRefusedError, match="remain pinned"):
        host._reset_pending_kv_imports()
    assert dict(host._pinned_handoff_blocks) == {4: blocks}  # nothing changed
    host.release_handoff_blocks(4)
    host.release_handoff_blocks(4)
    assert dict(host._pinned_handoff_blocks) == {}
    host._reset_pending_kv_imports()
    assert host.block_pool.num_free == host.block_pool.num_blocks


def test_a_push_needs_the_decode_destination_and_validates_before_sending() -> None:
    host = ToyHost("prefill", None)
    _pin_one(host)
    host._static_meta = {"ranks": []}
    with pytest.raises(MetadataError, match="destination"):
        host.push_handoff_kv(4, [{"kv": None}])
    with pytest.raises(MetadataError, match="num_tokens"):
        host.push_handoff_kv(4, with_push_destination([{"kv": None}], {"dst_block_ids": [0]}))
    assert host.pending_kv_push_count == 0
    with pytest.raises(HandoffStateError, match="no pinned handoff"):
        host.push_handoff_kv(5, with_push_destination([{}], {}))


# -- a reference-design engine (its own allocator; no ledger) -------------------------------------
class _Allocator:
    enable_prefix_caching = True

    def __init__(self, blocks: int) -> None:
        self.refs = torch.zeros(blocks, dtype=torch.int32)
        self.block_ref_counts = self.refs
        self.kv_hash_to_block_id: dict[int, int] = {}

    def is_memory_available(self, n: int, potential_matched_count: int = 0) -> bool:
        return int((self.refs == 0).sum()) - potential_matched_count >= n

    def allocate_memory_blocks(self, n: int) -> torch.Tensor | None:
        free = torch.nonzero(self.refs == 0).flatten()[:n]
        if len(free) < n:
            return None
        self.refs[free] = 1
        return free.to(torch.int32)

    def retain_memory_blocks(self, ids: list[int]) -> None:
        if ids:
            self.refs[torch.tensor(ids, dtype=torch.int64)] += 1

    def release_memory_blocks(self, ids: torch.Tensor) -> None:
        assert bool((self.refs[ids.long()] > 0).all())
        self.refs[ids.long()] -= 1

    def register_kv_block_hashes(
        self, ids: list[int], hashes: list[int], parent_hashes: Any
    ) -> None:
        self.kv_hash_to_block_id.update(zip(hashes, ids, strict=True))


class _Handle:
    def __init__(self) -> None:
        self.done = False

    def poll(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            raise TimeoutError


class _Agent:
    is_push = False

    def __init__(self) -> None:
        self.handles: list[_Handle] = []

    def begin_pull_blocks(self, meta: Any, src: list[int], dst: list[int]) -> _Handle:
        self.handles.append(_Handle())
        return self.handles[-1]


class RefEngine(InferenceStateHandoffMixin):
    """The reference design's engine surface, as little of it as the lifecycle needs."""

    def __init__(self, loop: asyncio.AbstractEventLoop, blocks: int = 6) -> None:
        self._initialize_disaggregation_state()
        self._loop = loop
        self.context = SimpleNamespace(
            **vars(_context(rows=4, tokens=16, spec=0)),
        )
        self.context.kv_block_allocator = _Allocator(blocks)
        self.context.mamba_slot_allocator = None
        self._kv_transfer_agent = _Agent()
        self._kv_transfer_role = "decode"
        self.pg_collection = SimpleNamespace(tp=None, pp=None, mp=None)
        self.waiting_request_ids: deque[int] = deque()
        self.requests: dict[int, Any] = {}
        self.track_generated_token_events = False
        self.use_coordinator = False
        self.is_mp_coordinator = False

    async def _notify_cond_for_new_request(self) -> None:
        return None


def test_reference_engine_handoffs_wait_in_fifo_order_until_capacity_returns(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = RefEngine(loop, blocks=4)
    params = Sampling(3)
    futures = [
        engine.add_request_with_kv_handoff(rid, [rid] * 8, params, {"resume_tokens": [5]}, [0, 1])
        for rid in (1, 2, 3)
    ]
    loop.run_until_complete(asyncio.sleep(0))
    # Each import holds 2 prompt blocks + 1 continuation block: one fits in 4 blocks.
    assert [h.request_id for h in engine._deferred_kv_handoffs] == [2, 3]
    assert engine.pending_kv_import_count == 3
    engine._pending_kv_imports[0].handle.done = True
    engine._poll_pending_kv_imports()
    engine._reset_pending_kv_imports()
    assert futures[0].cancelled() and futures[1].cancelled() and futures[2].cancelled()
    assert int(engine.context.kv_block_allocator.refs.sum()) == 0


def test_reference_engine_reset_changes_nothing_while_a_read_may_still_land(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = RefEngine(loop)
    engine.add_request_with_kv_handoff(1, [1] * 8, Sampling(3), {"resume_tokens": [5]}, [0, 1])
    held = engine.context.kv_block_allocator.refs.clone()
    with pytest.raises(ResetRefusedError, match="may still access cache storage"):
        engine._reset_pending_kv_imports()
    assert torch.equal(engine.context.kv_block_allocator.refs, held)
    assert len(engine._pending_kv_imports) == 1
    engine._pinned_handoff_blocks[9] = [0]
    with pytest.raises(ResetRefusedError, match="remain pinned"):
        engine._reset_pending_kv_imports()
    loop.run_until_complete(asyncio.sleep(0))


def test_reference_engine_metadata_errors_are_runtime_errors_too(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = RefEngine(loop)
    with pytest.raises(HandoffMetadataError, match="resume tokens") as info:
        engine.add_request_with_kv_handoff(1, [1] * 8, Sampling(3), {"resume_tokens": []}, [0, 1])
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    with pytest.raises(HandoffMetadataError, match="need 2"):
        engine.add_request_with_kv_handoff(1, [1] * 8, Sampling(3), {"resume_tokens": [5]}, [0])
    assert engine.pending_kv_import_count == 0


# -- the tracker across processes (gloo broadcasts the address, ZeroMQ carries the reports) -----
def _tracker_rank(rank: int) -> list[tuple[int, bool]]:
    """One rank of a 3-rank gloo world (set up by `spawn_gloo_world`): its decided reports."""
    import torch.distributed as dist
    import zmq

    world = dist.get_world_size()
    ctx = zmq.Context()
    tracker = HandoffCompletionTracker(ctx, dist.group.WORLD, "127.0.0.1")
    # Request 1 succeeds on every rank; request 2 fails on the last rank only.
    tracker.report(1, False)
    tracker.report(2, rank == world - 1)
    decided: list[tuple[int, bool]] = []
    if tracker.is_coordinator:
        while len(decided) < 2:
            decided += tracker.drain_completed()
    dist.barrier()
    for s in tracker.sockets:
        s.close(linger=0)
    ctx.term()
    return decided


def test_model_parallel_ranks_agree_through_the_coordinator_across_processes() -> None:
    got = spawn_gloo_world(3, _tracker_rank)
    assert sorted(got[0]) == [(1, False), (2, True)]
    assert got[1] == got[2] == []
