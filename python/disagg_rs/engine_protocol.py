"""The small protocol an inference engine provides to disagg_rs (docs/architecture.md §6).

These are :class:`typing.Protocol` classes: an engine does not subclass them, it just has the
methods. disagg_rs's own :class:`~disagg_rs.BlockPool` and :class:`~disagg_rs.SlotPool`
satisfy :class:`BlockAllocator` and :class:`SlotAllocator`; an engine may use them directly
(typically ``ImportLedger.block_pool``, so the ledger checks the same pool it allocates from)
or bring its own allocator with the same methods and semantics.

All ranges are half-open ``[lo, hi)``. Block and slot ids are ``int`` in ``[0, 2**32)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from disagg_rs._core import KVShardLayout, SSMShardLayout

__all__ = [
    "BlockAllocator",
    "DecodeBatch",
    "EngineSettings",
    "HandoffEngine",
    "HandoffHost",
    "ModelShape",
    "ReferenceDesignEngine",
    "SlotAllocator",
]


@runtime_checkable
class BlockAllocator(Protocol):
    """A paged KV block allocator with refcounts and a prefix cache (``BlockPool``'s methods).

    Semantics an own implementation must keep: ``allocate`` is all or nothing and may evict
    unreferenced cached blocks (least recently released first); ``retain``/``release`` count
    per occurrence and reject, unchanged, a list that would make a refcount negative;
    ``num_free`` counts never-used plus evictable blocks; ``block_hashes`` is a parent-aware
    chain over full blocks, identical in every process; ``match_prefix`` does not retain.
    """

    @property
    def num_blocks(self) -> int:
        """Total number of blocks."""
        ...

    @property
    def block_size_tokens(self) -> int:
        """Tokens per block."""
        ...

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now (never-used plus evictable)."""
        ...

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks still published in the prefix cache."""
        ...

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        ...

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1, all or nothing; raise ``CapacityError`` otherwise."""
        ...

    def retain(self, block_ids: Sequence[int]) -> None:
        """One more reference per occurrence (claims evictable cached blocks)."""
        ...

    def release(self, block_ids: Sequence[int]) -> None:
        """One reference less per occurrence, all or nothing."""
        ...

    def refcount(self, block_id: int) -> int:
        """Current reference count of one block."""
        ...

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Hash chain over the full blocks of ``tokens``."""
        ...

    def register_cached(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Publish held full blocks under their hashes."""
        ...

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (not retained)."""
        ...

    def check(self) -> None:
        """Verify conservation; raise ``ConservationError``."""
        ...


@runtime_checkable
class SlotAllocator(Protocol):
    """An SSM state slot allocator (``SlotPool``'s methods).

    ``detach(slot)`` moves an allocated slot out of the allocator's accounting to a live
    request; whoever owns the request then calls ``free(slot)``.
    """

    @property
    def num_slots(self) -> int:
        """Total number of slots."""
        ...

    @property
    def num_free(self) -> int:
        """Slots ready to hand out."""
        ...

    def allocate(self) -> int:
        """One free slot; raise ``CapacityError`` when none is free."""
        ...

    def free(self, slot: int) -> None:
        """Return an allocated or detached slot."""
        ...

    def detach(self, slot: int) -> None:
        """Move an allocated slot to a live request."""
        ...

    def check(self) -> None:
        """Verify conservation; raise ``ConservationError``."""
        ...


@runtime_checkable
class DecodeBatch(Protocol):
    """How the handoff mixin admits an imported request into the live decode batch.

    Called only at the engine's admission points (between forward steps), never from a
    transfer callback.
    """

    def can_admit(self, num_requests: int) -> int:
        """How many of ``num_requests`` ready imports the batch can take now (0 when full)."""
        ...

    def admit(self, request_id: int, block_ids: Sequence[int], ssm_slot: int | None) -> None:
        """Add the request to the batch; it now owns one reference to each block and the slot."""
        ...


class EngineSettings(Protocol):
    """The engine settings the handoff mixin reads."""

    @property
    def eos_token(self) -> int | None:
        """End-of-sequence token (None: generation ends only at the token limit)."""
        ...


class ModelShape(Protocol):
    """The model dimensions the handoff mixin reads."""

    @property
    def head_dim(self) -> int:
        """Attention head dimension."""
        ...


@runtime_checkable
class HandoffEngine(Protocol):
    """What an engine built on disagg_rs's pools provides to ``InferenceStateHandoffMixin``.

    The mixin touches exactly these members (plus :class:`HandoffHost`'s collective ones);
    mypy checks it against this protocol.
    """

    @property
    def block_pool(self) -> BlockAllocator:
        """The engine's KV block allocator."""
        ...

    @property
    def ssm_slot_pool(self) -> SlotAllocator | None:
        """The SSM slot allocator of a hybrid model, ``None`` for attention-only models."""
        ...

    @property
    def block_size_tokens(self) -> int:
        """Tokens per KV block on this engine."""
        ...

    @property
    def num_speculative_tokens(self) -> int:
        """Lookahead tokens reserved after the resume tokens (0 without speculation); pass
        it to ``make_handoff_ledger`` so every import reserves them."""
        ...

    @property
    def decode_batch(self) -> DecodeBatch:
        """The live decode batch imported requests are admitted into."""
        ...

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop on which handoff futures are resolved; raises ``AttributeError`` on an
        engine without one (``add_request_with_kv_handoff`` then returns no future)."""
        ...

    @property
    def config(self) -> EngineSettings:
        """Engine settings (the end-of-sequence token)."""
        ...

    @property
    def model(self) -> ModelShape:
        """Model dimensions (the attention head dimension)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Prompts waiting to be scheduled (a decode engine refuses to schedule them)."""
        ...

    @property
    def kv_cache(self) -> Any:
        """This rank's KV cache memory (one contiguous tensor to register for transfers)."""
        ...

    @property
    def kv_cache_layout(self) -> str:
        """Axes of :attr:`kv_cache`: ``megatron``, ``nhd`` or ``hnd``."""
        ...

    @property
    def kv_layout(self) -> KVShardLayout | None:
        """Which KV layers and heads this rank holds (None: no attention here)."""
        ...

    @property
    def ssm_layout(self) -> SSMShardLayout | None:
        """Which SSM layers, heads and groups this rank holds (None: no SSM layer here)."""
        ...

    @property
    def ssm_conv_state(self) -> Any:
        """Conv state tensor ``[L, slots, C, d_conv]`` (None without SSM layers)."""
        ...

    @property
    def ssm_recurrent_state(self) -> Any:
        """Recurrent state tensor ``[L, slots, H, p, n]`` (None without SSM layers)."""
        ...

    def expect_import(
        self,
        request_id: int,
        prompt: Sequence[int],
        resume_tokens: Sequence[int],
        max_new_tokens: int,
    ) -> None:
        """Announce a handed-off request before its state arrives (validated; raises before
        anything changes)."""
        ...

    def abort(self, request_id: int) -> bool:
        """Forget an announced request whose import failed (False for an unknown id)."""
        ...

    def complete_request_without_forward(self, request_id: int, result: Any) -> None:
        """Finish an announced request whose handed-off tokens (``result``, the resume
        tokens) already satisfy it."""
        ...


@runtime_checkable
class HandoffHost(HandoffEngine, Protocol):
    """A :class:`HandoffEngine` that runs the handoff mixin: it also shares small objects
    among its model-parallel ranks."""

    @property
    def handoff_mp_rank(self) -> int:
        """This rank's index among the engine's model-parallel ranks (0 for one rank)."""
        ...

    def handoff_all_gather(self, obj: Any) -> list[Any]:
        """All-gather a small picklable object over the engine's model-parallel ranks, in
        rank order (``[obj]`` for one rank)."""
        ...


class ReferenceDesignEngine(Protocol):
    """The members of the reference design's dynamic engine (Megatron-LM's
    ``DynamicInferenceEngine``) that ``InferenceStateHandoffMixin`` touches when no ledger is
    attached. Their types and meaning are the reference design's; ``context`` is its
    ``DynamicInferenceContext`` (block allocator, SSM metadata, per-request tensors)."""

    context: Any
    pg_collection: Any
    controller: Any
    requests: Any
    waiting_request_ids: Any
    track_generated_token_events: bool
    use_coordinator: bool
    is_mp_coordinator: bool
    finished_request_count: int
    zmq_context: Any
    zmq_sockets: Any
    _loop: asyncio.AbstractEventLoop
    _partial_emit_lengths: Any

    def add_request(
        self,
        request_id: int,
        prompt: Any,
        sampling_params: Any,
        precomputed_block_hashes: Any = None,
    ) -> asyncio.Future[Any]:
        """Queue a request (the handoff takes it straight out of the waiting queue)."""
        ...

    def get_request(self, request_id: int) -> Any:
        """The live request object."""
        ...

    def _notify_cond_for_new_request(self) -> Any:
        """Coroutine waking the engine loop."""
        ...

    def _check_stop_words_for_request_post_append(self, request: Any) -> tuple[bool, int]:
        """Whether the request's latest tokens end with a stop word."""
        ...

    def _try_send_streaming_partials(self) -> None:
        """Stream partial outputs to the coordinator."""
        ...

    def _send_request_records_to_coordinator(self, records: list[Any]) -> None:
        """Send finished request records to the coordinator."""
        ...
