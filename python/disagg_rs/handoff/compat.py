"""Compatibility with the reference design (Megatron-LM's disaggregation package), in one place.

Everything a dynamic-batching engine of the reference design needs lives here, so that
swapping the reference design's package for ``disagg_rs`` is an import-path change:

* the module helpers its engines look up (``get_pg_size``, ``get_pg_rank``,
  ``compute_block_hashes_batched``) and the ticket helpers of its block lists
  (``transfer_block_count``, ``drop_transfer_prefix_blocks``, from the Rust core);
* :class:`ReferenceDesignCompat`, the mixin's methods for an engine that brings its own block
  allocator and attaches no ledger (``_setup_reference_kv_transfer`` ...
  ``_reset_reference_imports``). The shared entry points of
  :class:`~disagg_rs.handoff.mixin.InferenceStateHandoffMixin` (``setup_kv_transfer``,
  ``add_request_with_kv_handoff``, ``_admit_pending_kv_imports`` ...) call them through the
  :class:`~disagg_rs.handoff.base.HandoffPath` bound once, when the handoff state is
  initialized (``_reference_path``), until a ledger is attached;
* the reference design's private names kept as aliases of one implementation: the
  ``_kv_backend`` / ``_ssm_backends`` properties (``_kv_transfer_agent`` /
  ``_ssm_transfer_agents``) and ``_pinned_handoff_blocks`` (a read-only view of the
  :class:`~disagg_rs.PinLedger` on a ledger-driven prefill).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from disagg_rs._core import (
    BlockPool,
    SSMShardLayout,
    SSMStateDims,
    check_reference,
    drop_transfer_prefix_blocks,
    reference_cached_prefix,
    reference_first_token,
    reference_hash_registration,
    reference_import_sizes,
    reference_live_slot,
    reference_prefill_metas,
    reference_push_metas,
    reference_record_sink,
    reference_setup,
    reference_ticket_blocks,
    refuse_reset_while_pinned,
)
from disagg_rs._core import (
    transfer_block_count as transfer_block_count,
)
from disagg_rs.decode_admission import (
    admit_prefilled_decode,
    can_admit_prefilled_decode,
)
from disagg_rs.exceptions import HandoffStateError, TransferError
from disagg_rs.handoff.base import (
    HandoffBase,
    HandoffPath,
    KvHandoffRequest,
    _PreparedHandoffMetadata,
    logger,
)
from disagg_rs.handoff_completion_tracker import HandoffCompletionTracker
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport, PendingSSMImport
from disagg_rs.transfer_backends import construct_kv_transfer_backend_class


def _group_query(group: Any, query: Callable[[Any], int], alone: int) -> int:
    """``query(group)``, or ``alone`` without a group or without torch.distributed."""
    dist = torch.distributed
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return alone
    return int(query(group))


def get_pg_size(group: Any) -> int:
    """Number of ranks of a process group (1 without one or without torch.distributed)."""
    return _group_query(group, lambda g: torch.distributed.get_world_size(g), 1)


def get_pg_rank(group: Any) -> int:
    """This process's rank in a process group (0 without one or without torch.distributed)."""
    return _group_query(group, lambda g: torch.distributed.get_rank(g), 0)


def _gather_object(obj: Any, group: Any) -> list[Any]:
    """``obj`` of every rank of ``group``, in rank order (``[obj]`` for one rank)."""
    gathered = [obj] * get_pg_size(group)
    if len(gathered) > 1:
        torch.distributed.all_gather_object(gathered, obj, group=group)
    return gathered


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


class ReferenceDesignCompat(HandoffBase):
    """The mixin's methods for a reference-design engine (its own allocator, no ledger)."""

    def _reference_path(self) -> HandoffPath:
        """The steps of a reference-design engine (see :class:`HandoffPath`)."""
        return HandoffPath(
            ledger=False,
            setup_transfer=self._setup_reference_kv_transfer,
            setup_tracking=self._setup_reference_completion_tracking,
            drain_outcomes=self._drain_reference_outcomes,
            record_outcome=self._reference_imports.decide,
            pending_imports=self._reference_pending_imports,
            has_admittable=self._reference_has_admittable,
            pending_pushes=self._reference_pending_pushes,
            num_quarantined=self._reference_num_quarantined,
            num_waiting=self._reference_num_waiting,
            add_request=self._add_reference_request_with_kv_handoff,
            try_start=self._start_reference_import,
            find_cached_prefix=self._reference_cached_prefix,
            capacity_available=self._reference_capacity_available,
            drain_deferred=self._drain_reference_deferred,
            report_completed=self._report_reference_imports,
            poll_imports=self._poll_reference_imports,
            admit=self._admit_reference_imports,
            finalize=self._finalize_reference_import,
            complete_without_forward=self._complete_reference_request_without_forward,
            release_import=self._release_reference_import,
            reset_imports=self._reset_reference_imports,
            prepare_metadata=self._prepare_reference_handoff_metadata,
            capture_meta=self._capture_reference_handoff_meta,
            release_handoff_blocks=self._release_reference_handoff_blocks,
            release_pinned_blocks=self._release_reference_pinned_blocks,
            push_kv=self._push_reference_handoff_kv,
            poll_pushes=self._poll_reference_pushes,
        )

    def _setup_reference_completion_tracking(self, hostname: str | None) -> None:
        """A :class:`HandoffCompletionTracker` over the engine's model-parallel group (ZeroMQ
        from each rank to the group's first rank)."""
        ref = self._ref()
        tracker = HandoffCompletionTracker(ref.zmq_context, ref.pg_collection.mp, hostname)
        self._handoff_completion_tracker = tracker
        ref.zmq_sockets.extend(tracker.sockets)

    def _drain_reference_outcomes(self) -> list[tuple[int, bool]]:
        tracker = self._handoff_completion_tracker
        return [] if tracker is None else tracker.drain_completed()

    def _reference_pending_imports(self) -> int:
        return len(self._deferred_kv_handoffs) + len(self._pending_kv_imports)

    def _reference_has_admittable(self) -> bool:
        context = self._ref().context
        resume = {p.request_id: len(p.resume_tokens) for p in self._pending_kv_imports}
        return any(
            failed or can_admit_prefilled_decode(context, resume[rid])
            for rid, failed in self._reference_imports.decided_in_order()
        )

    def _reference_pending_pushes(self) -> int:
        return len(self._pending_kv_pushes)

    def _reference_num_quarantined(self) -> int:
        return len(self._quarantined_kv_imports)

    def _reference_num_waiting(self) -> int:
        return len(self._ref().waiting_request_ids)

    def _reference_cached_prefix(self, hashes: list[int], num_blocks: int) -> list[int]:
        table = self._ref().context.kv_block_allocator.kv_hash_to_block_id
        # The cached blocks as far as they run unbroken from the first one, in Rust.
        return reference_cached_prefix(list(map(table.get, hashes[:num_blocks])))

    def _reference_capacity_available(self, num_blocks: int, cached_blocks: list[int]) -> bool:
        allocator = self._ref().context.kv_block_allocator
        ids = torch.tensor(cached_blocks, dtype=torch.int32)
        unreferenced = int((allocator.block_ref_counts[ids] == 0).sum())
        return bool(allocator.is_memory_available(num_blocks, potential_matched_count=unreferenced))

    def _drain_reference_deferred(self) -> int:
        started = 0
        queue = self._deferred_kv_handoffs
        while queue and self._whole()._try_start_kv_handoff_import(queue[0]):
            queue.popleft()
            started += 1
        return started

    def _poll_reference_imports(self) -> int:
        self._whole()._drain_deferred_kv_handoffs()
        self._whole()._report_completed_kv_imports()
        return int(self._whole().has_admittable_kv_import)

    def _release_reference_handoff_blocks(self, request_id: int) -> None:
        blocks = self._pinned_handoff_blocks.pop(request_id, None)
        if blocks:
            released = self._whole()._release_pinned_handoff_blocks(blocks)
            logger.info("handoff event=released request_id=%d blocks=%d", request_id, released)

    def _release_reference_pinned_blocks(self, block_ids: list[int]) -> int:
        """One allocator reference per block."""
        if block_ids:
            ids = torch.tensor(list(block_ids), dtype=torch.int32, device="cpu")
            self._ref().context.kv_block_allocator.release_memory_blocks(ids)
        return len(block_ids)

    def _poll_reference_pushes(self) -> int:
        pushes = self._pending_kv_pushes
        done = [all(h.poll() for h in hs) for _, hs in pushes]
        self._pending_kv_pushes = [p for p, d in zip(pushes, done, strict=False) if not d]
        return sum(done)

    def _setup_reference_kv_transfer(self, role: str, backend: str, **backend_kwargs: Any) -> None:
        """``setup_kv_transfer`` of a reference-design engine (its context's buffers; the
        backend's keyword arguments are not used)."""
        del backend_kwargs
        ref = self._ref()
        ctx = ref.context
        hybrid = bool(ctx.is_hybrid_model)
        allocator = ctx.kv_block_allocator
        config = ref.controller.inference_wrapped_model.model.config
        # The SSM state cache the role needs and prefix caching checked, then whether the
        # allocator pins finished blocks (a prefill, until the decode has read them) and the
        # global KV heads, in Rust (HandoffStateError naming the field).
        pinning, kv_heads = reference_setup(
            {
                "role": role,
                "hybrid": hybrid,
                "state_cache": ctx.mamba_slot_allocator is not None,
                "prefix_caching": bool(allocator.enable_prefix_caching),
                "num_query_groups": config.num_query_groups,
                "num_attention_heads": config.num_attention_heads,
            }
        )
        self._kv_transfer_role = role
        backend_cls = construct_kv_transfer_backend_class(backend)
        allocator.enable_handoff_pinning = pinning
        dist = torch.distributed
        rank = int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
        groups = ref.pg_collection
        tp_size, tp_rank = get_pg_size(groups.tp), get_pg_rank(groups.tp)
        pp_size, pp_rank = get_pg_size(groups.pp), get_pg_rank(groups.pp)
        n_attn, n_ssm = int(ctx.num_attention_layers), int(ctx.num_mamba_layers)
        # Every pipeline stage's layer counts: this stage's layers start after the earlier ones.
        counts = _gather_object((n_attn, n_ssm), groups.pp)
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
        gathered = _gather_object(local, groups.tp)
        check_reference("tp_agents", {"kinds": [list(g["ssm"]) for g in gathered]})
        # One TP rank keeps its own metadata; several keep one entry per rank.
        if tp_size > 1:
            self._kv_peer_metas = [g["kv"] for g in gathered]
            self._tp_ssm_peer_metas = {k: [g["ssm"][k] for g in gathered] for k in local["ssm"]}
        else:
            self._kv_peer_metas = local["kv"]
            self._tp_ssm_peer_metas = dict(local["ssm"])
        stage = {"kv": self._kv_peer_metas, "ssm": self._tp_ssm_peer_metas}
        stages = _gather_object(stage, groups.pp)
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
        check_reference(
            "ssm_buffers",
            {
                "heads": heads,
                "mamba_num_heads": config.mamba_num_heads,
                "conv_channels": int(conv.shape[-2]),
                "layout_conv_channels": layout.local_conv_channels,
            },
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

    def _prepare_reference_handoff_metadata(
        self,
        requests_and_state: Iterable[tuple[Any, ...]],
        decode_tokens_by_request: Mapping[int, list[int]],
    ) -> dict[int, _PreparedHandoffMetadata]:
        ctx = self._ref().context
        bs = int(ctx.block_size_tokens)
        handoffs = [
            (request.request_id, list(blocks)[: -(-len(request.prompt_tokens) // bs)])
            for request, blocks, *_ in requests_and_state
            if request.sampling_params.do_kv_handoff
        ]
        if not handoffs:
            return {}
        resume = decode_tokens_by_request
        rows = [
            {"request_id": rid, "blocks": len(b), "resume_tokens": list(resume.get(rid, []))}
            for rid, b in handoffs
        ]
        facts = {
            "requests": rows,
            "kv_stages": self._pp_kv_peer_metas,
            "ssm_stages": self._pp_ssm_peer_metas,
            "pp_size": get_pg_size(self._ref().pg_collection.pp),
            "num_speculative_tokens": int(ctx.num_speculative_tokens),
        }
        try:
            # Setup and every request checked before any slot is read or anything prepared;
            # then every ticket's metadata built, in Rust (HandoffStateError /
            # HandoffMetadataError naming the field).
            check_reference("prefill", facts)
            cache = ctx.mamba_slot_allocator
            slots = (
                [int(cache.get_slot(b[-1])) for _, b in handoffs]
                if self._ssm_transfer_agents
                else None
            )
            block_lists = [b for _, b in handoffs]
            metas = reference_prefill_metas(facts, block_lists, slots)
            return {
                row["request_id"]: _PreparedHandoffMetadata(
                    local_blocks=b,
                    kv_meta=meta,
                    ssm_meta=meta.get("ssm"),
                    resume_tokens=row["resume_tokens"],
                )
                for row, b, meta in zip(rows, block_lists, metas, strict=True)
            }
        except Exception:
            for _, blocks in handoffs:
                self._whole()._release_pinned_handoff_blocks(blocks)
            raise

    def _capture_reference_handoff_meta(
        self,
        request: Any,
        prepared: _PreparedHandoffMetadata | None,
        decode_metas: object = None,
    ) -> dict[str, Any]:
        del decode_metas  # the reference design stages nothing for the decode
        rid = request.request_id
        check_reference("prepared", {"request_id": rid, "prepared": prepared is not None})
        prepared = cast(_PreparedHandoffMetadata, prepared)
        blocks = prepared.local_blocks
        self._pinned_handoff_blocks[rid] = list(blocks)
        # The ticket's metadata was built for this request alone (reference_prefill_metas).
        params = {"request_id": rid, "block_ids": blocks, "kv_meta": prepared.kv_meta}
        request.disaggregated_params = params
        logger.info(
            "handoff event=pinned request_id=%d blocks=%d ssm=%d",
            rid,
            len(blocks),
            int(bool(prepared.ssm_meta)),
        )
        return params

    def _push_reference_handoff_kv(self, request_id: int, decode_metas: list[Any]) -> None:
        blocks = self._pinned_handoff_blocks.get(request_id)
        if not blocks:
            logger.warning(
                "SEND_KV for request %d with no pinned handoff blocks; skipped", request_id
            )
            return
        agents = self._ssm_transfer_agents
        cache = self._ref().context.mamba_slot_allocator
        slot = int(cache.get_slot(blocks[-1])) if agents else None
        # The destinations, per state kind, in Rust (HandoffMetadataError naming the kind).
        metas = reference_push_metas(request_id, list(decode_metas), slot, blocks[-1])
        handles = [self._kv_transfer_agent.begin_push_blocks(metas["kv"], blocks)]
        # The final block stays pinned until RELEASE_KV, so its SSM slot is not reused while
        # these sends run.
        handles += [agents[kind].begin_push_blocks(m, [slot]) for kind, m in metas["ssm"]]
        self._pending_kv_pushes.append((request_id, handles))

    def _reserve_ssm_handoff_import(self) -> PendingSSMImport:
        """Reserve the live request slot that receives exact SSM state (reference-design
        engine; a ledger reserves the slot with the blocks, all or nothing, in ``submit``)."""
        facts = {"ledger": self._ledger_driven(), "ssm_agents": bool(self._ssm_transfer_agents)}
        check_reference("reserve_ssm", facts)
        slot = self._ref().context.mamba_metadata.allocate_slot()
        # None: the capacity changed after the check (HandoffStateError, in Rust).
        return PendingSSMImport(handles={}, live_slot=reference_live_slot(slot))

    def _validate_decode_ready_handoff(self, pending: PendingKvImport) -> None:
        """Validate that transferred state can start decode without prompt execution (a
        ledger admits only imports whose quorum succeeded: it never calls this)."""
        ctx = self._ref().context
        check_reference(
            "decode_ready",
            {
                "request_id": pending.request_id,
                "resume_tokens": len(pending.resume_tokens),
                "num_speculative_tokens": int(ctx.num_speculative_tokens),
                "hybrid": bool(ctx.is_hybrid_model),
                "has_ssm": pending.ssm is not None,
            },
        )

    def _add_reference_request_with_kv_handoff(
        self, submission: KvHandoffRequest
    ) -> asyncio.Future[Any]:
        request_id, prompt, sampling_params, kv_meta, src_block_ids = submission
        ref = self._ref()
        ctx = ref.context
        bs = int(ctx.block_size_tokens)
        # The ticket's source blocks counted, then the engine's state and the ticket against
        # this decode, in Rust: prefix caching, transfer setup, SSM entry, first tokens, log
        # probabilities, source block count (HandoffStateError / HandoffMetadataError naming
        # the first bad field).
        num_blocks = reference_ticket_blocks(
            {
                "prefix_caching": bool(ctx.kv_block_allocator.enable_prefix_caching),
                "hybrid": bool(ctx.is_hybrid_model),
                "has_backend": self._kv_transfer_agent is not None,
                "request_id": request_id,
                "ssm": kv_meta.get("ssm"),
                "decode_has_ssm": bool(self._ssm_transfer_agents),
                "resume_tokens": len(kv_meta.get("resume_tokens", [])),
                "num_speculative_tokens": int(ctx.num_speculative_tokens),
                "return_log_probs": bool(getattr(sampling_params, "return_log_probs", False)),
                "top_n_logprobs": getattr(sampling_params, "top_n_logprobs", None),
                "prompt_tokens": len(prompt),
                "block_size": bs,
            },
            kv_meta,
            src_block_ids,
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
        if self._deferred_kv_handoffs or not self._whole()._try_start_kv_handoff_import(handoff):
            self._deferred_kv_handoffs.append(handoff)
        return handoff.future

    def _start_reference_import(self, handoff: DeferredKvHandoff) -> bool:
        """Reserve a live SSM slot (when SSM state comes) and blocks, and post the import, or
        change nothing."""
        ref = self._ref()
        ctx = ref.context
        allocator = ctx.kv_block_allocator
        meta = handoff.kv_meta  # a dict: the ticket check read its entries
        resume = [int(t) for t in meta.get("resume_tokens", [])]
        ssm_meta: dict[str, Any] | None = meta.get("ssm")
        # The hashes to look up in the prefix cache (none on a push transport: the prefill
        # writes every block) and the blocks the resume tokens need, in Rust.
        lookup, n_more = reference_import_sizes(
            bool(getattr(self._kv_transfer_agent, "is_push", False)),
            handoff.num_blocks,
            len(handoff.prompt),
            len(resume),
            int(ctx.block_size_tokens),
        )
        cached = self._whole()._find_cached_handoff_prefix(handoff.hashes, lookup)
        n_import = handoff.num_blocks - len(cached)
        fits = self._whole()._handoff_capacity_available(n_import + n_more, cached)
        if not fits or (ssm_meta and ctx.mamba_metadata.mamba_state_free_slot_count < 1):
            return False
        # The slot first: a refused reservation leaves every block where it was.
        ssm_import = self._reserve_ssm_handoff_import() if ssm_meta else None
        allocator.retain_memory_blocks(cached)
        got = allocator.allocate_memory_blocks(n_import + n_more)
        if got is None:
            self._release_reference_storage(cached, ssm_import)
            raise HandoffStateError(
                f"request {handoff.request_id}: allocator capacity changed between the check "
                f"and the allocation of {n_import + n_more} blocks",
                "kv_block_allocator",
            )
        fresh = [int(b) for b in got.tolist()]
        local = cached + fresh[:n_import]
        handle = None
        error: BaseException | None = None
        try:
            meta_left, src_left = drop_transfer_prefix_blocks(
                handoff.kv_meta, handoff.src_block_ids, len(cached)
            )
            handle = self._kv_transfer_agent.begin_pull_blocks(
                meta_left, src_left, fresh[:n_import]
            )
            if ssm_import is not None:
                self._whole()._start_ssm_handoff_import(handoff.request_id, meta["ssm"], ssm_import)
        except Exception as e:  # this rank's failure: reported to the quorum like any other
            error = e
        # Without an error (None has no such attribute) nothing can still write them.
        safe = bool(getattr(error, "transfer_destinations_safe", True))
        self._reference_imports.start(handoff.request_id, safe)
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
                destinations_safe=safe,
            )
        )
        loop = ref._loop
        loop.call_soon_threadsafe(loop.create_task, ref._notify_cond_for_new_request())
        return True

    def _finalize_reference_import(self, pending: PendingKvImport) -> None:
        ref = self._ref()
        ctx = ref.context
        # The imported suffix extends the reused prefix (each block keeps its parent link),
        # and the request's precomputed hashes, in Rust (the allocator registers an empty
        # suffix as nothing).
        blocks, hashes, parents, precomputed = reference_hash_registration(
            pending.local_blocks, pending.hashes, pending.cached_prefix_block_count
        )
        ctx.kv_block_allocator.register_kv_block_hashes(blocks, hashes, parent_hashes=parents)
        request_future = ref.add_request(
            pending.request_id,
            pending.prompt,
            pending.sampling_params,
            precomputed_block_hashes=precomputed,
        )
        request = ref.get_request(pending.request_id)
        if getattr(request.status, "name", None) == "FAILED":
            # add_request reported a validation failure through its own future.
            self._whole()._release_pending_kv_import(pending)
        else:
            facts = {"request_id": pending.request_id, "head": ref.waiting_request_ids[0]}
            check_reference("queue_head", facts)  # HandoffStateError naming both ids
            ref.waiting_request_ids.popleft()
            self._validate_decode_ready_handoff(pending)
            first = pending.resume_tokens[0]
            params = request.sampling_params
            stop_hit = False
            if params.num_tokens_to_generate > 0:
                request.generated_tokens.append(first)
                if ref.track_generated_token_events:
                    request.add_event_generated_token(first)
                added = getattr(request, "event_add_engine", None)
                if added is not None:
                    request.ttft = time.time() - added.timestamp
                # The engine's check answers False for a request without stop words.
                stop_hit = bool(ref._check_stop_words_for_request_post_append(request)[0])
            # A termination token or a stop word ends the request there; whether it has
            # generated every token already (in Rust).
            params.num_tokens_to_generate, done = reference_first_token(
                params.num_tokens_to_generate,
                len(request.generated_tokens),
                first,
                params.termination_id,
                stop_hit,
            )
            request.num_cached_tokens = len(pending.prompt)
            if done:
                self._whole()._release_pending_kv_import(pending)
                self._whole()._complete_handoff_request_without_forward(pending.request_id)
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
                sink = reference_record_sink(ref.use_coordinator, ref.is_mp_coordinator)
                if sink == "coordinator":
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
        # The record goes to the coordinator, to the caller detokenized, or is another
        # rank's to send (in Rust).
        match reference_record_sink(ref.use_coordinator, ref.is_mp_coordinator):
            case "coordinator":
                ref._send_request_records_to_coordinator([entry.record])
                ref._partial_emit_lengths.pop(request_id, None)
            case "caller":
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
        self._release_reference_storage(
            pending.local_blocks + pending.continuation_blocks, pending.ssm
        )
        pending.local_blocks = []
        pending.continuation_blocks = []
        pending.ssm = None

    def _release_reference_storage(self, blocks: list[int], ssm: PendingSSMImport | None) -> None:
        """Give an import's blocks (one allocator reference each) and live SSM slot back."""
        self._release_reference_pinned_blocks(blocks)
        if ssm is not None:
            self._ref().context.mamba_metadata.free_slot(ssm.live_slot)

    def _reference_local_outcome(self, pending: PendingKvImport) -> bool | None:
        """Whether this rank's import failed, or None while its transfers run (an error a
        poll raises is kept on the record as this rank's failure)."""
        if pending.local_error is not None:
            return True
        try:
            done = all(h.poll() for h in self._pending_transfer_handles(pending))
        except Exception as e:  # a terminal transfer error of this rank
            pending.local_error = e
            return True
        return False if done else None

    def _report_reference_imports(self) -> None:
        """Report each import's terminal local outcome once: to the model-parallel tracker,
        or, with one rank, as the decision itself (in Rust: ``ReferenceImports.report``)."""
        book = self._reference_imports
        records = {p.request_id: p for p in self._pending_kv_imports}
        outcomes = [(rid, self._reference_local_outcome(records[rid])) for rid in book.unreported()]
        tracker = self._handoff_completion_tracker
        shared = tracker is not None and tracker.world_size > 1
        mp = get_pg_size(self._ref().pg_collection.mp)
        for rid, failed in book.report(outcomes, shared, mp):
            cast(HandoffCompletionTracker, tracker).report(rid, failed)

    def _admit_reference_imports(self) -> int:
        """Admit decided imports in the order they started (``ReferenceImports``): a failed
        one is released, or quarantined while a transfer may still write its storage; an ok
        one waits only for room in the batch."""
        ref = self._ref()
        book = self._reference_imports
        records = {p.request_id: p for p in self._pending_kv_imports}
        admitted = 0
        try:
            for rid, failed in book.decided_in_order():
                pending = records[rid]
                if failed:
                    self._fail_reference_import(
                        pending,
                        pending.local_error
                        or TransferError(
                            f"KV import of request {rid} failed on a model-parallel peer",
                            "request_id",
                        ),
                    )
                    continue
                try:
                    self._validate_decode_ready_handoff(pending)
                    if not can_admit_prefilled_decode(ref.context, len(pending.resume_tokens)):
                        continue
                    self._whole()._finalize_kv_handoff_import(pending)
                    book.admitted(rid)
                    admitted += 1
                except Exception as exc:
                    self._fail_reference_import(pending, exc)
                    raise
        finally:
            self._pending_kv_imports = deque(records[rid] for rid in book.importing())
        if admitted:
            loop = ref._loop
            loop.call_soon_threadsafe(loop.create_task, ref._notify_cond_for_new_request())
        return admitted

    def _fail_reference_import(self, pending: PendingKvImport, error: BaseException) -> None:
        """The import failed with ``error`` (its future's exception): its storage goes back,
        or is quarantined while a transfer may still write it (``ReferenceImports.failed``)."""
        book = self._reference_imports
        rid = pending.request_id
        # A peer may fail before posting its half of a two-sided transfer: never wait on this
        # rank's unmatched operation; quarantine unless terminal.
        handles = self._pending_transfer_handles(pending)
        quiet = book.may_release(rid) and self._wait_for_transfer_handles(*handles)
        if book.failed(rid, quiet):
            self._whole()._release_pending_kv_import(pending)
        else:
            self._quarantined_kv_imports.append(pending)
            logger.error("request %d: storage quarantined after an incomplete handoff", rid)
        future = cast(asyncio.Future[Any], pending.future)  # every reference import has one
        if not future.done():
            future.set_exception(error)

    def _reset_reference_imports(self) -> None:
        """All or nothing: refuse while blocks are pinned or a transfer may still touch cache
        storage (in Rust: ``ReferenceImports.reset``, ResetRefusedError); otherwise cancel
        queued handoffs and release every import."""
        pinned = sorted(self._pinned_handoff_blocks)
        # Pinned blocks refuse before any wait (ResetRefusedError, in Rust).
        refuse_reset_while_pinned(pinned)
        wait = self._wait_for_transfer_handles
        imports = list(self._pending_kv_imports) + list(self._quarantined_kv_imports)
        pushes = [(rid, wait(*hs)) for rid, hs in self._pending_kv_pushes]
        handles = self._pending_transfer_handles
        # Unsafe destinations are never waited on.
        quiet = [(p.request_id, p.destinations_safe and wait(*handles(p))) for p in imports]
        self._reference_imports.reset(pinned, pushes, quiet)
        self._pending_kv_pushes = []
        futures = [h.future for h in self._deferred_kv_handoffs] + [p.future for p in imports]
        for future in futures:
            cast(asyncio.Future[Any], future).cancel()  # a no-op on a future already done
        for pending in imports:
            self._whole()._release_pending_kv_import(pending)
        self._deferred_kv_handoffs.clear()
        self._pending_kv_imports = deque()
        self._quarantined_kv_imports = []
