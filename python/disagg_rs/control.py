"""Control plane: a coordinator and its clients over ZeroMQ (loopback by default).

Engines register once with their static transfer metadata and an incarnation epoch (a restarted
engine registers a new incarnation, and peers replace the stale one). Per request only a small
ticket travels. Message flow of one request::

    client  --SUBMIT-->                  coordinator --PREFILL--> prefill engine
    prefill --PREFILL_DONE(ticket)-->    coordinator --SUBMIT_REQUEST_WITH_KV--> decode engine
    decode  --KV_RECV_POSTED-->          coordinator --SEND_KV--> prefill        (push transports)
    decode  --KV_IMPORTED-->             coordinator --RELEASE_KV--> prefill
    decode  --TOKENS / DONE / FAILED-->  coordinator --TOKENS / DONE / FAILED--> client

The routing logic is sans-IO (:class:`CoordinatorState`: messages and the caller's ``now`` in,
addressed messages out), so tests drive it with a virtual clock; :class:`CoordinatorServer` is
the thin ZeroMQ loop around it. Every request carries an attempt ``epoch``: a message for a
finished request or an old epoch is ignored and counted, never applied. Every request has a
deadline; when it passes the client gets ``FAILED`` and the engines ``ABORT``.

Lease safety: a prefill's pinned blocks are the source of the decode's reads, so RELEASE_KV
goes out only once the decode is known not to read them any more: it reported the import done
(``KV_IMPORTED ok``, ``DONE``), reported a failure with its reads quiet (``quiet: true``), or
was never sent the ticket. Otherwise (the decode is lost, fenced, restarted, past the deadline,
or its reads may still be running) the prefill keeps the pin until its lease ends, and the
decode, which knows that end from the ticket, never starts, completes or admits the import
after it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from disagg_rs.exceptions import ArgumentError, MetadataError, TransferTimeout

logger = logging.getLogger("disagg_rs.control")

__all__ = [
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_TOKENS",
    "PROTOCOL_VERSION",
    "ControlClient",
    "CoordinatorServer",
    "CoordinatorState",
    "EngineLink",
    "Msg",
    "Outgoing",
    "check_fields",
    "check_timeout",
    "decode_message",
    "encode_message",
]

PROTOCOL_VERSION = 2
"""Version 2 added HEARTBEAT and FENCED (coordinator liveness)."""

MAX_TIMEOUT_S = 86_400.0
"""Largest request timeout a SUBMIT may ask for (one day)."""


def check_timeout(value: Any, field: str = "timeout_s") -> float:
    """``value`` as a timeout in seconds: a real number in ``(0, MAX_TIMEOUT_S]``. NaN, inf,
    zero, negative, bool and non-numbers raise :class:`ArgumentError` naming ``field`` (a NaN
    deadline would never pass)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{field}={value!r:.60} must be a number of seconds", field)
    t = float(value)
    if not 0.0 < t <= MAX_TIMEOUT_S:  # also False for NaN
        raise ArgumentError(f"{field}={value!r} must be in (0, {MAX_TIMEOUT_S:g}] seconds", field)
    return t


class Msg(str, enum.Enum):
    """Control-plane message types."""

    REGISTER = "REGISTER"
    REGISTERED = "REGISTERED"
    PEERS = "PEERS"
    SUBMIT = "SUBMIT"
    PREFILL = "PREFILL"
    PREFILL_DONE = "PREFILL_DONE"
    PREFILL_FAILED = "PREFILL_FAILED"
    SUBMIT_REQUEST_WITH_KV = "SUBMIT_REQUEST_WITH_KV"
    KV_RECV_POSTED = "KV_RECV_POSTED"
    SEND_KV = "SEND_KV"
    KV_IMPORTED = "KV_IMPORTED"
    RELEASE_KV = "RELEASE_KV"
    TOKENS = "TOKENS"
    DONE = "DONE"
    FAILED = "FAILED"
    ABORT = "ABORT"
    SHUTDOWN = "SHUTDOWN"
    HEARTBEAT = "HEARTBEAT"
    FENCED = "FENCED"


_REQUIRED: dict[Msg, tuple[str, ...]] = {
    Msg.REGISTER: ("engine_id", "role", "incarnation", "meta"),
    Msg.REGISTERED: ("engine_id", "incarnation", "peers"),
    Msg.PEERS: ("peers",),
    Msg.SUBMIT: ("request_id", "prompt", "max_new_tokens"),
    Msg.PREFILL: ("request_id", "epoch", "prompt", "max_new_tokens"),
    Msg.PREFILL_DONE: ("request_id", "epoch", "ticket"),
    Msg.PREFILL_FAILED: ("request_id", "epoch", "error"),
    Msg.SUBMIT_REQUEST_WITH_KV: ("request_id", "epoch", "prompt", "max_new_tokens", "ticket"),
    Msg.KV_RECV_POSTED: ("request_id", "epoch"),
    Msg.SEND_KV: ("request_id", "epoch", "decode_engine_id"),
    Msg.KV_IMPORTED: ("request_id", "epoch", "ok"),
    Msg.RELEASE_KV: ("request_id", "epoch"),
    Msg.TOKENS: ("request_id", "tokens"),
    Msg.DONE: ("request_id", "tokens"),
    Msg.FAILED: ("request_id", "error"),
    Msg.ABORT: ("request_id", "epoch"),
    Msg.SHUTDOWN: (),
    Msg.HEARTBEAT: ("engine_id", "incarnation"),
    Msg.FENCED: ("engine_id",),
}


MAX_PROMPT_TOKENS = 1 << 20
"""Longest prompt a SUBMIT may carry."""
MAX_NEW_TOKENS = 1 << 20
"""Largest ``max_new_tokens`` a SUBMIT may ask for."""
MAX_ID = (1 << 63) - 1
"""Largest request id, epoch or incarnation (they travel as signed 64-bit ints)."""
MAX_TEXT = 4096
"""Longest engine id or error text."""
MAX_FRAME_BYTES = 64 << 20
"""Largest control frame a socket accepts (ZeroMQ ``MAXMSGSIZE``); larger ones are dropped."""


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and lo <= v <= hi


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_TEXT


def _int_list(max_len: int, min_len: int = 0) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        return (
            isinstance(v, list)
            and min_len <= len(v) <= max_len
            and all(type(t) is int and 0 <= t <= MAX_ID for t in v)
        )

    return ok


def _timeout(v: Any) -> bool:
    try:
        check_timeout(v)
    except ArgumentError:
        return False
    return True


_ID = _int_in(0, MAX_ID)
_BOOL: Callable[[Any], bool] = lambda v: isinstance(v, bool)  # noqa: E731
_MAP: Callable[[Any], bool] = lambda v: isinstance(v, dict)  # noqa: E731
_ANY: Callable[[Any], bool] = lambda v: True  # noqa: E731

#: Per message type the coordinator accepts: field -> check. Optional fields are checked only
#: when present; a failing check names the field. Types not listed are not for the coordinator.
_SCHEMA: dict[Msg, dict[str, Callable[[Any], bool]]] = {
    Msg.REGISTER: {
        "engine_id": _text,
        "role": lambda v: v in ("prefill", "decode"),
        "incarnation": _ID,
        "meta": _ANY,
    },
    Msg.SUBMIT: {
        "request_id": _ID,
        "prompt": _int_list(MAX_PROMPT_TOKENS, 1),
        "max_new_tokens": _int_in(1, MAX_NEW_TOKENS),
        "timeout_s": _timeout,
    },
    Msg.PREFILL_DONE: {"request_id": _ID, "epoch": _ID, "ticket": _MAP},
    Msg.PREFILL_FAILED: {"request_id": _ID, "epoch": _ID, "error": _text},
    Msg.KV_RECV_POSTED: {"request_id": _ID, "epoch": _ID, "transfer": _MAP},
    Msg.KV_IMPORTED: {
        "request_id": _ID,
        "epoch": _ID,
        "ok": _BOOL,
        "error": _text,
        "quiet": _BOOL,
    },
    Msg.TOKENS: {"request_id": _ID, "epoch": _ID, "tokens": _int_list(MAX_NEW_TOKENS)},
    Msg.DONE: {"request_id": _ID, "epoch": _ID, "tokens": _int_list(MAX_NEW_TOKENS + 1)},
    Msg.FAILED: {"request_id": _ID, "epoch": _ID, "error": _text, "quiet": _BOOL},
    Msg.HEARTBEAT: {"engine_id": _text, "incarnation": _ID},
}


def check_fields(msg: dict[str, Any]) -> None:
    """Check the fields of a decoded message the coordinator accepts (types, ranges, size
    caps; NaN and inf rejected); raises :class:`MetadataError` naming the first bad field."""
    kind: Msg = msg["type"]
    schema = _SCHEMA.get(kind)
    if schema is None:
        raise MetadataError(f"{kind.value} is not a message the coordinator accepts", "type")
    for name, ok in schema.items():
        if name in msg and not ok(msg[name]):
            raise MetadataError(f"{kind.value} field {name}={msg[name]!r:.80} is invalid", name)


def encode_message(kind: Msg, **fields: Any) -> bytes:
    """Pack one message (msgpack, versioned)."""
    missing = [k for k in _REQUIRED[kind] if k not in fields]
    if missing:
        raise MetadataError(f"{kind.value} message is missing {missing}", missing[0])
    packed: bytes = msgpack.packb(
        {"type": kind.value, "v": PROTOCOL_VERSION, **fields}, use_bin_type=True
    )
    return packed


def decode_message(data: bytes) -> dict[str, Any]:
    """Unpack and validate one message; raises :class:`MetadataError` naming the bad field."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    # TypeError: a map key that is itself a map or list (unhashable) in a corrupted frame.
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise MetadataError(f"undecodable control message: {e}", "<frame>") from None
    if not isinstance(msg, dict):
        raise MetadataError(f"control message is a {type(msg).__name__}, not a map", "<frame>")
    if msg.get("v") != PROTOCOL_VERSION:
        raise MetadataError(
            f"control protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}", "v"
        )
    try:
        kind = Msg(msg.get("type"))
    except ValueError:
        raise MetadataError(f"unknown control message type {msg.get('type')!r}", "type") from None
    missing = [k for k in _REQUIRED[kind] if k not in msg]
    if missing:
        raise MetadataError(f"{kind.value} message is missing {missing}", missing[0])
    msg["type"] = kind
    return msg


@dataclass(frozen=True)
class Outgoing:
    """One message the coordinator wants sent: to an engine id, or to a client identity."""

    to_engine: str | None
    to_client: bytes | None
    kind: Msg
    fields: dict[str, Any]


@dataclass
class _Engine:
    engine_id: str
    role: str
    incarnation: int
    meta: Any
    identity: bytes
    last_seen: float = 0.0


class _Phase(enum.Enum):
    PREFILLING = "prefilling"
    DECODING = "decoding"


@dataclass
class _Request:
    request_id: int
    client: bytes
    prompt: list[int]
    max_new_tokens: int
    deadline: float
    epoch: int
    phase: _Phase = _Phase.PREFILLING
    prefill: str | None = None
    decode: str | None = None
    pinned: bool = False
    ticket_sent: bool = False
    """The decode was sent the ticket: it may read the pinned blocks until it says it is quiet."""
    tokens: list[int] = field(default_factory=list)


class CoordinatorState:
    """Sans-IO routing of requests between clients, prefill and decode engines.

    ``handle(identity, msg, now)`` and ``poll(now)`` return the :class:`Outgoing` messages to
    send. Time is the caller's ``now`` (seconds, any monotonic origin).

    Liveness: with ``engine_timeout_s``, an engine heard from (any message; idle engines send
    HEARTBEAT) less recently than that is declared lost: the requests that depended on it fail
    at once instead of at their deadlines, it gets no new work, and its later messages are
    ignored until it registers again: its next HEARTBEAT is answered with FENCED, on which
    :class:`EngineLink` registers again by itself (a fenced engine's pins expire with their
    lease).
    """

    def __init__(
        self,
        request_timeout_s: float = 60.0,
        push_transport: bool = False,
        engine_timeout_s: float | None = None,
    ) -> None:
        if engine_timeout_s is not None and not engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s={engine_timeout_s!r} must be > 0 or None")
        self.request_timeout_s = check_timeout(request_timeout_s, "request_timeout_s")
        self.push_transport = push_transport
        self.engine_timeout_s = engine_timeout_s
        self.lost: Counter[str] = Counter()
        """Engines declared lost by the liveness timeout, by engine id."""
        self.left_to_lease = 0
        """Failed requests whose prefill pins were left to their lease (the decode may still
        have been reading them), instead of released by RELEASE_KV."""
        self.engines: dict[str, _Engine] = {}
        self.requests: dict[int, _Request] = {}
        self.ignored: Counter[str] = Counter()
        self.malformed: Counter[str] = Counter()
        """Messages refused by :func:`check_fields` (or that failed to apply), by type."""
        self.completed = 0
        self.failed = 0
        self._epochs = itertools.count(1)
        self._round_robin: dict[str, int] = Counter()

    # -- helpers -------------------------------------------------------------------------
    def _peers(self) -> dict[str, dict[str, Any]]:
        return {
            e.engine_id: {"role": e.role, "incarnation": e.incarnation, "meta": e.meta}
            for e in self.engines.values()
        }

    def _pick(self, role: str) -> str | None:
        ids = sorted(e.engine_id for e in self.engines.values() if e.role == role)
        if not ids:
            return None
        i = self._round_robin[role] % len(ids)
        self._round_robin[role] += 1
        return ids[i]

    def _fail(self, req: _Request, error: str, decode_quiet: bool = False) -> list[Outgoing]:
        """End a request with one FAILED and abort it on engines. Prefill pins are released
        only if no decode may read them (``decode_quiet``, or the ticket was never sent);
        otherwise they are left to the prefill's lease."""
        out = [
            Outgoing(None, req.client, Msg.FAILED, {"request_id": req.request_id, "error": error})
        ]
        for engine in {req.prefill, req.decode} - {None}:
            if engine in self.engines:
                out.append(
                    Outgoing(
                        engine, None, Msg.ABORT, {"request_id": req.request_id, "epoch": req.epoch}
                    )
                )
        if req.pinned and req.prefill in self.engines:
            if decode_quiet or not req.ticket_sent:
                out.append(self._release(req))
            else:
                self.left_to_lease += 1
        del self.requests[req.request_id]
        self.failed += 1
        return out

    def _release(self, req: _Request) -> Outgoing:
        req.pinned = False
        return Outgoing(
            req.prefill, None, Msg.RELEASE_KV, {"request_id": req.request_id, "epoch": req.epoch}
        )

    def _current(self, msg: dict[str, Any], sender: str | None) -> _Request | None:
        """The live request a message refers to, or None (ignored and counted)."""
        req = self.requests.get(msg["request_id"])
        if req is None or msg.get("epoch", req.epoch) != req.epoch:
            self.ignored[msg["type"].value] += 1
            return None
        kind = msg["type"]
        allowed = (
            (req.prefill,)
            if kind in (Msg.PREFILL_DONE, Msg.PREFILL_FAILED)
            else (req.decode,)
            if kind in (Msg.KV_RECV_POSTED, Msg.KV_IMPORTED, Msg.TOKENS, Msg.DONE)
            else (req.prefill, req.decode)
        )
        if sender is None or sender not in allowed:
            # From an engine that does not play that part for this request, or from an identity
            # that is not a registered engine (e.g. a replaced incarnation still talking).
            self.ignored[kind.value] += 1
            return None
        return req

    # -- events --------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict[str, Any], now: float) -> list[Outgoing]:
        """Apply one incoming message from ``identity``. Never raises on input: a message that
        fails :func:`check_fields` (or, defensively, any error while applying it) is counted in
        ``malformed`` by type and changes nothing; a malformed SUBMIT with a usable request id
        gets FAILED naming the bad field."""
        kind = msg.get("type") if isinstance(msg, dict) else None
        name = kind.value if isinstance(kind, Msg) else "<unknown>"
        try:
            if not isinstance(kind, Msg):
                raise MetadataError(f"message type {kind!r:.40} is not a Msg", "type")
            check_fields(msg)
        except MetadataError as e:
            self.malformed[name] += 1
            rid = msg.get("request_id") if isinstance(msg, dict) else None
            if kind is Msg.SUBMIT and _ID(rid) and rid not in self.requests:
                return [Outgoing(None, identity, Msg.FAILED, {"request_id": rid, "error": str(e)})]
            return []
        try:
            return self._apply(identity, msg, now)
        except Exception:  # a bug, not input: count it, keep serving
            logger.exception("coordinator failed to apply a %s message", name)
            self.malformed[name] += 1
            return []

    def _apply(self, identity: bytes, msg: dict[str, Any], now: float) -> list[Outgoing]:
        kind: Msg = msg["type"]
        sender = next((e.engine_id for e in self.engines.values() if e.identity == identity), None)
        if sender is not None:
            self.engines[sender].last_seen = now
        if kind is Msg.REGISTER:
            return self._on_register(identity, msg, now)
        if kind is Msg.SUBMIT:
            return self._on_submit(identity, msg, now)
        if kind is Msg.HEARTBEAT:
            if sender is not None:
                return []
            # Fenced (declared lost) or never registered: tell it to register again. Its old
            # requests have failed; what it still holds for them drains on its side (pins by
            # lease, imports by deadline, admitted requests by finishing unheard).
            self.ignored[kind.value] += 1
            return [Outgoing(None, identity, Msg.FENCED, {"engine_id": str(msg["engine_id"])})]
        req = self._current(msg, sender)
        if req is None:
            return []
        handler = {
            Msg.PREFILL_DONE: self._on_prefill_done,
            Msg.PREFILL_FAILED: self._on_failed,
            Msg.KV_RECV_POSTED: self._on_recv_posted,
            Msg.KV_IMPORTED: self._on_imported,
            Msg.TOKENS: self._on_tokens,
            Msg.DONE: self._on_done,
            Msg.FAILED: self._on_failed,
        }.get(kind)
        if handler is None:
            self.ignored[kind.value] += 1
            return []
        return handler(req, msg)

    def _on_register(self, identity: bytes, msg: dict[str, Any], now: float) -> list[Outgoing]:
        engine_id, incarnation = str(msg["engine_id"]), int(msg["incarnation"])
        old = self.engines.get(engine_id)
        if old is not None and incarnation < old.incarnation:
            self.ignored["REGISTER"] += 1
            return []
        out: list[Outgoing] = []
        if old is not None and incarnation > old.incarnation:
            # A restarted engine lost its state: fail the requests that still depend on it.
            out += self._fail_dependents(
                engine_id,
                f"engine {engine_id} restarted (incarnation {old.incarnation} -> "
                f"{incarnation}) while holding this request's state",
            )
        self.engines[engine_id] = _Engine(
            engine_id, str(msg["role"]), incarnation, msg["meta"], identity, now
        )
        peers = self._peers()
        out.append(
            Outgoing(
                engine_id,
                None,
                Msg.REGISTERED,
                {"engine_id": engine_id, "incarnation": incarnation, "peers": peers},
            )
        )
        out += [
            Outgoing(other, None, Msg.PEERS, {"peers": peers})
            for other in sorted(self.engines)
            if other != engine_id
        ]
        return out

    def _fail_dependents(self, engine_id: str, error: str) -> list[Outgoing]:
        """Fail every request that loses state it still needs with ``engine_id``."""
        out: list[Outgoing] = []
        for req in sorted(self.requests.values(), key=lambda r: r.request_id):
            if self._lost_with(req, engine_id):
                # Pins held by that prefill died with it: no RELEASE_KV goes to it (a lost one
                # is no longer an engine; a restarted one never had them).
                req.pinned = req.pinned and req.prefill != engine_id
                out += self._fail(req, error)
        return out

    @staticmethod
    def _lost_with(req: _Request, engine_id: str) -> bool:
        """Whether ``req`` loses state it still needs when ``engine_id`` restarts.

        A prefill matters while it prefills and while its pins are the decode's source (until
        KV_IMPORTED); a request whose state is imported finishes on its decode. A decode matters
        once it was handed the request; one that is still prefilling is handed to the decode's
        new incarnation (same layout, so a state staged for it stays valid).
        """
        if req.prefill == engine_id and (req.phase is _Phase.PREFILLING or req.pinned):
            return True
        return req.decode == engine_id and req.phase is _Phase.DECODING

    def _on_submit(self, identity: bytes, msg: dict[str, Any], now: float) -> list[Outgoing]:
        rid = int(msg["request_id"])
        try:
            timeout = check_timeout(msg.get("timeout_s", self.request_timeout_s))
        except ArgumentError as e:
            self.ignored["SUBMIT"] += 1
            return [Outgoing(None, identity, Msg.FAILED, {"request_id": rid, "error": str(e)})]
        if rid in self.requests:
            self.ignored["SUBMIT"] += 1
            return [
                Outgoing(
                    None, identity, Msg.FAILED, {"request_id": rid, "error": "duplicate request id"}
                )
            ]
        req = _Request(
            rid,
            identity,
            list(msg["prompt"]),
            int(msg["max_new_tokens"]),
            deadline=now + timeout,
            epoch=next(self._epochs),
        )
        self.requests[rid] = req
        req.prefill = self._pick("prefill")
        if req.prefill is None:
            return self._fail(req, "no prefill engine registered")
        # The decode is chosen now so that a one-sided prefill can stage (pack) its state for
        # that decode's layout before it announces the handoff.
        req.decode = self._pick("decode")
        return [
            Outgoing(
                req.prefill,
                None,
                Msg.PREFILL,
                {
                    "request_id": rid,
                    "epoch": req.epoch,
                    "prompt": req.prompt,
                    "max_new_tokens": req.max_new_tokens,
                    "decode_engine_id": req.decode,
                },
            )
        ]

    def _on_prefill_done(self, req: _Request, msg: dict[str, Any]) -> list[Outgoing]:
        if req.phase is not _Phase.PREFILLING:
            self.ignored["PREFILL_DONE"] += 1
            return []
        req.pinned = True
        req.phase = _Phase.DECODING
        if req.decode not in self.engines:
            req.decode = self._pick("decode")
        if req.decode is None:
            return self._fail(req, "no decode engine registered")
        ticket = dict(msg["ticket"])
        prefill = self.engines[req.prefill] if req.prefill else None
        ticket.setdefault("prefill_engine_id", req.prefill)
        ticket.setdefault("prefill_incarnation", prefill.incarnation if prefill else None)
        first = list(ticket.get("resume_tokens", []))
        streamed = (
            [
                Outgoing(
                    None, req.client, Msg.TOKENS, {"request_id": req.request_id, "tokens": first}
                )
            ]
            if first
            else []
        )
        req.ticket_sent = True  # from now on the decode may read the pinned blocks
        return [
            *streamed,
            Outgoing(
                req.decode,
                None,
                Msg.SUBMIT_REQUEST_WITH_KV,
                {
                    "request_id": req.request_id,
                    "epoch": req.epoch,
                    "prompt": req.prompt,
                    "max_new_tokens": req.max_new_tokens,
                    "ticket": ticket,
                },
            ),
        ]

    def _on_recv_posted(self, req: _Request, msg: dict[str, Any]) -> list[Outgoing]:
        if not self.push_transport or not req.pinned:
            self.ignored["KV_RECV_POSTED"] += 1
            return []
        return [
            Outgoing(
                req.prefill,
                None,
                Msg.SEND_KV,
                {
                    "request_id": req.request_id,
                    "epoch": req.epoch,
                    "decode_engine_id": req.decode,
                    # Where the decode posted its receives (blocks, slot, token range).
                    "transfer": msg.get("transfer", {}),
                },
            )
        ]

    def _on_imported(self, req: _Request, msg: dict[str, Any]) -> list[Outgoing]:
        if not req.pinned:
            self.ignored["KV_IMPORTED"] += 1
            return []
        if not msg["ok"]:
            # ``quiet``: the decode's reads of the pinned blocks are over (none posted, or all
            # terminal); without it they may still run and the pin waits for its lease.
            return self._fail(
                req,
                f"KV import failed: {msg.get('error', 'unknown error')}",
                decode_quiet=msg.get("quiet") is True,
            )
        return [self._release(req)]

    def _on_tokens(self, req: _Request, msg: dict[str, Any]) -> list[Outgoing]:
        req.tokens += list(msg["tokens"])
        return [
            Outgoing(
                None,
                req.client,
                Msg.TOKENS,
                {"request_id": req.request_id, "tokens": msg["tokens"]},
            )
        ]

    def _on_done(self, req: _Request, msg: dict[str, Any]) -> list[Outgoing]:
        out = [self._release(req)] if req.pinned else []
        fields = {k: v for k, v in msg.items() if k not in ("type", "v", "epoch")}
        out.append(Outgoing(None, req.client, Msg.DONE, fields))
        del self.requests[req.request_id]
        self.completed += 1
        return out

    def _on_failed(self, req: _Request, msg: dict[str, Any]) -> list[Outgoing]:
        return self._fail(req, str(msg["error"]), decode_quiet=msg.get("quiet") is True)

    def poll(self, now: float) -> list[Outgoing]:
        """Declare silent engines lost (``engine_timeout_s``), then fail every request whose
        deadline has passed."""
        out: list[Outgoing] = []
        timeout = self.engine_timeout_s
        lost = sorted(
            e.engine_id
            for e in self.engines.values()
            if timeout is not None and now - e.last_seen > timeout
        )
        for engine_id in lost:
            gone = self.engines.pop(engine_id)
            self.lost[engine_id] += 1
            out += self._fail_dependents(
                engine_id,
                f"engine {engine_id} (incarnation {gone.incarnation}) silent for more than "
                f"{timeout} s while holding this request's state",
            )
        if lost:
            peers = self._peers()
            out += [Outgoing(e, None, Msg.PEERS, {"peers": peers}) for e in sorted(self.engines)]
        for req in sorted(self.requests.values(), key=lambda r: r.request_id):
            if now >= req.deadline:
                out += self._fail(req, f"request {req.request_id} passed its deadline")
        return out


class CoordinatorServer:
    """The ZeroMQ ROUTER loop around :class:`CoordinatorState`; runs in a thread or a process."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        request_timeout_s: float = 60.0,
        push_transport: bool = False,
        engine_timeout_s: float | None = None,
    ) -> None:
        self.state = CoordinatorState(request_timeout_s, push_transport, engine_timeout_s)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.undeliverable = 0
        self.malformed = 0
        self.faults_injected = 0
        self._stop = threading.Event()
        # A ZeroMQ socket must only be used by one thread: while serve() runs, other threads
        # hand their messages to it through this queue (sending directly aborted the process).
        self._outbox: queue.SimpleQueue[Callable[[], list[Outgoing]]] = queue.SimpleQueue()
        self._serving: threading.Thread | None = None

    def inject_faults(self, rate: float, seed: int = 0, max_delay_rounds: int = 20) -> None:
        """Test hook: drop, duplicate, delay (reordering later traffic) a share ``rate`` of the
        messages to engines (never to clients and never SHUTDOWN). Deterministic per seed."""
        import random

        self._fault_rng = random.Random(seed)
        self._fault_rate = float(rate)
        self._fault_max_delay = max_delay_rounds

    def _faulty(self, out: list[Outgoing]) -> list[Outgoing]:
        rng = getattr(self, "_fault_rng", None)
        delayed: list[tuple[int, Outgoing]] = getattr(self, "_delayed", [])
        ready = [o for n, o in delayed if n <= 0]
        self._delayed = [(n - 1, o) for n, o in delayed if n > 0]
        if rng is None:
            return ready + out
        kept: list[Outgoing] = list(ready)
        for o in out:
            if o.to_engine is None or o.kind is Msg.SHUTDOWN or rng.random() >= self._fault_rate:
                kept.append(o)
                continue
            self.faults_injected += 1
            fault = rng.choice(("drop", "duplicate", "delay"))
            if fault == "duplicate":
                kept += [o, o]
            elif fault == "delay":
                self._delayed.append((rng.randint(1, self._fault_max_delay), o))
        return kept

    def _send(self, out: list[Outgoing]) -> None:
        out = self._faulty(out)
        for o in out:
            if o.to_client is not None:
                identity = o.to_client
            else:
                engine = self.state.engines.get(o.to_engine or "")
                if engine is None:
                    self.undeliverable += 1
                    continue
                identity = engine.identity
            try:
                self._sock.send_multipart([identity, encode_message(o.kind, **o.fields)])
            except zmq.ZMQError:
                self.undeliverable += 1

    def _flush_outbox(self) -> None:
        while True:
            try:
                self._send(self._outbox.get_nowait()())
            except queue.Empty:
                return

    def run_once(self, timeout_ms: int = 10) -> None:
        """Handle the messages that arrive within ``timeout_ms``, then the deadlines."""
        self._flush_outbox()
        if self._sock.poll(timeout_ms):
            while True:
                try:
                    identity, data = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:
                    self.malformed += 1
                    continue
                try:
                    msg = decode_message(data)
                except MetadataError:
                    self.malformed += 1
                    continue
                # handle() never raises on input; it counts refused messages itself.
                self._send(self.state.handle(identity, msg, time.monotonic()))
        self._send(self.state.poll(time.monotonic()))

    def serve(self) -> None:
        """Run until :meth:`stop`."""
        self._serving = threading.current_thread()
        try:
            while not self._stop.is_set():
                self.run_once(20)
            self._flush_outbox()
        finally:
            self._serving = None

    def shutdown_engines(self) -> None:
        """Tell every registered engine to stop (from any thread)."""

        def shutdown() -> list[Outgoing]:  # built on the sending thread: it owns the state too
            return [Outgoing(e, None, Msg.SHUTDOWN, {}) for e in sorted(self.state.engines)]

        serving = self._serving
        if serving is None or serving is threading.current_thread():
            self._send(shutdown())
        else:
            self._outbox.put(shutdown)

    def stop(self) -> None:
        """Ask :meth:`serve` to return."""
        self._stop.set()

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)


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
