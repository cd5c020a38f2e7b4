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
from typing import Any, Protocol, runtime_checkable

__all__ = ["BlockAllocator", "DecodeBatch", "HandoffEngine", "SlotAllocator"]


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


@runtime_checkable
class HandoffEngine(Protocol):
    """Everything ``InferenceStateHandoffMixin`` needs from the engine it is composed into."""

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
        """Lookahead tokens reserved after the resume tokens (0 without speculation)."""
        ...

    @property
    def decode_batch(self) -> DecodeBatch:
        """The live decode batch imported requests are admitted into."""
        ...

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop on which handoff futures are resolved."""
        ...

    def complete_request_without_forward(self, request_id: int, result: Any) -> None:
        """Finish a request whose transferred tokens already satisfy it."""
        ...
