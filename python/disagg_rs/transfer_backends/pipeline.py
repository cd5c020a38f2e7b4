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
  previous scatter (``_core.chunk_steps`` orders the steps). A slot is reused only after the
  scatter that read it was queued and the stream has waited for the message that last used
  it (:meth:`StagingPool.claim`). Completion is one CUDA event.
- With gloo (host memory) messages complete on the host, so one worker thread per handoff
  runs the same loop with blocking waits, off the serving thread, through a buffer of its
  own (one chunk, at most ``chunk_bytes``). It never shares a slot: a thread blocked on its
  peer while holding a slot another handoff needs lets two engines that start concurrent
  handoffs in different orders wait on each other until the transfer times out. Tags keep
  concurrent handoffs apart.

Ranges are half-open ``[lo, hi)``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from disagg_rs import _core
from disagg_rs.exceptions import CapacityError
from disagg_rs.transfer_backends import device_plan as dp

__all__ = ["DEFAULT_POOL_BYTES", "ChunkPlan", "StagingPool", "post_chunks"]

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
    device plan needs). Both sides evaluate it on the same metadata, so they agree."""
    geoms = [m.get("geometry") for m in metas]
    if any(m.get("state_kind") != "kv" for m in metas) or any(g is None for g in geoms):
        return False
    if any(len((m.get("buffer") or {}).get("regions") or ()) > 1 for m in metas):
        return False  # per-layer tensors: a device plan addresses one buffer
    if len({int(g["tokens_per_block"]) for g in geoms}) != 1:
        return False
    return all(
        int(g["num_heads"]) == 1
        or int(g["head_stride"]) == int(g["head_dim"]) * int(g["element_size"])
        for g in geoms
    )


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
        total = pool_bytes_from_env() if pool_bytes is None else int(pool_bytes)
        chunk = chunk_bytes_from_env() if chunk_bytes is None else int(chunk_bytes)
        if chunk < 256 or chunk % 256:
            raise ValueError(f"chunk_bytes={chunk} must be a positive multiple of 256")
        self.device = device
        self.slots = max(total // chunk, 1)
        self.slot_bytes = chunk
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
    def nbytes(self) -> int:
        """Bytes the pool holds once allocated."""
        return self.slots * self.slot_bytes

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index`` as a flat ``uint8`` tensor."""
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        lo = index * self.slot_bytes
        return self._buf[lo : lo + self.slot_bytes]

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


@dataclass
class ChunkPlan:
    """What one side of one (source, destination) pair moves: the device plan, the block ids
    of the local cache (on its device), the token count and the peer's process rank."""

    plan: dp.DevicePlan
    ids: torch.Tensor
    n_tok: int
    peer: int
    send: bool


def _one_chunk(
    cp: ChunkPlan,
    buffer: torch.Tensor,
    slot: torch.Tensor,
    chunk: tuple[int, int, int, int],
    group: Any,
    tag: int,
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """(post the message, land it) for one chunk; the pack happens before the post."""
    k_lo, k_hi, b_lo, b_hi = chunk
    window = slot[: b_hi - b_lo]
    local = dp.Side("src" if cp.send else "dst", buffer, cp.ids)
    packed = dp.Side("packed", window, bias=b_lo)
    if cp.send:
        dp.copy(cp.plan, local, packed, cp.n_tok, items=(k_lo, k_hi))
        return (lambda: dist.isend(window, cp.peer, group, tag)), (lambda: None)

    def land() -> None:
        dp.copy(cp.plan, packed, local, cp.n_tok, items=(k_lo, k_hi))

    return (lambda: dist.irecv(window, cp.peer, group, tag)), land


def post_chunks(
    pairs: list[ChunkPlan],
    buffer: torch.Tensor,
    pool: StagingPool,
    group: Any,
    tag: int,
) -> tuple[list[Any], Callable[[], bool], threading.Thread | None, list[str]]:
    """Move every pair's chunks through ``pool``.

    Returns ``(works, done, thread, errors)``: on CUDA, ``works`` are the NCCL works and
    ``done()`` queries the event recorded after the last scatter; on host memory a worker
    thread runs the loop through its own one-chunk buffer (``done()`` says it finished;
    ``errors`` holds its failures, e.g. the process group's timeout on a peer that never
    answered).
    """
    for cp in pairs:
        item = int(cp.plan.planes[:, 3].max()) * cp.plan.tokens_per_block
        if item > pool.slot_bytes:
            raise CapacityError(
                f"one block of one plane is {item} bytes but staging slots hold "
                f"chunk_bytes={pool.slot_bytes}",
                field="chunk_bytes",
            )
    chunks = [(cp, c) for cp in pairs for c in cp.plan.chunks(cp.n_tok, pool.slot_bytes)]
    if buffer.is_cuda:
        works: list[Any] = []
        stream = pool.stream
        # The pool's stream starts after what the engine queued so far (the blocks' bytes).
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
        for cp in pairs:
            # The ids were copied on the engine's stream; keep them until this stream is done.
            cp.ids.record_stream(stream)
        # Receives run ahead of their scatters by up to ``slots - 1`` chunks (a receive waits
        # for everything queued on the stream when it is posted); the order is Rust's.
        posted: dict[int, tuple[Any, Callable[[], None]]] = {}
        with torch.cuda.stream(stream):
            for step in _core.chunk_steps([cp.send for cp, _ in chunks], pool.slots):
                if step < 0:
                    work, land = posted.pop(-step - 1)
                    work.wait()  # the stream waits for the message; the host does not
                    land()
                    continue
                cp, chunk = chunks[step]
                index = pool.next_index()
                pool.claim(index)
                post, land = _one_chunk(cp, buffer, pool.slot(index), chunk, group, tag)
                work = post()
                works.append(work)
                pool.release(index, work)
                posted[step] = (work, land)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return works, lambda: bool(event.query()), None, []  # type: ignore[no-untyped-call]
    errors: list[str] = []
    finished = threading.Event()

    def run() -> None:
        try:
            own = torch.empty(max((c[3] - c[2] for _, c in chunks), default=0), dtype=torch.uint8)
            for cp, chunk in chunks:
                post, land = _one_chunk(cp, buffer, own, chunk, group, tag)
                post().wait()
                land()
        except Exception as exc:
            errors.append(f"chunked transfer failed: {exc!r}")
        finally:
            finished.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return [], finished.is_set, thread, errors
