"""Model-parallel agreement on each import's outcome (the reference design's
``handoff_completion_tracker`` module).

Every model-parallel rank of a decode engine moves its own share of a request's state, so a
request may start decoding only once every rank's transfer succeeded, and must fail as soon
as one rank's failed. Ranks report once per request; the coordinator (rank 0 of the group)
collects the reports and :meth:`HandoffCompletionTracker.drain_completed` returns the
decisions, which the engine then distributes with its usual per-step broadcast. The votes, the
decisions and the closed requests live in ``CompletionTracker`` (Rust, over the library's
:class:`~disagg_rs.CompletionQuorum`): success needs every rank,
the first failure decides at once, a late report of a decided request is absorbed, and a rank
that contradicts itself is an error.

Non-coordinator ranks send their reports over a ZeroMQ PUSH socket whose address the
coordinator broadcasts once at construction (``pyzmq`` is needed only with more than one rank).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping
from typing import Any

from disagg_rs._core import CompletionTracker
from disagg_rs.exceptions import HandoffStateError

__all__ = ["HandoffCompletionTracker"]


class HandoffCompletionTracker:
    """Aggregate per-rank transfer results at the model-parallel coordinator."""

    _REPORT_FORMAT = "!qi?"

    def __init__(self, zmq_context: Any, process_group: Any, hostname: str | None = None) -> None:
        import torch.distributed as dist

        self.rank = int(dist.get_rank(process_group))
        self.world_size = int(dist.get_world_size(process_group))
        self.is_coordinator = self.rank == 0
        self._reports = {}
        self._socket: Any = None
        self.sockets: list[Any] = []
        if self.world_size == 1:
            return
        import zmq

        root = dist.get_process_group_ranks(process_group)[0]
        if self.is_coordinator:
            self._socket = zmq_context.socket(zmq.PULL)
            self._socket.bind_to_random_port(f"tcp://{hostname or socket.gethostname()}")
            box: list[Any] = [self._socket.getsockopt_string(zmq.LAST_ENDPOINT)]
            dist.broadcast_object_list(box, src=root, group=process_group)
        else:
            box = [None]
            dist.broadcast_object_list(box, src=root, group=process_group)
            self._socket = zmq_context.socket(zmq.PUSH)
            self._socket.connect(box[0])
        self.sockets.append(self._socket)

    # -- state: a view over the Rust tracker -------------------------------------------------
    @property
    def _reports(self) -> dict[int, str]:
        """Requests with reports and no decision yet (read-only view)."""
        return dict.fromkeys(self._votes().open_ids(), "open")

    @_reports.setter
    def _reports(self, value: Mapping[int, Any]) -> None:
        if value:
            raise HandoffStateError(
                f"_reports can only be reset to empty, got {len(value)} entries", "_reports"
            )
        self.__dict__["_quorum"] = CompletionTracker(int(self.world_size))

    def _votes(self) -> CompletionTracker:
        tracker: CompletionTracker = self.__dict__["_quorum"]
        return tracker

    # -- API -----------------------------------------------------------------------------------
    def report(self, request_id: int, failed: bool) -> None:
        """Report this rank's terminal transfer result for a request (once)."""
        if self.is_coordinator:
            self._record(request_id, self.rank, failed)
            return
        self._socket.send(struct.pack(self._REPORT_FORMAT, request_id, self.rank, failed))

    def drain_completed(self) -> list[tuple[int, bool]]:
        """Requests that every rank completed, or that some rank failed, since the last drain:
        ``(request_id, failed)`` in decision order. Empty on non-coordinator ranks."""
        # A non-coordinator's socket only sends (never readable) and its tracker stays empty.
        while self._socket is not None and self._socket.poll(0):
            rid, rank, failed = struct.unpack(self._REPORT_FORMAT, self._socket.recv())
            self._record(rid, rank, failed)
        return self._votes().drain()

    def _record(self, request_id: int, rank: int, failed: bool) -> None:
        """One rank's report; the Rust tracker decides, absorbing reports for a request
        decided as failed (a contradicting report raises ``HandoffStateError`` naming the
        request and both outcomes)."""
        self._votes().record(request_id, rank, failed)

    def forget(self, request_id: int) -> None:
        """Drop everything known about a request that ended (its id may be reused)."""
        self._votes().forget(request_id)
