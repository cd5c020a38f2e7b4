"""The engine-side handoff driver: control messages in, engine calls and reports out.

:class:`HandoffDriver` connects an engine that uses the handoff mixin (prefill or decode) to
the coordinator through a link (:class:`~disagg_rs.control.EngineLink` over ZeroMQ, or
:class:`LoopbackLink` in one process). It dispatches ``PREFILL``, ``SUBMIT_REQUEST_WITH_KV``,
``SEND_KV``, ``RELEASE_KV``, ``ABORT`` and ``SHUTDOWN`` to the engine (and registers the peers
``PEERS`` announces, once per incarnation), advances the engine's
imports, pushes and pins once per turn, and reports ``PREFILL_DONE``, ``KV_IMPORTED``,
``TOKENS`` and ``DONE``. The decisions (acting on a duplicated message once, the attempt epoch
of each request, reporting each import once, when a shutdown may end) are made by the
library's core (:class:`disagg_rs._core.EngineDriverState`); this module only moves messages.

A serving loop::

    driver = HandoffDriver(engine, link)
    while driver.running:
        msgs = driver.receive()
        now, wall, msgs = engine.handoff_broadcast((time.monotonic_ns(), time.time_ns(), msgs))
        for msg in msgs:
            driver.on_message(msg)
        driver.tick(now, wall)
    report = driver.drain()

An engine with several ranks runs one driver per rank; only its first rank holds a link
(the others pass ``link=None``), and every rank acts on the same broadcast messages and clock.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, Protocol

from disagg_rs._core import EngineDriverState, LinkLiveness
from disagg_rs.control import CoordinatorState, Msg, Outgoing, decode_message, encode_message
from disagg_rs.control.link import SubmitClient
from disagg_rs.control.messages import MAX_FRAME_BYTES
from disagg_rs.exceptions import DisaggError
from disagg_rs.handoff.prefill import with_push_destination

__all__ = ["HandoffDriver", "Link", "LoopbackClient", "LoopbackCoordinator", "LoopbackLink"]


class Link(Protocol):
    """What the driver needs of its connection to the coordinator (both
    :class:`~disagg_rs.control.EngineLink` and :class:`LoopbackLink` provide it)."""

    peers: dict[str, dict[str, Any]]

    def register(self, meta: Any, timeout_s: float = ...) -> dict[str, dict[str, Any]]: ...
    def send(self, kind: Msg, **fields: Any) -> None: ...
    def heartbeat(self, interval_s: float = ...) -> bool: ...
    def poll(self, timeout_ms: int = ...) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...


class HandoffDriver:
    """Serves one engine rank: see the module documentation for the loop.

    ``link``: this rank's connection (``None`` on an engine's other ranks); the engine is
    registered on it at construction. ``heartbeat_s``: send a heartbeat when nothing was sent
    for this long. ``shutdown_grace_s``: after ``SHUTDOWN``, keep serving until nothing is in
    flight or this much time has passed (at least the pin lease, so that pins end).
    """

    def __init__(
        self,
        engine: Any,
        link: Link | None,
        *,
        heartbeat_s: float = 1.0,
        shutdown_grace_s: float = 60.0,
    ) -> None:
        self.engine = engine
        self.link = link
        self.role = engine.handoff_role
        self.heartbeat_s = heartbeat_s
        self.shutdown_grace_ns = int(shutdown_grace_s * 1e9)
        self.state = EngineDriverState()
        self.now_ns = int(engine.handoff_now_ns)
        self._wait_ms = 0
        self._targets: dict[int, Any] = {}  # prefill: request -> the decode's rank metadata
        #: Peer engines whose metadata the engine refused, with the error.
        self.refused_peers: dict[str, str] = {}
        # The actions the core's dispatch names; each role is only given its own.
        self._handlers: dict[str, Callable[[Any, dict[str, Any]], None]] = {
            "peers": self._on_peers,
            "shutdown": self._on_shutdown,
            "abort": self._on_abort,
            "ticket": self._on_ticket,
            "prefill": self._on_prefill,
            "send_kv": self._on_send_kv,
            "release": self._on_release,
        }
        # How this role advances its transfers and reports its steps.
        if self.role == "decode":
            self._abort_import: Callable[[int], None] = engine.abort_kv_import
            self._advance = self._advance_imports
            self._report_step = self._report_decode_step
        else:
            self._abort_import = _nothing
            self._advance = self._advance_pushes
            self._report_step = self._report_prefill_step
        if link is not None:
            link.register(engine.handoff_static_meta)

    # -- input ---------------------------------------------------------------------------
    def receive(self) -> list[dict[str, Any]]:
        """This rank's new messages (none without a link), with the peer metadata they name
        attached from the link's peer table (a ticket's source only at the incarnation it
        names: otherwise it has no source and is refused unread), after a ``PEERS`` message
        when the table changed (every rank registers it); sends a heartbeat when due."""
        if self.link is None:
            return []
        self.link.heartbeat(self.heartbeat_s)
        return self.state.inbox(self.link.poll(self._wait_ms), self.link.peers, Msg.PEERS)

    def on_message(self, msg: dict[str, Any]) -> None:
        """Act on one control message (a duplicate or malformed one is dropped and counted;
        one meant for the other role is dropped). ``PEERS`` registers the peers' metadata with
        the engine, once per incarnation."""
        action = self.state.dispatch(msg, self.role)
        if action is not None:
            self._handlers[action](msg.get("request_id", -1), msg)

    def _on_peers(self, rid: int, msg: dict[str, Any]) -> None:
        self.refused_peers.update(self.engine.register_handoff_peers(msg["peers"]))

    def _on_shutdown(self, rid: int, msg: dict[str, Any]) -> None:
        self.state.shutdown(self.now_ns, self.shutdown_grace_ns)

    def _on_prefill(self, rid: int, msg: dict[str, Any]) -> None:
        self._targets[rid] = msg.get("decode_meta")
        args = (rid, msg.get("prompt"), msg.get("max_new_tokens"))
        self._guard(rid, self.engine.add_request, *args, failure=Msg.PREFILL_FAILED)

    def _on_ticket(self, rid: int, msg: dict[str, Any]) -> None:
        ticket = msg.get("ticket")
        src = ticket.get("src_block_ids") if isinstance(ticket, dict) else None
        args = (rid, msg.get("prompt"), msg.get("max_new_tokens"), ticket, src)
        call = self.engine.add_request_with_kv_handoff
        self._guard(rid, call, *args, failure=Msg.FAILED, quiet=True)  # quiet: nothing was read

    def _report_posted_receives(self) -> None:
        # Two-sided: the prefill pushes once the decode's receives are posted, whether the
        # import started on the ticket's arrival (this turn's tick follows the message) or
        # later, out of the deferred queue. Always empty on a one-sided transport. The ticket's
        # prefill is named, so it can answer the posted receives (with fillers) even once the
        # coordinator has dropped the request.
        for rid, destination in self.engine.drain_posted_receives():
            source = self.state.source_of(rid)
            self._send(Msg.KV_RECV_POSTED, rid, transfer=destination, prefill_engine_id=source)

    def _on_send_kv(self, rid: int, msg: dict[str, Any]) -> None:
        args = (self.engine, rid, msg.get("decode_meta"), msg.get("transfer"))
        if msg.get("abort") is True or not self._guard(rid, _push, *args):
            # The decode posted its receives whatever happens here, and messages match by
            # post order per pair: answer each with a filler, or the next push lands in them.
            self._guard(rid, _filler, *args)

    def _on_release(self, rid: int, msg: dict[str, Any]) -> None:
        self.engine.release_handoff_blocks(rid)

    def _on_abort(self, rid: int, msg: dict[str, Any]) -> None:
        # Prefill: pins stay until RELEASE_KV or their lease (the decode may be reading).
        # Decode: the prefill stays named until the import settled, as receives it posted this
        # turn are still reported (KV_RECV_POSTED) and must be answered.
        self._abort_import(rid)  # decode: any import stage
        self.engine.abort(rid)

    # -- one turn ------------------------------------------------------------------------
    def tick(self, now_ns: int, wall_ns: int | None = None) -> None:
        """One serving turn at ``now_ns`` (monotonic; ``wall_ns``: wall clock, for leases
        carried across hosts): advance imports (decode) or pushes and pins (prefill), report
        what settled, run one engine step and report its output."""
        e = self.engine
        self.now_ns = now_ns
        e.handoff_now_ns = now_ns
        if wall_ns is not None:
            e.handoff_wall_now_ns = wall_ns
        self._advance()
        if e.has_work:
            self._report_step(e.step())
        self._wait_ms = self.state.turn(self.busy)

    def _advance_imports(self) -> None:
        # Admit first: this turn's clock was read after the last turn observed the
        # completions, so a lease that ended in between (a stalled process) is seen.
        e = self.engine
        e.admit_kv_imports()
        e.poll_kv_imports()
        self._report_posted_receives()
        settled = e.drain_handoff_outcomes()
        why = {rid: e.pop_handoff_failure_reason(rid) for rid, _ in settled}
        reports = self.state.imports_settled(settled, e.quarantined_kv_import_ids, why)
        for rid, epoch, ok, quiet, error in reports:
            self._send(Msg.KV_IMPORTED, rid, epoch, ok=ok, error=error, quiet=quiet)

    def _advance_pushes(self) -> None:
        self.engine.poll_kv_pushes()
        self.engine.expire_handoff_pins()

    def _report_prefill_step(self, out: Any) -> None:
        for h in out.handoffs:
            ticket = self.engine.capture_handoff_ticket(h, self._targets.pop(h.request_id, None))
            self._send(Msg.PREFILL_DONE, h.request_id, ticket=ticket)

    def _report_decode_step(self, out: Any) -> None:
        for rid, tok in out.new_tokens.items():
            self._send(Msg.TOKENS, rid, tokens=[tok])
        for done in out.finished:
            self._send(Msg.DONE, done.request_id, tokens=done.tokens)
        self._report_posted_receives()  # a finished request may have let a deferred one start

    @property
    def busy(self) -> bool:
        """Whether anything is in flight: engine work, imports, pushes, quarantined reads or
        pins."""
        e = self.engine
        return bool(
            e.has_work
            or e.pending_kv_import_count
            or e.pending_kv_push_count
            or e.num_quarantined_kv_imports
            or e.num_pinned_handoffs
        )

    @property
    def running(self) -> bool:
        """Whether the serving loop goes on (until ``SHUTDOWN``, then until drained or its
        grace period is over)."""
        return bool(self.state.running(self.now_ns, self.busy))

    def drain(self) -> dict[str, Any]:
        """After the loop: check that every block, slot and pin is back (raises
        :class:`~disagg_rs.exceptions.ConservationError` otherwise), and return the engine's
        handoff report: ``stats``, ``requests``, ``leaked_blocks``, ``quarantined``,
        ``pinned``, ``admitted``, the driver's ``dropped`` counters and the ``refused_peers``."""
        e = self.engine
        e.check_pools()
        e.check_handoff_ledgers()
        return {
            "stats": dict(e.handoff_stats),
            "requests": dict(e.handoff_request_stats),
            "leaked_blocks": e.leaked_blocks(),
            "quarantined": e.num_quarantined_kv_imports,
            "pinned": e.num_pinned_handoffs,
            "admitted": sorted({ev[1] for ev in e.handoff_events if ev[0] == "admitted"}),
            "dropped": self.state.counters(),
            "refused_peers": dict(self.refused_peers),
        }

    # -- output --------------------------------------------------------------------------
    def _send(self, kind: Msg, rid: int, epoch: int | None = None, **fields: Any) -> None:
        if self.link is None:
            return
        epoch = self.state.stamp(rid, epoch)
        if epoch is not None:  # None: no attempt known, the coordinator's deadline ends it
            self.link.send(kind, request_id=rid, epoch=epoch, **fields)

    def _guard(
        self,
        rid: int,
        call: Callable[..., Any],
        *args: Any,
        failure: Msg | None = None,
        **fields: Any,
    ) -> bool:
        """Call ``call(*args)``; a refusal (bad input, a retried id) fails this request alone:
        ``failure`` is reported with ``fields`` and the loop goes on."""
        try:
            call(*args)
        except (DisaggError, ValueError, TypeError, KeyError, IndexError) as err:
            if failure is not None:
                self._send(failure, rid, error=f"{type(err).__name__}: {err}", **fields)
            return False
        return True


def _nothing(request_id: int) -> None:
    del request_id


def _push(engine: Any, request_id: int, decode_meta: Any, transfer: Any) -> None:
    engine.push_handoff_kv(request_id, with_push_destination(decode_meta, transfer))


def _filler(engine: Any, request_id: int, decode_meta: Any, transfer: Any) -> None:
    engine.push_handoff_filler(request_id, with_push_destination(decode_meta, transfer))


class LoopbackCoordinator:
    """A coordinator in this process: :class:`~disagg_rs.control.CoordinatorState` with
    in-memory delivery, so engines' drivers and clients run in one process (the soak, tests).
    Every message is encoded and decoded as on the wire. ``clock``: seconds, any origin
    (a virtual clock in tests)."""

    def __init__(self, state: CoordinatorState, clock: Callable[[], float] = time.monotonic):
        self.state = state
        self.clock = clock
        self._inboxes: dict[bytes, collections.deque[bytes]] = {}
        self.undeliverable = 0
        self.malformed = 0
        """Frames dropped (too large) or refused at decode."""

    def link(self, engine_id: str, role: str, incarnation: int = 1) -> LoopbackLink:
        """A link for one engine."""
        return LoopbackLink(self, engine_id, role, incarnation)

    def client(self, name: str = "client") -> LoopbackClient:
        """A client that submits requests and reads their events."""
        return LoopbackClient(self, name.encode())

    def _inbox(self, identity: bytes) -> collections.deque[bytes]:
        return self._inboxes.setdefault(identity, collections.deque())

    def deliver(self, identity: bytes, frame: bytes) -> None:
        """Hand one frame from ``identity`` to the coordinator and route what it answers. As
        on the socket: a frame over ``MAX_FRAME_BYTES`` is dropped, one that fails its schema
        is refused (a SUBMIT with a readable id gets FAILED); both count in ``malformed``."""
        if len(frame) > MAX_FRAME_BYTES:
            self.malformed += 1
            return
        receipt, out = self.state.receive(identity, frame, self.clock())
        if receipt == "refused":
            self.malformed += 1
        self._route(out)

    def pump(self) -> None:
        """Run the coordinator's deadlines and liveness at the clock's time."""
        self._route(self.state.poll(self.clock()))

    def _route(self, out: list[Outgoing]) -> None:
        for o in out:
            identity = self.state.address(o)
            if identity is None:  # an engine that is gone
                self.undeliverable += 1
                continue
            self._inbox(identity).append(o.frame)

    def frames(self, identity: bytes) -> list[bytes]:
        """Every frame waiting for ``identity``."""
        box = self._inbox(identity)
        out = list(box)
        box.clear()
        return out

    def take(self, identity: bytes) -> list[dict[str, Any]]:
        """Every message waiting for ``identity``, decoded."""
        return [decode_message(f) for f in self.frames(identity)]


class LoopbackLink:
    """An engine's in-process link to a :class:`LoopbackCoordinator`, with the interface of
    :class:`~disagg_rs.control.EngineLink`."""

    def __init__(
        self, hub: LoopbackCoordinator, engine_id: str, role: str, incarnation: int
    ) -> None:
        self.hub, self.engine_id, self.role, self.incarnation = hub, engine_id, role, incarnation
        self.identity = f"{role}:{engine_id}:{incarnation}".encode()
        self.peers: dict[str, dict[str, Any]] = {}
        self.liveness = LinkLiveness(None, hub.clock())  # registration and fencing
        self._meta: Any = None
        self._last_sent = hub.clock()

    @property
    def fenced(self) -> int:
        """How many times the coordinator fenced this engine (it then registered again)."""
        return self.liveness.fenced

    def register(self, meta: Any, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Publish static metadata; returns the peers known to the coordinator."""
        del timeout_s  # the answer is immediate
        self._meta = meta
        self._register()
        return self.peers

    def _register(self) -> None:
        ids = {"engine_id": self.engine_id, "role": self.role, "incarnation": self.incarnation}
        self.send(Msg.REGISTER, meta=self._meta, **ids)

    def send(self, kind: Msg, **fields: Any) -> None:
        """Send one message to the coordinator."""
        self._last_sent = self.hub.clock()
        self.liveness.sent(kind.value, fields.get("request_id"), True, self._last_sent)
        self.hub.deliver(self.identity, encode_message(kind, **fields))

    def heartbeat(self, interval_s: float = 1.0) -> bool:
        """Send HEARTBEAT if nothing was sent for ``interval_s``."""
        if self.hub.clock() - self._last_sent < interval_s:
            return False
        self.send(Msg.HEARTBEAT, engine_id=self.engine_id, incarnation=self.incarnation)
        return True

    def poll(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Messages waiting for this engine (peer updates applied; FENCED answered by
        registering again). Never waits: everything was delivered when it was sent."""
        del timeout_ms
        frames = self.hub.frames(self.identity)
        msgs, self.peers, register = self.liveness.receive(frames, self.peers, self.hub.clock())
        if register:
            self._register()
        return msgs

    def close(self) -> None:
        """Nothing to close."""


class LoopbackClient(SubmitClient):
    """A client of a :class:`LoopbackCoordinator` (the interface of
    :class:`~disagg_rs.control.ControlClient`, without waiting)."""

    def __init__(self, hub: LoopbackCoordinator, identity: bytes) -> None:
        self.hub, self.identity = hub, identity

    def _deliver(self, request_id: int, timeout_s: float | None, frame: bytes) -> None:
        self.hub.deliver(self.identity, frame)

    def events(self) -> list[dict[str, Any]]:
        """TOKENS, DONE and FAILED messages received so far."""
        return self.hub.take(self.identity)
