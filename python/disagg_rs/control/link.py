"""The engines' and clients' ends of the control plane."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import zmq

from disagg_rs.control.messages import (
    MAX_FRAME_BYTES,
    Msg,
    check_timeout,
    decode_message,
    encode_message,
)
from disagg_rs.exceptions import MetadataError, TransferTimeout


class EngineLink:
    """An engine's connection to the coordinator (rank 0 of each engine holds one)."""

    def __init__(
        self, endpoint: str, engine_id: str, role: str, incarnation: int | None = None
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, f"{role}:{engine_id}:{self.incarnation}".encode())
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.connect(endpoint)
        self.peers: dict[str, dict[str, Any]] = {}
        self._last_sent = time.monotonic()
        self._meta: Any = None
        self._backlog: list[dict[str, Any]] = []
        self.fenced = 0
        """How many times the coordinator fenced this engine (it then registered again)."""
        self.malformed = 0
        """Undecodable frames received (dropped)."""

    def register(self, meta: Any, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Publish static metadata once; returns the peers known to the coordinator."""
        self._meta = meta
        self._send_register()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msgs = self.poll(100)
            for i, msg in enumerate(msgs):
                if msg["type"] is Msg.REGISTERED:
                    # Work the coordinator sent right behind REGISTERED (it counts the engine
                    # as registered before this reply is read) is kept for the next poll().
                    self._backlog += msgs[:i] + msgs[i + 1 :]
                    return self.peers
            self._backlog += [m for m in msgs if m["type"] is not Msg.REGISTERED]
        raise TransferTimeout(
            f"coordinator did not answer REGISTER within {timeout_s} s", "timeout_s"
        )

    def _send_register(self) -> None:
        self.send(
            Msg.REGISTER,
            engine_id=self.engine_id,
            role=self.role,
            incarnation=self.incarnation,
            meta=self._meta,
        )

    def send(self, kind: Msg, **fields: Any) -> None:
        """Send one message to the coordinator."""
        self._sock.send(encode_message(kind, **fields))
        self._last_sent = time.monotonic()

    def heartbeat(self, interval_s: float = 1.0) -> bool:
        """Send HEARTBEAT if nothing was sent for ``interval_s`` (call it from the serving
        loop; any message counts as a sign of life). Returns whether one was sent."""
        if time.monotonic() - self._last_sent < interval_s:
            return False
        self.send(Msg.HEARTBEAT, engine_id=self.engine_id, incarnation=self.incarnation)
        return True

    def poll(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Messages that arrived within ``timeout_ms`` (peer updates are applied here), after
        any that arrived while :meth:`register` waited."""
        out, self._backlog = self._backlog, []
        if self._sock.poll(0 if out else timeout_ms):
            while True:
                try:
                    msg = decode_message(self._sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except MetadataError:
                    self.malformed += 1  # an undecodable frame never stops the engine
                    continue
                if msg["type"] in (Msg.REGISTERED, Msg.PEERS):
                    self.peers = dict(msg["peers"])
                if msg["type"] is Msg.FENCED and self._meta is not None:
                    self.fenced += 1  # declared lost while alive: come back, same incarnation
                    self._send_register()
                    continue
                out.append(msg)
        return out

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)


class ControlClient:
    """Submits requests and streams their tokens back."""

    def __init__(self, endpoint: str) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def submit(
        self,
        request_id: int,
        prompt: list[int],
        max_new_tokens: int,
        timeout_s: float | None = None,
    ) -> None:
        """Send one request (``timeout_s``: see :func:`check_timeout`)."""
        extra = {} if timeout_s is None else {"timeout_s": check_timeout(timeout_s)}
        self._sock.send(
            encode_message(
                Msg.SUBMIT,
                request_id=request_id,
                prompt=prompt,
                max_new_tokens=max_new_tokens,
                **extra,
            )
        )

    def events(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        """TOKENS, DONE and FAILED messages until ``timeout_s`` passes without one."""
        while self._sock.poll(int(timeout_s * 1000)):
            yield decode_message(self._sock.recv())

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)
