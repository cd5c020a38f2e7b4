"""Engine-side lifecycle of a disaggregated KV/SSM state handoff (the reference design's
``inference_state_handoff`` module), composed into an engine as a mixin.

The mixin composes three parts: :mod:`~disagg_rs.handoff.decode` (importing a handed-off
request), :mod:`~disagg_rs.handoff.prefill` (exporting one) and
:mod:`~disagg_rs.handoff.compat` (the reference design's engines and helpers).

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

from collections.abc import Mapping
from typing import Any

from disagg_rs._core import (
    ImportLedger,
    PinLedger,
    check_reference,
    handoff_peer_plan,
    refuse_close_in_flight,
)
from disagg_rs.exceptions import DisaggError
from disagg_rs.handoff.base import (
    _KV_AXES,
    HandoffBase,
    HandoffPath,
    RankImport,
)
from disagg_rs.handoff.compat import ReferenceDesignCompat
from disagg_rs.handoff.decode import DecodeHandoff
from disagg_rs.handoff.prefill import PrefillHandoff, _PinnedBlocksView
from disagg_rs.transfer_backends import construct_kv_transfer_backend_class
from disagg_rs.transfer_backends.base import reference_layout_fields


class InferenceStateHandoffMixin(DecodeHandoff, PrefillHandoff, ReferenceDesignCompat):
    """Optional KV/SSM handoff behaviour composed into an engine (see the module docstring)."""

    def _setup_handoff_completion_tracking(self, hostname: str | None = None) -> None:
        """Create the CPU path used to aggregate model-parallel transfer completion.

        A ledger-driven engine shares completion through its ``handoff_all_gather``; a
        reference-design engine gets a :class:`HandoffCompletionTracker` over its
        model-parallel group (ZeroMQ from each rank to the group's first rank).
        """
        self._path.setup_tracking(hostname)

    def _setup_ledger_completion_tracking(self, hostname: str | None) -> None:
        del hostname
        self._completion_notifications = []

    def _drain_handoff_completion_notifications(self) -> list[tuple[int, bool]]:
        """Collect decisions that the engine's model-parallel schedule broadcast distributes:
        ``(request_id, failed)`` decided since the last drain."""
        return self._path.drain_outcomes()

    def _drain_ledger_outcomes(self) -> list[tuple[int, bool]]:
        out, self._completion_notifications = self._completion_notifications, []
        self._failure_reasons, self._new_failure_reasons = self._new_failure_reasons, {}
        return out

    def pop_handoff_failure_reason(self, request_id: int) -> str | None:
        """Why the import of ``request_id`` failed, for a failure returned by the latest
        ``_drain_handoff_completion_notifications`` (None otherwise)."""
        return self._failure_reasons.pop(request_id, None)

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
        check_reference("role", {"role": role})  # HandoffStateError naming the role
        if role == "prefill":
            return PinLedger(num_blocks, block_size_tokens, num_ssm_slots)
        return ImportLedger(
            num_blocks,
            block_size_tokens,
            num_ssm_slots,
            world_size=world_size,
            rank=rank,
            pull=pull,
            lookahead_tokens=num_speculative_tokens,
        )

    def attach_handoff_ledger(self, ledger: ImportLedger | PinLedger) -> None:
        """Use ``ledger`` (made by :meth:`make_handoff_ledger`) for this engine's handoffs.

        A decode ledger must reserve the engine's speculative lookahead with every import:
        its ``lookahead_tokens`` must equal the engine's ``num_speculative_tokens``.
        """
        if isinstance(ledger, ImportLedger):
            facts = {
                "lookahead_tokens": ledger.lookahead_tokens,
                "num_speculative_tokens": int(self._host().num_speculative_tokens),
            }
            check_reference("lookahead", facts)  # HandoffStateError naming both values
            self._import_ledger = ledger
        else:
            self._pin_ledger = ledger
            self._pinned_handoff_blocks = _PinnedBlocksView(ledger)
        self._path = self._ledger_path()

    def _ledger_path(self) -> HandoffPath:
        """The steps of an engine driven by the Rust ledgers (see :class:`HandoffPath`)."""
        return HandoffPath(
            ledger=True,
            setup_transfer=self._setup_ledger_kv_transfer,
            setup_tracking=self._setup_ledger_completion_tracking,
            drain_outcomes=self._drain_ledger_outcomes,
            record_outcome=self._record_ledger_outcome,
            pending_imports=self._ledger_pending_imports,
            has_admittable=self._ledger_has_admittable,
            pending_pushes=self._ledger_pending_pushes,
            num_quarantined=self._ledger_num_quarantined,
            num_waiting=self._ledger_num_waiting,
            add_request=self._submit_ledger_import,
            try_start=self._start_ledger_imports,
            find_cached_prefix=self._ledger_cached_prefix,
            capacity_available=self._ledger_capacity_available,
            drain_deferred=self._drain_ledger_deferred,
            report_completed=self._report_ledger_imports,
            poll_imports=self._poll_ledger_imports,
            admit=self._admit_ledger_imports,
            finalize=self._finalize_ledger_import,
            complete_without_forward=self._complete_ledger_request_without_forward,
            release_import=self._release_ledger_import,
            reset_imports=self._reset_ledger_imports,
            prepare_metadata=self._prepare_ledger_handoff_metadata,
            capture_meta=self._capture_ledger_handoff_meta,
            release_handoff_blocks=self._release_ledger_handoff_blocks,
            release_pinned_blocks=len,
            push_kv=self._push_ledger_handoff_kv,
            poll_pushes=self._poll_ledger_pushes,
        )

    @property
    def pending_kv_import_count(self) -> int:
        """Number of decode requests waiting for capacity or transfer completion."""
        return self._path.pending_imports()

    def _ledger_pending_imports(self) -> int:
        return 0 if self._import_ledger is None else self._import_ledger.pending_kv_import_count

    @property
    def has_admittable_kv_import(self) -> bool:
        """Whether a completed import can be handled at the next admission point."""
        return self._path.has_admittable()

    def _ledger_has_admittable(self) -> bool:
        return self._import_ledger is not None and self._import_ledger.has_admittable_kv_import

    @property
    def pending_kv_push_count(self) -> int:
        """Number of prefill sends waiting for transport completion."""
        return self._path.pending_pushes()

    def _ledger_pending_pushes(self) -> int:
        return len(self._pending_pushes) + len(self._filler_pushes)

    @property
    def num_quarantined_kv_imports(self) -> int:
        """Failed imports whose destinations may still be written."""
        return self._path.num_quarantined()

    def _ledger_num_quarantined(self) -> int:
        return 0 if self._import_ledger is None else self._import_ledger.num_quarantined

    def _ledger_num_waiting(self) -> int:
        return int(self._host().num_waiting)

    def schedule_waiting_requests(self) -> None:
        """The engine's scheduling point: a decode engine first admits completed imports, and
        refuses (``HandoffStateError``) only when prompts are actually waiting, since a
        dedicated decode engine never runs prompts; then the engine's own scheduler runs
        (``super().schedule_waiting_requests()``, when the engine has one)."""
        if self.handoff_role == "decode":
            self._admit_pending_kv_imports()
            waiting = self._path.num_waiting()
            check_reference("no_waiting", {"waiting": waiting})  # HandoffStateError
        parent = getattr(super(), "schedule_waiting_requests", None)
        if parent is not None:
            parent()

    def setup_kv_transfer(self, role: str, backend: str = "nixl", **backend_kwargs: Any) -> None:
        """Bring up the KV transfer agents for this engine.

        Must be called collectively by every model-parallel rank: each rank registers its own
        buffers and the static metadata of all ranks is gathered (``handoff_static_meta`` on a
        ledger-driven engine; the per-stage peer metadata on a reference-design engine).
        ``role`` is ``"prefill"`` or ``"decode"``; ``backend`` a registered transport
        (``"nixl"``; ``"nccl"`` selects the two-sided push family).
        """
        check_reference("role", {"role": role})  # HandoffStateError naming the role
        self._path.setup_transfer(role, backend, **backend_kwargs)

    def _setup_ledger_kv_transfer(self, role: str, backend: str, **backend_kwargs: Any) -> None:
        engine = self._host()
        cls = construct_kv_transfer_backend_class(backend)
        kv_layout = engine.kv_layout
        common = dict(backend_kwargs)
        agent = f"{role}-{kv_layout.global_rank if kv_layout is not None else 'x'}"
        self._kv_transfer_role = role
        self._backend_name = backend
        if kv_layout is not None:
            self._kv_backend = cls(
                agent,
                engine.kv_cache,
                engine.block_pool.num_blocks,
                heads_per_partition=kv_layout.heads_per_partition,
                head_dim=engine.model.head_dim,
                tokens_per_block=engine.block_size_tokens,
                axes=_KV_AXES[engine.kv_cache_layout],
                **reference_layout_fields(kv_layout),
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
        # Every rank states each kind; "kv" is None on a rank without a KV cache.
        local = {"kv": None, **{k: b.export_meta() for k, b in self._transfer_backends().items()}}
        ranks = engine.handoff_all_gather(local)
        self._static_meta = {
            "backend": backend,
            "role": role,
            "block_size_tokens": engine.block_size_tokens,
            "ranks": ranks,
        }
        self._event(("setup", -1, f"{backend} {role} ranks={len(ranks)}"))

    # -- the public serving surface (what a driver calls each turn) ---------------------------
    # The reference design names these steps with a leading underscore; the public names
    # below call those same methods (one implementation, overridable under either name).

    def init_handoff_state(self) -> None:
        """Initialize the handoff state (an engine's ``__init__`` calls it once, before
        :meth:`setup_kv_transfer`)."""
        self._initialize_disaggregation_state()

    def poll_kv_imports(self) -> int:
        """Decode, once per turn: start queued imports that now fit and report transfers that
        became terminal; returns how many imports are ready to admit."""
        return self._poll_pending_kv_imports()

    def admit_kv_imports(self) -> int:
        """Decode, at an admission point: admit the imports that are ready; returns how many
        were admitted."""
        return self._admit_pending_kv_imports()

    def drain_handoff_outcomes(self) -> list[tuple[int, bool]]:
        """Decode: ``(request_id, failed)`` of every import decided since the last drain
        (:meth:`pop_handoff_failure_reason` then says why one failed)."""
        return self._drain_handoff_completion_notifications()

    def poll_kv_pushes(self) -> int:
        """Prefill, once per turn: settle finished pushes (two-sided transports) and advance
        streamed staging (a one-sided backend's ``poll_streams``); returns how many pushes
        ended."""
        return self._poll_pending_kv_pushes()

    def capture_handoff_ticket(
        self, request: Any, decode_metas: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Prefill: pin a finished prefill's blocks and SSM slot and return its handoff ticket
        (``decode_metas``: the decode's rank metadata, when known, to stage for it)."""
        return self._capture_handoff_meta(request, None, decode_metas)

    def reset_kv_imports(self) -> None:
        """Decode, before an engine reset: cancel queued imports and release every import
        (``ResetRefusedError``, nothing changed, while a transfer may still write)."""
        self._reset_pending_kv_imports()

    @property
    def import_ledger(self) -> ImportLedger:
        """The decode's :class:`~disagg_rs.ImportLedger` (``HandoffStateError`` without one)."""
        return self._ledger()

    @property
    def pin_ledger(self) -> PinLedger:
        """The prefill's :class:`~disagg_rs.PinLedger` (``HandoffStateError`` without one)."""
        return self._pins()

    def check_handoff_ledgers(self) -> None:
        """Check the attached ledgers' conservation invariants (``ConservationError``)."""
        for ledger in (self._import_ledger, self._pin_ledger):
            if ledger is not None:
                ledger.check()

    @property
    def num_pinned_handoffs(self) -> int:
        """Requests whose blocks a prefill holds for a decode (0 without a pin ledger)."""
        return 0 if self._pin_ledger is None else int(self._pin_ledger.num_pinned)

    @property
    def quarantined_kv_import_ids(self) -> set[int]:
        """Requests whose failed import is quarantined (its destinations may still be
        written)."""
        return {rid for rid, _ in self._quarantined}

    @property
    def num_decode_requests(self) -> int:
        """Handed-off requests this decode tracks (submitted, not yet admitted or failed)."""
        return len(self._decode_requests)

    @property
    def handoff_two_sided(self) -> bool:
        """Whether the transport is two-sided (the prefill pushes once the decode posted its
        receives: :meth:`kv_import_destination`)."""
        return self._is_push

    #: The KV transfer backend (``None`` before :meth:`setup_kv_transfer`); settable, e.g. to
    #: wrap it for fault injection.
    kv_transfer_backend = HandoffBase._kv_backend
    #: The SSM transfer backends by state kind (``conv``, ``recurrent``); the dict itself, so
    #: an entry may be replaced.
    ssm_transfer_backends = HandoffBase._ssm_backends

    def pending_kv_import(self, request_id: int) -> RankImport | None:
        """This rank's record of a started, unsettled import (its transfer handles, a local
        start failure), or None."""
        return self._pending_imports.get(request_id)

    def wait_for_kv_import_transfers(self, request_id: int) -> bool:
        """Block until every transfer of a started import is terminal (each within its own
        deadline); returns whether all are (True also when none is pending)."""
        pending = self._pending_imports.get(request_id)
        handles = [] if pending is None else pending.handles
        return self._wait_for_transfer_handles(*handles)

    @staticmethod
    def rank_import_outcome(pending: RankImport) -> str | None:
        """One rank's terminal outcome of an import (``"ok"``, ``"error"``, ...), or None
        while a transfer may still write."""
        return DecodeHandoff._local_outcome(pending)

    def register_handoff_peers(self, peers: Mapping[str, Any]) -> dict[str, str]:
        """Parse and check the transfer metadata of peer engines now, once per incarnation,
        so that handoffs naming them only look them up (the driver calls it when the
        control plane announces its peers: REGISTER, PEERS).

        ``peers``: the control plane's peer table, ``{engine_id: {"role", "incarnation",
        "meta"}}`` with ``meta`` an engine's ``handoff_static_meta`` (this engine's own
        entry included: a prefill plans its staged copies from its own ranks' metadata).
        Returns the engines whose metadata was refused, with the error (their handoffs fail
        when they start); the others are registered. A peer the table no longer names
        (declared lost) or names with another incarnation (restarted) is forgotten by the
        transports: a read waiting for it fails at once, quietly.
        """
        backends = self._transfer_backends()
        # Each engine's ranks' metadata of each state this rank moves, read in Rust (a table
        # entry that cannot be read refuses its engine).
        # With this engine's own ranks under "" (a prefill plans its staged copies from them):
        # every handoff after this finds each dict by identity, none by content.
        own = {"": {"meta": self.handoff_static_meta}}
        plan, refused = handoff_peer_plan({**peers, **own}, list(backends))
        registered: list[Any] = []
        for engine_id, kind, named in plan:
            try:
                backends[kind].register_peers(named)
                registered += named
            except (DisaggError, KeyError, TypeError, AttributeError) as err:
                refused.setdefault(engine_id, f"{type(err).__name__}: {err}")
        for backend in backends.values():
            backend.retain_peers(registered)
        return refused

    def close_kv_transfer(self) -> None:
        """Deregister every buffer (idempotent).

        Refuses with ``ResetRefusedError`` (nothing changed) while an import or push may still
        touch the registered memory: deregistering under a live transfer would let it write
        freed memory or fail in the transport instead of in the ledger.
        """
        refuse_close_in_flight(
            [(rid, all(map(self._quiet, p.handles))) for rid, p in self._pending_imports.items()],
            [(rid, all(map(self._quiet, p.handles))) for (rid, _), p in self._quarantined.items()],
            list(self._pending_pushes),
            [rid for rid, _ in self._filler_pushes],
        )
        for backend in filter(None, [*self._ssm_backends.values(), self._kv_backend]):
            backend.close()
        self._ssm_backends = {}
        self._kv_backend = None
