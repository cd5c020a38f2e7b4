"""A reference-design decode engine (its own allocator, no ledger) takes imports all the way:
start, local report, decision, admission into the running batch or completion without a
forward step, prefix-cache registration and reuse, and failure. Transport-free: the transfer
handles are finished by hand (the transports have their own multi-process tests)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from disagg_rs.exceptions import HandoffStateError, ResetRefusedError, TransferError
from test_reference_api_lifecycle import BS, RefEngine


@dataclasses.dataclass
class Sampling:
    num_tokens_to_generate: int
    termination_id: int | None = None
    stop_word_ids: list[list[int]] = dataclasses.field(default_factory=list)
    detokenize_stop_sequence: bool = False


class Status(enum.Enum):
    ACTIVE = 1
    COMPLETED = 2
    FAILED = 3


class Request:
    def __init__(self, rid: int, prompt: list[int], params: Any) -> None:
        self.request_id = rid
        self.prompt = None
        self.prompt_tokens = torch.tensor(prompt)
        self.remaining_prompt_tokens = self.prompt_tokens.clone()
        self.sampling_params = params
        self.stop_word_ids = list(getattr(params, "stop_word_ids", []))
        self.generated_tokens: list[int] = []
        self.tracked_metadata = [0.5]
        self.status = Status.ACTIVE
        self.events: list[Any] = []
        self.num_cached_tokens = 0

    @staticmethod
    def get_metadata_types() -> list[tuple[str, torch.dtype]]:
        return [("temperature", torch.float32)]

    def add_event_add_context(self) -> None:
        self.events.append("add_context")

    def add_event_generated_token(self, token: int) -> None:
        self.events.append(("token", token))

    def add_event_finish(self) -> None:
        self.events.append("finish")


class DecodeEngine(RefEngine):
    """The reference engine's request surface: ``add_request`` queues, ``get_request`` reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, blocks: int = 12) -> None:
        super().__init__(loop, blocks)
        self.finished_request_count = 0
        self.track_generated_token_events = True
        self.controller = SimpleNamespace(
            tokenizer=None, detokenize=lambda tok, ids, remove_EOD: f"text{list(ids)}"
        )
        self.added: list[tuple[int, Any]] = []

    def add_request(
        self, request_id: int, prompt: Any, sampling_params: Any, precomputed_block_hashes: Any
    ) -> asyncio.Future[Any]:
        request = Request(request_id, list(prompt), sampling_params)
        future = self._loop.create_future()
        self.requests[request_id] = SimpleNamespace(record=[request], future=future)
        self.waiting_request_ids.append(request_id)
        self.added.append((request_id, precomputed_block_hashes))
        return future

    def get_request(self, request_id: int) -> Request:
        return self.requests[request_id].record[-1]  # type: ignore[no-any-return]

    def _check_stop_words_for_request_post_append(self, request: Any) -> tuple[bool, int]:
        tail = request.generated_tokens[-1]
        return any(w == [tail] for w in request.stop_word_ids), 0


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.run_until_complete(asyncio.sleep(0))  # the engine-loop wake-ups the handoffs scheduled
    lp.close()


def _submit(engine: DecodeEngine, rid: int, prompt: list[int], params: Any, first: int = 5) -> Any:
    src = list(range(-(-len(prompt) // BS)))
    return engine.add_request_with_kv_handoff(rid, prompt, params, {"resume_tokens": [first]}, src)


def _finish_transfers(engine: DecodeEngine) -> None:
    for pending in engine._pending_kv_imports:
        pending.handle.done = True


def _land(engine: DecodeEngine) -> int:
    """Finish every running transfer, poll, admit: how many were admitted."""
    _finish_transfers(engine)
    engine._poll_pending_kv_imports()
    return engine._admit_pending_kv_imports()


def _refs(engine: DecodeEngine) -> list[int]:
    return [int(r) for r in engine.context.kv_block_allocator.refs.tolist()]


def test_an_import_whose_first_token_ends_it_completes_without_a_forward_step(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    fut = _submit(engine, 1, list(range(8)), Sampling(1))
    assert engine._poll_pending_kv_imports() == 0  # its transfer still runs
    _finish_transfers(engine)
    assert engine._poll_pending_kv_imports() == 1
    assert engine._admit_pending_kv_imports() == 1
    loop.run_until_complete(asyncio.sleep(0))
    (request,) = fut.result()
    assert request.generated_tokens == [5] and request.status is Status.COMPLETED
    assert request.generated_text == "text[5]" and request.events[-1] == "finish"
    assert engine.finished_request_count == 1 and 1 not in engine.requests
    assert engine.context.total_request_count == 0 and sum(_refs(engine)) == 0
    assert engine.pending_kv_import_count == 0 and not engine.waiting_request_ids
    # The two prompt blocks entered the prefix cache; the request got their hashes.
    assert len(engine.context.kv_block_allocator.kv_hash_to_block_id) == 2
    assert engine.added[0][0] == 1 and len(engine.added[0][1]) == 2


@pytest.mark.parametrize(
    "params, finishes",
    [
        (Sampling(4, termination_id=5), True),
        (Sampling(4, stop_word_ids=[[5]]), True),
        (Sampling(4, stop_word_ids=[[4, 5]]), False),
        (Sampling(4), False),
    ],
    ids=["termination", "stop-word", "longer-stop-word", "limit-not-reached"],
)
def test_the_first_token_is_checked_against_termination_and_stop_words(
    loop: asyncio.AbstractEventLoop, params: Any, finishes: bool
) -> None:
    engine = DecodeEngine(loop)
    fut = _submit(engine, 2, list(range(6)), params)
    assert _land(engine) == 1
    loop.run_until_complete(asyncio.sleep(0))
    assert fut.done() == finishes
    assert engine.context.total_request_count == int(not finishes)
    request = fut.result()[0] if finishes else engine.get_request(2)
    assert request.generated_tokens == [5] and ("token", 5) in request.events
    assert request.num_cached_tokens == 6
    if finishes:
        assert params.num_tokens_to_generate == 1 and sum(_refs(engine)) == 0
    else:
        assert params.num_tokens_to_generate == 4
        # Admitted: the prompt blocks and the continuation block move to the live request.
        assert engine.context.request_to_kv_block_ids[0].tolist()[:2] == [0, 1]
        assert engine.context.token_to_input_ids[0].item() == 5
        assert request.events[-1] == "add_context"
        # The request's own completion resolves the handoff future.
        engine.requests[2].future.set_result("done")
        loop.run_until_complete(asyncio.sleep(0))
        assert fut.result() == "done"


def test_an_admitted_request_is_relayed_its_failure_and_cancellation(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    futs = [_submit(engine, rid, list(range(4)), Sampling(4)) for rid in (1, 2)]
    assert _land(engine) == 2
    engine.requests[1].future.set_exception(KeyError("gone"))
    engine.requests[2].future.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    assert isinstance(futs[0].exception(), KeyError) and futs[1].cancelled()


def test_a_second_import_reuses_the_first_ones_cached_prefix(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    _submit(engine, 1, list(range(8)), Sampling(1))
    assert _land(engine) == 1
    first_blocks = sorted(engine.context.kv_block_allocator.kv_hash_to_block_id.values())
    _submit(engine, 2, [*range(8), 9, 9, 9], Sampling(4))
    (pending,) = engine._pending_kv_imports
    assert pending.cached_prefix_block_count == 2 and pending.local_blocks[:2] == first_blocks
    # Pulled: only the third block; one more block for the first token.
    assert len(pending.local_blocks) == 3 and len(pending.continuation_blocks) == 0
    assert _land(engine) == 1
    assert len(engine.context.kv_block_allocator.kv_hash_to_block_id) == 2
    assert engine.context.total_request_count == 1


def test_an_import_failed_on_a_peer_fails_its_future_and_frees_its_blocks(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    fut = _submit(engine, 3, list(range(8)), Sampling(4))
    # This rank's transfers finished; a peer's failed: the tracker decides a failure.
    _finish_transfers(engine)
    engine._report_completed_kv_imports()
    engine._reference_imports.decide(3, True)
    assert engine._admit_pending_kv_imports() == 0
    assert isinstance(fut.exception(), TransferError)
    assert "failed on a model-parallel peer" in str(fut.exception())
    assert sum(_refs(engine)) == 0 and engine.num_quarantined_kv_imports == 0
    assert engine.pending_kv_import_count == 0


def test_an_import_whose_destinations_may_still_be_written_is_quarantined_for_good(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)

    class Broken(Exception):
        transfer_destinations_safe = False

    def broken_pull(meta: Any, src: list[int], dst: list[int]) -> Any:
        raise Broken("post failed")

    engine._kv_transfer_agent.begin_pull_blocks = broken_pull  # type: ignore[method-assign]
    fut = _submit(engine, 4, list(range(8)), Sampling(4))
    engine._poll_pending_kv_imports()
    assert engine._admit_pending_kv_imports() == 0
    assert isinstance(fut.exception(), Broken)
    assert engine.num_quarantined_kv_imports == 1 and sum(_refs(engine)) == 3
    # Its storage never goes back: a reset is refused and changes nothing.
    with pytest.raises(ResetRefusedError, match=r"imports of requests \[4\]"):
        engine._reset_pending_kv_imports()
    assert engine.num_quarantined_kv_imports == 1 and sum(_refs(engine)) == 3


def _setup_engine(loop: asyncio.AbstractEventLoop, prefix_caching: bool = True) -> DecodeEngine:
    """A reference engine with the context and model config ``setup_kv_transfer`` reads."""
    engine = DecodeEngine(loop, blocks=5)
    ctx = engine.context
    ctx.memory_buffer = torch.zeros(2, 2, 5, BS, 2, 8, dtype=torch.float32)
    ctx.num_attention_layers, ctx.num_mamba_layers = 2, 0
    ctx.num_attention_heads_per_partition, ctx.hidden_size_per_attention_head = 2, 8
    ctx.kv_block_allocator.pool_size = 5
    ctx.kv_block_allocator.enable_prefix_caching = prefix_caching
    config = SimpleNamespace(num_query_groups=None, num_attention_heads=2)
    engine.controller.inference_wrapped_model = SimpleNamespace(
        model=SimpleNamespace(config=config)
    )
    return engine


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_setup_on_one_rank_keeps_its_own_metadata_as_the_only_stage(
    loop: asyncio.AbstractEventLoop, role: str
) -> None:
    engine = _setup_engine(loop)
    engine.setup_kv_transfer(role, "nixl")
    try:
        allocator = engine.context.kv_block_allocator
        assert allocator.enable_handoff_pinning == (role == "prefill")
        meta = engine._kv_peer_metas
        assert isinstance(meta, dict) and meta["layer_start"] == 0
        assert engine._pp_kv_peer_metas == [meta] and engine._pp_ssm_peer_metas == [{}]
        assert engine._tp_ssm_peer_metas == {} and engine._kv_transfer_role == role
    finally:
        engine._kv_transfer_agent.close()


def test_setup_without_prefix_caching_is_refused_before_any_agent_exists(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = _setup_engine(loop, prefix_caching=False)
    agent = engine._kv_transfer_agent
    with pytest.raises(HandoffStateError, match="enable_prefix_caching"):
        engine.setup_kv_transfer("decode", "nixl")
    assert engine._kv_transfer_agent is agent


class _WaitCounter:
    """A transfer handle that counts the waits on it (a wait would time out)."""

    def __init__(self) -> None:
        self.waits = 0

    def poll(self) -> bool:
        return False

    def wait(self) -> None:
        self.waits += 1
        raise TimeoutError


def test_a_push_transport_looks_nothing_up_in_the_prefix_cache(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    engine._kv_transfer_agent.is_push = True
    # The second prompt extends the first, whose two blocks enter the cache: a pull would
    # reuse them; a push writes every block itself.
    for rid, prompt, blocks in ((1, list(range(8)), 2), (2, [*range(8), 9, 9, 9], 3)):
        _submit(engine, rid, prompt, Sampling(1))
        (pending,) = engine._pending_kv_imports
        assert (pending.cached_prefix_block_count, len(pending.local_blocks)) == (0, blocks)
        assert _land(engine) == 1
    assert len(engine.context.kv_block_allocator.kv_hash_to_block_id) == 2


def test_a_reset_with_pinned_blocks_is_refused_before_any_transfer_is_waited_for(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    _submit(engine, 1, list(range(8)), Sampling(4))
    (pending,) = engine._pending_kv_imports
    handle = pending.handle = _WaitCounter()
    engine._pinned_handoff_blocks[9] = [0]
    with pytest.raises(ResetRefusedError, match=r"remain pinned for requests \[9\]"):
        engine._reset_pending_kv_imports()
    assert handle.waits == 0 and engine.pending_kv_import_count == 1
    # Without pins the running transfer is waited for, and still refuses the reset.
    del engine._pinned_handoff_blocks[9]
    with pytest.raises(ResetRefusedError, match="may still access cache storage"):
        engine._reset_pending_kv_imports()
    assert handle.waits == 1 and engine.pending_kv_import_count == 1


def test_a_ticket_without_prepared_metadata_is_refused_naming_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    request = SimpleNamespace(request_id=7)
    with pytest.raises(HandoffStateError, match="request 7: no handoff metadata") as info:
        engine.capture_handoff_ticket(request)
    assert info.value.field == "prepared"
    assert 7 not in engine._pinned_handoff_blocks
