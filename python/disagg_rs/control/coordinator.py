"""The sans-IO coordinator: messages and the caller's ``now`` in, addressed messages out."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from disagg_rs._core import CoordinatorCore, decode_control_message
from disagg_rs.control.messages import Msg, check_timeout, decode_message, message_frame
from disagg_rs.exceptions import MetadataError


@dataclass(frozen=True)
class Outgoing:
    """One message the coordinator wants sent: to an engine id, or to a client identity, as
    the ``frame`` that goes on the wire (encoded in Rust: what
    :func:`~disagg_rs.control.encode_message` writes for the same fields)."""

    to_engine: str | None
    to_client: bytes | None
    kind: Msg
    frame: bytes = field(repr=False)

    @functools.cached_property
    def fields(self) -> dict[str, Any]:
        """The message's fields (decoded from ``frame`` when first read; no ``type``, no
        ``v``)."""
        fields: dict[str, Any] = decode_control_message(self.frame)
        del fields["type"], fields["v"]
        return fields

    def __repr__(self) -> str:
        to = f"to_engine={self.to_engine!r}, to_client={self.to_client!r}"
        return f"Outgoing({to}, kind={self.kind.value}, fields={self.fields!r})"


@dataclass(frozen=True)
class EngineView:
    """A registered engine, as the coordinator knows it."""

    engine_id: str
    role: str
    incarnation: int
    meta: Any
    identity: bytes
    last_seen: float


@dataclass(frozen=True)
class RequestView:
    """A live request, as the coordinator knows it (``phase``: ``"prefilling"`` or
    ``"decoding"``)."""

    epoch: int
    phase: str
    prefill: str | None
    decode: str | None
    pinned: bool
    ticket_sent: bool
    """The decode was sent the ticket: it may read the pinned blocks until it says it is quiet."""
    deadline: float


def _outgoing(out: list[tuple[str | None, bytes | None, str, bytes]]) -> list[Outgoing]:
    return [Outgoing(engine, client, Msg(kind), frame) for engine, client, kind, frame in out]


class CoordinatorState:
    """Sans-IO routing of requests between clients, prefill and decode engines.

    ``handle(identity, msg, now)`` and ``poll(now)`` return the :class:`Outgoing` messages to
    send. Time is the caller's ``now`` (seconds, any monotonic origin). The routing and the
    bookkeeping are decided in Rust (``CoordinatorCore``); this class converts.

    Liveness (on by default in :class:`~disagg_rs.control.CoordinatorServer`): with
    ``engine_timeout_s``, an engine heard from (any message; idle engines send HEARTBEAT) less
    recently than that is declared lost: the requests that depended on it fail
    at once instead of at their deadlines, it gets no new work, and its later messages are
    ignored until it registers again: its next HEARTBEAT is answered with FENCED, on which
    :class:`EngineLink` registers again by itself (a fenced engine's pins expire with their
    lease). Each HEARTBEAT of a registered engine is answered with HEARTBEAT_ACK, so
    engines detect a silent coordinator in turn.
    """

    def __init__(
        self,
        request_timeout_s: float = 60.0,
        push_transport: bool = False,
        engine_timeout_s: float | None = None,
    ) -> None:
        self.request_timeout_s = check_timeout(request_timeout_s, "request_timeout_s")
        self.push_transport = push_transport
        self.engine_timeout_s = engine_timeout_s
        # Refuses engine_timeout_s <= 0 (ArgumentError, a ValueError).
        self._core = CoordinatorCore(self.request_timeout_s, push_transport, engine_timeout_s)

    # -- what the core knows -------------------------------------------------------------
    @property
    def engines(self) -> dict[str, EngineView]:
        """The registered engines, by id."""
        return {e: EngineView(*row) for e, row in self._core.engines().items()}

    @property
    def requests(self) -> dict[int, RequestView]:
        """The live requests, by id."""
        return {r: RequestView(*row) for r, row in self._core.requests().items()}

    @property
    def ignored(self) -> Counter[str]:
        """Messages ignored (stale, from an engine that does not play that part, a
        duplicate), by type."""
        value: Counter[str] = Counter(self._core.counters()["ignored"])
        return value

    @property
    def malformed(self) -> Counter[str]:
        """Messages refused by :func:`check_fields` (or that failed to apply), by type."""
        value: Counter[str] = Counter(self._core.counters()["malformed"])
        return value

    @property
    def lost(self) -> Counter[str]:
        """Engines declared lost by the liveness timeout, by engine id."""
        value: Counter[str] = Counter(self._core.counters()["lost"])
        return value

    @property
    def completed(self) -> int:
        """Requests finished."""
        value: int = self._core.counters()["completed"]
        return value

    @property
    def failed(self) -> int:
        """Requests failed."""
        value: int = self._core.counters()["failed"]
        return value

    @property
    def aborted_pushes(self) -> int:
        """KV_RECV_POSTED answered with SEND_KV ``abort`` (a filler): the decode's
        receives were posted for a request the prefill will not push."""
        value: int = self._core.counters()["aborted_pushes"]
        return value

    @property
    def left_to_lease(self) -> int:
        """Failed requests whose prefill pins were left to their lease (the decode may
        still have been reading them), instead of released by RELEASE_KV."""
        value: int = self._core.counters()["left_to_lease"]
        return value

    @property
    def shutting_down(self) -> bool:
        """Set by :meth:`shutdown`: engines told to stop go silent, and are not
        declared lost."""
        value: bool = self._core.counters()["shutting_down"]
        return value

    # -- events --------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict[str, Any], now: float) -> list[Outgoing]:
        """Apply one incoming message from ``identity``. Never raises on input: a message that
        fails :func:`check_fields` (or whose fields the coordinator cannot use) is counted in
        ``malformed`` by type and changes nothing; a malformed SUBMIT with a usable request id
        gets FAILED naming the bad field."""
        try:
            frame = message_frame(msg)
        except Exception as e:  # any input problem: MetadataError, or a dict that is no message
            return _outgoing(self._core.refused(identity, msg, str(e)))
        return _outgoing(self._core.handle(identity, frame, now))

    def receive(
        self,
        identity: bytes,
        frame: bytes,
        now: float,
        auth: tuple[str, dict[str, str]] | None = None,
    ) -> tuple[str, list[Outgoing]]:
        """Apply one frame from ``identity`` as it came off the socket, decoded, checked and
        applied in Rust: ``("refused", answer)`` for a frame refused at decode (see
        :meth:`refused`); with ``auth`` (the sender's CURVE key, and the keys bound to engine
        ids) ``("unauthenticated", [])`` for one that does not come with the key bound to the
        engine id it speaks for (see :meth:`authentic`); else ``("applied", outgoing)`` as
        :meth:`handle` answers."""
        receipt, out = self._core.receive(identity, frame, now, auth)
        return receipt, _outgoing(out)

    def refused(self, identity: bytes, data: bytes, error: MetadataError) -> list[Outgoing]:
        """A frame refused at decode (``error``): a SUBMIT whose request id can be read gets
        FAILED naming the bad field, so its client does not wait for its own timeout."""
        return _outgoing(self._core.refused_frame(identity, data, str(error)))

    def decode_frame(
        self, identity: bytes, data: bytes
    ) -> tuple[dict[str, Any] | None, list[Outgoing]]:
        """``data`` from ``identity`` decoded, or ``None`` with the answer to a frame refused
        at decode (see :meth:`refused`)."""
        try:
            return decode_message(data), []
        except MetadataError as err:
            return None, self.refused(identity, data, err)

    def address(self, o: Outgoing) -> bytes | None:
        """The identity ``o`` goes to: its client, or its engine's current identity (``None``:
        the engine is gone)."""
        return self._core.address(o.to_engine, o.to_client)

    def authentic(
        self, identity: bytes, msg: dict[str, Any], user_key: str, keys: dict[str, str]
    ) -> bool:
        """Whether ``msg`` comes with the key ``keys`` binds to the engine id it speaks for
        (REGISTER and HEARTBEAT: the id they name; otherwise the engine registered from
        ``identity``); a peer that speaks for no engine may only SUBMIT (a client)."""
        claimed = msg.get("engine_id")
        return self._core.authentic(identity, msg.get("type", ""), claimed, user_key, keys)

    def fence(self, engine_id: str, why: str) -> list[Outgoing]:
        """Declare ``engine_id`` lost (``why``: silent, or not reading its messages): the
        requests that depend on it fail, the others learn the new peer table, and its later
        messages are ignored until it registers again (its next HEARTBEAT gets FENCED)."""
        return _outgoing(self._core.fence(engine_id, why))

    def shutdown(self) -> list[Outgoing]:
        """Tell every registered engine to stop. From then on the engines' silence is
        expected: the liveness timeout declares none of them lost."""
        return _outgoing(self._core.shutdown())

    def poll(self, now: float) -> list[Outgoing]:
        """Declare silent engines lost (``engine_timeout_s``), then fail every request whose
        deadline has passed."""
        return _outgoing(self._core.poll(now))
