"""Engine-side lifecycle of a disaggregated KV/SSM state handoff (the reference design's
``inference_state_handoff`` module), composed into an engine as a mixin.

The decisions live in the Rust ledgers: the decode side's :class:`~disagg_rs.ImportLedger`
(deferral, all-or-nothing reservation, quorum, admission, quarantine, deadlines) and the prefill
side's :class:`~disagg_rs.PinLedger` (pins until RELEASE_KV or lease expiry). This mixin only
carries their actions out: it posts transfers on the transport backends, polls the handles,
shares each rank's terminal outcome with the other model-parallel ranks, and admits requests at
the engine's admission points. Nothing here loops over blocks, tokens or descriptors.

The engine provides (docs/architecture.md §6, :mod:`disagg_rs.engine_protocol`): ``block_pool`` and
``ssm_slot_pool`` (the ledger's pools, so both account the same blocks), ``block_size_tokens``,
``num_speculative_tokens``, ``decode_batch`` (``can_admit``/``admit``), ``expect_import`` and
``complete_request_without_forward``, ``event_loop``, the state buffers (``kv_cache``,
``kv_cache_layout``, ``kv_layout``, ``ssm_layout``, ``ssm_conv_state``, ``ssm_recurrent_state``)
and ``handoff_all_gather(obj) -> list`` over its model-parallel ranks (identity for one rank).
Model-parallel ranks call every public method collectively, in the same order, with the same
arguments and the same ``now``, so their ledgers stay identical.

Time is an ``int`` of nanoseconds supplied by the driver (``now``), never read here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from disagg_rs._core import ImportLedger, LedgerAction, PinLedger
from disagg_rs.exceptions import (
    DisaggError,
    HandoffStateError,
    IntegrityError,
    MetadataError,
    ResetRefusedError,
    TransferError,
    TransferTimeout,
)
from disagg_rs.integrity import (
    IntegrityMismatch,
    IntegrityPiece,
    IntegrityTable,
    chunk_tokens_for,
    conv_pieces,
    kv_pieces,
    recurrent_pieces,
)
from disagg_rs.transfer_backends import construct_kv_transfer_backend_class

__all__ = ["InferenceStateHandoffMixin", "PendingKvImport", "_SSM_STATE_KINDS"]

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


def _tag(request_id: int, kind: str) -> int:
    """The two-sided message tag of one request's state kind (both sides compute it)."""
    return (request_id * 4 + _TAG_KIND[kind]) & 0x7FFFFFFF


@dataclass
class _PreparedHandoffMetadata:
    """Per-request metadata assembled once for a completed prefill batch."""

    local_blocks: list[int]
    local_ssm_slot: int | None
    kv_meta: Any
    ssm_meta: Any
    resume_tokens: list[int]


@dataclass
class PendingKvImport:
    """One started import on this rank: its transfer handles and what admission needs."""

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


class InferenceStateHandoffMixin:
    """Optional KV/SSM handoff behaviour composed into an engine (see the module docstring)."""

    # Attributes the composing engine provides (typed loosely: the protocol is structural).
    block_size_tokens: int
    handoff_role: str

    # -- state ----------------------------------------------------------------------------------
    def _initialize_disaggregation_state(self) -> None:
        """Initialize state without importing or constructing a transfer backend."""
        self._kv_backend: Any = None
        self._ssm_backends: dict[str, Any] = {}
        self._backend_name: str | None = None
        self._static_meta: dict[str, Any] | None = None
        self._import_ledger: ImportLedger | None = None
        self._pin_ledger: PinLedger | None = None
        self._pending_imports: dict[int, PendingKvImport] = {}
        self._quarantined: dict[tuple[int, int], PendingKvImport] = {}
        self._decode_requests: dict[int, _DecodeRequest] = {}
        self._pending_pushes: dict[int, tuple[int, list[Any]]] = {}
        self._pins_by_request: dict[int, tuple[list[int], int | None, int]] = {}
        self._staged_by_request: dict[int, list[dict[str, Any]]] = {}
        self._completion_notifications: list[tuple[int, bool]] = []
        self.handoff_now_ns = 0
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

    def _event(self, event: tuple[str, int, str]) -> None:
        """Record one lifecycle step and log it as a structured line."""
        self.handoff_events.append(event)
        kind, rid, detail = event
        logger.info(
            "handoff event=%s role=%s rank=%s request_id=%d %s",
            kind,
            getattr(self, "handoff_role", "?"),
            getattr(self, "handoff_mp_rank", 0),
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

        Completion is shared through the engine's ``handoff_all_gather`` (a gloo/NCCL
        all-gather over the model-parallel ranks); ``hostname`` is accepted, as in the reference.
        """
        del hostname
        self._completion_notifications = []

    def _drain_handoff_completion_notifications(self) -> list[tuple[int, bool]]:
        """Collect the (request_id, failed) decisions made since the last drain."""
        out, self._completion_notifications = self._completion_notifications, []
        self._failure_reasons, self._new_failure_reasons = self._new_failure_reasons, {}
        return out

    def pop_handoff_failure_reason(self, request_id: int) -> str | None:
        """Why the import of ``request_id`` failed, for a failure returned by the latest
        ``_drain_handoff_completion_notifications`` (None otherwise)."""
        return self._failure_reasons.pop(request_id, None)

    def _record_handoff_completion_notification(self, request_id: int, failed: bool) -> None:
        """Record a shared admission decision (every MP rank records the same ones)."""
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
    ) -> ImportLedger | PinLedger:
        """The ledger of ``role``; an engine builds its pools from ``ledger.block_pool`` and
        ``ledger.slot_pool`` so the ledger accounts exactly the blocks the engine uses."""
        if role == "decode":
            return ImportLedger(
                num_blocks,
                block_size_tokens,
                num_ssm_slots,
                world_size=world_size,
                rank=rank,
                pull=pull,
            )
        if role == "prefill":
            return PinLedger(num_blocks, block_size_tokens, num_ssm_slots)
        raise HandoffStateError(f"role={role!r} has no handoff ledger; use 'prefill' or 'decode'")

    def attach_handoff_ledger(self, ledger: ImportLedger | PinLedger) -> None:
        """Use ``ledger`` (made by :meth:`make_handoff_ledger`) for this engine's handoffs."""
        if isinstance(ledger, ImportLedger):
            self._import_ledger = ledger
        else:
            self._pin_ledger = ledger

    def _ledger(self) -> ImportLedger:
        if self._import_ledger is None:
            raise HandoffStateError("this engine has no ImportLedger (not a decode engine)")
        return self._import_ledger

    def _pins(self) -> PinLedger:
        if self._pin_ledger is None:
            raise HandoffStateError("this engine has no PinLedger (not a prefill engine)")
        return self._pin_ledger

    # -- counts (reference design names) ----------------------------------------------------------
    @property
    def pending_kv_import_count(self) -> int:
        """Number of decode requests waiting for capacity or transfer completion."""
        return 0 if self._import_ledger is None else self._import_ledger.pending_kv_import_count

    @property
    def has_admittable_kv_import(self) -> bool:
        """Whether a completed import can be handled at the next admission point."""
        return self._import_ledger is not None and self._import_ledger.has_admittable_kv_import

    @property
    def pending_kv_push_count(self) -> int:
        """Number of prefill sends waiting for transport completion."""
        return len(self._pending_pushes)

    @property
    def num_quarantined_kv_imports(self) -> int:
        """Failed imports whose destinations may still be written."""
        return 0 if self._import_ledger is None else self._import_ledger.num_quarantined

    def schedule_waiting_requests(self) -> None:
        """Reject prompt scheduling on a dedicated disaggregated decode engine."""
        if getattr(self, "handoff_role", None) == "decode":
            raise HandoffStateError(
                "a disaggregated decode engine does not schedule prompts; submit handoffs with "
                "add_request_with_kv_handoff",
                "role",
            )

    # -- transport setup ------------------------------------------------------------------------
    def setup_kv_transfer(self, role: str, backend: str = "nixl", **backend_kwargs: Any) -> None:
        """Bring up the KV transfer agents for this engine.

        Must be called collectively by every model-parallel rank: each rank registers its own
        buffers and the static metadata of all ranks is gathered (``handoff_static_meta``).
        """
        engine: Any = self
        cls = construct_kv_transfer_backend_class(backend)
        kv_layout = engine.kv_layout
        common = dict(backend_kwargs)
        agent = f"{role}-{kv_layout.global_rank if kv_layout is not None else 'x'}"
        self.handoff_role = role
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
        requests_and_state: list[tuple[Any, list[int], int | None]],
        decode_tokens_by_request: dict[int, list[int]],
    ) -> dict[int, _PreparedHandoffMetadata]:
        """Assemble metadata for all handoffs completed by one engine step."""
        out = {}
        for request, blocks, slot in requests_and_state:
            rid = int(request.request_id)
            out[rid] = _PreparedHandoffMetadata(
                local_blocks=list(blocks),
                local_ssm_slot=slot,
                kv_meta={
                    "src_block_ids": list(blocks),
                    "src_block_size_tokens": self.block_size_tokens,
                },
                ssm_meta=None if slot is None else {"src_slot": slot},
                resume_tokens=list(decode_tokens_by_request.get(rid, [])),
            )
        return out

    @staticmethod
    def _ssm_stage_transfer_meta(
        static_metas: dict[str, Any], selected_slot: int
    ) -> dict[str, Any]:
        """Attach the final recurrent-state slot to one stage's descriptors."""
        return {**static_metas, "slot": selected_slot}

    def _capture_handoff_meta(
        self,
        request: Any,
        prepared: _PreparedHandoffMetadata | None,
        decode_metas: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Pin the request's blocks and SSM slot in the PinLedger and return its ticket.

        ``request`` is the engine's finished-prefill record (``request_id``, ``block_ids``,
        ``ssm_slot``, ``first_token``). The engine's own reference on the blocks is dropped
        here: from now on the pin owns them until RELEASE_KV or lease expiry.
        """
        engine: Any = self
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
        self._pins_by_request[rid] = (blocks, slot, epoch)
        self._event(("pinned", rid, f"{len(blocks)} blocks slot={slot}"))
        ticket: dict[str, Any] = {
            "src_block_ids": blocks,
            "src_block_size_tokens": self.block_size_tokens,
            "src_ssm_slot": slot,
            "resume_tokens": [int(request.first_token)],
            "pin_epoch": epoch,
            "lease_ns": self.handoff_lease_ns,
        }
        if integrity is not None:
            ticket["integrity"] = integrity.to_wire()
        staged = self._stage_for_decode(rid, blocks, len(request.prompt), decode_metas)
        if staged:
            ticket["staged"] = staged
        return ticket

    # -- integrity digest (verify_integrity) ----------------------------------------------------
    def _integrity_shapes(self, num_chunks: int = 1) -> dict[str, tuple[int, ...]]:
        """Digest table shapes of this model (the parts this engine registers)."""
        engine: Any = self
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
        engine: Any = self
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

    def _verify_import_integrity(self, pending: PendingKvImport) -> IntegrityMismatch | None:
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
        engine: Any = self
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
        """Release blocks pinned by a finished handoff (RELEASE_KV); unknown ids are no-ops."""
        if request_id in self._pending_pushes:
            # The push may still read them: the ledger defers the release until it settles.
            self._event(("release_deferred", request_id, "push in flight"))
        actions = self._pins().release(request_id)
        self._pins_by_request.pop(request_id, None)
        self._release_staged(request_id)
        for a in actions:
            self._event(("released", a.request_id, str(a.reason)))

    def _release_pinned_handoff_blocks(self, block_ids: list[int]) -> int:
        """Blocks are released by the PinLedger; returns how many this request pinned."""
        return len(block_ids)

    def _release_pinned_handoff_ssm_slot(self, ssm_slot: int | None) -> None:
        """The PinLedger returns the slot with the blocks; nothing else to do."""
        del ssm_slot

    def expire_handoff_pins(self) -> int:
        """End pins whose lease has passed (``handoff_now_ns``); returns how many."""
        self._update_queue_metrics()
        if self._pin_ledger is None:
            return 0
        actions = self._pin_ledger.expire(self.handoff_now_ns)
        for a in actions:
            self._pins_by_request.pop(a.request_id, None)
            self._release_staged(a.request_id)
            self._event(("lease_expired", a.request_id, ""))
        return len(actions)

    def push_handoff_kv(
        self, request_id: int, decode_metas: list[Any], destination: dict[str, Any]
    ) -> None:
        """Push a pinned handoff's KV and SSM state to the decode ranks in ``decode_metas``
        (two-sided transports). ``destination`` is what the decode posted: its
        ``dst_block_ids``, ``dst_ssm_slot``, ``num_tokens`` and ``token_start``."""
        if request_id not in self._pins_by_request:
            raise HandoffStateError(
                f"request {request_id} has no pinned handoff to push", "request_id"
            )
        blocks, slot, epoch = self._pins_by_request[request_id]
        pins = self._pins()
        pins.begin_push(request_id, epoch)
        handles = []
        kv_metas = [r["kv"] for r in decode_metas if r.get("kv") is not None]
        token_start = int(destination.get("token_start", 0))
        first_src = token_start // self.block_size_tokens
        own = self.handoff_static_meta["ranks"]
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

    def _poll_pending_kv_pushes(self) -> int:
        """Reap completed push sends; unfinished ones stay pending. Returns how many ended."""
        ended = 0
        for rid, (epoch, handles) in list(self._pending_pushes.items()):
            if not self._wait_for_transfer_handles(*handles, block=False):
                continue
            del self._pending_pushes[rid]
            ended += 1
            for a in self._pins().push_settled(rid, epoch):
                self._pins_by_request.pop(a.request_id, None)
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
        ``LEASE_READ_FRACTION`` of it). ``sampling_params`` needs ``max_new_tokens`` (an int is
        accepted too).
        """
        engine: Any = self
        ledger = self._ledger()
        max_new = int(getattr(sampling_params, "max_new_tokens", sampling_params))
        resume = [int(t) for t in kv_meta.get("resume_tokens", [])]
        if "prefill_meta" not in kv_meta:
            raise MetadataError(f"request {request_id}: ticket has no prefill_meta", "prefill_meta")
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
        finished = len(resume) >= max_new or (
            engine.config.eos_token is not None and resume and resume[-1] == engine.config.eos_token
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
            src_block_size_tokens=int(kv_meta.get("src_block_size_tokens", self.block_size_tokens)),
            resume_tokens=len(resume),
            has_ssm=has_ssm,
            finished=bool(finished),
            deadline=now + budget,
            now=now,
        )
        # Validated by the ledger: now the engine learns of it (ledger and engine agree).
        engine.expect_import(request_id, prompt, resume, max_new)
        future: asyncio.Future[Any] | None = None
        loop = getattr(engine, "_event_loop", None)
        if loop is not None:
            future = loop.create_future()
        self._decode_requests[request_id] = _DecodeRequest(
            list(prompt), resume, max_new, dict(kv_meta), future, integrity
        )
        self._event(("submitted", request_id, f"{len(prompt)} tokens"))
        self._apply_import_actions(actions)
        return future

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

    def _try_start_kv_handoff_import(self, handoff: Any) -> bool:
        """Starts happen inside the ledger (all or nothing); this drains its queue."""
        del handoff
        return self._drain_deferred_kv_handoffs() > 0

    def _find_cached_handoff_prefix(self, hashes: list[int], num_blocks: int) -> list[int]:
        """The contiguous handoff prefix already cached on decode (pull transports only)."""
        engine: Any = self
        return list(engine.block_pool.match_prefix(hashes[:num_blocks]))

    def _handoff_capacity_available(self, num_blocks: int, cached_blocks: list[int]) -> bool:
        """Whether the pool can take an import of ``num_blocks`` beyond ``cached_blocks``."""
        engine: Any = self
        return bool(engine.block_pool.can_allocate(max(0, num_blocks - len(cached_blocks))))

    def _drain_deferred_kv_handoffs(self) -> int:
        """Start queued handoffs in FIFO order while the queue head fits (ledger poll)."""
        before = self._ledger().num_importing
        self._apply_import_actions(self._ledger().poll(self.handoff_now_ns))
        return max(0, self._ledger().num_importing - before)

    def _start_import(self, action: LedgerAction) -> None:
        """Post the transfers of a started import (pull: reads; push: receives)."""
        req = self._decode_requests[action.request_id]
        pending = PendingKvImport(action.request_id, action.epoch)
        self._pending_imports[action.request_id] = pending
        ticket = req.kv_meta
        prefill_ranks = ticket["prefill_meta"]["ranks"]
        num_tokens = len(req.prompt)
        token_start = int(action.token_start)
        src_bs = int(ticket.get("src_block_size_tokens", self.block_size_tokens))
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

    def _reserve_ssm_handoff_import(self) -> int:
        """The ledger reserves the SSM slot with the blocks (all or nothing)."""
        raise HandoffStateError("SSM slots are reserved by ImportLedger.submit, not separately")

    def _start_ssm_handoff_import(
        self, request_id: int, ssm_meta: dict[str, Any], pending: PendingKvImport
    ) -> None:
        """Post transfers into the slot already reserved for one handoff."""
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
    def _pending_transfer_handles(pending: PendingKvImport) -> list[Any]:
        """This import's active KV and SSM transfer handles."""
        return list(pending.handles)

    @staticmethod
    def _wait_for_transfer_handles(*handles: Any, block: bool = True) -> bool:
        """Whether every handle is terminal (``block``: wait for each, within its deadline)."""
        done = True
        for h in handles:
            try:
                if block:
                    h.wait()
                elif not h.poll():
                    done = False
            except (TransferError, TransferTimeout):
                continue
        return done

    @staticmethod
    def _local_outcome(pending: PendingKvImport) -> str | None:
        """This rank's terminal outcome, or None while a handle is active.

        A start that threw after posting part of the import (KV posted, SSM threw) is an
        error only once the parts already posted are terminal: until then they may still write
        the destinations, which must not go back to the pool.
        """
        return InferenceStateHandoffMixin._local_outcome_detail(pending)[0]

    @staticmethod
    def _local_outcome_detail(pending: PendingKvImport) -> tuple[str | None, str]:
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
        """Share each rank's locally terminal imports with every MP rank and feed the ledger."""
        engine: Any = self
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

    def _record_transfer_done(self, pending: PendingKvImport) -> None:
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

    @staticmethod
    def _quiet(handle: Any) -> bool:
        try:
            return bool(handle.poll())
        except (TransferError, TransferTimeout):
            return bool(getattr(handle, "done", True))

    def _poll_pending_kv_imports(self) -> int:
        """Progress imports without mutating the active decode batch; returns ready count."""
        if self._import_ledger is None:
            return 0
        self._report_completed_kv_imports()
        self._apply_import_actions(self._ledger().poll(self.handoff_now_ns))
        self._update_queue_metrics()
        return self._ledger().num_ready

    def _admit_pending_kv_imports(self) -> int:
        """Handle completed imports at an engine admission point; returns how many admitted."""
        engine: Any = self
        ledger = self._ledger()
        if not ledger.has_admittable_kv_import:
            return 0
        room = int(engine.decode_batch.can_admit(ledger.num_ready))
        before = self.handoff_stats["imports_admitted"]
        self._apply_import_actions(ledger.admit(room))
        return self.handoff_stats["imports_admitted"] - before

    def _validate_decode_ready_handoff(self, pending: Any) -> None:
        """The ledger admits only imports whose quorum succeeded; nothing else to check."""
        del pending

    def _finalize_kv_handoff_import(self, action: Any) -> None:
        """Admit: ownership of the blocks and slot moves to the live request."""
        engine: Any = self
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
        engine: Any = self
        self._pending_imports.pop(request_id, None)
        engine.complete_request_without_forward(request_id)
        req = self._decode_requests.pop(request_id, None)
        self.handoff_stats["imports_completed_without_forward"] += 1
        self._record_handoff_completion_notification(request_id, False)
        if req is not None and req.future is not None and not req.future.done():
            req.future.set_result(request_id)

    def _fail_import(self, action: Any) -> None:
        engine: Any = self
        rid = action.request_id
        pending = self._pending_imports.pop(rid, None)
        if action.quarantined and pending is not None:
            self._quarantined[(rid, action.epoch)] = pending
        req = self._decode_requests.pop(rid, None)
        expected = getattr(engine, "_expected", None)
        if isinstance(expected, dict):
            expected.pop(rid, None)
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

    def _release_pending_kv_import(self, pending: PendingKvImport) -> None:
        """Abort an unadmitted import; the ledger releases or quarantines its storage."""
        self._apply_import_actions(self._ledger().abort(pending.request_id, self.handoff_now_ns))

    def abort_kv_import(self, request_id: int) -> None:
        """Abort one import at any stage (unknown ids are counted no-ops in the ledger)."""
        self._apply_import_actions(self._ledger().abort(request_id, self.handoff_now_ns))

    def _reset_pending_kv_imports(self) -> None:
        """Drain and release pending handoff transfers before an engine reset.

        Refuses (``ResetRefusedError``, nothing changed) while a transfer may still write.
        """
        if self._import_ledger is not None:
            self._apply_import_actions(self._import_ledger.reset(self.handoff_now_ns))
        if self._pin_ledger is not None:
            if self._pending_pushes:
                raise HandoffStateError(
                    f"{len(self._pending_pushes)} pushes in flight; reset after they settle"
                )
            self._pin_ledger.reset()
            self._pins_by_request.clear()
