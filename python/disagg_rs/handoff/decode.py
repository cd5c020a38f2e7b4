"""Decode side of the handoff mixin: take a ticket, carry out the ImportLedger's actions (post
transfers, share outcomes across model-parallel ranks, admit, fail, quarantine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from disagg_rs._core import (
    CompletionQuorum,
    ImportLedger,
    LedgerAction,
    check_handoff_ticket,
    import_failure,
    import_limits,
)
from disagg_rs.exceptions import (
    DisaggError,
    IntegrityError,
    ResetRefusedError,
    TransferError,
    TransferTimeout,
)
from disagg_rs.handoff.base import (
    _SSM_STATE_KINDS,
    HandoffBase,
    KvHandoffRequest,
    RankImport,
    _DecodeRequest,
    _of_kind,
    _tag,
    logger,
)
from disagg_rs.integrity import (
    IntegrityMismatch,
    IntegrityTable,
)
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport, PendingSSMImport

_HandleState = Literal["running", "done", "timeout", "error"]


class DecodeHandoff(HandoffBase):
    """The decode half of :class:`~disagg_rs.handoff.mixin.InferenceStateHandoffMixin`."""

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
        return self._path.add_request((request_id, prompt, sampling_params, kv_meta, src_block_ids))

    def _submit_ledger_import(self, submission: KvHandoffRequest) -> asyncio.Future[Any] | None:
        """``add_request_with_kv_handoff`` of a ledger-driven engine: submit to the ledger."""
        request_id, prompt, sampling_params, kv_meta, src_block_ids = submission
        engine = self._host()
        ledger = self._ledger()
        resume = [int(t) for t in kv_meta.get("resume_tokens", [])]
        # The token limit and whether the handed-off tokens already finish it, in Rust.
        max_new, finished = import_limits(sampling_params, engine.config.eos_token, resume)
        has_ssm = engine.ssm_slot_pool is not None
        # Every field typed and range-checked once, in Rust, with what this rank needs of it:
        # the prefill's metadata names a source of every state it reads (else it would
        # reserve blocks, post nothing and be admitted unwritten).
        check_handoff_ticket(
            kv_meta,
            request_id=request_id,
            sources=(["kv"] if self._kv_backend is not None else []) + list(self._ssm_backends),
            has_ssm=has_ssm,
            integrity=self.verify_integrity,
        )
        if self._is_push:
            _tag(request_id, "kv")  # refuses an id whose tags would alias another request's
        integrity = None
        if self.verify_integrity:
            wire = kv_meta["integrity"]
            chunk = IntegrityTable.wire_chunk_tokens(wire)
            chunks = -(-len(prompt) // chunk) if chunk else 1
            integrity = IntegrityTable.from_wire(wire, self._integrity_shapes(chunks))
        now = self.handoff_now_ns
        # The prefill frees the source blocks when its lease ends: the import's deadline is at
        # most a share of the ticket's lease_ns by this clock, the rest absorbs the transit.
        deadline = ImportLedger.import_deadline(
            request_id, now, self.handoff_import_timeout_ns, kv_meta.get("lease_ns")
        )
        lease_end, now_wall = ImportLedger.source_lease(
            request_id, kv_meta.get("lease_until_wall_ns"), self.handoff_wall_now_ns
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
            deadline=deadline,
            now=now,
            lease_until_wall=lease_end,
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
        self.handoff_stats["imports_deferred"] = ledger.counters()["deferred"]
        return future

    def drain_posted_receives(self) -> list[tuple[int, dict[str, Any] | None]]:
        """Two-sided transports: ``(request_id, destination)`` of every import whose
        receives were posted since the last drain — on the ticket's arrival or later, when a
        deferred import started — so its prefill can be told to push. One that failed in
        between is named while its receives may still be posted (quarantined): its prefill
        must answer them (with a filler) or its next send on the pair lands in them. Imports
        whose receives are quiet again are left out."""
        posted = {(p.request_id, p.epoch): p.destination for p in self._pending_imports.values()}
        posted.update((key, p.destination) for key, p in self._quarantined.items())
        return [(rid, posted.get((rid, e))) for rid, e in self._ledger().drain_started_pushes()]

    def kv_import_destination(self, request_id: int) -> dict[str, Any] | None:
        """Where this rank receives a started import (ledger-driven decode): its
        ``dst_block_ids``, ``dst_ssm_slot``, ``num_tokens`` and ``token_start``. A two-sided
        prefill needs it to push (:func:`with_push_destination`); None when not importing."""
        pending = self._pending_imports.get(request_id)
        return None if pending is None else dict(pending.destination)

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
        return self._path.try_start(handoff)

    def _start_ledger_imports(self, handoff: DeferredKvHandoff | None) -> bool:
        del handoff  # the ledger starts what fits, all or nothing, from its own queue
        return self._drain_deferred_kv_handoffs() > 0

    def _find_cached_handoff_prefix(self, hashes: list[int], num_blocks: int) -> list[int]:
        """The contiguous handoff prefix already cached on decode (pull transports only)."""
        return self._path.find_cached_prefix(hashes, num_blocks)

    def _ledger_cached_prefix(self, hashes: list[int], num_blocks: int) -> list[int]:
        return list(self._host().block_pool.match_prefix(hashes[:num_blocks]))

    def _handoff_capacity_available(self, num_blocks: int, cached_blocks: list[int]) -> bool:
        """Whether ``num_blocks`` new blocks fit after retaining ``cached_blocks`` (cached
        blocks nobody references count against free capacity once retained)."""
        return self._path.capacity_available(num_blocks, cached_blocks)

    def _ledger_capacity_available(self, num_blocks: int, cached_blocks: list[int]) -> bool:
        pool = self._host().block_pool
        unreferenced = sum(map((0).__eq__, map(pool.refcount, cached_blocks)))
        return bool(pool.can_allocate(num_blocks + unreferenced))

    def _drain_deferred_kv_handoffs(self) -> int:
        """Start queued handoffs in FIFO order while the queue head fits."""
        return self._path.drain_deferred()

    def _drain_ledger_deferred(self) -> int:
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
                handle = self._kv_backend.begin_pull_blocks(
                    _of_kind(prefill_ranks, "kv"),
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
            pending.handles.append(
                backend.begin_pull_blocks(
                    _of_kind(ssm_meta["prefill_meta"]["ranks"], kind),
                    [src_slot],
                    [dst_slot],
                    **self._pull_kwargs(request_id, kind, {}),
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
    def _local_outcome(pending: RankImport) -> str | None:
        """This rank's terminal outcome, or None while a handle is active.

        A start that threw after posting part of the import (KV posted, SSM threw) is an
        error only once the parts already posted are terminal: until then they may still write
        the destinations, which must not go back to the pool.
        """
        return DecodeHandoff._local_outcome_detail(pending)[0]

    @staticmethod
    def _handle_state(handle: Any) -> tuple[_HandleState, str]:
        """One poll of a transfer handle: ``running``, ``done``, ``timeout`` or ``error``, and
        the error's text."""
        try:
            return ("done" if handle.poll() else "running"), ""
        except TransferTimeout as e:
            return "timeout", f"{type(e).__name__}: {e}"
        except TransferError as e:
            return "error", f"{type(e).__name__}: {e}"

    @staticmethod
    def _local_outcome_detail(pending: RankImport) -> tuple[str | None, str]:
        """``_local_outcome`` and, for a failure, the first error this rank saw (the outcome
        is folded by :meth:`disagg_rs.CompletionQuorum.local_outcome`)."""
        polled = [DecodeHandoff._handle_state(h) for h in pending.handles]
        outcome = CompletionQuorum.local_outcome(
            pending.failed_locally is not None, [state for state, _ in polled]
        )
        errors = [pending.failed_locally or "", *(text for _, text in polled)]
        return outcome, max(errors, key=bool)  # the first non-empty one (max keeps the first)

    def _report_completed_kv_imports(self) -> None:
        """Report locally terminal imports: a ledger-driven engine shares each rank's outcome
        with every model-parallel rank and feeds the ledger; a reference-design engine reports
        to its completion tracker (or, with one rank, records the decision directly)."""
        self._path.report_completed()

    def _report_ledger_imports(self) -> None:
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

    def _cancel_due_quarantines(self) -> None:
        """Cancel through the transport the transfers of quarantines whose drain horizon
        passed, before the ledger's poll returns their destinations to the pool. A transfer
        that cannot be cancelled (a posted two-sided receive) and is still running keeps its
        quarantine (``hold_quarantine``): it lands when its send (the data or a filler)
        comes, and its blocks and buffers must not be reused before."""
        ledger = self._ledger()
        now = self.handoff_now_ns
        for key in ledger.quarantine_due(now):
            handles = getattr(self._quarantined.get(key), "handles", [])
            cancels = [getattr(h, "cancel", None) for h in handles]
            stuck = [self._quiet(h) for h, c in zip(handles, cancels, strict=True) if c is None]
            for cancel in filter(None, cancels):
                cancel()
            ledger.hold_quarantine(*key, not all(stuck), now)

    def _poll_pending_kv_imports(self) -> int:
        """Progress imports without mutating the active decode batch: start queued handoffs
        that now fit and report transfers that became terminal. Returns the number ready to
        admit (a reference-design engine: whether one is, as 0 or 1)."""
        return self._path.poll_imports()

    def _poll_ledger_imports(self) -> int:
        if self._import_ledger is None:
            return 0
        self._report_completed_kv_imports()
        self._cancel_due_quarantines()
        self._apply_import_actions(self._ledger().poll(self.handoff_now_ns))
        self._update_queue_metrics()
        return self._ledger().num_ready

    def _admit_pending_kv_imports(self) -> int:
        """Handle completed imports at an engine admission point; returns how many admitted."""
        return self._path.admit()

    def _admit_ledger_imports(self) -> int:
        engine = self._host()
        ledger = self._ledger()
        if not ledger.has_admittable_kv_import:
            return 0
        room = int(engine.decode_batch.can_admit(ledger.num_ready))
        before = self.handoff_stats["imports_admitted"]
        # handoff_now_ns must be read after the completions were observed (next loop turn).
        self._apply_import_actions(ledger.admit(room, self.handoff_now_ns))
        return self.handoff_stats["imports_admitted"] - before

    def _finalize_kv_handoff_import(self, action: Any) -> None:
        """Admit: ownership of the blocks and slot moves to the live request.

        ``action`` is the ledger's admit action, or a reference-design engine's
        :class:`PendingKvImport`: its hashes are registered in the prefix cache, the request
        enters through the engine's ``add_request`` and leaves the waiting queue at once, and
        the handed-off token is appended; a request that token already finishes (its limit,
        termination token or stop word) completes without a forward step, any other is
        admitted into the running batch by ``admit_prefilled_decode``.
        """
        self._path.finalize(action)

    def _finalize_ledger_import(self, action: LedgerAction) -> None:
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
        self._path.complete_without_forward(request_id)

    def _complete_ledger_request_without_forward(self, request_id: int) -> None:
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
        # What the failure is reported as (a mismatch wins over a rank's error), in Rust.
        reason, detail, integrity, message = import_failure(
            rid, str(action.reason), mismatch, self._rank_errors.pop(rid, None)
        )
        self.handoff_stats["imports_failed"] += 1
        self.handoff_stats["integrity_failures"] += integrity
        if self.handoff_metrics is not None:
            self.handoff_metrics.failed(reason)
        self._record_handoff_completion_notification(rid, True)
        self._new_failure_reasons[rid] = f"{reason}{detail}"
        self.handoff_events.append(
            ("failed", rid, f"{reason} quarantined={action.quarantined}{detail}")
        )
        error = TransferError(message, "request_id")
        if integrity:
            logger.warning("request %d: %s", rid, message)
            error = IntegrityError(message, "integrity", mismatch)
        if req is not None and req.future is not None and not req.future.done():
            req.future.set_exception(error)

    def _release_pending_kv_import(self, pending: PendingKvImport | RankImport) -> None:
        """Release storage owned by an unadmitted decode import (a ledger-driven engine
        aborts it: the ledger releases or quarantines its storage)."""
        self._path.release_import(pending)

    def _release_ledger_import(self, pending: RankImport) -> None:
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
        self._path.reset_imports()

    def _reset_ledger_imports(self) -> None:
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
