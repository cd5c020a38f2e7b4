"""The sans-IO coordinator: messages and the caller's ``now`` in, addressed messages out."""

from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from disagg_rs._core import recv_posted_route
from disagg_rs.control.messages import MAX_ID, Msg, check_fields, check_timeout
from disagg_rs.exceptions import ArgumentError, MetadataError

logger = logging.getLogger("disagg_rs.control")


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
        if engine_timeout_s is not None and not engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s={engine_timeout_s!r} must be > 0 or None")
        self.request_timeout_s = check_timeout(request_timeout_s, "request_timeout_s")
        self.push_transport = push_transport
        self.engine_timeout_s = engine_timeout_s
        self.lost: Counter[str] = Counter()
        """Engines declared lost by the liveness timeout, by engine id."""
        self.aborted_pushes = 0
        """KV_RECV_POSTED answered with SEND_KV ``abort`` (a filler): the decode's receives
        were posted for a request the prefill will not push."""
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
        self.shutting_down = False
        """Set by :meth:`shutdown`: engines told to stop go silent, and are not declared lost."""
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
        except Exception as e:  # any input problem: MetadataError, or a dict that is no message
            self.malformed[name] += 1
            rid = msg.get("request_id") if isinstance(msg, dict) else None
            if (
                kind is Msg.SUBMIT
                and type(rid) is int
                and 0 <= rid <= MAX_ID
                and rid not in self.requests
            ):
                return [Outgoing(None, identity, Msg.FAILED, {"request_id": rid, "error": str(e)})]
            return []
        try:
            return self._apply(identity, msg, now)
        except Exception:  # a bug, not input: count it, keep serving
            logger.exception("coordinator failed to apply a %s message", name)
            self.malformed[name] += 1
            return []

    def refused(self, identity: bytes, data: bytes, error: MetadataError) -> list[Outgoing]:
        """A frame refused at decode (``error``): a SUBMIT whose request id can be read gets
        FAILED naming the bad field, so its client does not wait for its own timeout."""
        try:
            head = msgpack.unpackb(data, raw=False, strict_map_key=False)
            rid = head["request_id"]
            usable = head["type"] == "SUBMIT" and type(rid) is int and 0 <= rid <= MAX_ID
        except Exception:  # not even a map with those keys: nobody to answer
            return []
        if not usable or rid in self.requests:
            return []
        return [Outgoing(None, identity, Msg.FAILED, {"request_id": rid, "error": str(error)})]

    def _apply(self, identity: bytes, msg: dict[str, Any], now: float) -> list[Outgoing]:
        kind: Msg = msg["type"]
        sender = next((e.engine_id for e in self.engines.values() if e.identity == identity), None)
        if sender is not None:
            self.engines[sender].last_seen = now
        no_request: dict[Msg, Callable[[bytes, dict[str, Any], float], list[Outgoing]]] = {
            Msg.REGISTER: self._on_register,
            Msg.SUBMIT: self._on_submit,
            Msg.KV_RECV_POSTED: lambda _, m, __: self._on_recv_posted(sender, m),
        }
        unbound = no_request.get(kind)
        if unbound is not None:  # no live request needed
            return unbound(identity, msg, now)
        if kind is Msg.HEARTBEAT:
            if sender is not None:  # acknowledged: the engine's view of the coordinator's life
                ids = {"engine_id": sender, "incarnation": self.engines[sender].incarnation}
                return [Outgoing(sender, None, Msg.HEARTBEAT_ACK, ids)]
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
        # Provenance comes from the coordinator's own state, never from the sender's ticket.
        ticket["prefill_engine_id"] = req.prefill
        ticket["prefill_incarnation"] = prefill.incarnation if prefill else None
        ticket["epoch"] = req.epoch
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

    def _on_recv_posted(self, sender: str | None, msg: dict[str, Any]) -> list[Outgoing]:
        """A decode posted receives: its request's prefill pushes them (SEND_KV), or, where
        the request is gone, no longer pinned, of another epoch or of another decode, the
        prefill the message names answers them with fillers (SEND_KV with ``abort``): the
        receives are posted all the same and messages match by post order per pair (NCCL).
        The routing is decided in Rust (``recv_posted_route``)."""
        rid, epoch = msg["request_id"], msg["epoch"]
        req = self.requests.get(rid)
        named = str(msg.get("prefill_engine_id"))
        route = recv_posted_route(
            self.push_transport,
            (str(sender), getattr(self.engines.get(str(sender)), "role", "")),
            epoch,
            (
                getattr(req, "decode", None),
                getattr(req, "epoch", 0),
                getattr(req, "pinned", False),
                getattr(req, "prefill", None),
            ),
            (named, getattr(self.engines.get(named), "role", "")),
        )
        if route is None:
            self.ignored["KV_RECV_POSTED"] += 1
            return []
        target, abort = route
        self.aborted_pushes += abort
        fields = {
            "request_id": rid,
            "epoch": epoch,
            "decode_engine_id": sender,
            # Where the decode posted its receives (blocks, slot, token range).
            "transfer": msg.get("transfer", {}),
            "abort": abort,
        }
        return [Outgoing(target, None, Msg.SEND_KV, fields)]

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

    def fence(self, engine_id: str, why: str) -> list[Outgoing]:
        """Declare ``engine_id`` lost (``why``: silent, or not reading its messages): the
        requests that depend on it fail, the others learn the new peer table, and its later
        messages are ignored until it registers again (its next HEARTBEAT gets FENCED)."""
        gone = self.engines.pop(engine_id, None)
        if gone is None:
            return []
        out = self._fail_dependents(
            engine_id,
            f"{why} (incarnation {gone.incarnation}) while holding this request's state",
        )
        peers = self._peers()
        return out + [Outgoing(e, None, Msg.PEERS, {"peers": peers}) for e in sorted(self.engines)]

    def shutdown(self) -> list[Outgoing]:
        """Tell every registered engine to stop. From then on the engines' silence is
        expected: the liveness timeout declares none of them lost."""
        self.shutting_down = True
        return [Outgoing(e, None, Msg.SHUTDOWN, {}) for e in sorted(self.engines)]

    def poll(self, now: float) -> list[Outgoing]:
        """Declare silent engines lost (``engine_timeout_s``), then fail every request whose
        deadline has passed."""
        out: list[Outgoing] = []
        timeout = self.engine_timeout_s
        lost = sorted(
            e.engine_id
            for e in self.engines.values()
            if timeout is not None and not self.shutting_down and now - e.last_seen > timeout
        )
        for engine_id in lost:
            self.lost[engine_id] += 1
            out += self.fence(engine_id, f"engine {engine_id} silent for more than {timeout} s")
        for req in sorted(self.requests.values(), key=lambda r: r.request_id):
            if now >= req.deadline:
                out += self._fail(req, f"request {req.request_id} passed its deadline")
        return out
