"""Decode side of the handoff mixin: take a ticket, carry out the ImportLedger's actions (post
transfers, share outcomes across model-parallel ranks, admit, fail, quarantine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from disagg_rs._core import (
    LedgerAction,
    fold_import_reports,
    import_failure,
    import_local_outcomes,
    import_pulls,
    refuse_reset_while_pinned,
    settle_quiet_quarantines,
    ticket_import,
)
from disagg_rs.exceptions import (
    DisaggError,
    IntegrityError,
    TransferError,
    TransferTimeout,
)
from disagg_rs.handoff.base import (
    _SSM_STATE_KINDS,
    HandoffBase,
    KvHandoffRequest,
    RankImport,
    _DecodeRequest,
    logger,
)
from disagg_rs.integrity import (
    IntegrityMismatch,
    IntegrityTable,
)
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport, PendingSSMImport


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
        has_ssm = engine.ssm_slot_pool is not None
        now = self.handoff_now_ns
        # In Rust, in one call: every field of the ticket typed and range-checked once, with
        # what this rank needs of it (the prefill's metadata names a source of every state it
        # reads, else it would reserve blocks, post nothing and be admitted unwritten); the
        # token limit and whether the handed-off tokens already finish it; an id a two-sided
        # transport cannot tag (its tags would alias another request's) refused; the prompt's
        # arguments (a verifying decode reuses its prefix cache in whole digest chunks only,
        # a table without chunks allows none); the deadline, at most a share of the ticket's
        # lease_ns by this clock (the prefill frees the source blocks when its lease ends, the
        # rest absorbs the transit); and the source lease's wall-clock end.
        max_new, resume, submit_args = ticket_import(
            request_id,
            prompt,
            sampling_params,
            kv_meta,
            eos_token=engine.config.eos_token,
            sources=list(self._transfer_backends()),
            has_ssm=has_ssm,
            integrity=self.verify_integrity,
            two_sided=self._is_push,
            now=now,
            timeout=self.handoff_import_timeout_ns,
            wall_now=self.handoff_wall_now_ns,
        )
        integrity = self._ticket_integrity(kv_meta, len(prompt)) if self.verify_integrity else None
        actions = ledger.submit(request_id, **submit_args, src_block_ids=list(src_block_ids))
        # Validated by the ledger: now the engine learns of it (ledger and engine agree).
        engine.expect_import(request_id, prompt, resume, max_new)
        # An engine without an event loop raises AttributeError for it (the protocol's way).
        loop: asyncio.AbstractEventLoop | None = getattr(engine, "event_loop", None)
        future = None if loop is None else loop.create_future()
        self._decode_requests[request_id] = _DecodeRequest(
            list(prompt), resume, max_new, dict(kv_meta), future, integrity
        )
        self._event(("submitted", request_id, f"{len(prompt)} tokens"))
        self._apply_import_actions(actions)
        self.handoff_stats["imports_deferred"] = ledger.counters()["deferred"]
        return future

    def _ticket_integrity(self, kv_meta: dict[str, Any], num_tokens: int) -> IntegrityTable:
        """The prefill's digest a ticket carries, checked against this model's tables."""
        wire = kv_meta["integrity"]
        chunk = IntegrityTable.wire_chunk_tokens(wire)
        chunks = -(-num_tokens // chunk) if chunk else 1
        return IntegrityTable.from_wire(wire, self._integrity_shapes(chunks))

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
            match a.kind:
                case "start":
                    self._start_import(a)
                case "admit":
                    self._finalize_kv_handoff_import(a)
                case "complete":
                    self._complete_handoff_request_without_forward(a.request_id)
                case "fail":
                    self._fail_import(a)
                case "release":
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
        num_tokens = len(req.prompt)
        token_start = int(action.token_start)
        src_bs = int(ticket.get("src_block_size_tokens", self._host().block_size_tokens))
        pending.destination = {
            "dst_block_ids": list(action.dst_block_ids),
            # Every block of the prompt in token order, prefix-cached ones included.
            "block_ids": list(action.cached_block_ids) + list(action.dst_block_ids),
            "dst_ssm_slot": action.ssm_slot,
            "num_tokens": num_tokens,
            "token_start": token_start,
            "src_block_size_tokens": src_bs,
        }
        backends = self._transfer_backends()
        posted_at = time.perf_counter_ns()
        try:
            # What moves (KV past the cached prefix, each SSM kind into the slot), from which
            # prefill ranks and how (tag, staged copy), in Rust.
            pulls = import_pulls(
                action,
                ticket,
                num_tokens=num_tokens,
                kinds=list(backends),
                two_sided=self._is_push,
                kv_backend=self._kv_backend,
            )
            for kind, metas, src, dst, kwargs in pulls:
                pending.handles.append(backends[kind].begin_pull_blocks(metas, src, dst, **kwargs))
        except Exception as e:  # transfer start threw: local failure, quiet if nothing posted
            pending.failed_locally = f"{type(e).__name__}: {e}"
            logger.warning("request %d: transfer start failed: %s", action.request_id, e)
        pending.posted_ns = time.perf_counter_ns()
        self.handoff_stats["post_ns"] += pending.posted_ns - posted_at
        self._metrics.posted((pending.posted_ns - posted_at) / 1e9)
        self.handoff_stats["imports_started"] += 1
        self.handoff_request_stats[action.request_id] = {"token_start": token_start, "bytes": 0}
        self._event(("importing", action.request_id, f"token_start={token_start}"))

    def _start_ssm_handoff_import(
        self, request_id: int, ssm_meta: dict[str, Any], pending: PendingSSMImport
    ) -> None:
        """Post transfers into the slot already reserved for one handoff (a reference-design
        engine; a ledger-driven one posts them with the import's KV in ``_start_import``)."""
        del request_id
        pending.handles = {
            kind: self._ssm_transfer_agents[kind].begin_pull_blocks(
                ssm_meta[kind], [], [pending.live_slot]
            )
            for kind in _SSM_STATE_KINDS
        }

    @staticmethod
    def _local_outcome(pending: RankImport) -> str | None:
        """This rank's terminal outcome, or None while a handle is active.

        A start that threw after posting part of the import (KV posted, SSM threw) is an
        error only once the parts already posted are terminal: until then they may still write
        the destinations, which must not go back to the pool.
        """
        return DecodeHandoff._local_outcome_detail(pending)[0]

    @staticmethod
    def _poll(handle: Any) -> bool | TransferError | TransferTimeout:
        """One poll of a transfer handle: whether it is done, or the transfer error it raised
        (``TransferTimeout``: it timed out and may still write; ``TransferError``: it failed)."""
        try:
            return bool(handle.poll())
        except (TransferTimeout, TransferError) as e:
            return e

    @staticmethod
    def _local_outcome_detail(pending: RankImport) -> tuple[str | None, str]:
        """``_local_outcome`` and, for a failure, the first error this rank saw (the outcome
        is folded in Rust, as :meth:`disagg_rs.CompletionQuorum.local_outcome` folds it)."""
        return DecodeHandoff._local_outcomes([pending])[0]

    @staticmethod
    def _local_outcomes(pending: Sequence[RankImport]) -> list[tuple[str | None, str]]:
        """``_local_outcome_detail`` of each import, folded in one call."""
        polled = [(p.failed_locally, [DecodeHandoff._poll(h) for h in p.handles]) for p in pending]
        return import_local_outcomes(polled)

    def _report_completed_kv_imports(self) -> None:
        """Report locally terminal imports: a ledger-driven engine shares each rank's outcome
        with every model-parallel rank and feeds the ledger; a reference-design engine reports
        to its completion tracker (or, with one rank, records the decision directly)."""
        self._path.report_completed()

    def _report_ledger_imports(self) -> None:
        if not self._pending_imports and not self._quarantined:
            # Mirrored on every rank (same ledger actions), so all ranks skip the collective.
            return
        unreported = [p for p in self._pending_imports.values() if not p.reported]
        polled = zip(unreported, self._local_outcomes(unreported), strict=True)
        local = [self._local_report(p, o, d) for p, (o, d) in polled if o is not None]
        # Every rank's reports, in rank order, folded into the ledger (same on every rank):
        # each failing import keeps the first mismatch and the first rank error reported.
        gathered = self._host().handoff_all_gather(local)
        actions, mismatches, rank_errors = fold_import_reports(
            self._ledger(), gathered, self.handoff_now_ns
        )
        self._integrity_failures.update(mismatches)
        self._rank_errors.update(rank_errors)
        self._apply_import_actions(actions)
        # Quarantined destinations settle once every local handle is quiet again.
        quiet = [(*key, all(map(self._quiet, p.handles))) for key, p in self._quarantined.items()]
        self._apply_import_actions(settle_quiet_quarantines(self._ledger(), quiet))

    def _local_report(
        self, pending: RankImport, outcome: str, detail: str
    ) -> tuple[int, int, str, IntegrityMismatch | None, str]:
        """This rank's report of an import whose transfers ended: ``(request_id, epoch,
        outcome, mismatch, first_error)``. Once every local transfer finished the state is
        final: it is checked before the quorum can make the request admittable (a mismatch
        makes the report an error; a check that cannot run is this rank's error)."""
        pending.reported = True
        mismatch = None
        if outcome == "ok":
            self._record_transfer_done(pending)
            try:
                mismatch = self._verify_import_integrity(pending)
            except DisaggError as e:  # this rank cannot check: its import fails
                logger.warning("request %d: integrity check raised: %s", pending.request_id, e)
                outcome = "error"
        return pending.request_id, pending.epoch, outcome, mismatch, detail

    def _record_transfer_done(self, pending: RankImport) -> None:
        """Statistics and metrics of one import whose transfers completed on this rank."""
        moved = sum(int(h.stats.get("bytes", 0)) for h in pending.handles)
        descriptors = sum(int(h.stats.get("descriptors", 0)) for h in pending.handles)
        elapsed = time.perf_counter_ns() - pending.posted_ns
        self.handoff_stats["bytes_pulled"] += moved
        self.handoff_stats["descriptors"] += descriptors
        self.handoff_stats["transfer_ns"] += elapsed
        self.handoff_request_stats.setdefault(pending.request_id, {})["bytes"] = moved
        self._metrics.transfer_done(moved, descriptors, elapsed / 1e9)

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
            running = [self._cancel_or_poll(h) for h in handles]
            ledger.hold_quarantine(*key, any(running), now)

    def _cancel_or_poll(self, handle: Any) -> bool:
        """Cancel a transfer through its transport, or, one that cannot be cancelled, poll it:
        whether it is still running (then it may still write)."""
        cancel = getattr(handle, "cancel", None)
        if cancel is None:
            return not self._quiet(handle)
        cancel()
        return False

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
        self.handoff_stats["imports_admitted"] += 1
        self._record_handoff_completion_notification(rid, False)
        self._event(("admitted", rid, f"{len(action.block_ids)} blocks"))
        self._settle(rid)

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
        self.handoff_stats["imports_completed_without_forward"] += 1
        self._record_handoff_completion_notification(request_id, False)
        self._settle(request_id)

    def _settle(self, request_id: int, error: DisaggError | None = None) -> None:
        """Stop tracking a request that was admitted, completed or (``error``) failed, and
        resolve its completion future, if it has one still open."""
        req = self._decode_requests.pop(request_id, None)
        if req is None or req.future is None or req.future.done():
            return
        if error is None:
            req.future.set_result(request_id)
        else:
            req.future.set_exception(error)

    def _fail_import(self, action: Any) -> None:
        engine = self._host()
        rid = action.request_id
        pending = self._pending_imports.pop(rid, None)
        if action.quarantined and pending is not None:
            self._quarantined[(rid, action.epoch)] = pending
        # The engine forgets the announced request (expect_import) that will never arrive.
        engine.abort(rid)
        mismatch = self._integrity_failures.pop(rid, None)
        # What the failure is reported as (a mismatch wins over a rank's error), in Rust.
        reason, detail, integrity, message = import_failure(
            rid, str(action.reason), mismatch, self._rank_errors.pop(rid, None)
        )
        self.handoff_stats["imports_failed"] += 1
        self.handoff_stats["integrity_failures"] += integrity
        self._metrics.failed(reason)
        self._record_handoff_completion_notification(rid, True)
        self._new_failure_reasons[rid] = f"{reason}{detail}"
        self.handoff_events.append(
            ("failed", rid, f"{reason} quarantined={action.quarantined}{detail}")
        )
        error = TransferError(message, "request_id")
        if integrity:
            logger.warning("request %d: %s", rid, message)
            error = IntegrityError(message, "integrity", mismatch)
        self._settle(rid, error)

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
        # A decode may still be reading pinned blocks (until RELEASE_KV or lease expiry).
        refuse_reset_while_pinned(list(self._pinned_handoff_blocks))
        if self._import_ledger is not None:
            queued = map(self._decode_requests.get, self._import_ledger.deferred_ids())
            futures = [r.future for r in queued if r is not None]
            actions = self._import_ledger.reset(self.handoff_now_ns)
            # Queued imports are cancelled; the reset fails the others.
            for future in filter(None, futures):
                future.cancel()
            self._apply_import_actions(actions)
