"""Records of decode imports that wait for capacity or for their transfers (the reference
design's ``pending_handoff_imports`` module).

These are plain records: the handoff mixin fills and reads them. On an engine whose handoffs
run through :class:`~disagg_rs.ImportLedger` the ledger holds the lifecycle state and these
records only carry the transfer handles and the request's inputs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeferredKvHandoff", "PendingKvImport", "PendingSSMImport"]


@dataclass(kw_only=True)
class DeferredKvHandoff:
    """A decode handoff waiting for local cache capacity before any transfer starts."""

    request_id: int
    prompt: list[int]
    sampling_params: Any
    kv_meta: dict[str, Any]
    src_block_ids: list[int]
    hashes: list[int]
    num_blocks: int
    future: asyncio.Future[Any]


@dataclass(kw_only=True)
class PendingSSMImport:
    """Exact SSM state being transferred into a reserved live request slot.

    ``handles`` maps a state kind (``"conv"``, ``"recurrent"``) to its transfer handle.
    """

    handles: dict[str, Any]
    live_slot: int


@dataclass(kw_only=True)
class PendingKvImport:
    """A decode request whose KV (and SSM) import has started and not yet been admitted.

    ``local_blocks`` are the prompt's blocks in token order (reused cached prefix first),
    ``continuation_blocks`` the empty blocks reserved for the resume tokens and the
    speculative lookahead. ``destinations_safe`` is False while a transfer may still write
    them: such storage is quarantined, never returned to the pool.
    """

    request_id: int
    prompt: list[int]
    sampling_params: Any
    local_blocks: list[int]
    hashes: list[int]
    cached_prefix_block_count: int
    handle: Any
    future: asyncio.Future[Any] | None
    ssm: PendingSSMImport | None = None
    resume_tokens: list[int] = field(default_factory=list)
    """The token the prefill sampled, then any speculative proposals."""
    resume_log_probs: list[float] = field(default_factory=list)
    continuation_blocks: list[int] = field(default_factory=list)
    local_error: BaseException | None = None
    """The error this rank saw starting or polling the transfer, if any."""
    destinations_safe: bool = True
    terminal_state_reported: bool = False
    cancel_requested: bool = False
