"""Engine-side lifecycle of a disaggregated KV/SSM state handoff (the reference design's
``inference_state_handoff`` module), composed into an engine as a mixin.

The mixin works with two kinds of engine, chosen by what the engine has:

* An engine built on disagg_rs's pools (:class:`~disagg_rs.engine_protocol.HandoffHost`,
  e.g. :class:`disagg_rs.reference.handoff.HandoffReferenceEngine`) attaches a ledger with
  :meth:`InferenceStateHandoffMixin.attach_handoff_ledger`. The decisions then live in the
  Rust ledgers: the decode side's :class:`~disagg_rs.ImportLedger` (deferral, all-or-nothing
  reservation including speculative lookahead blocks, quorum, admission, quarantine,
  deadlines) and the prefill side's :class:`~disagg_rs.PinLedger` (pins until RELEASE_KV or
  lease expiry). The mixin carries their actions out: it posts transfers, polls the handles,
  shares each rank's outcome with the other model-parallel ranks, and admits requests at the
  engine's admission points.
* A dynamic-batching engine of the reference design (Megatron-LM's ``DynamicInferenceEngine``,
  :class:`~disagg_rs.engine_protocol.ReferenceDesignEngine`) attaches no ledger: the mixin
  then keeps the reference design's records (:mod:`disagg_rs.pending_handoff_imports`) over
  the engine's own block allocator and admits through :mod:`disagg_rs.decode_admission`, and
  model-parallel agreement goes through
  :class:`~disagg_rs.handoff_completion_tracker.HandoffCompletionTracker` (a Rust
  :class:`~disagg_rs.CompletionQuorum`). Swapping the reference design's package for
  ``disagg_rs`` is an import-path change for such an engine.

Model-parallel ranks call every public method collectively, in the same order, with the same
arguments and the same ``now``, so their ledgers stay identical. Time is an ``int`` of
nanoseconds supplied by the driver (``handoff_now_ns``), never read here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from disagg_rs._core import (
    BlockPool,
    ImportLedger,
    LedgerAction,
    PinLedger,
    SSMShardLayout,
    SSMStateDims,
)
from disagg_rs.decode_admission import (
    additional_decode_blocks,
    admit_prefilled_decode,
    can_admit_prefilled_decode,
)
from disagg_rs.exceptions import (
    ArgumentError,
    DisaggError,
    HandoffMetadataError,
    HandoffStateError,
    IntegrityError,
    MetadataError,
    ResetRefusedError,
    TransferError,
    TransferTimeout,
)
from disagg_rs.handoff_completion_tracker import HandoffCompletionTracker
from disagg_rs.integrity import (
    IntegrityMismatch,
    IntegrityPiece,
    IntegrityTable,
    chunk_tokens_for,
    conv_pieces,
    kv_pieces,
    recurrent_pieces,
)
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport, PendingSSMImport
from disagg_rs.transfer_backends import construct_kv_transfer_backend_class

if TYPE_CHECKING:
    from disagg_rs.engine_protocol import HandoffHost, ReferenceDesignEngine

__all__ = [
    "DeferredKvHandoff",
    "InferenceStateHandoffMixin",
    "PendingKvImport",
    "PendingSSMImport",
    "RankImport",
    "_SSM_STATE_KINDS",
    "additional_decode_blocks",
    "admit_prefilled_decode",
    "can_admit_prefilled_decode",
    "compute_block_hashes_batched",
    "construct_kv_transfer_backend_class",
    "get_pg_rank",
    "get_pg_size",
    "with_push_destination",
]

logger = logging.getLogger("disagg_rs.handoff")

_SSM_STATE_KINDS = ("conv", "recurrent")

#: Default deadline of one import (submit to admission) and lease of one prefill pin.
DEFAULT_IMPORT_TIMEOUT_NS = 60_000_000_000
DEFAULT_LEASE_NS = 120_000_000_000
#: Share of the prefill's lease (ticket ``lease_ns``) a decode import may use, submit to
#: admission, by the decode's clock; the rest covers the ticket's transit from the prefill.
LEASE_READ_FRACTION = 0.5

_KV_AXES = {
    "megatron": "kv layer block token head dim",
    "nhd": "kv block token head dim",
    "hnd": "kv block head token dim",
}


_TAG_KIND = {"kv": 0, "conv": 1, "recurrent": 2}


#: Request ids a two-sided transport can tag: ``id * 4 + kind`` must fit a 31-bit tag.
MAX_TWO_SIDED_REQUEST_ID = (1 << 29) - 1


def _tag(request_id: int, kind: str) -> int:
    """The two-sided message tag of one request's state kind (both sides compute it).

    Injective: an id outside ``[0, MAX_TWO_SIDED_REQUEST_ID]`` is refused
    (``ArgumentError``) instead of wrapping onto another request's tag.
    """
    if not 0 <= request_id <= MAX_TWO_SIDED_REQUEST_ID:
        raise ArgumentError(
            f"request_id={request_id} must be in [0, {MAX_TWO_SIDED_REQUEST_ID}] on a two-sided "
            "transport (its message tags are 31-bit)",
            "request_id",
        )
    return request_id * 4 + _TAG_KIND[kind]


# -- helpers the reference design's engines use (module attributes, looked up at call time) ----
def get_pg_size(group: Any) -> int:
    """Number of ranks of a process group (1 without one or without torch.distributed)."""
    dist = torch.distributed
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def get_pg_rank(group: Any) -> int:
    """This process's rank in a process group (0 without one or without torch.distributed)."""
    dist = torch.distributed
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.get_rank(group))


def compute_block_hashes_batched(prompt_tokens: Any, block_size_tokens: int) -> list[int]:
    """Hash chain of a prompt's full blocks, as the engine's prefix cache keys them.

    A reference-design engine's allocator keys its cache with the reference design's own
    chain (``megatron.core.inference.inference_request.compute_block_hashes_batched``), used
    when importable; otherwise disagg_rs's :meth:`BlockPool.block_hashes` chain.
    """
    try:
        from megatron.core.inference.inference_request import (  # type: ignore[import-not-found]
            compute_block_hashes_batched as engine_hashes,
        )
    except ImportError:
        tokens: list[int] = torch.as_tensor(prompt_tokens).cpu().tolist()
        return list(BlockPool(1, int(block_size_tokens)).block_hashes(tokens))
    return list(engine_hashes(prompt_tokens, block_size_tokens))


def transfer_block_count(kv_meta: Any, src_block_ids: Sequence[int]) -> int:
    """Source blocks a ticket names: those of its first pipeline stage or TP rank when it
    carries per-stage / per-rank lists, else ``src_block_ids``."""
    if isinstance(kv_meta, dict):
        stages = kv_meta.get("pp_metas")
        if stages and "block_ids" in stages[0]:
            return len(stages[0]["block_ids"])
        ranks = kv_meta.get("tp_metas")
        if isinstance(ranks, list) and ranks and "block_ids" in ranks[0]:
            return len(ranks[0]["block_ids"])
    return len(src_block_ids)


def drop_transfer_prefix_blocks(
    kv_meta: Any, src_block_ids: Sequence[int], num_cached: int
) -> tuple[Any, list[int]]:
    """The ticket and source blocks with the first ``num_cached`` blocks (already cached on
    the decode) left out of every per-stage and per-rank block list."""
    if num_cached == 0 or not isinstance(kv_meta, dict):
        return kv_meta, list(src_block_ids)
    meta = dict(kv_meta)
    if isinstance(meta.get("pp_metas"), list):
        meta["pp_metas"] = [_trim_blocks(stage, num_cached) for stage in meta["pp_metas"]]
    if isinstance(meta.get("tp_metas"), list):
        meta["tp_metas"] = [_trim_blocks(rank, num_cached) for rank in meta["tp_metas"]]
    return meta, list(src_block_ids)[num_cached:]


def _trim_blocks(entry: Any, n: int) -> Any:
    if isinstance(entry, dict) and "block_ids" in entry:
        return {**entry, "block_ids": list(entry["block_ids"])[n:]}
    return entry


def with_push_destination(
    decode_metas: Sequence[Mapping[str, Any]], destination: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The decode's per-rank transfer metadata with the destination it posted receives for
    (``dst_block_ids``, ``dst_ssm_slot``, ``num_tokens``, ``token_start``) attached, as
    :meth:`InferenceStateHandoffMixin.push_handoff_kv` takes it."""
    return [{**m, "destination": dict(destination)} for m in decode_metas]


@dataclass
class _PreparedHandoffMetadata:
    """Per-request metadata assembled once for a completed prefill batch."""

    local_blocks: list[int]
    kv_meta: Any
    ssm_meta: Any
    resume_tokens: list[int]
    local_ssm_slot: int | None = None


@dataclass
class RankImport:
    """One started import on this rank of a ledger-driven engine: its transfer handles and
    what admission needs (the ledger holds the lifecycle state)."""

    request_id: int
    epoch: int
    handles: list[Any] = field(default_factory=list)
    reported: bool = False
    failed_locally: str | None = None
    destination: dict[str, Any] = field(default_factory=dict)
    posted_ns: int = 0
    """``perf_counter_ns`` when the transfers were posted (statistics only)."""


@dataclass
class _DecodeRequest:
    prompt: list[int]
    resume_tokens: list[int]
    max_new_tokens: int
    kv_meta: dict[str, Any]
    future: asyncio.Future[Any] | None
    integrity: IntegrityTable | None = None
    """The prefill's digest, when this decode verifies (``verify_integrity``)."""


class _PinnedBlocksView(Mapping[int, list[int]]):
    """``_pinned_handoff_blocks`` of a ledger-driven prefill: request id -> pinned blocks,
    read from the :class:`~disagg_rs.PinLedger` (read-only)."""

    def __init__(self, ledger: PinLedger) -> None:
        self._ledger = ledger

    def __getitem__(self, request_id: int) -> list[int]:
        blocks = self._ledger.pinned_blocks(request_id)
        if blocks is None:
            raise KeyError(request_id)
        return blocks

    def __iter__(self) -> Iterator[int]:
        return iter(self._ledger.pinned_request_ids())

    def __len__(self) -> int:
        return self._ledger.num_pinned


def _sampling_limits(sampling_params: Any) -> tuple[int, int | None, list[list[int]]]:
    """(tokens to generate, termination token or None, stop-word token lists) of the
    reference design's ``SamplingParams`` (or any object with its attributes; a bare int is
    the number of tokens)."""
    if isinstance(sampling_params, int) and not isinstance(sampling_params, bool):
        return sampling_params, None, []
    limit = getattr(sampling_params, "num_tokens_to_generate", None)
    if limit is None:
        limit = getattr(sampling_params, "max_new_tokens", None)
    if limit is None:
        raise MetadataError(
            f"sampling_params={sampling_params!r} has neither num_tokens_to_generate nor "
            "max_new_tokens",
            "sampling_params",
        )
    term = getattr(sampling_params, "termination_id", None)
    stops = getattr(sampling_params, "stop_word_ids", None) or []
    return int(limit), (None if term is None or term < 0 else int(term)), [list(w) for w in stops]


def _hits_stop_word(tokens: list[int], stop_word_ids: list[list[int]]) -> bool:
    """Whether ``tokens`` end with one of the stop words (a loop over stop words)."""
    return any(w and tokens[-len(w) :] == w for w in stop_word_ids)


class InferenceStateHandoffMixin:
    """Optional KV/SSM handoff behaviour composed into an engine (see the module docstring)."""

    # -- state ----------------------------------------------------------------------------------
    def _initialize_disaggregation_state(self) -> None:
        """Initialize state without importing or constructing a transfer backend."""
        # Role and transports (both engine kinds).
        self._kv_transfer_role: str | None = None
        self._kv_transfer_agent: Any = None
        self._ssm_transfer_agents: dict[str, Any] = {}
        self._kv_peer_metas: Any = None
        self._pp_kv_peer_metas: list[Any] | None = None
        self._ssm_peer_metas: dict[str, Any] = {}
        self._tp_ssm_peer_metas: dict[str, Any] = {}
        self._pp_ssm_peer_metas: list[Any] | None = None
        # Reference-design engines (no ledger attached): the reference design's records.
        self._pinned_handoff_blocks: Any = {}
        self._deferred_kv_handoffs: deque[DeferredKvHandoff] = deque()
        self._pending_kv_imports: deque[PendingKvImport] = deque()
        self._quarantined_kv_imports: list[PendingKvImport] = []
        self._handoff_completion_tracker: HandoffCompletionTracker | None = None
        self._handoff_completion_notifications: dict[int, bool] = {}
        self._pending_kv_pushes: list[tuple[int, list[Any]]] = []
        # Ledger-driven engines.
        self._backend_name: str | None = None
        self._static_meta: dict[str, Any] | None = None
        self._import_ledger: ImportLedger | None = None
        self._pin_ledger: PinLedger | None = None
        self._pending_imports: dict[int, RankImport] = {}
        self._quarantined: dict[tuple[int, int], RankImport] = {}
        self._decode_requests: dict[int, _DecodeRequest] = {}
        self._pending_pushes: dict[int, tuple[int, list[Any]]] = {}
        self._staged_by_request: dict[int, list[dict[str, Any]]] = {}
        self._completion_notifications: list[tuple[int, bool]] = []
        self.handoff_now_ns = 0
        #: Wall clock (``time.time_ns()``) read with ``handoff_now_ns``, or None. When set, a
        #: prefill states its pin's end on it in each ticket (``lease_until_wall_ns``) and a
        #: decode never starts, completes or admits an import past that end (less the
        #: ledger's clock offset bound), however long the ticket took to arrive.
        self.handoff_wall_now_ns: int | None = None
        #: Digest the handed-off state (prefill: put a table in every ticket; decode: require
        #: one and check the written state against it before admission, failing the import
        #: with ``IntegrityError``). See :mod:`disagg_rs.integrity`. Set it like
        #: ``handoff_lease_ns``, on every model-parallel rank alike (the digest is collective).
        self.verify_integrity = False
        self._integrity_failures: dict[int, IntegrityMismatch] = {}
        # The first transport error a rank reported for a failing import (until it fails).
        self._rank_errors: dict[int, str] = {}
        self.handoff_import_timeout_ns = DEFAULT_IMPORT_TIMEOUT_NS
        self.handoff_lease_ns = DEFAULT_LEASE_NS
        self.handoff_stats: dict[str, int] = {
            "imports_started": 0,
            "imports_admitted": 0,
            "imports_failed": 0,
            "integrity_failures": 0,
            "integrity_ns": 0,
            "imports_completed_without_forward": 0,
            "bytes_pulled": 0,
            "descriptors": 0,
            "pushes": 0,
            "post_ns": 0,
            "transfer_ns": 0,
        }
        self.handoff_events: list[tuple[str, int, str]] = []
        # Reasons of failed imports: recorded, then those of the latest drain (bounded).
        self._new_failure_reasons: dict[int, str] = {}
        self._failure_reasons: dict[int, str] = {}
        #: Per imported request: ``token_start`` (prompt tokens reused from the decode prefix
        #: cache) and ``bytes`` moved for it on this rank.
        self.handoff_request_stats: dict[int, dict[str, int]] = {}
        #: Optional :class:`disagg_rs.metrics.HandoffMetrics` the mixin records into.
        self.handoff_metrics: Any = None

    # -- which engine this is ---------------------------------------------------------------------
    def _host(self) -> HandoffHost:
        """This object as the disagg_rs engine protocol (every engine member used goes here)."""
        return cast("HandoffHost", self)

    def _ref(self) -> ReferenceDesignEngine:
        """This object as the reference design's dynamic engine."""
        return cast("ReferenceDesignEngine", self)

    def _ledger_driven(self) -> bool:
        """Whether a Rust ledger drives this engine's handoffs (else: a reference-design
        engine with its own allocator)."""
        d = self.__dict__
        return d.get("_import_ledger") is not None or d.get("_pin_ledger") is not None

    @property
    def handoff_role(self) -> str | None:
        """``"prefill"`` or ``"decode"`` once :meth:`setup_kv_transfer` ran, else None."""
        return self.__dict__.get("_kv_transfer_role")

    @property
    def _kv_backend(self) -> Any:
        """The KV transfer backend (alias of ``_kv_transfer_agent``)."""
        return self._kv_transfer_agent

    @_kv_backend.setter
    def _kv_backend(self, backend: Any) -> None:
        self._kv_transfer_agent = backend

    @property
    def _ssm_backends(self) -> dict[str, Any]:
        """The SSM transfer backends by state kind (alias of ``_ssm_transfer_agents``)."""
        return self._ssm_transfer_agents

    @_ssm_backends.setter
    def _ssm_backends(self, backends: dict[str, Any]) -> None:
        self._ssm_transfer_agents = backends

    def _event(self, event: tuple[str, int, str]) -> None:
        """Record one lifecycle step and log it as a structured line."""
        self.handoff_events.append(event)
        kind, rid, detail = event
        logger.info(
            "handoff event=%s role=%s rank=%s request_id=%d %s",
            kind,
            self.handoff_role,
            self._host().handoff_mp_rank,
            rid,
            detail,
        )

    def _update_queue_metrics(self) -> None:
        if self.handoff_metrics is None:
            return
        depths = {"pushing": len(self._pending_pushes)}
        if self._import_ledger is not None:
            ledger = self._import_ledger
            depths.update(
                deferred=ledger.num_deferred,
                importing=ledger.num_importing,
                ready=ledger.num_ready,
                quarantined=ledger.num_quarantined,
            )
        if self._pin_ledger is not None:
            depths["pinned"] = self._pin_ledger.num_pinned
        self.handoff_metrics.queue_depths(depths)

    def _setup_handoff_completion_tracking(self, hostname: str | None = None) -> None:
        """Create the CPU path used to aggregate model-parallel transfer completion.

        A ledger-driven engine shares completion through its ``handoff_all_gather``; a
        reference-design engine gets a :class:`HandoffCompletionTracker` over its
        model-parallel group (ZeroMQ from each rank to the group's first rank).
        """
        if self._ledger_driven():
            self._completion_notifications = []
            return
        ref = self._ref()
        tracker = HandoffCompletionTracker(ref.zmq_context, ref.pg_collection.mp, hostname)
        self._handoff_completion_tracker = tracker
        ref.zmq_sockets.extend(tracker.sockets)

    def _drain_handoff_completion_notifications(self) -> list[tuple[int, bool]]:
        """Collect decisions that the engine's model-parallel schedule broadcast distributes:
        ``(request_id, failed)`` decided since the last drain."""
        if not self._ledger_driven():
            tracker = self.__dict__.get("_handoff_completion_tracker")
            return [] if tracker is None else tracker.drain_completed()
        out, self._completion_notifications = self._completion_notifications, []
        self._failure_reasons, self._new_failure_reasons = self._new_failure_reasons, {}
        return out

    def pop_handoff_failure_reason(self, request_id: int) -> str | None:
        """Why the import of ``request_id`` failed, for a failure returned by the latest
        ``_drain_handoff_completion_notifications`` (None otherwise)."""
        return self._failure_reasons.pop(request_id, None)

    def _record_handoff_completion_notification(self, request_id: int, failed: bool) -> None:
        """Record a shared admission decision (every model-parallel rank records the same)."""
        if not self._ledger_driven():
            self._handoff_completion_notifications[request_id] = failed
            return
        self._completion_notifications.append((request_id, failed))

    # -- ledgers ------------------------------------------------------------------------------
    @staticmethod
    def make_handoff_ledger(
        role: str,
        num_blocks: int,
        block_size_tokens: int,
        num_ssm_slots: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        pull: bool = True,
        num_speculative_tokens: int = 0,
    ) -> ImportLedger | PinLedger:
        """The ledger of ``role``; an engine builds its pools from ``ledger.block_pool`` and
        ``ledger.slot_pool`` so the ledger accounts exactly the blocks the engine uses.

        A decode ledger reserves, with every import, the blocks of the resume tokens plus
        ``num_speculative_tokens`` lookahead tokens (pass the engine's
        ``num_speculative_tokens``), all or nothing with the prompt's blocks.
        """
        if role == "decode":
            return ImportLedger(
                num_blocks,
                block_size_tokens,
                num_ssm_slots,
                world_size=world_size,
                rank=rank,
                pull=pull,
                lookahead_tokens=num_speculative_tokens,
            )
        if role == "prefill":
            return PinLedger(num_blocks, block_size_tokens, num_ssm_slots)
        raise HandoffStateError(f"role={role!r} has no handoff ledger; use 'prefill' or 'decode'")

    def attach_handoff_ledger(self, ledger: ImportLedger | PinLedger) -> None:
        """Use ``ledger`` (made by :meth:`make_handoff_ledger`) for this engine's handoffs.

        A decode ledger must reserve the engine's speculative lookahead with every import:
        its ``lookahead_tokens`` must equal the engine's ``num_speculative_tokens``.
        """
        if isinstance(ledger, ImportLedger):
            spec = self._host().num_speculative_tokens
            if ledger.lookahead_tokens != spec:
                raise HandoffStateError(
                    f"ImportLedger lookahead_tokens={ledger.lookahead_tokens} but the engine's "
                    f"num_speculative_tokens={spec}: pass the engine's num_speculative_tokens "
                    "to make_handoff_ledger",
                    "num_speculative_tokens",
                )
            self._import_ledger = ledger
        else:
            self._pin_ledger = ledger
            self._pinned_handoff_blocks = _PinnedBlocksView(ledger)

    def _ledger(self) -> ImportLedger:
        if self._import_ledger is None:
            raise HandoffStateError("this engine has no ImportLedger (not a decode engine)")
        return self._import_ledger

    def _pins(self) -> PinLedger:
        if self._pin_ledger is None:
            raise HandoffStateError("this engine has no PinLedger (not a prefill engine)")
        return self._pin_ledger

    # -- counts (the reference design's names) -----------------------------------------------------
    @property
    def pending_kv_import_count(self) -> int:
        """Number of decode requests waiting for capacity or transfer completion."""
        if not self._ledger_driven():
            return len(self._deferred_kv_handoffs) + len(self._pending_kv_imports)
        return 0 if self._import_ledger is None else self._import_ledger.pending_kv_import_count

    @property
    def has_admittable_kv_import(self) -> bool:
        """Whether a completed import can be handled at the next admission point."""
        if not self._ledger_driven():
            context = self._ref().context
            decided = self._handoff_completion_notifications
            return any(
                decided[p.request_id] or can_admit_prefilled_decode(context, len(p.resume_tokens))
                for p in self._pending_kv_imports
                if p.request_id in decided
            )
        return self._import_ledger is not None and self._import_ledger.has_admittable_kv_import

    @property
    def pending_kv_push_count(self) -> int:
        """Number of prefill sends waiting for transport completion."""
        if not self._ledger_driven():
            return len(self._pending_kv_pushes)
        return len(self._pending_pushes)

    @property
    def num_quarantined_kv_imports(self) -> int:
        """Failed imports whose destinations may still be written."""
        if not self._ledger_driven():
            return len(self._quarantined_kv_imports)
        return 0 if self._import_ledger is None else self._import_ledger.num_quarantined

    def schedule_waiting_requests(self) -> None:
        """The engine's scheduling point: a decode engine first admits completed imports, and
        refuses (``HandoffStateError``) only when prompts are actually waiting, since a
        dedicated decode engine never runs prompts; then the engine's own scheduler runs
        (``super().schedule_waiting_requests()``, when the engine has one)."""
        if self.handoff_role == "decode":
            self._admit_pending_kv_imports()
            waiting = (
                self._host().num_waiting
                if self._ledger_driven()
                else len(self._ref().waiting_request_ids)
            )
            if waiting:
                raise HandoffStateError(
                    f"a disaggregated decode engine cannot schedule prompt prefill requests: "
                    f"{waiting} waiting; submit handoffs with add_request_with_kv_handoff",
                    "role",
                )
        parent = getattr(super(), "schedule_waiting_requests", None)
        if parent is not None:
            parent()

    # -- transport setup ------------------------------------------------------------------------
    def setup_kv_transfer(self, role: str, backend: str = "nixl", **backend_kwargs: Any) -> None:
        """Bring up the KV transfer agents for this engine.

        Must be called collectively by every model-parallel rank: each rank registers its own
        buffers and the static metadata of all ranks is gathered (``handoff_static_meta`` on a
        ledger-driven engine; the per-stage peer metadata on a reference-design engine).
        ``role`` is ``"prefill"`` or ``"decode"``; ``backend`` a registered transport
        (``"nixl"``; ``"nccl"`` selects the two-sided push family).
        """
        if role not in ("prefill", "decode"):
            raise HandoffStateError(f"role={role!r} must be 'prefill' or 'decode'", "role")
        if self._ledger_driven():
            self._setup_ledger_kv_transfer(role, backend, **backend_kwargs)
        else:
            self._setup_reference_kv_transfer(role, backend)

    def _setup_ledger_kv_transfer(self, role: str, backend: str, **backend_kwargs: Any) -> None:
        engine = self._host()
        cls = construct_kv_transfer_backend_class(backend)
        kv_layout = engine.kv_layout
        common = dict(backend_kwargs)
        agent = f"{role}-{kv_layout.global_rank if kv_layout is not None else 'x'}"
        self._kv_transfer_role = role
        self._backend_name = backend
        if kv_layout is not None and not hasattr(engine.kv_cache, "data_ptr"):
            raise HandoffStateError(
                f"kv_cache_layout={engine.kv_cache_layout!r} is a list of per-layer tensors; the "
                "transfer backends register one contiguous buffer per rank (use 'megatron')",
                "kv_cache_layout",
            )
        if kv_layout is not None:
            self._kv_backend = cls(
                agent,
                engine.kv_cache,
                engine.block_pool.num_blocks,
                tp_size=kv_layout.tp_size,
                tp_rank=kv_layout.tp_rank,
                num_kv_heads_global=kv_layout.num_kv_heads,
                heads_per_partition=kv_layout.heads_per_partition,
                head_dim=engine.model.head_dim,
                tokens_per_block=engine.block_size_tokens,
                global_rank=kv_layout.global_rank,
                pp_size=kv_layout.pp_size,
                pp_rank=kv_layout.pp_rank,
                num_layers_global=kv_layout.num_layers,
                layer_start=kv_layout.layer_start,
                layer_end=kv_layout.layer_end,
                axes=_KV_AXES[engine.kv_cache_layout],
                **common,
            )
        ssm_layout = engine.ssm_layout
        if ssm_layout is not None and engine.ssm_slot_pool is not None:
            for kind, buf in (
                ("conv", engine.ssm_conv_state),
                ("recurrent", engine.ssm_recurrent_state),
            ):
                if self._kv_backend is not None:
                    self._ssm_backends[kind] = self._kv_backend.new_registered_buffer(
                        memory_buffer=buf,
                        expected_num_blocks=engine.ssm_slot_pool.num_slots,
                        ssm_layout=ssm_layout,
                        ssm_state_kind=kind,
                        global_rank=ssm_layout.global_rank,
                    )
                else:
                    self._ssm_backends[kind] = cls(
                        f"{agent}-{kind}",
                        buf,
                        engine.ssm_slot_pool.num_slots,
                        global_rank=ssm_layout.global_rank,
                        ssm_layout=ssm_layout,
                        ssm_state_kind=kind,
                        **common,
                    )
        local = {
            "kv": self._kv_backend.export_meta() if self._kv_backend is not None else None,
            **{k: b.export_meta() for k, b in self._ssm_backends.items()},
        }
        ranks = engine.handoff_all_gather(local)
        self._static_meta = {
            "backend": backend,
            "role": role,
            "block_size_tokens": engine.block_size_tokens,
            "ranks": ranks,
        }
        self._event(("setup", -1, f"{backend} {role} ranks={len(ranks)}"))

    def _setup_reference_kv_transfer(self, role: str, backend: str) -> None:
        """``setup_kv_transfer`` of a reference-design engine (its context's buffers)."""
        ref = self._ref()
        ctx = ref.context
        hybrid = bool(ctx.is_hybrid_model)
        if hybrid:
            durable = ctx.mamba_slot_allocator
            if role == "prefill" and durable is None:
                raise HandoffStateError(
                    "a hybrid prefill handoff needs an SSM state cache (mamba_slot_allocator is "
                    "None): the pinned state is read from it",
                    "mamba_slot_allocator",
                )
            if role == "decode" and durable is not None:
                raise HandoffStateError(
                    "a hybrid decode handoff writes directly into live SSM state; configure no "
                    "SSM state cache (mamba_slot_allocator) on the decode engine",
                    "mamba_slot_allocator",
                )
        allocator = ctx.kv_block_allocator
        if not allocator.enable_prefix_caching:
            raise HandoffStateError(
                "KV handoff needs prefix caching on both engines: enable_prefix_caching=False",
                "enable_prefix_caching",
            )
        self._kv_transfer_role = role
        backend_cls = construct_kv_transfer_backend_class(backend)
        # Only a prefill's finished blocks stay pinned until the decode has read them.
        allocator.enable_handoff_pinning = role == "prefill"
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        rank = int(dist.get_rank()) if distributed else 0
        config = ref.controller.inference_wrapped_model.model.config
        kv_heads = config.num_query_groups or config.num_attention_heads
        groups = ref.pg_collection
        tp_size, tp_rank = get_pg_size(groups.tp), get_pg_rank(groups.tp)
        pp_size, pp_rank = get_pg_size(groups.pp), get_pg_rank(groups.pp)
        n_attn, n_ssm = int(ctx.num_attention_layers), int(ctx.num_mamba_layers)
        layer_start, n_attn_global, ssm_start = 0, n_attn, 0
        if pp_size > 1 and distributed:
            counts: list[Any] = [None] * pp_size
            dist.all_gather_object(counts, (n_attn, n_ssm), group=groups.pp)
            layer_start = sum(c[0] for c in counts[:pp_rank])
            n_attn_global = sum(c[0] for c in counts)
            ssm_start = sum(c[1] for c in counts[:pp_rank])
        self._kv_transfer_agent = backend_cls(
            agent_name=f"{role}-rank{rank}",
            memory_buffer=ctx.memory_buffer,
            expected_num_blocks=allocator.pool_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            num_kv_heads_global=kv_heads,
            heads_per_partition=ctx.num_attention_heads_per_partition,
            head_dim=ctx.hidden_size_per_attention_head,
            tokens_per_block=ctx.block_size_tokens,
            global_rank=rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            num_layers_global=n_attn_global,
            layer_start=layer_start,
            layer_end=layer_start + n_attn,
        )
        if hybrid:
            self._setup_reference_ssm_agents(role, backend_cls, rank, tp_size, tp_rank, ssm_start)
        local = {"kv": self._kv_transfer_agent.export_meta(), "ssm": self._ssm_peer_metas}
        if distributed and tp_size > 1:
            gathered: list[Any] = [None] * tp_size
            dist.all_gather_object(gathered, local, group=groups.tp)
            kinds = [set(g["ssm"]) for g in gathered]
            if any(k != kinds[0] for k in kinds[1:]):
                raise HandoffStateError(
                    f"SSM handoff agents differ between TP ranks: {kinds}", "ssm_state_kind"
                )
            self._kv_peer_metas = [g["kv"] for g in gathered]
            self._tp_ssm_peer_metas = {k: [g["ssm"][k] for g in gathered] for k in kinds[0]}
        else:
            self._kv_peer_metas = local["kv"]
            self._tp_ssm_peer_metas = dict(local["ssm"])
        stage = {"kv": self._kv_peer_metas, "ssm": self._tp_ssm_peer_metas}
        stages: list[Any] = [stage]
        if distributed and pp_size > 1:
            stages = [None] * pp_size
            dist.all_gather_object(stages, stage, group=groups.pp)
        self._pp_kv_peer_metas = [st["kv"] for st in stages]
        self._pp_ssm_peer_metas = [st["ssm"] for st in stages]

    def _setup_reference_ssm_agents(
        self, role: str, backend_cls: Any, rank: int, tp_size: int, tp_rank: int, ssm_start: int
    ) -> None:
        """Register a hybrid reference-design engine's SSM buffers: the prefill's pinned
        state cache, or the decode's live request slots."""
        ref = self._ref()
        ctx = ref.context
        if role == "prefill":
            cache = ctx.mamba_slot_allocator
            conv, recurrent, num_slots = cache.conv_states, cache.ssm_states, cache.max_slots
        else:
            conv, recurrent = ctx.mamba_conv_states, ctx.mamba_ssm_states
            num_slots = ctx.max_requests
        config = ref.controller.inference_wrapped_model.model.config
        heads = int(recurrent.shape[-3]) * tp_size
        if config.mamba_num_heads is not None and config.mamba_num_heads != heads:
            raise HandoffMetadataError(
                f"SSM state shape implies {heads} heads but mamba_num_heads="
                f"{config.mamba_num_heads}",
                "mamba_num_heads",
            )
        dims = SSMStateDims(
            heads,
            int(recurrent.shape[-2]),
            int(recurrent.shape[-1]),
            int(config.mamba_num_groups),
            int(conv.shape[-1]),
        )
        n_local = int(ctx.num_mamba_layers)
        layout = SSMShardLayout(
            ssm_start + n_local,
            dims,
            tp_size,
            tp_rank,
            global_rank=rank,
            layer_start=ssm_start,
            num_local_layers=n_local,
        )
        if int(conv.shape[-2]) != layout.local_conv_channels:
            raise HandoffMetadataError(
                f"SSM conv state has {conv.shape[-2]} channels but the TP layout needs "
                f"{layout.local_conv_channels}",
                "mamba_conv_states",
            )
        make = getattr(self._kv_transfer_agent, "new_registered_buffer", backend_cls)
        specs = {
            "conv": (conv, conv.shape[-2], conv.shape[-1]),
            "recurrent": (
                recurrent,
                recurrent.shape[-3],
                recurrent.shape[-2] * recurrent.shape[-1],
            ),
        }
        for kind, (buf, width, dim) in specs.items():
            self._ssm_transfer_agents[kind] = make(
                agent_name=f"{role}-ssm-{kind}-rank{rank}",
                memory_buffer=buf,
                expected_num_blocks=num_slots,
                heads_per_partition=width,
                head_dim=dim,
                tokens_per_block=1,
                ssm_layout=layout,
                ssm_state_kind=kind,
            )
        self._ssm_peer_metas = {k: a.export_meta() for k, a in self._ssm_transfer_agents.items()}

    @property
    def handoff_static_meta(self) -> dict[str, Any]:
        """Static transfer metadata of every rank of this engine (published once)."""
        if self._static_meta is None:
            raise HandoffStateError("setup_kv_transfer has not run")
        return self._static_meta

    @property
    def _is_push(self) -> bool:
        return self._backend_name == "nccl"

    def close_kv_transfer(self) -> None:
        """Deregister every buffer (idempotent).

        Refuses with ``ResetRefusedError`` (nothing changed) while an import or push may still
        touch the registered memory: deregistering under a live transfer would let it write
        freed memory or fail in the transport instead of in the ledger.
        """
        live = sorted(
            rid
            for rid, p in self._pending_imports.items()
            if not all(self._quiet(h) for h in p.handles)
        )
        live += sorted(
            rid
            for (rid, _), p in self._quarantined.items()
            if p.handles and not all(self._quiet(h) for h in p.handles)
        )
        live += sorted(self._pending_pushes)
        if live:
            raise ResetRefusedError(
                f"close_kv_transfer: transfers of requests {live} are still in flight; "
                "close after they settle",
                "request_id",
            )
        for b in self._ssm_backends.values():
            b.close()
        if self._kv_backend is not None:
            self._kv_backend.close()
        self._ssm_backends = {}
        self._kv_backend = None

    # -- prefill side ---------------------------------------------------------------------------
    def _prepare_handoff_metadata_batch(
        self,
        requests_and_state: Iterable[tuple[Any, ...]],
        decode_tokens_by_request: Mapping[int, list[int]],
    ) -> dict[int, _PreparedHandoffMetadata]:
        """Assemble metadata for all handoffs completed by one engine step.

        Entries are ``(request, block_ids)`` or ``(request, block_ids, ssm_slot)``. No
        collective runs here: the static transport metadata was gathered at setup.
        """
        if self._ledger_driven():
            out = {}
            for request, blocks, *rest in requests_and_state:
                rid = int(request.request_id)
                slot = rest[0] if rest else None
                out[rid] = _PreparedHandoffMetadata(
                    local_blocks=list(blocks),
                    local_ssm_slot=slot,
                    kv_meta={
                        "src_block_ids": list(blocks),
                        "src_block_size_tokens": self._host().block_size_tokens,
                    },
                    ssm_meta=None if slot is None else {"src_slot": slot},
                    resume_tokens=list(decode_tokens_by_request.get(rid, [])),
                )
            return out
        return self._prepare_reference_handoff_metadata(
            requests_and_state, decode_tokens_by_request
        )

    def _prepare_reference_handoff_metadata(
        self,
        requests_and_state: Iterable[tuple[Any, ...]],
        decode_tokens_by_request: Mapping[int, list[int]],
    ) -> dict[int, _PreparedHandoffMetadata]:
        ctx = self._ref().context
        bs = int(ctx.block_size_tokens)
        handoffs = [
            (request, list(blocks)[: -(-len(request.prompt_tokens) // bs)])
            for request, blocks, *_ in requests_and_state
            if request.sampling_params.do_kv_handoff
        ]
        if not handoffs:
            return {}
        if self._kv_peer_metas is None:
            raise HandoffStateError(
                "a KV handoff was requested before setup_kv_transfer", "setup_kv_transfer"
            )
        pp_size = get_pg_size(self._ref().pg_collection.pp)
        try:
            ssm_cache = ctx.mamba_slot_allocator if self._ssm_transfer_agents else None
            kv_stages = self._pp_kv_peer_metas or [self._kv_peer_metas]
            ssm_stages = self._pp_ssm_peer_metas or [self._tp_ssm_peer_metas]
            if len(kv_stages) != pp_size or len(ssm_stages) != pp_size:
                raise HandoffMetadataError(
                    f"static metadata covers {len(kv_stages)} KV / {len(ssm_stages)} SSM "
                    f"pipeline stages but pp_size={pp_size}",
                    "pp_metas",
                )
            want_resume = int(ctx.num_speculative_tokens) + 1
            prepared: dict[int, _PreparedHandoffMetadata] = {}
            for request, blocks in handoffs:
                rid = request.request_id
                resume = list(decode_tokens_by_request.get(rid, []))
                if len(resume) != want_resume:
                    raise HandoffMetadataError(
                        f"request {rid}: {len(resume)} resume tokens but a decode-only handoff "
                        f"needs num_speculative_tokens+1={want_resume}",
                        "resume_tokens",
                    )
                if not blocks:
                    raise HandoffMetadataError(f"request {rid}: no prompt KV blocks", "block_ids")
                slot = -1 if ssm_cache is None else int(ssm_cache.get_slot(blocks[-1]))
                if ssm_cache is not None and slot < 0:
                    raise HandoffStateError(
                        f"request {rid}: no SSM state cached for its final block {blocks[-1]}",
                        "ssm_slot",
                    )
                kv_meta: Any = (
                    {"pp_metas": [{"tp_metas": m, "block_ids": blocks} for m in kv_stages]}
                    if pp_size > 1
                    else self._kv_peer_metas
                )
                ssm_meta = None
                if self._ssm_transfer_agents:
                    per_stage = [self._ssm_stage_transfer_meta(m, slot) for m in ssm_stages]
                    ssm_meta = {
                        kind: (
                            {"pp_metas": [{"tp_metas": st[kind]} for st in per_stage]}
                            if pp_size > 1
                            else per_stage[0][kind]
                        )
                        for kind in _SSM_STATE_KINDS
                    }
                prepared[rid] = _PreparedHandoffMetadata(
                    local_blocks=blocks,
                    kv_meta=kv_meta,
                    ssm_meta=ssm_meta,
                    resume_tokens=resume,
                    local_ssm_slot=None if ssm_cache is None else slot,
                )
            return prepared
        except Exception:
            for _, blocks in handoffs:
                self._release_pinned_handoff_blocks(blocks)
            raise

    @staticmethod
    def _ssm_stage_transfer_meta(
        static_metas: dict[str, Any], selected_slot: int
    ) -> dict[str, Any]:
        """Attach the final recurrent-state slot to one stage's descriptors (per state kind:
        one descriptor, or a list with one per TP rank)."""
        out: dict[str, Any] = {}
        for kind in _SSM_STATE_KINDS:
            metas = static_metas.get(kind)
            if metas is None:
                raise HandoffMetadataError(f"static {kind} SSM handoff metadata is missing", kind)
            out[kind] = (
                [{**m, "block_ids": [selected_slot]} for m in metas]
                if isinstance(metas, list)
                else {**metas, "block_ids": [selected_slot]}
            )
        return out

    def _capture_handoff_meta(
        self,
        request: Any,
        prepared: _PreparedHandoffMetadata | None,
        decode_metas: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Attach prepared transfer metadata and retain the request's blocks.

        Ledger-driven prefill: pin the request's blocks and SSM slot in the PinLedger and
        return its ticket. ``request`` is the engine's finished-prefill record
        (``request_id``, ``block_ids``, ``ssm_slot``, ``first_token``). The engine's own
        reference on the blocks is dropped here: from now on the pin owns them until
        RELEASE_KV or lease expiry.

        Reference-design prefill: the blocks (whose reference the engine's allocator keeps
        pinned) are recorded for RELEASE_KV and ``request.disaggregated_params`` receives
        ``request_id``, ``block_ids`` and ``kv_meta``; returns that mapping.
        """
        if not self._ledger_driven():
            return self._capture_reference_handoff_meta(request, prepared)
        engine = self._host()
        rid = int(request.request_id)
        blocks = list(prepared.local_blocks if prepared else request.block_ids)
        slot = prepared.local_ssm_slot if prepared else request.ssm_slot
        # Digest before pinning (collective): a digest that raises leaves nothing pinned.
        integrity = (
            self._integrity_table_of(blocks, len(request.prompt), slot)
            if self.verify_integrity
            else None
        )
        now = self.handoff_now_ns
        epoch = self._pins().pin(
            rid, blocks, slot, lease_until=now + self.handoff_lease_ns, now=now
        )
        engine.block_pool.release(blocks)
        self._event(("pinned", rid, f"{len(blocks)} blocks slot={slot}"))
        ticket: dict[str, Any] = {
            "src_block_ids": blocks,
            "src_block_size_tokens": self._host().block_size_tokens,
            "src_ssm_slot": slot,
            "resume_tokens": [int(request.first_token)],
            "pin_epoch": epoch,
            "lease_ns": self.handoff_lease_ns,
        }
        if self.handoff_wall_now_ns is not None:
            ticket["lease_until_wall_ns"] = self.handoff_wall_now_ns + self.handoff_lease_ns
        if integrity is not None:
            ticket["integrity"] = integrity.to_wire()
        staged = self._stage_for_decode(rid, blocks, len(request.prompt), decode_metas)
        if staged:
            ticket["staged"] = staged
        return ticket

    def _capture_reference_handoff_meta(
        self, request: Any, prepared: _PreparedHandoffMetadata | None
    ) -> dict[str, Any]:
        if prepared is None:
            raise HandoffStateError(
                f"request {request.request_id}: no handoff metadata was prepared", "prepared"
            )
        rid = request.request_id
        blocks = prepared.local_blocks
        self._pinned_handoff_blocks[rid] = list(blocks)
        # A list is one descriptor per TP rank; a dict is the engine's shared descriptor and
        # is copied so request-specific entries stay out of it.
        kv_meta = (
            {"tp_metas": prepared.kv_meta}
            if isinstance(prepared.kv_meta, list)
            else dict(prepared.kv_meta)
        )
        kv_meta["resume_tokens"] = prepared.resume_tokens
        if prepared.ssm_meta is not None:
            kv_meta["ssm"] = prepared.ssm_meta
        params = {"request_id": rid, "block_ids": blocks, "kv_meta": kv_meta}
        request.disaggregated_params = params
        logger.info(
            "handoff event=pinned request_id=%d blocks=%d ssm=%d",
            rid,
            len(blocks),
            int(prepared.ssm_meta is not None),
        )
        return params

    # -- integrity digest (verify_integrity) ----------------------------------------------------
    def _integrity_shapes(self, num_chunks: int = 1) -> dict[str, tuple[int, ...]]:
        """Digest table shapes of this model (the parts this engine registers)."""
        engine = self._host()
        kv = engine.kv_layout if self._kv_backend is not None else None
        ssm = engine.ssm_layout if self._ssm_backends else None
        return IntegrityTable.shapes(kv, ssm, num_chunks)

    def _local_integrity_pieces(
        self,
        block_ids: list[int],
        num_tokens: int,
        ssm_slot: int | None,
        chunk_tokens: int | None = None,
    ) -> list[IntegrityPiece]:
        """This rank's digest entries of one request: the cells it holds, on its device."""
        pieces: list[IntegrityPiece] = []
        kv = self._kv_backend
        if kv is not None and num_tokens > 0:
            pieces += kv_pieces(
                kv.memory_buffer, kv.geometry, kv.layout, block_ids, num_tokens, chunk_tokens
            )
        if ssm_slot is not None:
            for kind, b in self._ssm_backends.items():
                fn = conv_pieces if kind == "conv" else recurrent_pieces
                pieces += fn(b.memory_buffer, b.geometry, b.layout, ssm_slot)
        return pieces

    def _integrity_table_of(
        self, block_ids: list[int], num_tokens: int, ssm_slot: int | None
    ) -> IntegrityTable:
        """The full digest of one prefilled request, assembled over the model-parallel ranks
        (collective: each rank contributes the cells it holds)."""
        engine = self._host()
        started = time.perf_counter_ns()
        chunk = chunk_tokens_for(num_tokens)
        local: list[IntegrityPiece] | str
        try:
            local = self._local_integrity_pieces(block_ids, num_tokens, ssm_slot, chunk)
        except DisaggError as e:  # gathered, so every rank raises instead of one hanging
            local = f"{type(e).__name__}: {e}"
        gathered = engine.handoff_all_gather(local)
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            raise HandoffStateError(f"integrity digest failed on a rank: {errors[0]}", "integrity")
        pieces = [p for rank in gathered for p in rank]
        table = IntegrityTable.merge(self._integrity_shapes(-(-num_tokens // chunk)), pieces)
        table.chunk_tokens = chunk
        self.handoff_stats["integrity_ns"] += time.perf_counter_ns() - started
        return table

    def _verify_import_integrity(self, pending: RankImport) -> IntegrityMismatch | None:
        """Check the state this rank holds for a finished import against the ticket's digest
        (``None`` when it matches or this decode does not verify)."""
        req = self._decode_requests.get(pending.request_id)
        if req is None or req.integrity is None:
            return None
        started = time.perf_counter_ns()
        dest = pending.destination
        chunk = req.integrity.chunk_tokens
        local = self._local_integrity_pieces(
            list(dest["block_ids"]), int(dest["num_tokens"]), dest["dst_ssm_slot"], chunk
        )
        # A prefix reused from this decode's cache was not moved (and, prefilled in another
        # batch, may differ in its last bits): the ledger reused whole chunks only, skip them.
        first = int(dest["token_start"]) // chunk if chunk else 0
        mismatch = req.integrity.first_mismatch(local, first_chunk=first)
        self.handoff_stats["integrity_ns"] += time.perf_counter_ns() - started
        return mismatch

    def _stage_for_decode(
        self,
        request_id: int,
        blocks: list[int],
        num_tokens: int,
        decode_metas: list[dict[str, Any]] | None,
    ) -> dict[int, list[dict[str, Any]]]:
        """One-sided staged pulls: pack this rank's fragments for every decode rank before the
        handoff is announced, and gather every prefill rank's tickets (collective).

        Returns ``{decode global rank: [ticket per prefill rank that packed]}``; empty when the
        backend reads directly (two-sided, ``mode="direct"``, or no decode chosen yet).
        """
        engine = self._host()
        backend = self._kv_backend
        stage = getattr(backend, "stage_blocks", None)
        if not decode_metas or stage is None or getattr(backend, "mode", "direct") == "direct":
            return {}
        own = [r["kv"] for r in self.handoff_static_meta["ranks"] if r.get("kv") is not None]
        local: dict[int, dict[str, Any]] = {}
        for dm in decode_metas:
            kv = dm.get("kv")
            if kv is None:
                continue
            t = stage(kv, blocks, src_metas=own, num_tokens=num_tokens)
            if t.get("staged"):
                local[int(kv["layout"]["global_rank"])] = t
        self._staged_by_request[request_id] = list(local.values())
        merged: dict[int, list[dict[str, Any]]] = {}
        for per_rank in engine.handoff_all_gather(local):
            for dst, t in per_rank.items():
                merged.setdefault(int(dst), []).append(t)
        return merged

    def _release_staged(self, request_id: int) -> None:
        """Free the staging regions packed for a handoff (after RELEASE_KV or lease expiry)."""
        release = getattr(self._kv_backend, "release_staged", None)
        for t in self._staged_by_request.pop(request_id, []):
            if release is not None:
                release(t)

    def release_handoff_blocks(self, request_id: int) -> None:
        """Release blocks pinned by a finished handoff (RELEASE_KV); unknown ids and repeated
        releases are no-ops."""
        if not self._ledger_driven():
            blocks = self._pinned_handoff_blocks.pop(request_id, None)
            if blocks:
                released = self._release_pinned_handoff_blocks(blocks)
                logger.info("handoff event=released request_id=%d blocks=%d", request_id, released)
            return
        if request_id in self._pending_pushes:
            # The push may still read them: the ledger defers the release until it settles.
            self._event(("release_deferred", request_id, "push in flight"))
        actions = self._pins().release(request_id)
        self._release_staged(request_id)
        for a in actions:
            self._event(("released", a.request_id, str(a.reason)))

    def _release_pinned_handoff_blocks(self, block_ids: list[int]) -> int:
        """Drop this request's ownership of its pinned blocks; returns how many.

        Reference-design engine: one allocator reference per block. Ledger-driven engine: the
        PinLedger releases them with the pin (nothing to do here).
        """
        if not block_ids:
            return 0
        if not self._ledger_driven():
            ids = torch.tensor(list(block_ids), dtype=torch.int32, device="cpu")
            self._ref().context.kv_block_allocator.release_memory_blocks(ids)
        return len(block_ids)

    def _release_pinned_handoff_ssm_slot(self, ssm_slot: int | None) -> None:
        """The slot's ownership ends with the pin (PinLedger, or the reference design's state
        cache, which keys it by the pinned final block); nothing else to release."""
        del ssm_slot

    def expire_handoff_pins(self) -> int:
        """End pins whose lease has passed (``handoff_now_ns``); returns how many."""
        self._update_queue_metrics()
        if self._pin_ledger is None:
            return 0
        actions = self._pin_ledger.expire(self.handoff_now_ns)
        for a in actions:
            self._release_staged(a.request_id)
            self._event(("lease_expired", a.request_id, ""))
        return len(actions)

    def push_handoff_kv(self, request_id: int, decode_metas: list[Any]) -> None:
        """Push a pinned handoff's KV and live SSM state to the decode instance described by
        ``decode_metas`` (two-sided transports only): one entry per decode rank.

        The decode posted its matching receives when SUBMIT_REQUEST_WITH_KV arrived; the
        sends are reaped by ``_poll_pending_kv_pushes`` and the pins stay until RELEASE_KV.
        Everything is validated before any send is posted.

        On a ledger-driven engine each entry carries the decode's static ``kv``/``conv``/
        ``recurrent`` metadata and the ``destination`` it posted receives for (attach it with
        :func:`with_push_destination`). On a reference-design engine each entry is the
        decode rank's KV descriptor with its SSM descriptors under ``"ssm"``.
        """
        if not self._ledger_driven():
            self._push_reference_handoff_kv(request_id, decode_metas)
            return
        pins = self._pins()
        blocks = pins.pinned_blocks(request_id)
        epoch = pins.epoch_of(request_id)
        if blocks is None or epoch is None:
            raise HandoffStateError(
                f"request {request_id} has no pinned handoff to push", "request_id"
            )
        _tag(request_id, "kv")  # an id that cannot be tagged is refused before the push starts
        slot = pins.pinned_ssm_slot(request_id)
        destination = next((m["destination"] for m in decode_metas if "destination" in m), None)
        if destination is None:
            raise MetadataError(
                f"request {request_id}: decode_metas carry no 'destination' (attach the "
                "decode's posted destination with with_push_destination)",
                "destination",
            )
        for key in ("dst_block_ids", "num_tokens") + (
            ("dst_ssm_slot",) if slot is not None else ()
        ):
            if key not in destination:
                raise MetadataError(
                    f"request {request_id}: push destination has no {key!r}", "destination"
                )
        token_start = int(destination.get("token_start", 0))
        first_src = token_start // self._host().block_size_tokens
        own = self.handoff_static_meta["ranks"]
        kv_metas = [r["kv"] for r in decode_metas if r.get("kv") is not None]
        pins.begin_push(request_id, epoch)
        handles = []
        if self._kv_backend is not None and kv_metas:
            handles.append(
                self._kv_backend.begin_push_blocks(
                    kv_metas,
                    blocks[first_src:],
                    destination["dst_block_ids"],
                    src_metas=[r["kv"] for r in own if r.get("kv") is not None],
                    num_tokens=int(destination["num_tokens"]) - token_start,
                    tag=_tag(request_id, "kv"),
                )
            )
        if slot is not None:
            for kind, backend in self._ssm_backends.items():
                metas = [r[kind] for r in decode_metas if r.get(kind) is not None]
                handles.append(
                    backend.begin_push_blocks(
                        metas,
                        [slot],
                        [int(destination["dst_ssm_slot"])],
                        src_metas=[r[kind] for r in own if r.get(kind) is not None],
                        tag=_tag(request_id, kind),
                    )
                )
        self._pending_pushes[request_id] = (epoch, handles)
        self.handoff_stats["pushes"] += 1

    def _push_reference_handoff_kv(self, request_id: int, decode_metas: list[Any]) -> None:
        blocks = self._pinned_handoff_blocks.get(request_id)
        if not blocks:
            logger.warning(
                "SEND_KV for request %d with no pinned handoff blocks; skipped", request_id
            )
            return
        ssm_sends = []
        if self._ssm_transfer_agents:
            slot = int(self._ref().context.mamba_slot_allocator.get_slot(blocks[-1]))
            if slot < 0:
                raise HandoffStateError(
                    f"request {request_id}: no pinned SSM state for its final block {blocks[-1]}",
                    "ssm_slot",
                )
            for kind in _SSM_STATE_KINDS:
                try:
                    peers = [entry["ssm"][kind] for entry in decode_metas]
                except (KeyError, TypeError) as e:
                    raise HandoffMetadataError(
                        f"request {request_id}: decode metadata is missing {kind} SSM transfer "
                        "state",
                        kind,
                    ) from e
                ssm_sends.append((self._ssm_transfer_agents[kind], peers, slot))
        handles = [
            self._kv_transfer_agent.begin_push_blocks({"tp_metas": list(decode_metas)}, blocks)
        ]
        # The final block stays pinned until RELEASE_KV, so its SSM slot is not reused while
        # these sends run.
        for agent, peers, slot in ssm_sends:
            handles.append(agent.begin_push_blocks({"tp_metas": peers}, [slot]))
        self._pending_kv_pushes.append((request_id, handles))

    def _poll_pending_kv_pushes(self) -> int:
        """Reap completed push sends; unfinished ones stay pending. Returns how many ended."""
        if not self._ledger_driven():
            pushes = self._pending_kv_pushes
            done = [all(h.poll() for h in hs) for _, hs in pushes]
            self._pending_kv_pushes = [p for p, d in zip(pushes, done, strict=False) if not d]
            return sum(done)
        ended = 0
        for rid, (epoch, handles) in list(self._pending_pushes.items()):
            if not self._wait_for_transfer_handles(*handles, block=False):
                continue
            del self._pending_pushes[rid]
            ended += 1
            for a in self._pins().push_settled(rid, epoch):
                self._event(("released", a.request_id, str(a.reason)))
        return ended

    # -- decode side ----------------------------------------------------------------------------
    def add_request_with_kv_handoff(
        self,
        request_id: int,
        prompt: list[int],
        sampling_params: Any,
        kv_meta: dict[str, Any],
        src_block_ids: list[int],
    ) -> asyncio.Future[Any] | None:
        """Start or capacity-queue a KV import and return its completion future.

        ``kv_meta`` is the ticket: ``resume_tokens``, ``src_block_size_tokens``,
        ``src_ssm_slot``, ``prefill_meta`` (the prefill engine's ``handoff_static_meta``) and
        optionally ``lease_ns`` (the prefill pin's lease: the import's deadline is at most
        ``LEASE_READ_FRACTION`` of it). ``sampling_params`` is the reference design's
        ``SamplingParams`` or any object with its ``num_tokens_to_generate`` (or
        ``max_new_tokens``), ``termination_id`` and ``stop_word_ids``; a bare int is the number
        of tokens to generate. A handed-off token that ends the request (the limit, the
        termination token or a stop word) completes it without a forward step.

        Returns a future resolved when the request is admitted (or completed, or failed), on
        any engine with an event loop; ``None`` on an engine without one.

        On a reference-design engine ``kv_meta`` is the prefill's ``disaggregated_params``
        ``kv_meta`` and the future resolves with the finished request's record.
        """
        if not self._ledger_driven():
            return self._add_reference_request_with_kv_handoff(
                request_id, prompt, sampling_params, kv_meta, src_block_ids
            )
        engine = self._host()
        ledger = self._ledger()
        max_new, termination_id, stop_word_ids = _sampling_limits(sampling_params)
        resume = [int(t) for t in kv_meta.get("resume_tokens", [])]
        if "prefill_meta" not in kv_meta:
            raise MetadataError(f"request {request_id}: ticket has no prefill_meta", "prefill_meta")
        self._check_ticket_sources(request_id, kv_meta)
        if self._is_push:
            _tag(request_id, "kv")  # refuses an id whose tags would alias another request's
        integrity = None
        if self.verify_integrity:
            if kv_meta.get("integrity") is None:
                raise MetadataError(
                    f"request {request_id}: this decode verifies integrity but the ticket has "
                    "no integrity table (enable verify_integrity on the prefill engine)",
                    "integrity",
                )
            wire = kv_meta["integrity"]
            chunk = IntegrityTable.wire_chunk_tokens(wire)
            chunks = -(-len(prompt) // chunk) if chunk else 1
            integrity = IntegrityTable.from_wire(wire, self._integrity_shapes(chunks))
        has_ssm = engine.ssm_slot_pool is not None
        if has_ssm != (kv_meta.get("src_ssm_slot") is not None):
            raise MetadataError(
                f"request {request_id}: decode has_ssm={has_ssm} but ticket src_ssm_slot="
                f"{kv_meta.get('src_ssm_slot')}",
                "src_ssm_slot",
            )
        if termination_id is None:
            termination_id = engine.config.eos_token
        finished = (
            len(resume) >= max_new
            or (termination_id is not None and bool(resume) and resume[-1] == termination_id)
            or _hits_stop_word(resume, stop_word_ids)
        )
        now = self.handoff_now_ns
        budget = self.handoff_import_timeout_ns
        lease = kv_meta.get("lease_ns")
        if lease is not None:
            if not isinstance(lease, int) or isinstance(lease, bool) or lease < 2:
                raise MetadataError(
                    f"request {request_id}: ticket lease_ns={lease!r} must be an int >= 2",
                    "lease_ns",
                )
            # The prefill frees the source blocks when its lease ends; a read still running (or
            # not yet started) then may see reused blocks. Clocks of the two engines are not
            # comparable, so the decode finishes within LEASE_READ_FRACTION of the lease by its
            # own clock and the rest absorbs the ticket's transit: past it the import fails.
            budget = min(budget, int(lease * LEASE_READ_FRACTION))
        lease_end = kv_meta.get("lease_until_wall_ns")
        now_wall = self.handoff_wall_now_ns if lease_end is not None else None
        if now_wall is not None and (
            not isinstance(lease_end, int) or isinstance(lease_end, bool) or lease_end < 0
        ):
            raise MetadataError(
                f"request {request_id}: ticket lease_until_wall_ns={lease_end!r} must be "
                "an int >= 0",
                "lease_until_wall_ns",
            )
        # A verifying decode reuses its prefix cache in whole digest chunks only (their
        # entries are then skipped); a table without chunks allows no reuse at all.
        prompt_args: dict[str, Any] = {"prompt_tokens": np.asarray(prompt, dtype=np.int64)}
        if integrity is not None:
            if integrity.chunk_tokens is None:
                prompt_args = {"num_prompt_tokens": len(prompt), "prompt_hashes": []}
            else:
                prompt_args["reuse_align_tokens"] = integrity.chunk_tokens
        actions = ledger.submit(
            request_id,
            **prompt_args,
            src_block_ids=list(src_block_ids),
            src_block_size_tokens=int(
                kv_meta.get("src_block_size_tokens", engine.block_size_tokens)
            ),
            resume_tokens=len(resume),
            has_ssm=has_ssm,
            finished=bool(finished),
            deadline=now + budget,
            now=now,
            lease_until_wall=lease_end if now_wall is not None else None,
            now_wall=now_wall,
        )
        # Validated by the ledger: now the engine learns of it (ledger and engine agree).
        engine.expect_import(request_id, prompt, resume, max_new)
        future: asyncio.Future[Any] | None = None
        try:
            loop: asyncio.AbstractEventLoop | None = engine.event_loop
        except AttributeError:  # the protocol's way of saying "this engine has no loop"
            loop = None
        if loop is not None:
            future = loop.create_future()
        self._decode_requests[request_id] = _DecodeRequest(
            list(prompt), resume, max_new, dict(kv_meta), future, integrity
        )
        self._event(("submitted", request_id, f"{len(prompt)} tokens"))
        self._apply_import_actions(actions)
        return future

    def kv_import_destination(self, request_id: int) -> dict[str, Any] | None:
        """Where this rank receives a started import (ledger-driven decode): its
        ``dst_block_ids``, ``dst_ssm_slot``, ``num_tokens`` and ``token_start``. A two-sided
        prefill needs it to push (:func:`with_push_destination`); None when not importing."""
        pending = self._pending_imports.get(request_id)
        return None if pending is None else dict(pending.destination)

    def _check_ticket_sources(self, request_id: int, kv_meta: dict[str, Any]) -> None:
        """Refuse a ticket whose prefill metadata names no source for a state this decode
        must read (it would reserve blocks, post nothing and be admitted unwritten)."""
        needed = (["kv"] if self._kv_backend is not None else []) + list(self._ssm_backends)
        if not needed:  # this rank reads no state (no transfer backend set up)
            return
        ranks = (
            kv_meta["prefill_meta"].get("ranks")
            if isinstance(kv_meta["prefill_meta"], dict)
            else None
        )
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
            raise MetadataError(
                f"request {request_id}: ticket prefill_meta has no list of rank metadata "
                f"(got ranks={ranks!r:.80})",
                "prefill_meta",
            )
        for kind in needed:
            if not any(r.get(kind) is not None for r in ranks):
                raise MetadataError(
                    f"request {request_id}: ticket prefill_meta has no {kind!r} source on any "
                    f"of its {len(ranks)} ranks, but this decode must read {kind} state",
                    "prefill_meta",
                )

    def _apply_import_actions(self, actions: Sequence[LedgerAction]) -> None:
        for a in actions:
            kind = a.kind
            if kind == "start":
                self._start_import(a)
            elif kind == "admit":
                self._finalize_kv_handoff_import(a)
            elif kind == "complete":
                self._complete_handoff_request_without_forward(a.request_id)
            elif kind == "fail":
                self._fail_import(a)
            elif kind == "release":
                self._quarantined.pop((a.request_id, a.epoch), None)
                self._event(("quarantine_drained", a.request_id, str(a.reason)))

    def _try_start_kv_handoff_import(self, handoff: DeferredKvHandoff | None) -> bool:
        """Reserve cache state and start one import, or return False without mutation.

        On a ledger-driven engine starts happen inside the ledger (all or nothing) and this
        drains its queue; ``handoff`` is not needed there.
        """
        if not self._ledger_driven():
            if handoff is None:
                raise HandoffStateError(
                    "a reference-design engine starts a given handoff", "handoff"
                )
            return self._start_reference_import(handoff)
        return self._drain_deferred_kv_handoffs() > 0

    def _find_cached_handoff_prefix(self, hashes: list[int], num_blocks: int) -> list[int]:
        """The contiguous handoff prefix already cached on decode (pull transports only)."""
        if not self._ledger_driven():
            table = self._ref().context.kv_block_allocator.kv_hash_to_block_id
            found = list(map(table.get, hashes[:num_blocks]))
            n = found.index(None) if None in found else len(found)
            return [int(b) for b in found[:n]]
        return list(self._host().block_pool.match_prefix(hashes[:num_blocks]))

    def _handoff_capacity_available(self, num_blocks: int, cached_blocks: list[int]) -> bool:
        """Whether ``num_blocks`` new blocks fit after retaining ``cached_blocks`` (cached
        blocks nobody references count against free capacity once retained)."""
        if not self._ledger_driven():
            allocator = self._ref().context.kv_block_allocator
            unreferenced = 0
            if cached_blocks:
                ids = torch.tensor(cached_blocks, dtype=torch.int32)
                unreferenced = int((allocator.block_ref_counts[ids] == 0).sum())
            return bool(
                allocator.is_memory_available(num_blocks, potential_matched_count=unreferenced)
            )
        pool = self._host().block_pool
        unreferenced = sum(map((0).__eq__, map(pool.refcount, cached_blocks)))
        return bool(pool.can_allocate(num_blocks + unreferenced))

    def _drain_deferred_kv_handoffs(self) -> int:
        """Start queued handoffs in FIFO order while the queue head fits."""
        if not self._ledger_driven():
            started = 0
            queue = self._deferred_kv_handoffs
            while queue and self._try_start_kv_handoff_import(queue[0]):
                queue.popleft()
                started += 1
            return started
        before = self._ledger().num_importing
        self._cancel_due_quarantines()
        self._apply_import_actions(self._ledger().poll(self.handoff_now_ns))
        return max(0, self._ledger().num_importing - before)

    def _start_import(self, action: LedgerAction) -> None:
        """Post the transfers of a started import (pull: reads; push: receives)."""
        req = self._decode_requests[action.request_id]
        pending = RankImport(action.request_id, action.epoch)
        self._pending_imports[action.request_id] = pending
        ticket = req.kv_meta
        prefill_ranks = ticket["prefill_meta"]["ranks"]
        num_tokens = len(req.prompt)
        token_start = int(action.token_start)
        src_bs = int(ticket.get("src_block_size_tokens", self._host().block_size_tokens))
        src_ids = list(action.src_block_ids)
        pending.destination = {
            "dst_block_ids": list(action.dst_block_ids),
            # Every block of the prompt in token order, prefix-cached ones included.
            "block_ids": list(action.cached_block_ids) + list(action.dst_block_ids),
            "dst_ssm_slot": action.ssm_slot,
            "num_tokens": num_tokens,
            "token_start": token_start,
            "src_block_size_tokens": src_bs,
        }
        posted_at = time.perf_counter_ns()
        try:
            if self._kv_backend is not None and num_tokens > token_start:
                kv_metas = [r["kv"] for r in prefill_ranks if r.get("kv") is not None]
                handle = self._kv_backend.begin_pull_blocks(
                    kv_metas,
                    src_ids,
                    list(action.dst_block_ids),
                    num_tokens=num_tokens - token_start,
                    **self._pull_kwargs(action.request_id, "kv", ticket),
                )
                pending.handles.append(handle)
            if action.ssm_slot is not None:
                self._start_ssm_handoff_import(action.request_id, ticket, pending)
        except Exception as e:  # transfer start threw: local failure, quiet if nothing posted
            pending.failed_locally = f"{type(e).__name__}: {e}"
            logger.warning("request %d: transfer start failed: %s", action.request_id, e)
        pending.posted_ns = time.perf_counter_ns()
        self.handoff_stats["post_ns"] += pending.posted_ns - posted_at
        if self.handoff_metrics is not None:
            self.handoff_metrics.posted((pending.posted_ns - posted_at) / 1e9)
        self.handoff_stats["imports_started"] += 1
        self.handoff_request_stats[action.request_id] = {"token_start": token_start, "bytes": 0}
        self._event(("importing", action.request_id, f"token_start={token_start}"))

    def _reserve_ssm_handoff_import(self) -> PendingSSMImport:
        """Reserve the live request slot that receives exact SSM state (reference-design
        engine; a ledger reserves the slot with the blocks, all or nothing, in ``submit``)."""
        if self._ledger_driven():
            raise HandoffStateError(
                "SSM slots are reserved by ImportLedger.submit, not separately", "ssm_slot"
            )
        if not self._ssm_transfer_agents:
            raise HandoffStateError(
                "received SSM handoff state but this decode engine has no SSM transfer agents "
                "(setup_kv_transfer on a hybrid decode engine)",
                "setup_kv_transfer",
            )
        slot = self._ref().context.mamba_metadata.allocate_slot()
        if slot is None:
            raise HandoffStateError(
                "live SSM slot capacity changed between the check and the reservation",
                "mamba_state_free_slot_count",
            )
        return PendingSSMImport(handles={}, live_slot=int(slot))

    def _start_ssm_handoff_import(
        self, request_id: int, ssm_meta: dict[str, Any], pending: Any
    ) -> None:
        """Post transfers into the slot already reserved for one handoff."""
        if isinstance(pending, PendingSSMImport):
            pending.handles = {
                kind: self._ssm_transfer_agents[kind].begin_pull_blocks(
                    ssm_meta[kind], [], [pending.live_slot]
                )
                for kind in _SSM_STATE_KINDS
            }
            return
        dst_slot = pending.destination["dst_ssm_slot"]
        src_slot = int(ssm_meta["src_ssm_slot"])
        for kind, backend in self._ssm_backends.items():
            metas = [r[kind] for r in ssm_meta["prefill_meta"]["ranks"] if r.get(kind) is not None]
            pending.handles.append(
                backend.begin_pull_blocks(
                    metas, [src_slot], [dst_slot], **self._pull_kwargs(request_id, kind, {})
                )
            )

    def _pull_kwargs(self, request_id: int, kind: str, ticket: dict[str, Any]) -> dict[str, Any]:
        """Backend-specific arguments of a pull: the tag of a two-sided receive, or the
        staging tickets of a one-sided staged read."""
        if self._is_push:
            return {"tag": _tag(request_id, kind)}
        staged = ticket.get("staged") or {}
        pending = self._pending_imports.get(request_id)
        if kind != "kv" or pending is None or pending.destination.get("token_start", 0) != 0:
            # The packed layout covers the whole prompt: a prefix-trimmed pull reads directly.
            return {}
        me = self._kv_backend.layout.global_rank if self._kv_backend is not None else None
        mine = staged.get(me) or staged.get(str(me))
        return {"staged": mine} if mine else {}

    @staticmethod
    def _pending_transfer_handles(pending: PendingKvImport | RankImport) -> list[Any]:
        """This import's KV and SSM transfer handles."""
        if isinstance(pending, RankImport):
            return list(pending.handles)
        handles = [pending.handle]
        if pending.ssm is not None:
            handles += list(pending.ssm.handles.values())
        return [h for h in handles if h is not None]

    @staticmethod
    def _wait_for_transfer_handles(*handles: Any, block: bool = True) -> bool:
        """Whether every handle is terminal, so its destinations may be reused.

        ``block``: wait for each (within its own deadline); a handle whose wait times out may
        still be active (False); one that ends in a transfer error is terminal. Without
        ``block``: poll once; an error also counts as terminal.
        """
        done = True
        for h in handles:
            if h is None:
                continue
            try:
                if block:
                    h.wait()
                elif not h.poll():
                    done = False
            except TimeoutError:
                if block:
                    done = False
            except Exception:  # a terminal transfer error: nothing is moving any more
                continue
        return done

    @staticmethod
    def _local_outcome(pending: RankImport) -> str | None:
        """This rank's terminal outcome, or None while a handle is active.

        A start that threw after posting part of the import (KV posted, SSM threw) is an
        error only once the parts already posted are terminal: until then they may still write
        the destinations, which must not go back to the pool.
        """
        return InferenceStateHandoffMixin._local_outcome_detail(pending)[0]

    @staticmethod
    def _local_outcome_detail(pending: RankImport) -> tuple[str | None, str]:
        """``_local_outcome`` and, for a failure, the first error this rank saw."""
        outcome = "ok" if pending.failed_locally is None else "error"
        detail = pending.failed_locally or ""
        for h in pending.handles:
            try:
                if not h.poll():
                    return None, ""
            except TransferTimeout as e:
                outcome = "may_still_write"
                detail = detail or f"{type(e).__name__}: {e}"
            except TransferError as e:
                outcome = "error" if outcome == "ok" else outcome
                detail = detail or f"{type(e).__name__}: {e}"
        return outcome, detail

    def _report_completed_kv_imports(self) -> None:
        """Report locally terminal imports: a ledger-driven engine shares each rank's outcome
        with every model-parallel rank and feeds the ledger; a reference-design engine reports
        to its completion tracker (or, with one rank, records the decision directly)."""
        if not self._ledger_driven():
            self._report_reference_imports()
            return
        engine = self._host()
        if not self._pending_imports and not self._quarantined:
            # Mirrored on every rank (same ledger actions), so all ranks skip the collective.
            return
        local = []
        for pending in self._pending_imports.values():
            if pending.reported:
                continue
            outcome, detail = self._local_outcome_detail(pending)
            if outcome is None:
                continue
            pending.reported = True
            mismatch = None
            if outcome == "ok":
                self._record_transfer_done(pending)
                # Every local transfer finished: the state is final, check it before the
                # quorum can make the request admittable. A mismatch is this rank's error.
                try:
                    mismatch = self._verify_import_integrity(pending)
                except DisaggError as e:  # this rank cannot check: its import fails
                    logger.warning("request %d: integrity check raised: %s", pending.request_id, e)
                    outcome = "error"
                if mismatch is not None:
                    outcome = "error"
            local.append((pending.request_id, pending.epoch, outcome, mismatch, detail))
        ledger = self._ledger()
        for rank, rank_reports in enumerate(engine.handoff_all_gather(local)):
            for rid, epoch, outcome, mismatch, detail in rank_reports:
                if mismatch is not None and rid in self._pending_imports:
                    # Every rank records the same first mismatch (same gathered order).
                    self._integrity_failures.setdefault(rid, mismatch)
                if outcome != "ok" and detail and rid in self._pending_imports:
                    self._rank_errors.setdefault(rid, f"model-parallel rank {rank}: {detail}")
                self._apply_import_actions(
                    ledger.report(rid, epoch, rank, outcome, self.handoff_now_ns)
                )
        # Quarantined destinations settle once every local handle is quiet again.
        for key, pending in list(self._quarantined.items()):
            if all(self._quiet(h) for h in pending.handles):
                self._apply_import_actions(ledger.settle(*key))

    def _record_transfer_done(self, pending: RankImport) -> None:
        """Statistics and metrics of one import whose transfers completed on this rank."""
        moved = sum(int(h.stats.get("bytes", 0)) for h in pending.handles)
        descriptors = sum(int(h.stats.get("descriptors", 0)) for h in pending.handles)
        elapsed = time.perf_counter_ns() - pending.posted_ns
        self.handoff_stats["bytes_pulled"] += moved
        self.handoff_stats["descriptors"] += descriptors
        self.handoff_stats["transfer_ns"] += elapsed
        self.handoff_request_stats.setdefault(pending.request_id, {})["bytes"] = moved
        if self.handoff_metrics is not None:
            self.handoff_metrics.transfer_done(moved, descriptors, elapsed / 1e9)

    def _cancel_due_quarantines(self) -> None:
        """Cancel through the transport the transfers of quarantines whose drain horizon
        passed, before the ledger's poll returns their destinations to the pool."""
        for key in self._ledger().quarantine_due(self.handoff_now_ns):
            pending = self._quarantined.get(key)
            for handle in pending.handles if pending is not None else []:
                cancel = getattr(handle, "cancel", None)
                if cancel is not None:
                    cancel()

    @staticmethod
    def _quiet(handle: Any) -> bool:
        try:
            return bool(handle.poll())
        except (TransferError, TransferTimeout):
            return bool(getattr(handle, "done", True))

    def _poll_pending_kv_imports(self) -> int:
        """Progress imports without mutating the active decode batch: start queued handoffs
        that now fit and report transfers that became terminal. Returns the number ready to
        admit (a reference-design engine: whether one is, as 0 or 1)."""
        if not self._ledger_driven():
            self._drain_deferred_kv_handoffs()
            if not self._pending_kv_imports:
                return 0
            self._report_completed_kv_imports()
            return int(self.has_admittable_kv_import)
        if self._import_ledger is None:
            return 0
        self._report_completed_kv_imports()
        self._cancel_due_quarantines()
        self._apply_import_actions(self._ledger().poll(self.handoff_now_ns))
        self._update_queue_metrics()
        return self._ledger().num_ready

    def _admit_pending_kv_imports(self) -> int:
        """Handle completed imports at an engine admission point; returns how many admitted."""
        if not self._ledger_driven():
            return self._admit_reference_imports()
        engine = self._host()
        ledger = self._ledger()
        if not ledger.has_admittable_kv_import:
            return 0
        room = int(engine.decode_batch.can_admit(ledger.num_ready))
        before = self.handoff_stats["imports_admitted"]
        # handoff_now_ns must be read after the completions were observed (next loop turn).
        self._apply_import_actions(ledger.admit(room, self.handoff_now_ns))
        return self.handoff_stats["imports_admitted"] - before

    def _validate_decode_ready_handoff(self, pending: Any) -> None:
        """Validate that transferred state can start decode without prompt execution (a
        ledger admits only imports whose quorum succeeded: nothing else to check there)."""
        if not isinstance(pending, PendingKvImport):
            return
        ctx = self._ref().context
        want = int(ctx.num_speculative_tokens) + 1
        if len(pending.resume_tokens) != want:
            raise HandoffMetadataError(
                f"request {pending.request_id}: {len(pending.resume_tokens)} resume tokens, "
                f"expected num_speculative_tokens+1={want}",
                "resume_tokens",
            )
        if ctx.is_hybrid_model and pending.ssm is None:
            raise HandoffStateError(
                f"request {pending.request_id}: a hybrid decode-only handoff has no transferred "
                "SSM state",
                "ssm",
            )

    def _finalize_kv_handoff_import(self, action: Any) -> None:
        """Admit: ownership of the blocks and slot moves to the live request.

        ``action`` is the ledger's admit action, or a reference-design engine's
        :class:`PendingKvImport`: its hashes are registered in the prefix cache, the request
        enters through the engine's ``add_request`` and leaves the waiting queue at once, and
        the handed-off token is appended; a request that token already finishes (its limit,
        termination token or stop word) completes without a forward step, any other is
        admitted into the running batch by ``admit_prefilled_decode``.
        """
        if isinstance(action, PendingKvImport):
            self._finalize_reference_import(action)
            return
        engine = self._host()
        rid = action.request_id
        self._pending_imports.pop(rid, None)
        engine.decode_batch.admit(rid, list(action.block_ids), action.ssm_slot)
        req = self._decode_requests.pop(rid, None)
        self.handoff_stats["imports_admitted"] += 1
        self._record_handoff_completion_notification(rid, False)
        self._event(("admitted", rid, f"{len(action.block_ids)} blocks"))
        if req is not None and req.future is not None and not req.future.done():
            req.future.set_result(rid)

    def _complete_handoff_request_without_forward(self, request_id: int) -> None:
        """Complete an imported request whose transferred token already satisfies it."""
        if not self._ledger_driven():
            self._complete_reference_request_without_forward(request_id)
            return
        engine = self._host()
        self._pending_imports.pop(request_id, None)
        req = self._decode_requests.get(request_id)
        engine.complete_request_without_forward(
            request_id, None if req is None else list(req.resume_tokens)
        )
        req = self._decode_requests.pop(request_id, None)
        self.handoff_stats["imports_completed_without_forward"] += 1
        self._record_handoff_completion_notification(request_id, False)
        if req is not None and req.future is not None and not req.future.done():
            req.future.set_result(request_id)

    def _fail_import(self, action: Any) -> None:
        engine = self._host()
        rid = action.request_id
        pending = self._pending_imports.pop(rid, None)
        if action.quarantined and pending is not None:
            self._quarantined[(rid, action.epoch)] = pending
        req = self._decode_requests.pop(rid, None)
        # The engine forgets the announced request (expect_import) that will never arrive.
        engine.abort(rid)
        mismatch = self._integrity_failures.pop(rid, None)
        rank_error = self._rank_errors.pop(rid, None)
        self.handoff_stats["imports_failed"] += 1
        reason = str(action.reason) if mismatch is None else "integrity"
        if mismatch is not None:
            self.handoff_stats["integrity_failures"] += 1
        if self.handoff_metrics is not None:
            self.handoff_metrics.failed(reason)
        self._record_handoff_completion_notification(rid, True)
        detail = (
            f" {mismatch.describe()}"
            if mismatch is not None
            else f" ({rank_error})"
            if rank_error
            else ""
        )
        self._new_failure_reasons[rid] = f"{reason}{detail}"
        self.handoff_events.append(
            ("failed", rid, f"{reason} quarantined={action.quarantined}{detail}")
        )
        if mismatch is not None:
            logger.warning("request %d: integrity check failed: %s", rid, mismatch.describe())
        error: TransferError = (
            TransferError(
                f"KV import of request {rid} failed: {action.reason}{detail}", "request_id"
            )
            if mismatch is None
            else IntegrityError(
                f"KV import of request {rid} failed the integrity check: {mismatch.describe()}",
                "integrity",
                mismatch,
            )
        )
        if req is not None and req.future is not None and not req.future.done():
            req.future.set_exception(error)

    def _release_pending_kv_import(self, pending: PendingKvImport | RankImport) -> None:
        """Release storage owned by an unadmitted decode import (a ledger-driven engine
        aborts it: the ledger releases or quarantines its storage)."""
        if isinstance(pending, PendingKvImport):
            self._release_reference_import(pending)
            return
        self._apply_import_actions(self._ledger().abort(pending.request_id, self.handoff_now_ns))

    def abort_kv_import(self, request_id: int) -> None:
        """Abort one import at any stage (unknown ids are counted no-ops in the ledger)."""
        self._apply_import_actions(self._ledger().abort(request_id, self.handoff_now_ns))

    def _reset_pending_kv_imports(self) -> None:
        """Drain and release pending handoff transfers before an engine reset.

        Refuses (``ResetRefusedError``, nothing changed) while a transfer may still touch
        cache storage and while prefill blocks are pinned (a decode's one-sided read may
        still be landing in them: they end with RELEASE_KV or lease expiry). Otherwise
        queued handoffs are cancelled (their futures too) and every import is released.
        """
        if not self._ledger_driven():
            self._reset_reference_imports()
            return
        if self._pin_ledger is not None and self._pin_ledger.num_pinned:
            raise ResetRefusedError(
                f"cannot reset while KV handoff blocks remain pinned for requests "
                f"{self._pin_ledger.pinned_request_ids()}: a decode may still be reading them; "
                "wait for RELEASE_KV or lease expiry",
                "request_id",
            )
        if self._import_ledger is not None:
            deferred = set(self._import_ledger.deferred_ids())
            cancelled = [
                self._decode_requests[rid].future
                for rid in deferred
                if rid in self._decode_requests
            ]
            actions = self._import_ledger.reset(self.handoff_now_ns)
            for future in cancelled:
                if future is not None and not future.done():
                    future.cancel()
            self._apply_import_actions(actions)

    # -- reference-design engine: decode side ----------------------------------------------------
    def _add_reference_request_with_kv_handoff(
        self,
        request_id: int,
        prompt: list[int],
        sampling_params: Any,
        kv_meta: dict[str, Any],
        src_block_ids: list[int],
    ) -> asyncio.Future[Any]:
        ref = self._ref()
        ctx = ref.context
        if not ctx.kv_block_allocator.enable_prefix_caching:
            raise HandoffStateError(
                "add_request_with_kv_handoff needs prefix caching on the decode engine "
                "(enable_prefix_caching=False)",
                "enable_prefix_caching",
            )
        ssm_meta = kv_meta.get("ssm") if isinstance(kv_meta, dict) else None
        has_ssm = bool(self._ssm_transfer_agents)
        if ctx.is_hybrid_model and not has_ssm:
            raise HandoffStateError(
                f"request {request_id}: a hybrid decode received a handoff before SSM transfer "
                "setup",
                "setup_kv_transfer",
            )
        if has_ssm:
            if not isinstance(ssm_meta, dict):
                raise HandoffMetadataError(
                    f"request {request_id}: a hybrid decode needs the ticket's 'ssm' mapping, "
                    f"got {type(ssm_meta).__name__}",
                    "ssm",
                )
            missing = [k for k in _SSM_STATE_KINDS if k not in ssm_meta]
            if missing:
                raise HandoffMetadataError(
                    f"request {request_id}: SSM metadata lacks state kinds {missing}", "ssm"
                )
        elif ssm_meta is not None:
            raise HandoffMetadataError(
                f"request {request_id}: an attention-only decode received SSM metadata from a "
                "hybrid prefill",
                "ssm",
            )
        if self._kv_transfer_agent is None:
            raise HandoffStateError(
                f"request {request_id}: no transfer backend (setup_kv_transfer has not run)",
                "setup_kv_transfer",
            )
        resume = [int(t) for t in kv_meta.get("resume_tokens", [])]
        want = int(ctx.num_speculative_tokens) + 1
        if len(resume) != want:
            raise HandoffMetadataError(
                f"request {request_id}: {len(resume)} resume tokens but a decode-only handoff "
                f"needs num_speculative_tokens+1={want}",
                "resume_tokens",
            )
        if (
            getattr(sampling_params, "return_log_probs", False)
            or (getattr(sampling_params, "top_n_logprobs", 0) or 0) > 0
        ):
            raise HandoffMetadataError(
                f"request {request_id}: a decode-only handoff carries no log probabilities "
                "(return_log_probs / top_n_logprobs)",
                "return_log_probs",
            )
        bs = int(ctx.block_size_tokens)
        num_blocks = transfer_block_count(kv_meta, src_block_ids)
        if num_blocks != -(-len(prompt) // bs):
            raise HandoffMetadataError(
                f"request {request_id}: {num_blocks} source blocks but {len(prompt)} prompt "
                f"tokens at block_size={bs} need {-(-len(prompt) // bs)} (partial tail included)",
                "src_block_ids",
            )
        hashes = compute_block_hashes_batched(torch.tensor(prompt, dtype=torch.int64), bs)
        handoff = DeferredKvHandoff(
            request_id=request_id,
            prompt=list(prompt),
            sampling_params=sampling_params,
            kv_meta=kv_meta,
            src_block_ids=list(src_block_ids),
            hashes=hashes,
            num_blocks=num_blocks,
            future=ref._loop.create_future(),
        )
        # FIFO under backpressure: two-sided receives must match the sender's order, and a
        # stream of small handoffs must not starve an older large one.
        if self._deferred_kv_handoffs or not self._try_start_kv_handoff_import(handoff):
            self._deferred_kv_handoffs.append(handoff)
        return handoff.future

    def _start_reference_import(self, handoff: DeferredKvHandoff) -> bool:
        """Reserve blocks (and a live SSM slot) and post the import, or change nothing."""
        ref = self._ref()
        ctx = ref.context
        allocator = ctx.kv_block_allocator
        cached = (
            []
            if getattr(self._kv_transfer_agent, "is_push", False)
            else self._find_cached_handoff_prefix(handoff.hashes, handoff.num_blocks)
        )
        meta = handoff.kv_meta if isinstance(handoff.kv_meta, dict) else {}
        resume = [int(t) for t in meta.get("resume_tokens", [])]
        ssm_meta: dict[str, Any] | None = meta.get("ssm")
        n_import = handoff.num_blocks - len(cached)
        n_more = (
            additional_decode_blocks(len(handoff.prompt), len(resume), int(ctx.block_size_tokens))
            if resume
            else 0
        )
        if not self._handoff_capacity_available(n_import + n_more, cached):
            return False
        if ssm_meta and ctx.mamba_metadata.mamba_state_free_slot_count < 1:
            return False
        allocator.retain_memory_blocks(cached)
        got = allocator.allocate_memory_blocks(n_import + n_more)
        if got is None:
            if cached:
                allocator.release_memory_blocks(torch.tensor(cached, dtype=torch.int32))
            raise HandoffStateError(
                f"request {handoff.request_id}: allocator capacity changed between the check "
                f"and the allocation of {n_import + n_more} blocks",
                "kv_block_allocator",
            )
        fresh = [int(b) for b in got.tolist()]
        local = cached + fresh[:n_import]
        owned = torch.tensor(local + fresh[n_import:], dtype=torch.int32)
        ssm_import = None
        if ssm_meta:
            try:
                ssm_import = self._reserve_ssm_handoff_import()
            except Exception:
                allocator.release_memory_blocks(owned)
                raise
        handle = None
        error: BaseException | None = None
        try:
            meta_left, src_left = drop_transfer_prefix_blocks(
                handoff.kv_meta, handoff.src_block_ids, len(cached)
            )
            handle = self._kv_transfer_agent.begin_pull_blocks(
                meta_left, src_left, fresh[:n_import]
            )
            if ssm_import is not None and ssm_meta is not None:
                self._start_ssm_handoff_import(handoff.request_id, ssm_meta, ssm_import)
        except Exception as e:  # this rank's failure: reported to the quorum like any other
            error = e
        self._pending_kv_imports.append(
            PendingKvImport(
                request_id=handoff.request_id,
                prompt=handoff.prompt,
                sampling_params=handoff.sampling_params,
                local_blocks=local,
                hashes=handoff.hashes,
                cached_prefix_block_count=len(cached),
                handle=handle,
                future=handoff.future,
                ssm=ssm_import,
                resume_tokens=resume,
                continuation_blocks=fresh[n_import:],
                local_error=error,
                destinations_safe=error is None
                or bool(getattr(error, "transfer_destinations_safe", True)),
            )
        )
        loop = ref._loop
        loop.call_soon_threadsafe(loop.create_task, ref._notify_cond_for_new_request())
        return True

    def _finalize_reference_import(self, pending: PendingKvImport) -> None:
        ref = self._ref()
        ctx = ref.context
        start = pending.cached_prefix_block_count
        end = min(len(pending.local_blocks), len(pending.hashes))
        if end > start:
            # The imported suffix extends the reused prefix: keep each block's parent link.
            ctx.kv_block_allocator.register_kv_block_hashes(
                pending.local_blocks[start:end],
                pending.hashes[start:end],
                parent_hashes=([0, *pending.hashes])[start:end],
            )
        request_future = ref.add_request(
            pending.request_id,
            pending.prompt,
            pending.sampling_params,
            precomputed_block_hashes=pending.hashes[:end] if end > 0 else None,
        )
        request = ref.get_request(pending.request_id)
        if getattr(request.status, "name", None) == "FAILED":
            # add_request reported a validation failure through its own future.
            self._release_pending_kv_import(pending)
        else:
            head = ref.waiting_request_ids[0]
            if head != pending.request_id:
                raise HandoffStateError(
                    f"admission expected request {pending.request_id} at the waiting queue head, "
                    f"found {head}",
                    "waiting_request_ids",
                )
            ref.waiting_request_ids.popleft()
            self._validate_decode_ready_handoff(pending)
            first = pending.resume_tokens[0]
            params = request.sampling_params
            if params.num_tokens_to_generate > 0:
                request.generated_tokens.append(first)
                if ref.track_generated_token_events:
                    request.add_event_generated_token(first)
                added = getattr(request, "event_add_engine", None)
                if added is not None:
                    request.ttft = time.time() - added.timestamp
                stop_hit = False
                if request.stop_word_ids:
                    stop_hit, _ = ref._check_stop_words_for_request_post_append(request)
                if first == params.termination_id or stop_hit:
                    params.num_tokens_to_generate = len(request.generated_tokens)
            request.num_cached_tokens = len(pending.prompt)
            if len(request.generated_tokens) >= params.num_tokens_to_generate:
                self._release_pending_kv_import(pending)
                self._complete_handoff_request_without_forward(pending.request_id)
            else:
                admit_prefilled_decode(
                    ctx,
                    request,
                    pending.local_blocks,
                    pending.continuation_blocks,
                    pending.resume_tokens,
                    ssm_state_idx=None if pending.ssm is None else pending.ssm.live_slot,
                )
                pending.ssm = None
                pending.local_blocks = []
                pending.continuation_blocks = []
                if ref.use_coordinator and ref.is_mp_coordinator:
                    ref._try_send_streaming_partials()

        def relay(src: asyncio.Future[Any]) -> None:
            """Forward the request's completion to the handoff future."""
            dst = pending.future
            if dst is None or dst.done():
                return
            if src.cancelled():
                dst.cancel()
            elif src.exception() is not None:
                dst.set_exception(cast(BaseException, src.exception()))
            else:
                dst.set_result(src.result())

        request_future.add_done_callback(relay)

    def _complete_reference_request_without_forward(self, request_id: int) -> None:
        ref = self._ref()
        entry = ref.requests.pop(request_id)
        request = entry.record[-1]
        request.generated_length = len(request.generated_tokens)
        request.status = type(request.status)["COMPLETED"]
        request.add_event_finish()
        ref.finished_request_count += 1
        if ref.use_coordinator and ref.is_mp_coordinator:
            ref._send_request_records_to_coordinator([entry.record])
            ref._partial_emit_lengths.pop(request_id, None)
        elif not ref.use_coordinator:
            controller = ref.controller
            if request.prompt is None:
                request.prompt = controller.detokenize(
                    controller.tokenizer, request.prompt_tokens.tolist(), remove_EOD=False
                )
            request.generated_text = controller.detokenize(
                controller.tokenizer,
                request.generated_tokens,
                remove_EOD=not request.sampling_params.detokenize_stop_sequence,
            )
        entry.future.set_result(entry.record)

    def _release_reference_import(self, pending: PendingKvImport) -> None:
        ctx = self._ref().context
        owned = pending.local_blocks + pending.continuation_blocks
        if owned:
            ctx.kv_block_allocator.release_memory_blocks(torch.tensor(owned, dtype=torch.int32))
        pending.local_blocks = []
        pending.continuation_blocks = []
        if pending.ssm is not None:
            ctx.mamba_metadata.free_slot(pending.ssm.live_slot)
            pending.ssm = None

    def _report_reference_imports(self) -> None:
        tracker = self._handoff_completion_tracker
        for pending in self._pending_kv_imports:
            if pending.terminal_state_reported:
                continue
            failed = pending.local_error is not None
            if not failed:
                try:
                    if not all(h.poll() for h in self._pending_transfer_handles(pending)):
                        continue
                except Exception as e:  # a terminal transfer error of this rank
                    pending.local_error = e
                    failed = True
            if tracker is None or tracker.world_size == 1:
                mp = get_pg_size(self._ref().pg_collection.mp)
                if mp != 1:
                    raise HandoffStateError(
                        f"model-parallel size {mp} needs a completion tracker "
                        "(_setup_handoff_completion_tracking)",
                        "_handoff_completion_tracker",
                    )
                self._handoff_completion_notifications[pending.request_id] = failed
            else:
                tracker.report(pending.request_id, failed)
            pending.terminal_state_reported = True

    def _admit_reference_imports(self) -> int:
        ref = self._ref()
        decided = self._handoff_completion_notifications
        admitted = 0
        remaining: deque[PendingKvImport] = deque()
        queue = self._pending_kv_imports
        while queue:
            pending = queue.popleft()
            failed = decided.get(pending.request_id)
            if failed is None:
                remaining.append(pending)
                continue
            try:
                if failed:
                    raise pending.local_error or TransferError(
                        f"KV import of request {pending.request_id} failed on a model-parallel "
                        "peer",
                        "request_id",
                    )
                self._validate_decode_ready_handoff(pending)
                if not can_admit_prefilled_decode(ref.context, len(pending.resume_tokens)):
                    remaining.append(pending)
                    continue
                decided.pop(pending.request_id)
                self._finalize_kv_handoff_import(pending)
                admitted += 1
            except Exception as exc:
                decided.pop(pending.request_id, None)
                # A peer may fail before posting its half of a two-sided transfer: never wait
                # on this rank's unmatched operation; quarantine unless it is already terminal.
                safe = (
                    pending.destinations_safe
                    and pending.terminal_state_reported
                    and self._wait_for_transfer_handles(*self._pending_transfer_handles(pending))
                )
                if safe:
                    self._release_pending_kv_import(pending)
                else:
                    self._quarantined_kv_imports.append(pending)
                    logger.error(
                        "request %d: storage quarantined after an incomplete handoff",
                        pending.request_id,
                    )
                if pending.future is not None and not pending.future.done():
                    pending.future.set_exception(exc)
                if failed:
                    continue
                remaining.extend(queue)
                self._pending_kv_imports = remaining
                raise
        self._pending_kv_imports = remaining
        if admitted:
            loop = ref._loop
            loop.call_soon_threadsafe(loop.create_task, ref._notify_cond_for_new_request())
        return admitted

    def _reset_reference_imports(self) -> None:
        """All or nothing: refuse while blocks are pinned or a transfer may still touch cache
        storage; otherwise cancel queued handoffs and release every import."""
        if self._pinned_handoff_blocks:
            raise ResetRefusedError(
                f"cannot reset while KV handoff blocks remain pinned for requests "
                f"{sorted(self._pinned_handoff_blocks)}: a decode may still be reading them; "
                "wait for RELEASE_KV",
                "request_id",
            )
        busy_pushes = [
            rid for rid, hs in self._pending_kv_pushes if not self._wait_for_transfer_handles(*hs)
        ]
        imports = list(self._pending_kv_imports) + list(self._quarantined_kv_imports)
        busy = [
            p.request_id
            for p in imports
            if not (
                p.destinations_safe
                and self._wait_for_transfer_handles(*self._pending_transfer_handles(p))
            )
        ]
        if busy_pushes or busy:
            raise ResetRefusedError(
                "cannot reset while KV handoff transfers may still access cache storage: "
                f"pushes of requests {busy_pushes}, imports of requests {busy}",
                "request_id",
            )
        self._pending_kv_pushes = []
        while self._deferred_kv_handoffs:
            handoff = self._deferred_kv_handoffs.popleft()
            if not handoff.future.done():
                handoff.future.cancel()
        for pending in imports:
            self._release_pending_kv_import(pending)
            if pending.future is not None and not pending.future.done():
                pending.future.cancel()
        self._pending_kv_imports = deque()
        self._quarantined_kv_imports = []
        self._handoff_completion_notifications.clear()
