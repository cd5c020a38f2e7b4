"""Bounded, chunked staging for two-sided transfers: a fixed pool per engine, whatever the
prompt size, and one message per chunk so packing, moving and scattering overlap.

A :class:`StagingPool` is ``pool_bytes`` (default 256 MiB) cut into ``slots`` equal slots.
A handoff of one (source rank, destination rank) pair walks the device plan's item ranges
(``DevicePlan.chunks(n_tok, slot_bytes)``) in packed order; chunk ``i`` travels through
slot ``i % slots`` as one point-to-point message. Both sides compute the same chunks from
the same plan, so messages match by post order (NCCL) or by tag (gloo) without any
exchange.

- On CUDA with NCCL everything is queued, nothing waits on the host: the sender packs chunk
  ``i`` on the current stream and posts its send (NCCL's stream waits for the pack), so the
  send of chunk ``i`` runs while chunk ``i + 1`` packs; the receiver posts the receive of
  chunk ``i + 1`` before it makes the stream wait for chunk ``i`` (``work.wait()`` is a
  stream dependency there) and queues its scatter, so a receive never waits for the
  previous scatter (``_core.chunk_schedule`` orders the steps). A slot is reused only after the
  scatter that read it was queued and the stream has waited for the message that last used
  it (:meth:`StagingPool.claim`). Completion is one CUDA event.
- With gloo (host memory) messages complete on the host, so one worker thread per handoff
  runs the same loop with blocking waits, off the serving thread, through a buffer of its
  own (one chunk, at most ``chunk_bytes``). It never shares a slot: a thread blocked on its
  peer while holding a slot another handoff needs lets two engines that start concurrent
  handoffs in different orders wait on each other until the transfer times out. Tags keep
  concurrent handoffs apart. Where messages match by post order instead (``lane``: NCCL's
  rule on gloo), every transfer of the process group runs on one thread (:func:`lane_of`)
  in the order the transfers were started, so each side posts in its serving thread's order.

Every message starts with a ``_core.P2P_HEADER_BYTES`` header (``_core.chunk_schedule``: the
handoff's tag, the sender's incarnation, the chunk index and count, the payload size; a filler
says ``aborted``), so a slot is that much larger than a chunk. The receiver checks it
(``_core.PeerSteps.check``) before the bytes count: on host memory before each chunk's
scatter; on CUDA, where nothing waits on the host, each chunk's header is copied aside on the
stream and all of them are checked once the transfer's event completed, before the handle
reports success (the scatters wrote only the import's own, not yet admitted, destination
blocks). A receive whose message is a filler fails at once (``PushAbortedError``); one whose
message was meant for another receive fails as out of step (``MessageOrderError``), and
``PeerSteps`` marks its peer.

Ranges are half-open ``[lo, hi)``.
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from disagg_rs import _core
from disagg_rs.exceptions import PushAbortedError
from disagg_rs.transfer_backends import device_plan as dp

__all__ = [
    "DEFAULT_POOL_BYTES",
    "ChunkPlan",
    "Lane",
    "StagingPool",
    "lane_of",
    "post_chunks",
    "run_ops",
]

#: Bytes of the header in front of every message (``_core.chunk_schedule``).
HEADER = int(_core.P2P_HEADER_BYTES)

#: Default staging pool per engine: 256 MiB (``DISAGG_STAGING_POOL_BYTES`` overrides).
DEFAULT_POOL_BYTES = 256 << 20
#: Default chunk: 128 MiB, two slots of the default pool (``DISAGG_CHUNK_BYTES`` overrides;
#: it must be the same on every engine, since both sides of a pair cut the packed region the
#: same way). Each chunk costs about 0.2 ms of host time to post on an H200 host, so smaller
#: chunks starve the link: 32K tokens TP1->TP1 over NCCL moved 52 GB/s with 16 MiB chunks,
#: 196 with 64 MiB and 275 with 128 MiB.
DEFAULT_CHUNK_BYTES = 128 << 20


def pool_bytes_from_env() -> int:
    """``DISAGG_STAGING_POOL_BYTES`` or the default."""
    return int(os.environ.get("DISAGG_STAGING_POOL_BYTES", DEFAULT_POOL_BYTES))


def chunk_bytes_from_env() -> int:
    """``DISAGG_CHUNK_BYTES`` or the default."""
    return int(os.environ.get("DISAGG_CHUNK_BYTES", DEFAULT_CHUNK_BYTES))


def chunkable(metas: list[Any]) -> bool:
    """Whether a handoff between these ranks (sources and destination) moves in chunks: KV
    state, one block size everywhere, the heads of a token contiguous in every cache (what a
    device plan needs), one registered buffer each. Both sides evaluate it on the same
    metadata, so they agree. Decided in Rust."""
    return _core.chunkable(metas)


class StagingPool:
    """``pool_bytes // chunk_bytes`` slots of ``chunk_bytes`` (at least one), allocated on
    first use on ``device``; the only staging memory of a two-sided backend. CUDA pools run
    their packs and scatters on their own stream, so a transfer waiting for its peer never
    holds up the engine's compute stream."""

    def __init__(
        self,
        device: torch.device,
        pool_bytes: int | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        # ``chunk_bytes`` must be a positive multiple of 256 (``ArgumentError``).
        self.slots, self.slot_bytes = _core.staging_slots(
            pool_bytes, chunk_bytes, pool_bytes_from_env(), chunk_bytes_from_env()
        )
        self.device = device
        self.stream: Any = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )
        self._buf: torch.Tensor | None = None
        self._last: list[Any] = [None] * self.slots
        self._next = 0
        self._lock = threading.Lock()

    @property
    def stride(self) -> int:
        """Bytes of one slot: a chunk and its message header."""
        return self.slot_bytes + HEADER

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds once allocated."""
        return self.slots * self.stride

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index`` as a flat ``uint8`` tensor (header, then up to ``slot_bytes``)."""
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        lo = index * self.stride
        return self._buf[lo : lo + self.stride]

    def next_index(self) -> int:
        """Round-robin slot for the next chunk of any handoff."""
        with self._lock:
            index = self._next
            self._next = (self._next + 1) % self.slots
            return index

    def claim(self, index: int) -> None:
        """Order the next use of a slot after the message that last used it (CUDA: the
        current stream waits for it, the host does not)."""
        last, self._last[index] = self._last[index], None
        if last is not None:
            last.wait()

    def release(self, index: int, work: Any) -> None:
        """Record the message now using slot ``index``."""
        self._last[index] = work


def _settle(future: Future[Any], job: Callable[[], Any]) -> None:
    """Run ``job`` into ``future``."""
    future.set_running_or_notify_cancel()
    try:
        future.set_result(job())
    except BaseException as exc:
        future.set_exception(exc)


class _Spawn:
    """Runs each job on a daemon thread of its own."""

    @staticmethod
    def submit(job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        threading.Thread(target=_settle, args=(future, job), daemon=True).start()
        return future


class _Ordered:
    """Runs jobs on one daemon thread, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        for future, job in iter(self._jobs.get, None):
            _settle(future, job)

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, job))
        return future


#: Where host-memory transfers run (daemon threads: a receive blocked on its peer must not
#: hold up the interpreter's exit).
Lane = _Spawn | _Ordered
_SPAWN = _Spawn()
_LANES: collections.defaultdict[int, _Ordered] = collections.defaultdict(_Ordered)
_LANES_LOCK = threading.Lock()


def lane_of(group: Any, ordered: bool) -> Lane:
    """Where this process runs host-memory transfers of process group ``group`` (``None``:
    the default group). ``ordered`` (messages match by post order): one thread for the
    group, running its transfers in the order they were started, so a side's posts follow
    its serving thread's order (per-transfer threads would race); a transfer blocked on its
    peer holds up the later ones, as a receive that never gets its send holds up the pair on
    NCCL. Otherwise one thread per transfer: tags keep concurrent transfers apart, and one
    waiting for its peer holds up nothing else."""
    if not ordered:
        return _SPAWN
    with _LANES_LOCK:
        return _LANES[id(group)]


def run_ops(ops: list[Any], lane: Lane) -> tuple[Callable[[], bool], list[str]]:
    """Post point-to-point ``ops`` on ``lane`` and wait for them there; returns ``(done,
    errors)`` as :func:`post_chunks` does."""
    errors: list[str] = []
    job = lane.submit(lambda: [work.wait() for work in dist.batch_isend_irecv(ops)])
    # The failure, if any, is recorded before ``done()`` says so (callbacks run first).
    reported = "torch.distributed reported {!r}".format
    job.add_done_callback(lambda f: errors.extend(map(reported, filter(None, [f.exception()]))))
    return job.done, errors


@dataclass
class ChunkPlan:
    """What one side of one (source, destination) pair moves: the device plan, the block ids
    of the local cache (on its device), the token count and the peer's process rank; the
    handoff's ``tag`` and the sender's ``incarnation`` (what the headers say); ``filler``: a
    send of the posted sizes whose headers say ``aborted`` (nothing is packed)."""

    plan: dp.DevicePlan
    ids: torch.Tensor
    n_tok: int
    peer: int
    send: bool
    tag: int = 0
    incarnation: int = 0
    filler: bool = False

    def sizes(self, slot_bytes: int) -> list[int]:
        """Payload bytes of each chunk."""
        return [c[3] - c[2] for c in self.plan.chunks(self.n_tok, slot_bytes)]

    def schedule_args(self, slot_bytes: int) -> tuple[bool, bool, int, int, int, list[int]]:
        """What ``_core.chunk_schedule`` needs of this pair: the bytes of one block of its
        largest plane (one slot must hold it) and each chunk's payload bytes."""
        item = int(self.plan.planes[:, 3].max()) * self.plan.tokens_per_block
        sizes = self.sizes(slot_bytes)
        return self.send, self.filler, self.tag, self.incarnation, item, sizes

    def check(self, steps: _core.PeerSteps, got: torch.Tensor, slot_bytes: int, first: int) -> None:
        """Check received headers of chunks ``first..`` (``PushAbortedError`` for fillers,
        ``MessageOrderError`` for another message, marking the peer in ``steps``)."""
        raw = got.cpu().numpy().tobytes()
        steps.check(self.peer, raw, self.tag, self.incarnation, self.sizes(slot_bytes), first)


class _Receiver:
    """Host memory: checks each received chunk's header before its scatter. After a filler
    the pair's remaining chunks are still received (keeping the pair in step), not landed;
    a message out of step raises (nothing more on the pair can be trusted)."""

    def __init__(self, cp: ChunkPlan, steps: _core.PeerSteps, pool: StagingPool, errors: list[str]):
        self.cp, self.steps, self.pool, self.errors = cp, steps, pool, errors
        self.aborted = False

    def __call__(self, got: torch.Tensor, index: int, land: Callable[[], None]) -> None:
        if self.aborted:
            return
        try:
            self.cp.check(self.steps, got, self.pool.slot_bytes, index)
        except PushAbortedError as exc:
            self.aborted = True
            self.errors.append(str(exc))
            return
        land()


def _sent(got: torch.Tensor, index: int, land: Callable[[], None]) -> None:
    """Host memory, a send: nothing to check or land."""


def _one_chunk(
    cp: ChunkPlan,
    buffer: torch.Tensor,
    slot: torch.Tensor,
    chunk: tuple[int, int, int, int],
    group: Any,
    wire_tag: int,
    header: torch.Tensor,
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """(post the message, land it) for one chunk; a send's header (``header``) and pack
    happen before the post. The message is the slot's header and the chunk's bytes."""
    k_lo, k_hi, b_lo, b_hi = chunk
    window = slot[: HEADER + b_hi - b_lo]
    packed = dp.Side("packed", window[HEADER:], bias=b_lo)
    if cp.send:
        window[:HEADER].copy_(header)
        if not cp.filler:
            src = dp.Side("src", buffer, cp.ids)
            dp.copy(cp.plan, src, packed, cp.n_tok, items=(k_lo, k_hi))
        return (lambda: dist.isend(window, cp.peer, group, wire_tag)), (lambda: None)
    local = dp.Side("dst", buffer, cp.ids)

    def land() -> None:
        dp.copy(cp.plan, packed, local, cp.n_tok, items=(k_lo, k_hi))

    return (lambda: dist.irecv(window, cp.peer, group, wire_tag)), land


def post_chunks(
    pairs: list[ChunkPlan],
    buffer: torch.Tensor,
    pool: StagingPool,
    group: Any,
    match_by_order: bool,
    steps: _core.PeerSteps,
    lane: Lane = _SPAWN,
) -> tuple[list[Any], Callable[[], bool], list[Callable[[], None]], list[str]]:
    """Move every pair's chunks through ``pool``, every message on its pair's tag (or, where
    messages ``match_by_order``, one tag for every handoff); received headers are checked
    through ``steps``.

    Returns ``(works, done, checks, errors)``: on CUDA, ``works`` are the NCCL works,
    ``done()`` queries the event recorded after the last scatter and ``checks`` check each
    receiving pair's headers (run once ``done()``, before the transfer counts as a success);
    on host memory a thread of ``lane`` (:func:`lane_of`) runs the loop through its own
    one-chunk buffer, checking each header before its scatter (``done()`` says it finished).
    ``errors`` holds the failures (e.g. the process group's timeout on a peer that never
    answered, a filler, a message out of step).
    """
    # One block of one plane must fit a slot (``CapacityError`` before anything is posted);
    # Rust orders the steps, builds each pair's headers (sent, or (receive) expected, then
    # overwritten by what came) and picks the tag each pair's messages travel on.
    order, raw_heads, wire_tags = _core.chunk_schedule(
        [cp.schedule_args(pool.slot_bytes) for cp in pairs],
        pool.slot_bytes,
        pool.slots,
        match_by_order,
    )
    chunks = [
        (p, i, c)
        for p, cp in enumerate(pairs)
        for i, c in enumerate(cp.plan.chunks(cp.n_tok, pool.slot_bytes))
    ]
    heads = [torch.frombuffer(bytearray(h), dtype=torch.uint8).to(buffer.device) for h in raw_heads]
    errors: list[str] = []
    if buffer.is_cuda:
        works: list[Any] = []
        stream = pool.stream
        # The pool's stream starts after what the engine queued so far (the blocks' bytes).
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
        for cp, head in zip(pairs, heads, strict=True):
            # The ids and headers were copied on the engine's stream; keep them until this
            # stream is done.
            cp.ids.record_stream(stream)
            head.record_stream(stream)
        # Receives run ahead of their scatters by up to ``slots - 1`` chunks (a receive waits
        # for everything queued on the stream when it is posted); the order is Rust's.
        posted: dict[int, tuple[Any, Callable[[], None], torch.Tensor, torch.Tensor]] = {}
        with torch.cuda.stream(stream):
            for step in order:
                if step < 0:
                    work, land, window, aside = posted.pop(-step - 1)
                    work.wait()  # the stream waits for the message; the host does not
                    aside.copy_(window[:HEADER])  # the header that came (a send's own)
                    land()
                    continue
                p, i, chunk = chunks[step]
                index = pool.next_index()
                pool.claim(index)
                own = heads[p][i * HEADER : (i + 1) * HEADER]
                slot = pool.slot(index)
                post, land = _one_chunk(pairs[p], buffer, slot, chunk, group, wire_tags[p], own)
                work = post()
                works.append(work)
                pool.release(index, work)
                posted[step] = (work, land, slot, own)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        checks: list[Callable[[], None]] = [
            functools.partial(cp.check, steps, head, pool.slot_bytes, 0)
            for cp, head in zip(pairs, heads, strict=True)
            if not cp.send
        ]
        return works, lambda: bool(event.query()), checks, errors  # type: ignore[no-untyped-call]
    finished = threading.Event()
    receivers = [_sent if cp.send else _Receiver(cp, steps, pool, errors) for cp in pairs]

    def run() -> None:
        try:
            own = torch.empty(
                HEADER + max((c[3] - c[2] for _, _, c in chunks), default=0), dtype=torch.uint8
            )
            for p, i, chunk in chunks:
                head = heads[p][i * HEADER : (i + 1) * HEADER]
                post, land = _one_chunk(pairs[p], buffer, own, chunk, group, wire_tags[p], head)
                post().wait()
                receivers[p](own[:HEADER], i, land)
        except Exception as exc:
            errors.append(f"chunked transfer failed: {exc!r}")
        finally:
            finished.set()

    lane.submit(run)
    return [], finished.is_set, [], errors
