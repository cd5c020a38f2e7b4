"""The engines' and clients' ends of the control plane.

Neither end ever blocks on the coordinator: sends are non-blocking (a message that cannot be
queued is dropped and counted), an engine declares the coordinator lost when nothing (not
even a HEARTBEAT_ACK) came back for ``coordinator_timeout_s`` and aborts the requests it was
given, and a client reports FAILED for a request that got no answer by its deadline.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from disagg_rs._core import ClientDeadlines, LinkLiveness
from disagg_rs.control.keys import CurveKeys, connect_with, use_curve
from disagg_rs.control.messages import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    DEFAULT_SEND_HWM,
    MAX_FRAME_BYTES,
    Msg,
    check_timeout,
    decode_message,
    encode_message,
    submit_frame,
)


def _dealer(
    endpoint: str,
    keys: CurveKeys | None,
    server_key: bytes | None,
    insecure: bool,
    what: str,
    send_hwm: int,
) -> zmq.Socket[bytes]:
    curve = use_curve(keys, server_key, insecure, what, endpoint)  # refuses before any socket
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    if curve and keys is not None and server_key is not None:
        connect_with(sock, keys, server_key)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return sock


class EngineLink:
    """An engine's connection to the coordinator (rank 0 of each engine holds one).

    ``keys`` and ``server_key``: this engine's CURVE key pair and the coordinator's public key;
    without them the link refuses to start unless ``insecure=True``. ``coordinator_timeout_s``
    (``None``: off): when nothing came from the coordinator for this long, :meth:`poll`
    declares it lost (``coordinator_lost``; counted in ``liveness``) and returns an
    ABORT for every request this engine was given and has not finished, so the driver fails
    that work cleanly (a prefill's pins then end with their lease); once the coordinator is
    heard again the engine registers again. ``clock``: seconds, for these decisions (a virtual
    clock in tests).
    """

    def __init__(
        self,
        endpoint: str,
        engine_id: str,
        role: str,
        incarnation: int | None = None,
        keys: CurveKeys | None = None,
        server_key: bytes | None = None,
        *,
        insecure: bool = False,
        coordinator_timeout_s: float | None = DEFAULT_LIVENESS_TIMEOUT_S,
        send_hwm: int = DEFAULT_SEND_HWM,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.liveness = LinkLiveness(coordinator_timeout_s, clock())  # refuses a bad timeout
        """The coordinator's liveness as this engine sees it (decided in the core)."""
        self._sock = _dealer(endpoint, keys, server_key, insecure, f"engine {engine_id}", send_hwm)
        self._sock.setsockopt(zmq.IDENTITY, f"{role}:{engine_id}:{self.incarnation}".encode())
        self._sock.connect(endpoint)
        self._clock = clock
        self.coordinator_timeout_s = coordinator_timeout_s
        self.peers: dict[str, dict[str, Any]] = {}
        self._meta: Any = None
        self._backlog: list[dict[str, Any]] = []
        self.unsent = 0
        """Messages dropped because the coordinator's queue was full (it does not read)."""

    @property
    def coordinator_lost(self) -> bool:
        """Whether the coordinator is silent past ``coordinator_timeout_s`` now
        (``liveness.counters()``: ``losses``, and ``abandoned`` requests)."""
        return self.liveness.lost

    @property
    def fenced(self) -> int:
        """How many times the coordinator fenced this engine (it then registered again)."""
        return self.liveness.fenced

    def register(self, meta: Any, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Publish static metadata once; returns the peers known to the coordinator."""
        self._meta = meta
        self._send_register()
        since = time.monotonic()
        # Until REGISTERED comes; TransferTimeout once timeout_s passed without it (in Rust).
        while self.liveness.awaiting_registration(since, timeout_s, time.monotonic()):
            # Work the coordinator sent around REGISTERED (it counts the engine as registered
            # before this reply is read) is kept for the next poll().
            self._backlog += self.poll(100)
        return self.peers

    def _send_register(self) -> None:
        self.send(
            Msg.REGISTER,
            engine_id=self.engine_id,
            role=self.role,
            incarnation=self.incarnation,
            meta=self._meta,
        )

    def send(self, kind: Msg, **fields: Any) -> None:
        """Send one message to the coordinator; never blocks (a message the coordinator's
        queue cannot take is dropped and counted in ``unsent``)."""
        try:
            self._sock.send(encode_message(kind, **fields), zmq.NOBLOCK)
            delivered = True
        except zmq.Again:
            self.unsent += 1
            delivered = False
        self.liveness.sent(kind.value, fields.get("request_id"), delivered, self._clock())

    def heartbeat(self, interval_s: float = 1.0) -> bool:
        """Send HEARTBEAT if nothing was sent, or nothing heard, for ``interval_s`` (at most
        one per interval; call it from the serving loop). The coordinator acknowledges each
        one, so a coordinator that answers nothing is detected. Returns whether one was sent."""
        if not self.liveness.heartbeat_due(interval_s, self._clock()):
            return False
        self.send(Msg.HEARTBEAT, engine_id=self.engine_id, incarnation=self.incarnation)
        return True

    def poll(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Messages that arrived within ``timeout_ms`` (peer updates are applied here), after
        any that arrived while :meth:`register` waited; when the coordinator has just been
        declared lost, an ABORT for each request this engine still holds."""
        out, self._backlog = self._backlog, []
        frames, wait = [], 0 if out else timeout_ms
        while self._sock.poll(wait):  # everything that arrived: decoded and sorted in Rust
            frames.append(self._sock.recv(zmq.NOBLOCK))
            wait = 0
        msgs, self.peers, register = self.liveness.receive(frames, self.peers, self._clock())
        if register:  # fenced while alive, or a coordinator again (it may not know us)
            self._send_register()
        abandoned = self.liveness.check(self._clock())
        return out + msgs + [{"type": Msg.ABORT, "request_id": r, "epoch": e} for r, e in abandoned]

    @property
    def malformed(self) -> int:
        """Undecodable frames received (dropped; counted by :attr:`liveness`)."""
        return self.liveness.malformed

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)


def _no_answer(request_id: int) -> dict[str, Any]:
    error = f"request {request_id}: no answer from the coordinator by its deadline"
    return {"type": Msg.FAILED, "request_id": request_id, "error": error}


class SubmitClient(abc.ABC):
    """What both clients share: :meth:`submit` builds the frame, the client delivers it."""

    def submit(
        self,
        request_id: int,
        prompt: list[int],
        max_new_tokens: int,
        timeout_s: float | None = None,
    ) -> None:
        """Send one request (``timeout_s``: its deadline, see :func:`check_timeout`; ``None``:
        the default); never blocks."""
        self._deliver(
            request_id, timeout_s, submit_frame(request_id, prompt, max_new_tokens, timeout_s)
        )

    @abc.abstractmethod
    def _deliver(self, request_id: int, timeout_s: float | None, frame: bytes) -> None:
        """Send a SUBMIT ``frame`` for ``request_id`` (``timeout_s`` as given)."""


class ControlClient(SubmitClient):
    """Submits requests and streams their tokens back.

    ``keys`` and ``server_key``: the client's CURVE key pair and the coordinator's public key
    (required unless ``insecure=True``). Every request has a deadline on this side too
    (``timeout_s`` of :meth:`submit`, else ``default_timeout_s``, plus ``grace_s`` for the
    coordinator's own FAILED to arrive first): :meth:`events` yields FAILED for a request
    that got no DONE or FAILED by then, so a client is told even when the coordinator is
    gone. ``clock``: seconds, for the deadlines (a virtual clock in tests).
    """

    def __init__(
        self,
        endpoint: str,
        keys: CurveKeys | None = None,
        server_key: bytes | None = None,
        *,
        insecure: bool = False,
        default_timeout_s: float = 60.0,
        grace_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = _dealer(endpoint, keys, server_key, insecure, "client", DEFAULT_SEND_HWM)
        self._sock.connect(endpoint)
        self.default_timeout_s = check_timeout(default_timeout_s, "default_timeout_s")
        self.grace_s = grace_s
        self._clock = clock
        self._deadlines = ClientDeadlines(self.default_timeout_s, grace_s)
        self.unsent = 0
        """Requests whose SUBMIT the coordinator's queue could not take (they fail at their
        deadline)."""

    def _deliver(self, request_id: int, timeout_s: float | None, frame: bytes) -> None:
        """Send a SUBMIT without blocking, its deadline set (``timeout_s``: see
        :func:`check_timeout`)."""
        self._deadlines.submit(request_id, timeout_s, self._clock())
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.unsent += 1

    def events(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        """TOKENS, DONE and FAILED messages until ``timeout_s`` passes without one; a request
        past its deadline without an answer gets a FAILED from this side."""
        while True:
            if self._sock.poll(int(timeout_s * 1000)):
                msg = decode_message(self._sock.recv())
                self._deadlines.answered(msg["type"].value, msg.get("request_id"))
                yield msg
                continue
            late = self._deadlines.expired(self._clock())
            if not late:
                return
            yield from [_no_answer(rid) for rid in late]

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)
