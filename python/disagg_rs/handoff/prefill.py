"""Prefill side of the handoff mixin: prepare and capture a finished prefill's ticket, pin its
blocks (PinLedger), stage or push its state, release it on RELEASE_KV or lease expiry.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from disagg_rs._core import (
    LedgerAction,
    PinLedger,
    gathered_integrity_pieces,
    push_sends,
)
from disagg_rs.exceptions import DisaggError
from disagg_rs.handoff.base import (
    HandoffBase,
    _of_kind,
    _PreparedHandoffMetadata,
)
from disagg_rs.integrity import (
    IntegrityPiece,
    IntegrityTable,
    chunk_tokens_for,
)


def handoff_ticket(
    *,
    src_block_ids: list[int],
    src_block_size_tokens: int,
    src_ssm_slot: int | None,
    resume_tokens: list[int],
    pin_epoch: int,
    lease_ns: int,
    lease_until_wall_ns: int | None = None,
    integrity: Any = None,
    staged: Mapping[int, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The handoff ticket a ledger-driven prefill announces for one pinned request: the one
    place its fields are assembled.

    ``src_block_ids`` / ``src_ssm_slot`` are the pinned source state, ``resume_tokens`` the
    tokens the decode continues from, ``pin_epoch`` the pin's epoch, ``lease_ns`` its lease
    and ``lease_until_wall_ns`` the lease's end on the prefill's wall clock (when it reads
    one). ``integrity`` is the digest table in wire form, ``staged`` the packed staging
    tickets by decode rank; absent optional fields are left out of the ticket. The
    coordinator adds ``prefill_meta`` (the prefill's static metadata) on its way to a decode.
    """
    ticket: dict[str, Any] = {
        "src_block_ids": list(src_block_ids),
        "src_block_size_tokens": int(src_block_size_tokens),
        "src_ssm_slot": src_ssm_slot,
        "resume_tokens": list(resume_tokens),
        "pin_epoch": int(pin_epoch),
        "lease_ns": int(lease_ns),
    }
    optional = {
        "lease_until_wall_ns": lease_until_wall_ns,
        "integrity": integrity,
        "staged": dict(staged) if staged else None,
    }
    ticket.update((key, value) for key, value in optional.items() if value is not None)
    return ticket


def with_push_destination(
    decode_metas: Sequence[Mapping[str, Any]], destination: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The decode's per-rank transfer metadata with the destination it posted receives for
    (``dst_block_ids``, ``dst_ssm_slot``, ``num_tokens``, ``token_start``) attached, as
    :meth:`InferenceStateHandoffMixin.push_handoff_kv` takes it."""
    return [{**m, "destination": dict(destination)} for m in decode_metas]


def _no_streams() -> int:
    """``poll_streams`` of a backend that streams nothing."""
    return 0


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


class PrefillHandoff(HandoffBase):
    """The prefill half of :class:`~disagg_rs.handoff.mixin.InferenceStateHandoffMixin`."""

    def _prepare_handoff_metadata_batch(
        self,
        requests_and_state: Iterable[tuple[Any, ...]],
        decode_tokens_by_request: Mapping[int, list[int]],
    ) -> dict[int, _PreparedHandoffMetadata]:
        """Assemble metadata for all handoffs completed by one engine step.

        Entries are ``(request, block_ids)`` or ``(request, block_ids, ssm_slot)``. No
        collective runs here: the static transport metadata was gathered at setup.
        """
        return self._path.prepare_metadata(requests_and_state, decode_tokens_by_request)

    def _prepare_ledger_handoff_metadata(
        self,
        requests_and_state: Iterable[tuple[Any, ...]],
        decode_tokens_by_request: Mapping[int, list[int]],
    ) -> dict[int, _PreparedHandoffMetadata]:
        tokens = decode_tokens_by_request
        return {int(e[0].request_id): self._prepared_of(tokens, *e) for e in requests_and_state}

    def _prepared_of(
        self,
        decode_tokens_by_request: Mapping[int, list[int]],
        request: Any,
        blocks: list[int],
        slot: int | None = None,
    ) -> _PreparedHandoffMetadata:
        """One entry of :meth:`_prepare_ledger_handoff_metadata`."""
        return _PreparedHandoffMetadata(
            local_blocks=list(blocks),
            local_ssm_slot=slot,
            kv_meta={
                "src_block_ids": list(blocks),
                "src_block_size_tokens": self._host().block_size_tokens,
            },
            ssm_meta=None if slot is None else {"src_slot": slot},
            resume_tokens=list(decode_tokens_by_request.get(int(request.request_id), [])),
        )

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
        return self._path.capture_meta(request, prepared, decode_metas)

    def _capture_ledger_handoff_meta(
        self,
        request: Any,
        prepared: _PreparedHandoffMetadata | None,
        decode_metas: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        engine = self._host()
        rid = int(request.request_id)
        prepared = prepared or self._prepared_of({}, request, request.block_ids, request.ssm_slot)
        blocks, slot = list(prepared.local_blocks), prepared.local_ssm_slot
        # Digest before pinning (collective): a digest that raises leaves nothing pinned.
        n = len(request.prompt)
        integrity = self._integrity_table_of(blocks, n, slot) if self.verify_integrity else None
        now = self.handoff_now_ns
        epoch = self._pins().pin(
            rid, blocks, slot, lease_until=now + self.handoff_lease_ns, now=now
        )
        engine.block_pool.release(blocks)
        self._event(("pinned", rid, f"{len(blocks)} blocks slot={slot}"))
        wall = self.handoff_wall_now_ns
        return handoff_ticket(
            src_block_ids=blocks,
            src_block_size_tokens=engine.block_size_tokens,
            src_ssm_slot=slot,
            resume_tokens=[int(request.first_token)],
            pin_epoch=epoch,
            lease_ns=self.handoff_lease_ns,
            lease_until_wall_ns=None if wall is None else wall + self.handoff_lease_ns,
            integrity=integrity,
            staged=self._stage_for_decode(rid, blocks, len(request.prompt), decode_metas),
        )

    def _integrity_table_of(
        self, block_ids: list[int], num_tokens: int, ssm_slot: int | None
    ) -> dict[str, Any]:
        """The full digest of one prefilled request, assembled over the model-parallel ranks
        (collective: each rank contributes the cells it holds), in wire form."""
        engine = self._host()
        started = time.perf_counter_ns()
        chunk = chunk_tokens_for(num_tokens)
        local: list[IntegrityPiece] | str
        try:
            local = self._local_integrity_pieces(block_ids, num_tokens, ssm_slot, chunk)
        except DisaggError as e:  # gathered, so every rank raises instead of one hanging
            local = f"{type(e).__name__}: {e}"
        # Every rank's pieces; a rank's failure raises on every rank alike (HandoffStateError).
        pieces = gathered_integrity_pieces(engine.handoff_all_gather(local))
        table = IntegrityTable.merge(self._integrity_shapes(-(-num_tokens // chunk)), pieces)
        table.chunk_tokens = chunk
        self.handoff_stats["integrity_ns"] += time.perf_counter_ns() - started
        return table.to_wire()

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
        own = _of_kind(self.handoff_static_meta["ranks"], "kv")
        kvs = _of_kind(decode_metas, "kv")
        tickets = [stage(kv, blocks, src_metas=own, num_tokens=num_tokens) for kv in kvs]
        local = {
            int(kv["layout"]["global_rank"]): t
            for kv, t in zip(kvs, tickets, strict=True)
            if t.get("staged")
        }
        self._staged_by_request[request_id] = list(local.values())
        merged: dict[int, list[dict[str, Any]]] = {}
        gathered = engine.handoff_all_gather(local)
        for dst, t in itertools.chain.from_iterable(per_rank.items() for per_rank in gathered):
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
        self._path.release_handoff_blocks(request_id)

    def _release_ledger_handoff_blocks(self, request_id: int) -> None:
        if request_id in self._pending_pushes:
            # The push may still read them: the ledger defers the release until it settles.
            self._event(("release_deferred", request_id, "push in flight"))
        actions = self._pins().release(request_id)
        self._release_staged(request_id)
        self._released(actions)

    def _released(self, actions: Sequence[LedgerAction]) -> None:
        """Record the pin ledger's releases."""
        for a in actions:
            self._event(("released", a.request_id, str(a.reason)))

    def _release_pinned_handoff_blocks(self, block_ids: list[int]) -> int:
        """Drop this request's ownership of its pinned blocks; returns how many.

        Reference-design engine: one allocator reference per block. Ledger-driven engine: the
        PinLedger releases them with the pin (nothing to do here).
        """
        return self._path.release_pinned_blocks(block_ids)

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
        self._path.push_kv(request_id, decode_metas)

    def _push_ledger_handoff_kv(self, request_id: int, decode_metas: list[Any]) -> None:
        epoch, _, handles = self._post_push(request_id, decode_metas, filler=False)
        self._pending_pushes[request_id] = (epoch, handles)
        self.handoff_stats["pushes"] += 1

    def _post_push(
        self, request_id: int, decode_metas: list[Any], filler: bool
    ) -> tuple[int, int, list[Any]]:
        """Plan and post the sends of one push (or its filler): the pin's epoch, the KV tokens
        sent and the sends' handles."""
        backends = self._transfer_backends()
        # In Rust, in one call: an id that cannot be tagged refused before anything starts;
        # the push validated (pin, destination, token range) and marked in flight in the pin
        # ledger (a filler changes nothing); which states go (KV to the decode's KV ranks,
        # each SSM kind with the slot), with their tags.
        epoch, num_tokens, sends = push_sends(
            self._pins(),
            request_id,
            decode_metas,
            self.handoff_static_meta["ranks"],
            list(backends),
            filler=filler,
        )
        handles = [
            backends[kind].begin_push_blocks(metas, src, dst, **kwargs)
            for kind, metas, src, dst, kwargs in sends
        ]
        return epoch, num_tokens, handles

    def push_handoff_filler(self, request_id: int, decode_metas: list[Any]) -> None:
        """Answer the receives a decode posted for a handoff this engine will not push (the
        request is unknown or no longer pinned, its push was refused, its lease ended) with
        fillers (two-sided transports, ledger-driven engines): the same messages a push
        would send to the same ``destination``, their headers saying ``aborted``. The
        decode's receives complete at once, its import fails without waiting for its
        deadline, and the next send on the pair matches its own receive: messages match by
        post order per pair (NCCL), so a receive left unanswered would take it.

        ``decode_metas``: as for :meth:`push_handoff_kv`. Nothing is read from the cache; the
        sizes come from the destination (checked in the pin ledger, with this pool's size
        as the cap).
        """
        _, num_tokens, handles = self._post_push(request_id, decode_metas, filler=True)
        self._filler_pushes.append((request_id, handles))
        self.handoff_stats["push_fillers"] += 1
        self._event(("push_filler", request_id, f"{num_tokens} tokens"))

    def _poll_pending_kv_pushes(self) -> int:
        """Reap completed push sends; unfinished ones stay pending. Returns how many ended.

        Also advances the streamed packed copies of a one-sided backend (``poll_streams``):
        the decodes' acknowledgements free slots, the next chunks are packed and announced.
        """
        getattr(self._kv_backend, "poll_streams", _no_streams)()
        return self._path.poll_pushes()

    def _poll_ledger_pushes(self) -> int:
        ended = 0
        fillers = self._filler_pushes
        settled = [self._wait_for_transfer_handles(*hs, block=False) for _, hs in fillers]
        self._filler_pushes = list(itertools.compress(fillers, [not done for done in settled]))
        for rid, (epoch, handles) in list(self._pending_pushes.items()):
            if not self._wait_for_transfer_handles(*handles, block=False):
                continue
            del self._pending_pushes[rid]
            ended += 1
            self._released(self._pins().push_settled(rid, epoch))
        return ended
