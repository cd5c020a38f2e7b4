"""One-sided transfers over NIXL: the decode reads the prefill's blocks (``NixlTransferBackend``).

Each rank registers its state buffers once on ONE NIXL agent shared by them
(``_NixlAgentContext``, reference-counted; ``new_registered_buffer`` adds the SSM conv and
recurrent buffers). ``export_meta()`` ships the agent metadata with the buffer description;
a decode registers a peer lazily on its first pull and replaces it when the peer's
incarnation changes (a restarted prefill must never be read through a stale registration).

Two ways to move a source rank's bytes, chosen per source rank by the compiler:

- direct: the compiled ``(addr, len, device)`` descriptor lists go to NIXL as one READ;
- staged: the SOURCE packs its fragments into its registered staging region
  (``stage_blocks``, once per handoff, before the pull is announced) and announces the copy
  with a NIXL notification once its pack has completed; the decode reads the packed region
  with one descriptor once announced and scatters it (``staging.scatter``) on completion;
- streamed (a packed copy larger than the source's staging pool): the source packs it chunk
  by chunk into a few slots of its pool and announces each with a NIXL notification; the
  decode reads each into a few slots of its own pool, acknowledges it once read (which
  frees the source's slot for a later chunk) and scatters it (``_StreamOut`` /
  ``_ChunkedRead``; the schedule and the notifications are ``_core.StreamSource`` /
  ``_core.StreamSink``). The
  source advances only when polled (``poll_streams``, from the prefill's turn).

``stage_blocks`` returns as soon as the packs are queued (the serving thread never waits for
the GPU): the decode reads a region, whole copy or chunk, only after the source announced
it, which ``poll_streams`` does once the pack's CUDA event has completed (host memory: at
once, on the same path).

The ticket ``stage_blocks`` returns travels with the handoff to the decode's
``begin_pull_blocks(..., staged=[ticket, ...])``. In ``"auto"`` mode the source packs (it
cannot know the decode's blocks) and the decode reads the packed copy only where the
compiler's cost model prefers staging; any source can always be read directly.

Prepared descriptor lists (``prep_xfer_dlist`` / ``make_prepped_xfer``) pay off when one list
is prepared once and indexed by many transfers, as in the reference design's fixed per-block
lists. Compiled programs are coalesced per handoff, so a list would be prepared and used once:
the backend posts them with ``initialize_xfer``, which does the same work in one call.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import hashlib
import importlib.metadata as importlib_metadata
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs import _core
from disagg_rs.exceptions import (
    TransferError,
    TransferStartError,
)
from disagg_rs.transfer_backends import device_plan as dp
from disagg_rs.transfer_backends import ipc
from disagg_rs.transfer_backends.base import (
    BlockIds,
    Clock,
    PeerMeta,
    ProgramCompiler,
    TransferBackendBase,
    TransferHandleBase,
    incarnation_of,
    kv_layout_from_meta,
    no_blocks,
    peer_set_key,
)

__all__ = ["NixlPullHandle", "NixlTransferBackend", "StagingArena"]

logger = logging.getLogger(__name__)

#: Poll interval of ``NixlPullHandle.wait`` (NIXL has no blocking wait).
_POLL_INTERVAL_S = 0.0005
#: Default deadline of a pull, from submission.
_POLL_TIMEOUT_S = 30.0


def _attempt(call: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, result)`` of ``call()``, or ``(False, repr(exception))``."""
    try:
        return True, call()
    except Exception as exc:
        return False, repr(exc)


def _detect_nixl_variant(api_module_name: str) -> str | None:
    """Return the installed distribution's package (``nixl_cu12``, ``nixl_cu13``, ...) that
    provides the active NIXL API module ``api_module_name``; ``None`` if none is installed
    (or the installed distributions cannot be listed: a broken site-packages must not stop
    the import)."""
    top = api_module_name.split(".", 1)[0]
    listed, provided = _attempt(importlib_metadata.packages_distributions)
    logger.debug("installed distributions listed: %s", listed)
    return top if listed and provided.get(top) else None


try:
    from nixl import _api as _nixl_api

    #: NIXL's agent class and its config (module globals, so tests may replace them).
    nixl_agent: Any = _nixl_api.nixl_agent
    nixl_agent_config: Any = _nixl_api.nixl_agent_config
    #: Package of the active NIXL build (``nixl_cu12``/``nixl_cu13``), or ``None``.
    _NIXL_VARIANT: str | None = _detect_nixl_variant(_nixl_api.__name__)
    _HAVE_NIXL = True
except ImportError:  # the backend then refuses construction with an explanation
    nixl_agent = None
    nixl_agent_config = None
    _NIXL_VARIANT = None
    _HAVE_NIXL = False


#: Whether a ``UCX_TLS`` value leaves UCX a transport that moves CUDA memory (decided in Rust).
ucx_tls_allows_cuda = _core.ucx_tls_allows_cuda
#: Why a NIXL build's CUDA major differs from torch's, or ``None`` (decided in Rust).
nixl_cuda_major_mismatch = _core.nixl_cuda_major_mismatch
#: Whether a NIXL backend's memory types include GPU memory (decided in Rust).
backend_supports_vram = _core.backend_supports_vram


def _validate_ucx_transport_config(
    memory_buffer: torch.Tensor, have_nixl: bool = True, mode: str = "auto"
) -> str:
    """Configure safe UCX memory detection and reject host-only transports for GPU buffers;
    return ``mode`` checked (the nixl package, ``have_nixl``, and the mode are checked first).

    Host-memory buffers are not checked: a CPU deployment may restrict UCX to ``tcp,self,sm``.
    The UCX memory-type cache misclassifies CUDA allocations reused by torch's caching
    allocator; disabling it (unless set) is the documented safe setting for registered VRAM.
    What to set is decided in Rust, after the checks.
    """
    tls, cache = os.environ.get("UCX_TLS"), os.environ.get("UCX_MEMTYPE_CACHE")
    checked, env = _core.nixl_setup(have_nixl, mode, memory_buffer.is_cuda, tls, cache)
    os.environ.update(env)
    return checked


def _validate_nixl_cuda_support(agent: Any, memory_buffer: torch.Tensor) -> None:
    """Reject a NIXL/UCX runtime that cannot safely register CUDA memory (host buffers are
    not checked). An older NIXL that cannot list its memory types is left to registration."""
    get_mem_types = getattr(agent, "get_backend_mem_types", _unknown_mem_types)
    _core.check_nixl_cuda_support(
        memory_buffer.is_cuda, _NIXL_VARIANT, torch.version.cuda, get_mem_types("UCX")
    )


def _unknown_mem_types(backend: str) -> None:
    """What an older NIXL, which cannot list a backend's memory types, is taken to say."""
    del backend


class _NixlAgentContext:
    """NIXL resources shared by the state buffers on one rank: one agent, one peer table.

    The agent is created by the first ``acquire()`` and dropped by the last ``release()``;
    who holds it and which peers are registered on it is ``_core.NixlAgentPeers``'s.
    """

    def __init__(
        self, agent_name: str, backends: Sequence[str] = ("UCX",), incarnation: int | None = None
    ) -> None:
        self.agent_name = agent_name
        self.backends = list(backends)
        self.incarnation = incarnation_of(incarnation)
        #: The shared agent while a registration holds it, else ``None``.
        self.agent: Any = None
        #: Registrations holding the agent, and the peers registered on it.
        self.registrations = _core.NixlAgentPeers(agent_name)
        #: Stream notifications waiting for their stream, by (peer agent name, stream id):
        #: each stream open on this rank has a mailbox (see :meth:`mail`).
        self.mailboxes = _core.StreamMailboxes()
        #: Stream ids start at a random point below 2**62: a notification an earlier
        #: incarnation of this agent (same name) sent late, after a decode forgot it, never
        #: names a stream of this one.
        self._next_stream = 1 + secrets.randbits(62)

    @property
    def peers(self) -> dict[str, tuple[int, str, str]]:
        """Peer agent name -> (incarnation, digest of its metadata, id NIXL gave it)."""
        return self.registrations.peers()

    @property
    def known_peers(self) -> dict[str, tuple[int, str, str]]:
        """The peer table (the reference design's name)."""
        return self.peers

    def live_agent(self) -> Any:
        """The agent; raises ``TransferError`` once every registration has been released."""
        self.registrations.check_open()
        return self.agent

    def acquire(self) -> Any:
        """Retain the shared agent for one buffer registration (created on first use)."""
        if self.agent is None:
            options = _core.NixlAgentPeers.agent_options(_HAVE_NIXL, self.backends)
            self.agent = nixl_agent(self.agent_name, nixl_agent_config(**options))
        self.registrations.retain()
        return self.agent

    def release(self) -> None:
        """Release one registration; drop the agent after the last user closes."""
        self._forget(self.registrations.release())
        if not self.registrations.refs:
            self.agent = None

    @property
    def ref_count(self) -> int:
        """Registrations still holding the agent."""
        return int(self.registrations.refs)

    @property
    def refs(self) -> int:
        """Alias of ``ref_count``."""
        return self.ref_count

    def new_stream_id(self) -> int:
        """A stream id unique on this agent (named in the ticket and every notification)."""
        sid = self._next_stream
        self._next_stream += 1
        return sid

    def mail(self, box: int, now: float, timeout_s: float) -> tuple[list[bytes], bool]:
        """Take what mailbox ``box`` (``mailboxes.open``) received so far, in order, and
        whether its peer is gone (forgotten since: nothing more will come).

        NIXL hands every notification of the agent out at once: each is routed by the peer
        and stream named in it (parsed in Rust); one of a stream not open here waits for it
        (bounded, and at most ``timeout_s`` from ``now``, the asking backend's clock and
        stream timeout: a stream opened later could not run anyway), one that is not a
        stream notification is dropped.
        """
        notifs = list(self.live_agent().get_new_notifs().items())
        self.mailboxes.route(notifs, now, timeout_s)
        return self.mailboxes.take(box)

    def _forget(self, peers: Sequence[tuple[str, str]]) -> None:
        """Remove the peers the table forgot (``(name, NIXL id)`` each) from NIXL, and end
        their streams (a new incarnation numbers its streams anew; those open with this one
        end)."""
        for name, loaded in peers:
            logger.info("forgetting NIXL peer %s", name)
            self.mailboxes.forget(name)
            # A peer that is gone cannot be disconnected cleanly: the outcome is only logged.
            removed = _outcome(functools.partial(self._remove_remote, loaded))
            logger.debug("removing NIXL peer %s: %s", name, removed)

    def _remove_remote(self, loaded: str) -> Any:
        return self.agent.remove_remote_agent(loaded)

    def ensure_peer(self, meta: PeerMeta) -> str:
        """Register the peer on first use, replacing a stale incarnation; return the id NIXL
        gave it (its agent name). Takes the reference design's ``agent_metadata_b64`` and a
        missing incarnation (0) too."""
        name = str(meta["agent_name"])
        blob, digest = _decoded(meta.get("agent_metadata", meta.get("agent_metadata_b64")))
        incarnation = int(meta.get("incarnation", 0))
        known, stale = self.registrations.admit(name, incarnation, digest)
        self._forget(stale)
        if known is not None:
            return str(known)
        # A registration NIXL refuses raises ``TransferError`` (field ``agent_metadata``).
        added = _attempt(functools.partial(self._add_remote, blob))
        return str(self.registrations.register(name, incarnation, digest, *added))

    def _add_remote(self, blob: bytes) -> Any:
        return self.live_agent().add_remote_agent(blob)


@functools.lru_cache(maxsize=1024)
def _decoded(text: str | bytes) -> tuple[bytes, str]:
    """A peer's NIXL metadata (base64 ``text``) decoded, and its digest: once per text (a text
    seen again, the same object or an equal one, is found by its cached hash)."""
    blob = base64.b64decode(text)
    return blob, hashlib.sha256(blob).hexdigest()


#: Byte ranges of the registered staging region (first fit, 256-byte aligned starts), kept
#: in Rust: one entry per staged part in flight, never one per block.
StagingArena = _core.StagingRanges


class _Reserved:
    """``nbytes`` of the staging pool reserved for a pack (``with``, the range's offset):
    given back when queuing the pack raises. Lighter than an ``ExitStack`` on the
    host-submit path."""

    __slots__ = ("arena", "offset")

    def __init__(self, arena: StagingArena, nbytes: int) -> None:
        self.arena, self.offset = arena, int(arena.alloc(nbytes))

    def __enter__(self) -> int:
        return self.offset

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:
            self.arena.free(self.offset)


def _settled() -> bool:
    """The landing of a part with nothing to wait for."""
    return True


def _no_cleanup() -> None:
    """The cleanup of a part with nothing to give back."""


@dataclass
class _PullPart:
    """One NIXL READ of a pull and what to do when it lands."""

    src_rank: int
    xfer: Any
    on_done: Callable[[], None] | None = None
    cleanup: Callable[[], None] = _no_cleanup
    context: str = ""
    descriptors: int = 0
    """Descriptors this read posted (1 for a staged read)."""
    landed: Callable[[], bool] = _settled
    """Set by ``on_done`` when the landing (scatter) is queued on the GPU: the part is DONE
    once it returns True (a CUDA event query; the serving thread never synchronises)."""
    local: bool = False
    """No NIXL transfer: the part is a GPU copy (CUDA IPC) settled by ``landed`` alone."""
    step: Callable[[], str] | None = None
    """A part that drives its own reads (chunked staging): advances once, returns "PROC"
    or "DONE", raises on failure."""
    poll_s: float = _POLL_INTERVAL_S
    """How often the part wants its handle polled (a staged read posts its next chunk only
    when polled)."""

    def is_landed(self) -> bool:
        """Whether the landing has completed (or there is none to wait for)."""
        return self.landed()

    def finish(self) -> None:
        """Run the cleanup once."""
        cleanup, self.cleanup = self.cleanup, _no_cleanup
        cleanup()


#: One handoff: source ids, destination ids and tokens.
_Handoff = tuple[BlockIds, BlockIds, int | None]


@dataclass(frozen=True)
class _IpcRoute:
    """A peer set on the CUDA IPC path: its parsed peers (held, so the identity key of the
    route stays theirs), the merged device copy and the part label."""

    peers: tuple[Any, ...]
    copy: dp.PullRoute
    label: str

    def pull(
        self,
        backend: NixlTransferBackend,
        staged: list[Mapping[str, Any]],
        handoff: _Handoff,
        timeout: float,
    ) -> NixlPullHandle | None:
        """Queue one handoff on this route (tickets checked, ids checked and written by Rust,
        one upload, one launch per merged plan); its handle, or ``None`` (nothing queued)
        when its ids do not fit the route."""
        peers = list(self.peers)
        _core.check_staging_tickets_of(staged, peers)
        got = self.copy.run(
            peers,
            *handoff,
            local_num_blocks=backend.expected_num_blocks,
            local_tokens_per_block=backend.tokens_per_block,
        )
        if got is None:
            return None
        done, nbytes = got  # a CUDA event: routes exist for GPU buffers only
        part = _PullPart(-1, None, context=self.label, landed=done.query, local=True)
        handle = NixlPullHandle(backend.agent, [part], timeout, backend.clock, None)
        handle.stats = {"bytes": nbytes, "descriptors": 0, "modes": {-1: "ipc"}}
        return handle


@dataclass(frozen=True)
class _NoIpcRoute:
    """A peer set that cannot take the CUDA IPC path (its peers held like a route's): it is
    read over NIXL."""

    peers: tuple[Any, ...] = ()

    @staticmethod
    def pull(*args: Any) -> None:
        """Nothing is queued here."""
        del args


class NixlPullHandle(TransferHandleBase):
    """Pollable handle for one logical pull made of one or more NIXL transfers."""

    def __init__(
        self, agent: Any, parts: list[_PullPart], timeout_s: float, clock: Clock, error: str | None
    ) -> None:
        super().__init__(timeout_s, clock)
        self.poll_interval_s = _POLL_INTERVAL_S
        self.agent = agent
        self.parts = parts
        self.error = error
        self.fold = _core.PullParts(
            [
                (p.step is not None, p.local, p.xfer is not None, p.on_done is not None, p.context)
                for p in parts
            ],
            error,
        )

    @property
    def xfers(self) -> list[Any]:
        """The NIXL transfer handles of the parts still held."""
        return [p.xfer for p in self.parts if p.xfer is not None]

    @property
    def contexts(self) -> list[str]:
        """One label per part, for logs."""
        return [p.context for p in self.parts]

    def _progress(self, now: float) -> bool:
        # Rust folds the part states; Python only runs the calls it asks for. Past the
        # deadline, a part with nothing in flight fails quietly (``PullParts.settle``).
        parts, fold = self.parts, self.fold
        landed, steps, xfers = fold.begin()
        check = self.agent.check_xfer_state
        on_done = fold.observe(
            [parts[i].is_landed() for i in landed],
            [_outcome(cast(Callable[[], Any], parts[i].step)) for i in steps],
            [_outcome(functools.partial(check, parts[i].xfer)) for i in xfers],
        )
        settle = fold.after_on_done(
            on_done, [_outcome(cast(Callable[[], Any], parts[i].on_done)) for i in on_done]
        )
        releases, terminal = fold.settle([parts[i].is_landed() for i in settle], now, self.deadline)
        self._apply(releases)
        return terminal

    def cancel(self) -> None:
        """Stop the parts still running: NIXL releases (aborts) each posted read, so nothing
        writes the destinations afterwards. The handle then counts as failed."""
        self._apply(self.fold.cancel())
        self.done = True

    def _apply(self, releases: tuple[list[int], list[int], list[int]]) -> None:
        """Return the handles ``abort`` names to NIXL, forget those ``drop`` names and run
        the cleanups ``finish`` names; take the fold's first error."""
        abort, drop, finish = releases
        _release_xfers(self.agent, [self.parts[i].xfer for i in abort])
        for i in drop:
            self.parts[i].xfer = None
        for i in finish:
            self.parts[i].finish()
        self.error = self.fold.error


def _release_xfers(agent: Any, xfers: Sequence[Any]) -> None:
    """Give NIXL back the handles of reads still held, aborting those in flight (so nothing
    writes their destinations afterwards); one NIXL cannot release is left to it."""
    for xfer in xfers:
        with contextlib.suppress(Exception):
            agent.release_xfer_handle(xfer)


def _outcome(call: Callable[[], Any]) -> tuple[bool, str]:
    """``(True, str(result))`` of ``call()``, or ``(False, repr(exception))``."""
    ok, got = _attempt(call)
    return ok, str(got)


#: Slots of the decode's staging pool one chunked read cycles through: one landing while one
#: scatters and one is read.
_CHUNK_SLOTS = 3
#: ``wait()``'s pause between polls of a handle with a chunked read (a chunk of a few tens of
#: MiB lands in about a tenth of a millisecond on NVLink).
_CHUNK_POLL_INTERVAL_S = 0.00002


def _landed_event(window: torch.Tensor) -> Any:
    """An event recorded after the work just queued on ``window``'s device (a host window's
    work has completed already)."""
    if not window.is_cuda:
        return dp._DONE
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _settle(events: Sequence[Any]) -> None:
    """Wait for the work behind ``events`` (packs or scatters still queued on a slot)."""
    for event in events:
        event.synchronize()


def _scatter_chunk(
    backend: NixlTransferBackend,
    plan: dp.DevicePlan,
    ids: torch.Tensor,
    n_tok: int,
    chunks: Sequence[Sequence[int]],
    k: int,
    window: torch.Tensor,
) -> Any:
    """Queue the scatter of chunk ``k`` of ``chunks`` (read into ``window``) into blocks
    ``ids``; its completion."""
    k_lo, k_hi, lo, _ = chunks[k]
    dp.copy(plan, dp.Side("packed", window, bias=lo),
            dp.Side("dst", backend.memory_buffer, ids), n_tok, items=(k_lo, k_hi))  # fmt: skip
    return _landed_event(window)


class _ChunkedRead:
    """One source's packed copy read chunk by chunk through a few slots of this rank's
    staging pool: the copy held whole in the source's region, or streamed through a few
    slots of it (announced one by one, each acknowledged once its read has landed).

    The device plan cuts the packed region into item ranges (``DevicePlan.chunks``); each
    chunk is one NIXL READ into a free slot, then one scatter of its items from the slot
    (``device_plan.copy`` with the slot as a packed window), and the slot is free again once
    the scatter's event has completed. So the READ of chunk ``i + 1`` runs while chunk ``i``
    scatters, the pool holds ``slots x slot_bytes`` whatever the prompt size, and nothing
    waits on the host: :meth:`step` only polls. What to read next, into which slot, what has
    landed and what to acknowledge is ``_core.StreamSink``'s. A copy held whole read in one
    piece is the same read of one chunk into one slot (``_core.StreamSink.one_piece``).
    Nothing is read before the source announced it.
    """

    def __init__(
        self,
        backend: NixlTransferBackend,
        meta: PeerMeta,
        peer: tuple[str, tuple[str, str]],
        slot_bytes: int,
        offsets: list[int],
    ) -> None:
        #: ``peer``: the source's NIXL peer id and the memory types of its reads.
        self.backend, self.meta, (self.peer, self.mems) = backend, meta, peer
        #: This rank's staging pool (a staged read is routed only where there is one).
        self.staging = cast(torch.Tensor, backend.staging_buffer)
        #: This rank's slots, owned from here on: :meth:`close` gives them back.
        self.offsets = offsets
        self.slot_bytes = slot_bytes
        self.src_name = str(meta["agent_name"])
        self.remote = int(meta["staging"]["addr"])
        self.sink = _core.StreamSink.whole([], 0, 1)  # nothing to read until :meth:`start`
        self.id = 0
        #: This read's mailbox (``StreamMailboxes.open``; 0: none opened).
        self.box = 0
        self.chunks: list[tuple[int, ...]] = []
        #: Reads in flight and scatters queued, by chunk.
        self.xfers: dict[int, Any] = {}
        #: Completion of each scatter queued and not finished, in queue order.
        self.events: list[Any] = []

    def start(self, sink: _core.StreamSink, land: Callable[[int, torch.Tensor], Any]) -> None:
        """Read what ``sink`` schedules; ``land(chunk, window)`` queues the scatter of a chunk
        read into ``window`` and returns its completion."""
        self.sink, self.land = sink, land
        self.chunks = [tuple(c) for c in self.sink.chunks]
        self.id = int(self.sink.stream_id)
        self.box = self.backend._ctx.mailboxes.open(self.src_name, self.id)

    def _window(self, slot: int, nbytes: int) -> torch.Tensor:
        at = self.offsets[slot]
        return self.staging[at : at + nbytes]

    def step(self) -> str:
        """Take the source's announcements, acknowledge and scatter the reads that landed,
        free the slots whose scatter has completed, read the next chunks; the sink's status
        (``"WAIT"`` while nothing is in flight). While it waits for an announcement, the source
        is probed (a NIXL notification, which fails at once when its process is gone). Raises
        once the source gave the stream up or is gone (its peer forgotten: restarted,
        declared lost or replaced; or a probe refused)."""
        b = self.backend
        probed = b._notify_all(self.peer, self.sink.probes(b.clock()))
        gone = self.sink.take(*b._ctx.mail(self.box, b.clock(), b.timeout_s), probed)
        states = [(k, str(b.agent.check_xfer_state(x))) for k, x in self.xfers.items()]
        landed, acks, error = self.sink.observe(states)
        b._notify_all(self.peer, acks)  # the source's slots are free once the reads landed
        for k, slot in landed:
            b.agent.release_xfer_handle(self.xfers.pop(k))
            _, _, lo, hi = self.chunks[k]
            self.events.append(self.land(k, self._window(slot, hi - lo)))
        if gone or error:
            raise TransferError(f"{gone or error} (source {self.src_name})", field="staged")
        del self.events[: self.sink.scattered([e.query() for e in self.events])]
        dev, src_dev = int(b.buffer_info["device_id"]), int(self.meta["buffer"]["device_id"])
        for k, slot, at, (_, _, lo, hi) in self.sink.reads():
            local = _np_u64([[int(self._window(slot, hi - lo).data_ptr()), hi - lo, dev]])
            remote = _np_u64([[self.remote + at, hi - lo, src_dev]])
            label = f"chunk {k} of {self.src_name}"
            self.xfers[k] = b._post(local, remote, self.mems, self.peer, label)
        return str(self.sink.status)

    def close(self) -> None:
        """Abort reads still in flight, tell the source of an unfinished stream, give the
        slots back (idempotent)."""
        b = self.backend
        _release_xfers(b._ctx.agent, list(self.xfers.values()))  # None once the agent is gone
        _settle(self.events)  # a scatter still queued reads its slot
        self.xfers, self.events = {}, []
        b._notify_all(self.peer, self.sink.close())
        b._ctx.mailboxes.close(self.box)
        b.arena.free_all(self.offsets)
        self.offsets = []


#: Slots of the source's staging pool one streamed packed copy cycles through: one packed
#: while one is read and one is acknowledged.
_STREAM_SLOTS = 3
#: A streamed copy takes at most ``1 / _STREAM_SHARE`` of the source's largest free range,
#: so another request can stream beside it.
_STREAM_SHARE = 2


def _no_release() -> None:
    """What a stream gives back once closed: nothing (more)."""


class _StreamOut:
    """The source side of one announced packed copy: streamed (a copy larger than the
    staging pool), or held whole in its region (announced as one chunk, ``ticket["ready"]``).

    Chunk ``k`` of a stream (``DevicePlan.chunks``: whole items of the device plan) is
    packed into source slot ``k % slots`` once chunk ``k - slots`` is acknowledged; the first
    ``slots`` chunks are packed (queued) before the ticket leaves. Every chunk is announced to
    the decode with a NIXL notification once its pack has completed; the decode's
    acknowledgements free the slots. A copy held whole is over once announced (its region is
    the ticket's until ``release_staged``). ``_core.StreamSource`` decides all of it;
    :meth:`step` only polls and is driven by ``NixlTransferBackend.poll_streams``.
    """

    def __init__(
        self,
        backend: NixlTransferBackend,
        peer: str,
        sid: int,
        src: _core.StreamSource,
        offsets: list[int],
        pack: Callable[[list[tuple[int, int]]], list[Any]],
        release: Callable[[], None] = _no_release,
    ) -> None:
        self.backend, self.peer, self.id, self.src = backend, peer, sid, src
        #: The slots this stream owns (freed by :meth:`close`; none for a copy held whole).
        self.offsets = offsets
        self.pack = pack
        #: Gives back what the packs read (the block ids' slot) once they have completed.
        self.release = release
        self.deadline = backend.clock() + backend.timeout_s
        #: Completion of each packed chunk not announced yet, in order.
        self.events: list[Any] = []
        self.box = backend._ctx.mailboxes.open(peer, self.id)

    def announce(self) -> None:
        """Announce the queued chunks whose packs have completed (in order)."""
        b = self.backend
        ready = self.src.announce([e.query() for e in self.events])
        del self.events[: len(ready)]
        b._notify_all(self.peer, ready)
        b.__dict__["_announced"] = b.__dict__.get("_announced", 0) + len(ready)

    def step(self) -> bool:
        """Take the decode's notifications, pack what they freed, announce finished packs;
        ``True`` once the stream is over (every chunk acknowledged, given up, expired, or its
        decode gone: the slots are free again)."""
        b = self.backend
        mail, gone = b._ctx.mail(self.box, b.clock(), b.timeout_s)
        running, give_up, todo = self.src.poll(mail, b.clock(), self.deadline, gone)
        self.events += self.pack(todo)
        self.announce()
        if running:
            return False
        self.close(give_up=give_up)
        return True

    def close(self, *, give_up: bool) -> None:
        """Give the slots back (idempotent); with ``give_up``, tell a decode that may still
        read first."""
        b = self.backend
        b._notify_all(self.peer, self.src.close(give_up))
        _settle(self.events)  # a pack still queued writes its slot
        self.events = []
        self.release()
        self.release = _no_release
        b._ctx.mailboxes.close(self.box)
        b.arena.free_all(self.offsets)
        self.offsets = []


def _no_packs(todo: list[tuple[int, int]]) -> list[Any]:
    """What a copy held whole packs when polled: nothing (its pack is queued already)."""
    del todo
    return []


class _NoStream:
    """What ``release_staged`` finds for a stream that has ended already."""

    @staticmethod
    def close(*, give_up: bool) -> None:
        del give_up


def _pack_chunks(
    route: dp.PackRoute,
    got: dp.PackIds,
    chunks: Sequence[Sequence[int]],
    offsets: Sequence[int],
    todo: list[tuple[int, int]],
) -> list[Any]:
    """Pack chunks ``[(chunk, slot)]`` of a stream (consecutive chunks) into its slots at
    ``offsets`` (queued, up to three chunks per launch); their completions."""
    return route.pack_items(got, [(offsets[slot], chunks[k][0], chunks[k][1]) for k, slot in todo])


def _step_stream(out: _StreamOut) -> bool:
    """Advance one stream; ``True`` once it is over. A stream that fails is given up (the
    decode is told), so one bad stream never stops the prefill's turn."""
    try:
        return out.step()
    except Exception as exc:
        logger.warning("stream %d to %s failed: %r; giving it up", out.id, out.peer, exc)
        out.close(give_up=True)
        return True


def _new_read(agent: Any, local: Any, remote: Any, mems: tuple[str, str], peer: str) -> Any:
    """A NIXL READ of ``remote`` rows of ``peer`` into ``local`` rows (``mems``: their memory
    types), not posted yet. NIXL's order is (op, local, remote, peer)."""
    local_mem, remote_mem = mems
    return agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs(local, mem_type=local_mem),
        agent.get_xfer_descs(remote, mem_type=remote_mem),
        peer,
    )


class _HandoffCheck:
    """The check of one handoff's peers and ids (``run``), run at most once whoever asks
    first: ``num_tokens`` is the caller's until it has run (``done``), the checked count
    after (a pack route given them then skips its own check)."""

    def __init__(self, run: Callable[[], int | None], num_tokens: int | None) -> None:
        self._run = run
        self.num_tokens = num_tokens
        self.done = False

    @functools.cached_property
    def checked(self) -> int | None:
        """The token count the check returns (run on first use)."""
        self.num_tokens, self.done = self._run(), True
        return self.num_tokens

    def run(self) -> int | None:
        """Run the check unless it has run; the token count."""
        return self.checked


#: A stage's source peers, decode peer and source block ids.
_StagePeers = tuple[list[Any], Any, BlockIds]


def _stage_checked(
    backend: NixlTransferBackend, ticket: dict[str, Any], peers: _StagePeers, check: _HandoffCheck
) -> dict[str, Any]:
    """``stage_blocks`` of a rank that packs nothing for the pair: the peers and ids
    checked (unless ``check`` has run), the ticket as it is (the decode reads directly)."""
    del backend, peers
    check.run()
    return ticket


def _stage_rows(
    backend: NixlTransferBackend, ticket: dict[str, Any], peers: _StagePeers, check: _HandoffCheck
) -> dict[str, Any]:
    """``stage_blocks`` without a pack route taking the ids: the peers and ids checked
    (unless ``check`` has run), this rank's rows of the compiled program packed whole (a
    copy larger than the free pool is not packed: the decode reads directly)."""
    src_peers, dst_peer, src_block_ids = peers
    n = check.checked
    program = backend._compile(src_peers, dst_peer, src_block_ids, None, n, "staged")
    me = backend.layout.global_rank
    nbytes = int(program.packed_bytes(me))
    pack = functools.partial(backend._pack_rows_at, program, me, nbytes)
    stream = functools.partial(backend._not_streamed, dst_peer.meta, nbytes)
    return backend._place(ticket, dst_peer.meta, nbytes, pack, stream)


#: What stages a handoff's ids when the pair's pack route does not take them.
_OtherStage = Callable[
    ["NixlTransferBackend", dict[str, Any], _StagePeers, _HandoffCheck], dict[str, Any]
]


class _NoPackRoute:
    """The pack route of a rank without one for a (sources, decode) pair: it takes no ids
    (``stage_blocks`` then checks them and packs the program's rows, if anything)."""

    @staticmethod
    def begin(*args: Any, **kwargs: Any) -> None:
        """Nothing is taken here."""
        del args, kwargs


#: The pack route of a pair whose rank has none.
_NO_PACK_ROUTE = _NoPackRoute()

#: The route of a peer set not seen on the IPC path yet (``begin_pull_blocks``' first look).
_NO_IPC_ROUTE = _NoIpcRoute()


def _np_u64(rows: Sequence[Sequence[int]]) -> npt.NDArray[np.uint64]:
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 3)


#: One source's staged read: the pull, the source rank, its NIXL peer id with the memory
#: types of its reads, and its device plan with the destination ids and tokens.
_SourceRead = tuple[
    "_Pull", int, tuple[str, tuple[str, str]], tuple[dp.DevicePlan, npt.NDArray[np.int64], int]
]


@dataclass(frozen=True)
class _Pull:
    """One pull on the NIXL path, as each source's read needs it."""

    program: Any
    by_rank: Mapping[int, PeerMeta]
    tickets: Mapping[int, Mapping[str, Any]]
    plans: Mapping[int, dp.DevicePlan]
    tables: Mapping[int, _core.PackedRows]
    """Each device plan's table, as Rust's read decision takes it."""
    handoff: tuple[BlockIds, BlockIds, int | None]
    """Source ids, destination ids and tokens of the handoff."""
    direct: Callable[[int], tuple[Any, Any]]
    """The direct descriptor rows of a source rank (cached)."""


class NixlTransferBackend(TransferBackendBase):
    """Per-buffer registration on a rank's NIXL agent; the decode pulls with one-sided reads.

    Constructor parameters are the reference design's; keyword extensions: ``axes`` (cache
    layout), ``staging_bytes`` (registered staging region for staged pulls, 0 = none; a fixed
    pool whatever the prompt size: a larger copy is streamed through a few slots of it),
    ``mode`` (``"auto"``/``"direct"``/``"staged"``, passed to the compiler), ``timeout_s``,
    ``compiler``, ``incarnation``, ``clock``.
    """

    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        memory_buffer: torch.Tensor | Sequence[Any],
        expected_num_blocks: int,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        num_kv_heads_global: int | None = None,
        heads_per_partition: int | None = None,
        head_dim: int | None = None,
        tokens_per_block: int | None = None,
        global_rank: int | None = None,
        pp_size: int | None = None,
        pp_rank: int | None = None,
        num_layers_global: int | None = None,
        layer_start: int | None = None,
        layer_end: int | None = None,
        ssm_layout: _core.SSMShardLayout | None = None,
        ssm_state_kind: str | None = None,
        _shared_context: _NixlAgentContext | None = None,
        *,
        axes: str | None = None,
        staging_bytes: int = 0,
        mode: str = "auto",
        timeout_s: float = _POLL_TIMEOUT_S,
        compiler: ProgramCompiler | None = None,
        incarnation: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        context = _shared_context or _NixlAgentContext(agent_name, incarnation=incarnation)
        incarnation = context.incarnation  # the agent's (a shared context keeps its own)
        super().__init__(**self._base_arguments(locals()))  # the reference signature, whole
        memory_buffer = self.memory_buffer  # the first tensor of a per-layer list
        # The nixl package, the mode and UCX's transports are checked (in Rust) before the
        # agent is held or anything registered.
        self.mode: str = _validate_ucx_transport_config(memory_buffer, _HAVE_NIXL, mode)
        self._ctx = context
        self._agent_context = context
        self._known_peers = context.peers
        # Everything ``close`` gives back exists before the agent is held.
        self._ipc = ipc.IpcMapper()
        #: IPC routes by peer set (``_ipc_route``), and the agent names of each set.
        self._ipc_routes: dict[tuple[int, ...], _IpcRoute | _NoIpcRoute] = {}
        self._route_names: dict[Any, set[str]] = {}
        self.arena = StagingArena(int(staging_bytes))
        #: This rank's staging pool and where it lies, exported to peers (``None``: no pool).
        self.staging_buffer: torch.Tensor | None = None
        self._staging: dict[str, int] | None = None
        registered = list(self.region_tensors)
        if staging_bytes > 0:
            self.staging_buffer = torch.zeros(
                int(staging_bytes), dtype=torch.uint8, device=memory_buffer.device
            )
            registered.append(self.staging_buffer)
            self._staging = {"addr": int(self.staging_buffer.data_ptr()),
                             "nbytes": int(staging_bytes)}  # fmt: skip
        agent = context.acquire()
        with contextlib.ExitStack() as rollback:
            rollback.callback(context.release)  # the agent is let go unless registration holds
            _validate_nixl_cuda_support(agent, memory_buffer)
            #: The buffer's (and staging pool's) NIXL registration, given back by ``close``.
            self._reg = agent.register_memory(registered)
            rollback.pop_all()
        #: The shared NIXL agent (``None`` once this registration is closed).
        self._agent: Any = agent
        self._closed = False
        # Device plans per peer set, block ids through pinned memory, peers' buffers mapped
        # through CUDA IPC when they share this host (see device_plan.py and ipc.py).
        self._plans = dp.PlanCache()
        self._ids = dp.IdUploader(memory_buffer.device)
        # CUDA IPC maps one buffer: per-layer tensors are read over NIXL.
        self.ipc_meta = ipc.export(memory_buffer) if len(self.region_tensors) == 1 else None
        self._init_kwargs: dict[str, Any] = {
            "axes": axes,
            "mode": mode,
            "timeout_s": timeout_s,
            "compiler": compiler,
            "clock": clock,
        }

    # -- registration ----------------------------------------------------------------------

    @property
    def agent(self) -> Any:
        """The rank's shared NIXL agent; raises ``TransferError`` after the last close."""
        return self._ctx.live_agent()

    def new_registered_buffer(self, **kwargs: Any) -> NixlTransferBackend:
        """Register another state buffer (e.g. SSM conv/recurrent) on this backend's agent.

        ``kwargs`` are constructor arguments; ``agent_name`` defaults to this backend's and the
        keyword extensions default to this backend's values.
        """
        kwargs = {"agent_name": self.agent_name, **self._init_kwargs, **kwargs}
        return NixlTransferBackend(_shared_context=self._ctx, **kwargs)

    def close(self) -> None:
        """Deregister this buffer and release its reference to the shared agent (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for out in self._streams.values():
            out.close(give_up=True)
        self._streams.clear()
        self._agent = None
        try:  # the agent is held by this registration until ``release`` below
            self._ctx.agent.deregister_memory(self._reg)
        except Exception as exc:
            logger.warning("deregister_memory failed: %r", exc)
        self._ipc.close()
        self._ipc_routes.clear()
        self._route_names.clear()
        self._ctx.release()

    # -- metadata ------------------------------------------------------------------------

    def export_meta(self) -> dict[str, Any]:
        """Plain metadata for a peer: agent name and metadata, buffer, layout, version, hash.

        The agent metadata is taken now, so export after registering all buffers of the rank.
        """
        meta = self._base_meta()
        blob = base64.b64encode(self.agent.get_agent_metadata()).decode("ascii")
        meta["agent_metadata"] = blob
        meta["agent_metadata_b64"] = blob  # the reference design's name
        meta["ipc"] = self.ipc_meta
        meta["staging"] = copy.copy(self._staging)  # the peer's own (``None``: no pool)
        return meta

    def _base_meta(self) -> dict[str, Any]:
        meta = super()._base_meta()
        # Peers address the rank's NIXL agent, whichever buffer name registered on it.
        meta["agent_name"] = self._ctx.agent_name
        meta["buffer_name"] = self.agent_name
        return meta

    def _ensure_peer_registered(self, peer_meta: PeerMeta) -> str:
        """Register the peer with NIXL on first use; return its agent id."""
        return self._ctx.ensure_peer(peer_meta)

    # -- source side of a staged pull ----------------------------------------------------

    @property
    def _streams(self) -> dict[int, _StreamOut]:
        """The streams this rank is sending, by id."""
        streams: dict[int, _StreamOut] = self.__dict__.setdefault("_stream_table", {})
        return streams

    def stage_blocks(
        self,
        peer_meta: PeerMeta,
        src_block_ids: BlockIds,
        *,
        src_metas: Sequence[PeerMeta] | None = None,
        num_tokens: int | None = None,
    ) -> dict[str, Any]:
        """Pack this rank's fragments for the decode rank ``peer_meta`` (source side).

        ``src_metas`` are all source ranks' metadata (default: this rank alone) so the plan
        picks the same representatives the decode will. Returns the ticket to send with the
        handoff; ``{"staged": False}`` in it means the compiler chose direct for this rank, or
        the packed copy can neither fit the staging pool now nor be streamed through it (the
        decode then reads this rank's blocks directly). A copy larger than the free pool is
        streamed: the ticket's ``stream`` names it, the first chunks are packed here and the
        rest as ``poll_streams`` sees the decode's acknowledgements. Returns as soon as the
        packs are queued: a copy held whole (its ticket's ``ready`` names its announcement)
        and every chunk of a stream is announced to the decode with a NIXL notification once
        its pack has completed, here or in a later ``poll_streams`` (host memory: here), and
        the decode reads nothing before. Release the region with ``release_staged``.
        """
        # Parsed peers travel on (a metadata dict seen before is found by identity; its
        # parsed metadata would be looked up by content again, each time).
        dst_peer = self._adopt_peer(peer_meta)
        src_peers = (
            [self._adopt_peer(m) for m in src_metas] if src_metas is not None else [self._own_peer]
        )
        ticket: dict[str, Any] = {
            "src_rank": self.layout.global_rank,
            "agent_name": self.agent_name,
            "incarnation": self.incarnation,
            "staged": False,
            "offset": 0,
            "nbytes": 0,
        }
        # What this rank packs for a (sources, decode) pair is settled on its first handoff
        # (``_pack_route``, cached). The pack route checks the peers and ids (in Rust, once)
        # and lays this rank's ids out for its kernel; what it does not take (no route, SSM
        # state, another block count) is checked, and packed where the rank packs, by the
        # pair's other path (``_stage_checked`` or ``_stage_rows``).
        key = ("stage", peer_set_key(src_peers), peer_set_key([dst_peer]))
        check = _HandoffCheck(functools.partial(
            self._validate_peers, src_peers, src_block_ids, None, num_tokens, local_is_dst=False
        ), num_tokens)  # fmt: skip
        build = functools.partial(self._pack_route, src_peers, dst_peer, src_block_ids, check)
        sources, route, other = self._cached(key, build)
        side = self._local_side
        got = route.begin(src_peers, src_block_ids, check.num_tokens, checked=check.done, **side)
        if got is None:
            peers = (src_peers, dst_peer, src_block_ids)
            staged: dict[str, Any] = other(self, ticket, peers, check)
            return staged
        nbytes = route.plan.packed_bytes(got.num_tokens)
        stream = functools.partial(self._stream_out, route, got, dst_peer.meta, sources, nbytes)
        pack = functools.partial(route.pack_whole, got)
        return self._place(ticket, dst_peer.meta, nbytes, pack, stream)

    def _pack_route(
        self, src_peers: list[Any], dst_peer: Any, src_block_ids: BlockIds, check: _HandoffCheck
    ) -> tuple[int, dp.PackRoute | _NoPackRoute, _OtherStage]:
        """What this rank packs for one (sources, decode) pair, from its first handoff:
        ``(source ranks of the plan, its pack route, what stages the ids the route does not
        take)``, the route a null one where it has none: the rank packs nothing (the ids are
        only checked), or the program's rows (SSM state).

        The peers and ids are checked first. Nothing is packed (nor compiled) for a decode
        that reads this rank directly: mode ``"direct"``, or a decode on this host, which
        reads the blocks through CUDA IPC. A rank of the plan without a staging pool raises
        ``CapacityError`` (Rust decides both)."""
        n = check.checked
        mine, theirs = self.ipc_meta, dst_peer.meta.get("ipc")
        if not _core.nixl_source_packs(self.mode, self.memory_buffer.is_cuda, mine, theirs):
            return 0, _NO_PACK_ROUTE, _stage_checked
        program = self._compile(src_peers, dst_peer, src_block_ids, None, n, "staged")
        me, ranks = self.layout.global_rank, list(program.src_ranks)
        if not _core.nixl_source_stages(me, ranks, self.arena.capacity):
            return len(ranks), _NO_PACK_ROUTE, _stage_checked
        addr, staging = int(self.buffer_info["addr"]), cast(torch.Tensor, self.staging_buffer)
        plan = dp.DevicePlan.from_program(program, me, src_addr=addr, dst_addr=0)
        route = _NO_PACK_ROUTE if plan is None else dp.PackRoute(
            plan, me, self.memory_buffer, staging, self._ids
        )  # fmt: skip
        return len(ranks), route, _stage_rows

    @functools.cached_property
    def _local_side(self) -> dict[str, Any]:
        """This rank's side of the id checks (``check_peer_transfer``'s local arguments)."""
        return {
            "local_num_blocks": self.expected_num_blocks,
            "local_tokens_per_block": self.tokens_per_block,
        }

    def _pack_rows_at(self, program: Any, me: int, nbytes: int, offset: int) -> Any:
        """Pack this rank's rows of ``program`` into the staging region at ``offset``; the
        completion of the pack."""
        region = cast(torch.Tensor, self.staging_buffer)[offset : offset + nbytes]
        self.pack_rows(program.gather(me), region)
        return _landed_event(region)

    def _place(
        self,
        ticket: dict[str, Any],
        dst: PeerMeta,
        nbytes: int,
        pack: Callable[[int], Any],
        stream: Callable[[], dict[str, Any]],
    ) -> dict[str, Any]:
        """Pack this rank's copy (``nbytes``) whole into a free range of the staging pool
        (``pack(offset)`` queues it and returns its completion) and announce it once packed.
        The pool is fixed whatever the prompt size: a copy that does not fit now is streamed
        through a few slots of it (``stream()`` returns the ticket's fields; none when it
        cannot be: the decode reads this rank's blocks)."""
        if nbytes > self.arena.largest_free:
            return {**ticket, **stream()}
        with _Reserved(self.arena, nbytes) as offset:  # the range goes back unless queued
            done = pack(offset)
        return self._announce_whole(ticket, dst, offset, nbytes, done)

    def _announce_whole(
        self, ticket: dict[str, Any], dst: PeerMeta, offset: int, nbytes: int, done: Any
    ) -> dict[str, Any]:
        """Complete the ticket of a copy packed whole into ``[offset, offset + nbytes)``:
        the decode reads the region once announced, when its pack (``done``) has completed
        (here, or in a later ``poll_streams``)."""
        sid = self._ctx.new_stream_id()
        src = _core.StreamSource.whole(sid, offset, nbytes)
        out = _StreamOut(self, self._ensure_peer_registered(dst), sid, src, [], _no_packs)
        out.events.append(done)
        self._streams[sid] = out
        out.announce()
        ticket.update(staged=True, offset=offset, nbytes=nbytes, ready=sid)
        return ticket

    def _cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` (device plans and the plan's source ranks)."""
        return self._plans.get(key, build)

    def _stream_out(
        self, route: dp.PackRoute, got: dp.PackIds, dst: PeerMeta, sources: int, nbytes: int
    ) -> dict[str, Any]:
        """Start streaming this rank's packed copy (``nbytes``; ``got``: its ids, laid out by
        its pack ``route``) to decode ``dst``: reserve up to ``_STREAM_SLOTS`` slots of
        ``1 / _STREAM_SHARE`` of the largest free range, each holding a chunk the decode's
        pool holds too (it reads ``sources`` copies through two slots each at least), pack the
        first chunks. Returns the ticket fields; none (nothing reserved, the decode reads the
        blocks) when no slot holds one item of the plan."""
        got_slots = self.arena.alloc_stream(
            route.plan.item_bytes, dst.get("staging"), sources, _STREAM_SHARE, _STREAM_SLOTS
        )
        if got_slots is None:
            route.release(got)
            return self._not_streamed(dst, nbytes)
        slot_bytes, offsets = got_slots
        peer = self._ensure_peer_registered(dst)
        sid = self._ctx.new_stream_id()
        chunks = route.plan.chunks(got.num_tokens, slot_bytes)
        pack = functools.partial(_pack_chunks, route, got, chunks, offsets)
        release = functools.partial(route.release, got)
        src = _core.StreamSource(sid, chunks, offsets)
        out = _StreamOut(self, peer, sid, src, offsets, pack, release)
        # Registered first: a pack that fails leaves the stream to its deadline or release.
        self._streams[sid] = out
        # The first chunks are queued here and announced once packed (like the later ones).
        out.events += out.pack(out.src.first())
        out.announce()
        self.__dict__["_streams_started"] = self.__dict__.get("_streams_started", 0) + 1
        stream = {"id": sid, "chunk_bytes": slot_bytes, "slot_bytes": slot_bytes,
                  "offsets": list(offsets)}  # fmt: skip
        return {"staged": True, "nbytes": nbytes, "stream": stream}

    def _not_streamed(self, dst: PeerMeta, nbytes: int) -> dict[str, Any]:
        """The ticket fields of a copy that neither fits the pool now nor can be streamed
        through it: none (the decode reads this rank's blocks directly)."""
        logger.info(
            "staging: %d bytes for decode rank %s do not fit (largest free range %d of "
            "staging_bytes=%d) and cannot be streamed; the decode reads directly",
            nbytes, dst["layout"].get("global_rank"), self.arena.largest_free,
            self.arena.capacity,
        )  # fmt: skip
        return {}

    def poll_streams(self) -> int:
        """Advance the streamed packed copies of this rank (source side): take the decodes'
        acknowledgements, pack the chunks they freed, announce finished packs, end streams
        that are done, given up or past their deadline (their slots return to the pool).
        Never blocks; returns how many streams are still running. A prefill calls it each
        turn (``poll_kv_pushes``)."""
        streams = self._streams
        running = {sid: out for sid, out in streams.items() if not _step_stream(out)}
        streams.clear()
        streams.update(running)
        return len(streams)

    def retain_peers(self, peer_meta: Sequence[Mapping[str, Any]]) -> list[str]:
        """Forget every NIXL peer registered here that ``peer_meta`` (every peer buffer the
        control plane's peer table names now) no longer names (declared lost) or names with
        another incarnation (restarted); return their agent names. A read waiting for a
        forgotten peer's announcement fails at its next poll, quietly (it posted nothing);
        one with reads in flight aborts them; a stream this rank serves it ends."""
        named = {str(m.get("agent_name")): int(m.get("incarnation", 0)) for m in peer_meta}
        stale = self._ctx.registrations.forget_stale(named)
        self._ctx._forget(stale)
        return [name for name, _ in stale]

    def _notify_all(self, peer: str, msgs: Sequence[bytes]) -> list[tuple[bool, str]]:
        """Send NIXL notifications to ``peer`` in order; ``(sent, error)`` of each. One that
        cannot be sent (a peer that is gone) is dropped: its stream then ends at its deadline
        or release (a probe's failure ends a read at once: ``StreamSink.take``)."""
        return [_outcome(functools.partial(self.agent.send_notif, peer, m)) for m in msgs]

    def staging_stats(self) -> dict[str, int]:
        """The staging pool now: bytes reserved, ranges reserved, streams running (copies
        held whole not announced yet among them), the streams this rank has started in all,
        and the packed copies and chunks it has announced ready to the decodes in all."""
        return {
            "in_use": int(self.arena.in_use),
            "ranges": len(self.arena),
            "streams": len(self._streams),
            "streamed": int(self.__dict__.get("_streams_started", 0)),
            "announced": int(self.__dict__.get("_announced", 0)),
        }

    def release_staged(self, ticket: Mapping[str, Any]) -> None:
        """Free the staging region of a ticket (after RELEASE_KV or the lease's end): a
        stream still running is given up (the decode is told) and its slots freed;
        idempotent."""
        stream, held = _core.staging_release(ticket)
        self._streams.pop(stream, _NoStream).close(give_up=True)
        self.arena.free_all(held)

    # -- decode side -----------------------------------------------------------------------

    def begin_pull_blocks(
        self,
        peer_meta: Any,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        num_tokens: int | None = None,
        staged: Sequence[Mapping[str, Any]] | None = None,
        timeout_s: float | None = None,
    ) -> NixlPullHandle:
        """Validate, compile and post the reads of one handoff; return a pollable handle.

        ``peer_meta`` is one source rank's metadata or a list of them (every source rank this
        rank reads from). ``staged`` holds the tickets of ``stage_blocks`` (one per source
        rank that packed). Everything is validated and every peer registered before the
        first read is posted.
        """
        peers, src_ids = self._resolve_peers(peer_meta, src_block_ids)
        src_block_ids = cast(BlockIds, src_ids)  # given, so resolved to the ids or a rank map
        if no_blocks(src_block_ids, dst_block_ids):  # nothing to move: a settled handle
            return NixlPullHandle(self.agent, [], self.timeout_s, self.clock, None)
        timeout = self._timeout(timeout_s)
        staged = list(staged or ())
        # A peer set seen before on the CUDA IPC path: Rust checks the ids while writing
        # them into the upload slot (the same checks as below), one launch follows.
        key = tuple(map(id, peers))
        seen = self._ipc_routes.get(key, _NO_IPC_ROUTE)
        ipc_pull = seen.pull(self, staged, (src_block_ids, dst_block_ids, num_tokens), timeout)
        if ipc_pull is not None:
            return ipc_pull
        num_tokens = self._validate_peers(
            peers, src_block_ids, dst_block_ids, num_tokens, local_is_dst=True
        )
        by_rank = {p.global_rank: p.meta for p in peers}
        tickets = _core.check_staging_tickets_of(staged, peers)
        handoff = (src_block_ids, dst_block_ids, num_tokens)
        ipc_pull = self._pull_by_ipc(key, peers, by_rank, staged, handoff, timeout)
        if ipc_pull is not None:
            return ipc_pull
        program = self._compile(
            peers, self._own_peer, src_block_ids, dst_block_ids, num_tokens, self.mode
        )
        # Per source in plan order: its staged copy or its blocks (decided in Rust).
        route, direct_ranks = _core.nixl_pull_route(
            [(r, program.mode(r), program.packed_bytes(r)) for r in program.src_ranks],
            list(by_rank),
            tickets,
            self.arena.capacity,
        )
        # Every remote byte a descriptor names lies in the source's exported regions, every
        # local byte in this rank's; a range running across per-layer tensors is split.
        by_peer, me = {p.global_rank: p for p in peers}, self._own_peer

        @functools.cache
        def direct_rows(rank: int) -> tuple[Any, Any]:
            return by_peer[rank].split_descriptors(*program.direct_descriptors(rank), me)  # type: ignore[no-any-return]

        plans = self._pull_plans(peers, by_rank, program)
        # Rust's read decision takes each device plan's table.
        tables = {r: p.packed for r, p in plans.items()}
        pull = _Pull(program, by_rank, tickets, plans, tables,
                     (src_block_ids, dst_block_ids, num_tokens), direct_rows)  # fmt: skip
        # Checked before anything is posted: the direct reads' descriptors, every peer.
        list(map(direct_rows, direct_ranks))
        agents = {rank: self._ensure_peer_registered(by_rank[rank]) for rank, _, _ in route}
        parts: list[_PullPart] = []
        error: str | None = None
        # A chunked read takes its share of the free pool (staged reads still to post).
        for rank, packed, share in route:
            try:
                parts += self._post_source(pull, rank, agents[rank], packed, share)
            except Exception as exc:
                # Parts already posted keep running; the handle raises once they settle.
                error = f"posting the read from rank {rank} failed: {exc!r}"
                break
        handle = NixlPullHandle(self.agent, parts, timeout, self.clock, error)
        # A chunked read posts its next chunk only when polled: it asks to be polled often.
        handle.poll_interval_s = min([handle.poll_interval_s, *(p.poll_s for p in parts)])
        # What was actually posted (a source without a staged ticket is read directly); the
        # bytes per source, not the program's ``stats``, which walk every descriptor.
        handle.stats = {
            "bytes": sum(program.packed_bytes(r) for r in program.src_ranks),
            "descriptors": sum(p.descriptors for p in parts),
            "modes": {p.src_rank: p.context.split(":", 1)[0] for p in parts},
        }
        return handle

    def _pull_plans(
        self, peers: Sequence[Any], by_rank: Mapping[int, PeerMeta], program: Any
    ) -> dict[int, dp.DevicePlan]:
        """Device plans of every source rank of this peer set (cached), or none (``{}``) when
        a rank has none (SSM state, HND caches, block-size changes)."""

        def build() -> dict[int, dp.DevicePlan]:
            dst_addr = int(self.buffer_info["addr"])
            plans = {
                rank: dp.DevicePlan.from_program(
                    program, rank, src_addr=int(by_rank[rank]["buffer"]["addr"]), dst_addr=dst_addr
                )
                for rank in program.src_ranks
            }
            return {} if None in plans.values() else cast(dict[int, dp.DevicePlan], plans)

        plans: dict[int, dp.DevicePlan] = self._cached(("pull", peer_set_key(peers)), build)
        return plans

    def _pull_by_ipc(
        self,
        key: tuple[int, ...],
        peers: list[Any],
        by_rank: Mapping[int, PeerMeta],
        staged: list[Mapping[str, Any]],
        handoff: _Handoff,
        timeout: float,
    ) -> NixlPullHandle | None:
        """Copy every source rank's blocks straight from its CUDA IPC mapping (same host),
        one kernel for all source ranks, no staging; ``None`` when any rank cannot be mapped
        or has no device plan (the caller then takes the NIXL path).

        Everything that depends only on the peer set (mappings, plans, bounds, the merged
        plan and its prepared launch) is settled once per peer set (:meth:`_ipc_route`) and
        found again by the parsed peers' identity (``key``) at the top of
        ``begin_pull_blocks``, which has tried a route settled before already (its ids, the
        same checks in Rust, did not fit it: they do not now). Host memory exports no IPC
        metadata."""
        if key in self._ipc_routes or handoff[2] is None or self.ipc_meta is None:
            return None
        return self._ipc_route(key, peers, by_rank, handoff).pull(self, staged, handoff, timeout)

    def _ipc_route(
        self,
        key: tuple[int, ...],
        peers: list[Any],
        by_rank: Mapping[int, PeerMeta],
        handoff: _Handoff,
    ) -> _IpcRoute | _NoIpcRoute:
        """The IPC route of one peer set (``_NoIpcRoute`` when the set cannot take the IPC
        path); cached either way by the parsed peers' identity (the route holds the
        peers, so those ids stay theirs); a peer's new incarnation is a new peer set and
        drops the routes of its old one."""
        metas = [p.meta for p in peers]
        names = {str(m["agent_name"]) for m in metas}
        for old in [k for k in self._ipc_routes if names & self._route_names[k]]:
            del self._ipc_routes[old]
            del self._route_names[old]
        route: _IpcRoute | _NoIpcRoute = _NoIpcRoute(tuple(peers))
        mapped = {}
        for rank, meta in by_rank.items():
            view = self._ipc.open(meta, self.ipc_meta, self.memory_buffer.device)
            if view is None:
                break
            mapped[rank] = view
        else:
            # First handoff of this peer set: compile once (raises the compiler's errors).
            program = self._compile(peers, self._own_peer, *handoff, "staged")
            plans = self._pull_plans(peers, by_rank, program)
            if plans and self._ipc_bounds_hold(plans, by_rank, mapped):
                merged = dp.PullRoute(
                    plans, {r: mapped[r] for r in plans}, self.memory_buffer, self._ids
                )
                label = "ipc:" + ",".join(str(by_rank[r]["agent_name"]) for r in merged.ranks)
                route = _IpcRoute(tuple(peers), merged, label)
        self._ipc_routes[key] = route
        self._route_names[key] = names
        return route

    def _ipc_bounds_hold(
        self,
        plans: Mapping[int, dp.DevicePlan],
        by_rank: Mapping[int, PeerMeta],
        mapped: Mapping[int, torch.Tensor],
    ) -> bool:
        """Every byte the kernels may touch lies inside both buffers, and every source rank
        cuts the prompt into the same blocks (decided in Rust from each plan's table with its
        source buffer's blocks and bytes)."""
        tables = [(plan.packed, int(by_rank[rank]["num_blocks"]), mapped[rank].numel())
                  for rank, plan in plans.items()]  # fmt: skip
        dst = (self.expected_num_blocks, int(self.buffer_info["nbytes"]))
        return bool(_core.ipc_bounds_hold(tables, *dst))

    def _post(
        self,
        local: npt.NDArray[np.uint64],
        remote: npt.NDArray[np.uint64],
        mems: tuple[str, str],
        peer: str,
        label: str,
    ) -> Any:
        """Post one READ of ``remote`` rows of ``peer`` into ``local`` rows (``mems``: their
        NIXL memory types, decided in Rust with the source's read); its NIXL handle. A read
        NIXL refuses (``TransferError``) or fails to post is given back before the error
        propagates."""
        agent = self.agent
        xfer = _new_read(agent, local, remote, mems, peer)
        with contextlib.ExitStack() as refused:
            refused.callback(agent.release_xfer_handle, xfer)
            _core.check_xfer_posted(agent.transfer(xfer), label)
            refused.pop_all()
        return xfer

    def _post_direct(
        self, rows: tuple[Any, Any], rank: int, meta: PeerMeta, peer: str, mems: tuple[str, str]
    ) -> list[_PullPart]:
        src, dst = rows
        if len(src) == 0:
            return []
        label = f"direct:{meta['agent_name']}:{rank}"
        part = _PullPart(rank, self._post(dst, src, mems, peer, label), context=label)
        part.descriptors = len(src)
        return [part]

    def _post_source(
        self, pull: _Pull, rank: int, peer: str, packed: bool, share: int
    ) -> list[_PullPart]:
        """Post the read of source ``rank`` (``packed``: the route reads its staged copy,
        taking ``1 / share`` of the free pool at most): its blocks directly, its packed copy
        held whole, or in chunks through a few slots of the pool, as Rust decides from the
        ticket, the device plan and the pool now, with the memory types of its reads. A source
        whose ticket is not read has its stream given up (its slots are free at once) and
        what it announced dropped."""
        meta, ticket = pull.by_rank[rank], pull.tickets.get(rank)
        plan, n_tok = pull.plans.get(rank), pull.handoff[2]
        dst_ids = np.asarray(pull.handoff[1], dtype=np.int64).reshape(-1)
        kind, give_up, slot_bytes, mems = _core.nixl_source_read(
            packed,
            ticket,
            pull.tables.get(rank),
            meta,
            largest_free=self.arena.largest_free,
            alignment=self.arena.alignment,
            share=share,
            on_gpu=self.memory_buffer.is_cuda,
            num_tokens=n_tok,
            dst_blocks=dst_ids.size,
            local_mem=self.buffer_info["mem_type"],
        )
        if give_up:
            self._give_up_ticket(peer, meta, cast(Mapping[str, Any], ticket))
        if kind == "direct":
            return self._post_direct(pull.direct(rank), rank, meta, peer, mems)
        plan_ids = (cast(dp.DevicePlan, plan), dst_ids, cast(int, n_tok))
        read: _SourceRead = (pull, rank, (peer, mems), plan_ids)
        if kind == "chunked":
            return [self._post_chunked(read, slot_bytes, share)]
        return [self._post_whole(read, kind)]

    def _post_whole(self, read: _SourceRead, kind: str) -> _PullPart:
        """One READ of the whole packed copy into one range of its size, once the source
        announced it; landed by one kernel of the device plan (``kind`` ``"whole"``) or by
        the program's scatter rows (``"rows"``)."""
        pull, rank, peer, plan_ids = read
        meta, ticket, program = pull.by_rank[rank], pull.tickets[rank], pull.program
        by_plan = functools.partial(self._land_by_plan, *plan_ids)
        by_rows = functools.partial(self._land_by_rows, program, rank)
        land = by_plan if kind == "whole" else by_rows
        nbytes = int(ticket["nbytes"])
        reader = _ChunkedRead(self, meta, peer, nbytes, [self.arena.alloc(nbytes)])
        return self._start_read(
            reader, lambda: (_core.StreamSink.one_piece(ticket), land, "staged"), rank
        )

    def _land_by_plan(
        self, plan: dp.DevicePlan, dst_ids: npt.NDArray[np.int64], n_tok: int, k: int,
        window: torch.Tensor,
    ) -> Any:  # fmt: skip
        """Queue the landing of a whole copy read into ``window`` (one kernel of the cached
        plan); its completion (the part settles on it: the serving thread never waits)."""
        del k
        (ids,) = self._ids.upload(dst_ids)
        dp.copy(plan, dp.Side("packed", window), dp.Side("dst", self.memory_buffer, ids), n_tok)
        return _landed_event(window)

    def _land_by_rows(self, program: Any, rank: int, k: int, window: torch.Tensor) -> Any:
        """Queue the landing of a whole copy read into ``window`` by the program's scatter
        rows of source ``rank``."""
        del k
        self.scatter_rows(window, program.scatter(rank))
        return _landed_event(window)

    def _start_read(
        self,
        reader: _ChunkedRead,
        make: Callable[[], tuple[_core.StreamSink, Callable[[int, torch.Tensor], Any], str]],
        rank: int,
    ) -> _PullPart:
        """Start ``reader`` on the sink, landing and label kind ``make()`` returns (its first
        step posts what the source announced already) and wrap it as a part; its slots go
        back if starting fails."""
        with contextlib.ExitStack() as rollback:
            rollback.callback(reader.close)  # the slots go back unless the read starts
            sink, land, kind = make()
            reader.start(sink, land)
            reader.step()
            rollback.pop_all()
        label = f"{kind}:{reader.meta['agent_name']}:{rank}"
        return _PullPart(rank, None, cleanup=reader.close, context=label, step=reader.step,
                         descriptors=len(reader.chunks), poll_s=_CHUNK_POLL_INTERVAL_S)  # fmt: skip

    def _give_up_ticket(self, peer: str, meta: PeerMeta, ticket: Mapping[str, Any]) -> None:
        """This rank reads the source of ``ticket`` directly: tell a stream's source (its
        slots are free at its next poll, not at release) and drop the announcements of the
        ticket received so far."""
        self._notify_all(peer, _core.stream_abort_msgs(ticket))
        self._ctx.mailboxes.forget_ticket(str(meta["agent_name"]), ticket)

    def _post_chunked(self, read: _SourceRead, slot_bytes: int, share: int) -> _PullPart:
        """Read a source's packed copy through at most ``_CHUNK_SLOTS`` slots of at least
        ``slot_bytes`` of this rank's staging pool (``1 / share`` of its largest free range:
        the other staged sources of the pull read through the rest; Rust checked they fit)."""
        pull, rank, peer, (plan, dst_ids, n_tok) = read
        meta, ticket = pull.by_rank[rank], pull.tickets[rank]
        (ids,) = self._ids.upload(dst_ids)
        got = self.arena.alloc_slots(slot_bytes, share, _CHUNK_SLOTS)
        slot_bytes, offsets = cast(tuple[int, list[int]], got)
        reader = _ChunkedRead(self, meta, peer, slot_bytes, offsets)

        def make() -> tuple[_core.StreamSink, Callable[[int, torch.Tensor], Any], str]:
            sink = _core.StreamSink.of_ticket(
                ticket, plan.rows, plan.tokens_per_block, n_tok, slot_bytes, len(offsets)
            )
            land = functools.partial(_scatter_chunk, self, plan, ids, n_tok, sink.chunks)
            return sink, land, str(sink.kind)

        return self._start_read(reader, make, rank)

    # -- the reference design's primitives -------------------------------------------------

    @staticmethod
    def _kv_layout_from_meta(meta: Mapping[str, Any]) -> _core.KVShardLayout:
        """Reconstruct a peer's KV layout from the reference design's metadata fields."""
        return kv_layout_from_meta(meta)

    def _validate_peer(
        self,
        meta: Mapping[str, Any],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        matched_layout: bool = False,
    ) -> None:
        """Validate a peer's metadata and one block mapping against this buffer.

        Raises what ``begin_pull_blocks`` raises before posting (``MetadataError``,
        ``GeometryMismatchError``, ``BlockIdError``); with ``matched_layout`` the slice
        geometry (outer slices, slice bytes, blocks axis, heads) must be equal as well.
        """
        peer = self._adopt_peer_meta(meta)
        self._validate_peers([peer], src_block_ids, dst_block_ids, None, local_is_dst=True)
        if matched_layout:
            mine = self._reference_fields()
            keys = ("num_outer", "bytes_per_slice", "blocks_axis", "heads_per_partition")
            _core.check_matched_slices(
                str(peer["agent_name"]),
                [(k, peer.get(k)) for k in keys],
                [(k, mine[k]) for k in keys],
            )

    def _begin_transfer(
        self,
        peer_meta: Mapping[str, Any],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        src_o_start: int,
        dst_o_start: int,
        n_outer: int,
        src_h0: int = 0,
        dst_h0: int = 0,
        n_heads: int = 0,
    ) -> tuple[Any, str]:
        """Submit one full-slice (``n_heads=0``) or head-fragment NIXL read.

        The reference design's primitive over its address fields: ``n_outer`` outer slices
        from ``src_o_start``/``dst_o_start`` of each block pair, or heads ``[h0, h0 +
        n_heads)`` of each token. Descriptors are built as arrays. If posting fails after
        NIXL took the read, ``TransferStartError.cleanup_handles`` holds it.
        """
        agent = self._agent
        peer_id = self._ensure_peer_registered(peer_meta)
        # The address rules and the id-count check are Rust's; NIXL takes the arrays as rows.
        # This side's fields by the reference design's metadata names (read as the peer's).
        optional = ("heads_per_partition", "head_dim", "element_size", "tokens_per_block")
        here = {"base_addr": self._buf_ptr, "outer_stride_bytes": self._outer_stride_bytes,
                "bytes_per_slice": self._bytes_per_slice, "device_id": self._device_id,
                "buffer": getattr(self, "buffer_info", None),
                **{name: getattr(self, f"_{name}", None) for name in optional}}  # fmt: skip
        local, remote, local_mem, remote_mem, ctx = _core.slice_reads(
            peer_meta,
            here,
            np.asarray(src_block_ids, dtype=np.uint64).reshape(-1),
            np.asarray(dst_block_ids, dtype=np.uint64).reshape(-1),
            (src_o_start, dst_o_start, n_outer),
            (src_h0, dst_h0, n_heads),
            peer_id,
        )
        xfer = _new_read(agent, local, remote, (local_mem, remote_mem), peer_id)
        try:
            _core.check_xfer_posted(agent.transfer(xfer), ctx)
        except Exception as exc:
            # NIXL may have taken the read before failing: its destination is not safe to
            # reuse until the handle below settles.
            cleanup = NixlPullHandle(
                agent,
                [_PullPart(-1, xfer, context=ctx)],
                getattr(self, "timeout_s", _POLL_TIMEOUT_S),
                getattr(self, "clock", time.monotonic),
                None,
            )
            raise TransferStartError(
                f"posting {ctx} failed: {exc!r}",
                storage_safe=False,
                resources=(local, remote),
                cleanup_handles=[cleanup],
            ) from exc
        return xfer, ctx
