"""State and helpers shared by the decode side, the prefill side and the reference-design
compatibility layer of :class:`~disagg_rs.handoff.mixin.InferenceStateHandoffMixin`."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from disagg_rs._core import MAX_TWO_SIDED_REQUEST_ID as _MAX_TWO_SIDED_REQUEST_ID
from disagg_rs._core import (
    ImportLedger,
    PinLedger,
    ReferenceImports,
    two_sided_tag,
)
from disagg_rs.exceptions import (
    HandoffStateError,
    TransferError,
    TransferTimeout,
)
from disagg_rs.handoff_completion_tracker import HandoffCompletionTracker
from disagg_rs.integrity import (
    IntegrityMismatch,
    IntegrityPiece,
    IntegrityTable,
    conv_pieces,
    kv_pieces,
    recurrent_pieces,
)
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport

if TYPE_CHECKING:
    from disagg_rs.engine_protocol import HandoffHost, ReferenceDesignEngine
    from disagg_rs.handoff.mixin import InferenceStateHandoffMixin

logger = logging.getLogger("disagg_rs.handoff")

_SSM_STATE_KINDS = ("conv", "recurrent")

_T = TypeVar("_T")


class _NoMetrics:
    """What the mixin records into while no ``handoff_metrics`` is set: nothing."""

    def posted(self, seconds: float) -> None:
        del seconds

    def transfer_done(self, moved: int, descriptors: int, seconds: float) -> None:
        del moved, descriptors, seconds

    def failed(self, reason: str) -> None:
        del reason

    def queue_depths(self, depths: dict[str, int]) -> None:
        del depths


_NO_METRICS = _NoMetrics()


def _of_kind(ranks: Any, kind: str) -> list[Any]:
    """Each rank's metadata of one state kind (``kv``, ``conv``, ``recurrent``), skipping
    ranks without it."""
    return [r[kind] for r in ranks if r.get(kind) is not None]


#: Default deadline of one import (submit to admission) and lease of one prefill pin.
DEFAULT_IMPORT_TIMEOUT_NS = 60_000_000_000
DEFAULT_LEASE_NS = 120_000_000_000
#: Share of the prefill's lease (ticket ``lease_ns``) a decode import may use, submit to
#: admission, by the decode's clock; the rest covers the ticket's transit from the prefill.
LEASE_READ_FRACTION = ImportLedger.LEASE_READ_PERCENT / 100

_KV_AXES = {
    "megatron": "kv layer block token head dim",
    "nhd": "kv block token head dim",
    "hnd": "kv block head token dim",
}


#: Request ids a two-sided transport can tag (its message tags are 31-bit). The tag of each
#: request's state kind is derived, injectively, by the library's core; an id outside
#: ``[0, MAX_TWO_SIDED_REQUEST_ID]`` is refused with ``ArgumentError``.
MAX_TWO_SIDED_REQUEST_ID = _MAX_TWO_SIDED_REQUEST_ID
_tag = two_sided_tag


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


#: The arguments of one ``add_request_with_kv_handoff`` call, in its order: ``request_id``,
#: ``prompt``, ``sampling_params``, ``kv_meta``, ``src_block_ids``.
KvHandoffRequest = tuple[int, list[int], Any, dict[str, Any], list[int]]


@dataclass(frozen=True)
class HandoffPath:
    """How this engine carries out each step the two engine kinds do differently, chosen once:
    the reference design's records over the engine's own allocator (bound by
    ``_initialize_disaggregation_state``) or the Rust ledgers (bound by
    ``attach_handoff_ledger``). The shared entry points of the mixin call through it."""

    ledger: bool
    setup_transfer: Callable[..., None]
    setup_tracking: Callable[[str | None], None]
    drain_outcomes: Callable[[], list[tuple[int, bool]]]
    record_outcome: Callable[[int, bool], None]
    pending_imports: Callable[[], int]
    has_admittable: Callable[[], bool]
    pending_pushes: Callable[[], int]
    num_quarantined: Callable[[], int]
    num_waiting: Callable[[], int]
    add_request: Callable[[KvHandoffRequest], asyncio.Future[Any] | None]
    try_start: Callable[[Any], bool]  # a reference-design engine starts the given handoff
    find_cached_prefix: Callable[[list[int], int], list[int]]
    capacity_available: Callable[[int, list[int]], bool]
    drain_deferred: Callable[[], int]
    report_completed: Callable[[], None]
    poll_imports: Callable[[], int]
    admit: Callable[[], int]
    finalize: Callable[[Any], None]
    complete_without_forward: Callable[[int], None]
    release_import: Callable[[Any], None]
    reset_imports: Callable[[], None]
    prepare_metadata: Callable[..., dict[int, _PreparedHandoffMetadata]]
    capture_meta: Callable[..., dict[str, Any]]
    release_handoff_blocks: Callable[[int], None]
    release_pinned_blocks: Callable[[list[int]], int]
    push_kv: Callable[[int, list[Any]], None]
    poll_pushes: Callable[[], int]


class HandoffBase:
    """The handoff state every part of the mixin reads (see the module docstring)."""

    # -- state --------------------------------------------------------------------------------
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
        self._reference_imports = ReferenceImports()
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
        #: Fillers in flight (two-sided): request id -> their send handles.
        self._filler_pushes: list[tuple[int, list[Any]]] = []
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
            "imports_deferred": 0,
            "imports_admitted": 0,
            "imports_failed": 0,
            "integrity_failures": 0,
            "integrity_ns": 0,
            "imports_completed_without_forward": 0,
            "bytes_pulled": 0,
            "descriptors": 0,
            "pushes": 0,
            "push_fillers": 0,
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
        # Until a ledger is attached, the reference design's records drive the handoffs.
        self._path = self._whole()._reference_path()

    def _host(self) -> HandoffHost:
        """This object as the disagg_rs engine protocol (every engine member used goes here)."""
        return cast("HandoffHost", self)

    def _whole(self) -> InferenceStateHandoffMixin:
        """This object as the composed mixin: one part (decode, prefill, compatibility layer)
        calls another's methods through it."""
        return cast("InferenceStateHandoffMixin", self)

    def _ref(self) -> ReferenceDesignEngine:
        """This object as the reference design's dynamic engine."""
        return cast("ReferenceDesignEngine", self)

    def _ledger_driven(self) -> bool:
        """Whether a Rust ledger drives this engine's handoffs (else: a reference-design
        engine with its own allocator)."""
        return self._path.ledger

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

    @property
    def _metrics(self) -> Any:
        """``handoff_metrics``, or a recorder of nothing while it is unset."""
        return self.handoff_metrics or _NO_METRICS

    def _transfer_backends(self) -> dict[str, Any]:
        """This engine's transfer backends by state kind (``kv`` first, then the SSM kinds)."""
        backends = {"kv": self._kv_backend, **self._ssm_backends}
        return {kind: b for kind, b in backends.items() if b is not None}

    def _update_queue_metrics(self) -> None:
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
        self._metrics.queue_depths(depths)

    def _record_handoff_completion_notification(self, request_id: int, failed: bool) -> None:
        """Record a shared admission decision (every model-parallel rank records the same)."""
        self._path.record_outcome(request_id, failed)

    def _record_ledger_outcome(self, request_id: int, failed: bool) -> None:
        self._completion_notifications.append((request_id, failed))

    @staticmethod
    def _required(value: _T | None, missing: str) -> _T:
        """``value``; ``HandoffStateError`` saying what is ``missing`` when it is None."""
        if value is None:
            raise HandoffStateError(missing)
        return value

    def _ledger(self) -> ImportLedger:
        missing = "this engine has no ImportLedger (not a decode engine)"
        return self._required(self._import_ledger, missing)

    def _pins(self) -> PinLedger:
        return self._required(
            self._pin_ledger, "this engine has no PinLedger (not a prefill engine)"
        )

    @property
    def handoff_static_meta(self) -> dict[str, Any]:
        """Static transfer metadata of every rank of this engine (published once)."""
        return self._required(self._static_meta, "setup_kv_transfer has not run")

    @property
    def _is_push(self) -> bool:
        return self._backend_name == "nccl"

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

    @staticmethod
    def _pending_transfer_handles(pending: PendingKvImport) -> list[Any]:
        """A reference-design import's KV and SSM transfer handles."""
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
        return all([HandoffBase._terminal(h, block) for h in handles if h is not None])

    @staticmethod
    def _terminal(handle: Any, block: bool) -> bool:
        """One handle of :meth:`_wait_for_transfer_handles`: waited for, or polled once."""
        try:
            if block:
                handle.wait()
                return True
            return bool(handle.poll())
        except TimeoutError:  # a wait that timed out may still be active; a poll's is over
            return not block
        except Exception:  # a terminal transfer error: nothing is moving any more
            return True

    @staticmethod
    def _quiet(handle: Any) -> bool:
        try:
            return bool(handle.poll())
        except (TransferError, TransferTimeout):
            return bool(getattr(handle, "done", True))
