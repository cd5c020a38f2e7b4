"""The coordinator's ZeroMQ loop."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping

import zmq
from zmq.auth.thread import ThreadAuthenticator

from disagg_rs._core import FaultPlan
from disagg_rs.control.coordinator import CoordinatorState, Outgoing
from disagg_rs.control.keys import CurveKeys, serve_with, use_curve
from disagg_rs.control.messages import DEFAULT_LIVENESS_TIMEOUT_S, DEFAULT_SEND_HWM, MAX_FRAME_BYTES


class CoordinatorServer:
    """The ZeroMQ ROUTER loop around :class:`CoordinatorState`; runs in a thread or a process."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        request_timeout_s: float = 60.0,
        push_transport: bool = False,
        engine_timeout_s: float | None = DEFAULT_LIVENESS_TIMEOUT_S,
        keys: CurveKeys | None = None,
        engine_keys: Mapping[str, bytes] | None = None,
        client_keys: Collection[bytes] = (),
        *,
        insecure: bool = False,
        send_hwm: int = DEFAULT_SEND_HWM,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        """``keys``: the socket is a CURVE server: only the public keys in ``engine_keys``
        (engine id -> key) and ``client_keys`` may connect, and a message naming an engine id
        counts only from that engine's key (others are dropped, counted in
        ``unauthenticated``). Without keys the server refuses to start
        (:class:`~disagg_rs.exceptions.ArgumentError`) unless ``insecure=True`` asks for
        plain TCP, which logs a warning.

        ``engine_timeout_s``: liveness, on by default: an engine silent this long is declared
        lost (``None`` turns it off). ``send_hwm``: messages queued per peer; a registered
        engine that lets that many pile up unread is fenced (its requests fail, counted in
        ``slow_engines``): sends never block the serving thread. ``max_frame_bytes``: a peer
        that sends a larger frame is disconnected (ZeroMQ ``MAXMSGSIZE``)."""
        self.state = CoordinatorState(request_timeout_s, push_transport, engine_timeout_s)
        self._auth: ThreadAuthenticator | None = None
        # Refuses keys with insecure=True, and neither: CURVE exactly when keys are given.
        use_curve(keys, "server end", insecure, "coordinator", endpoint)
        self._engine_keys: dict[str, str] | None = None
        self.unauthenticated = 0
        if keys is None:
            self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        else:
            bound = dict(engine_keys or {})
            self._engine_keys = {e: k.decode() for e, k in bound.items()}
            self._ctx = zmq.Context()  # one ZAP handler per context
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            allowed = _AllowList({*bound.values(), *client_keys})
            self._auth.configure_curve_callback("*", credentials_provider=allowed)
            self._sock = self._ctx.socket(zmq.ROUTER)
            serve_with(self._sock, keys)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Unroutable sends fail at once (counted) instead of vanishing; with NOBLOCK a full
        # queue fails at once too (the peer is fenced) instead of blocking the thread.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.undeliverable = 0
        """Messages to a peer that is gone, or dropped because a client does not read."""
        self.slow_engines: Counter[str] = Counter()
        """Engines fenced because their send queue was full (they do not read), by id."""
        self.malformed = 0
        self._faults = FaultPlan(0.0, 0, 1)
        self._stop = threading.Event()
        # A ZeroMQ socket must only be used by one thread: while serve() runs, other threads
        # hand their messages to it through this queue (sending directly aborted the process).
        self._outbox: queue.SimpleQueue[Callable[[], list[Outgoing]]] = queue.SimpleQueue()
        self._serving: threading.Thread | None = None

    def inject_faults(self, rate: float, seed: int = 0, max_delay_rounds: int = 20) -> None:
        """Test hook: drop, duplicate, delay (reordering later traffic) a share ``rate`` of the
        messages to engines (never to clients and never SHUTDOWN). Deterministic per seed
        (decided in Rust)."""
        self._faults = FaultPlan(float(rate), seed, max_delay_rounds)

    @property
    def faults_injected(self) -> int:
        """Messages dropped, duplicated or delayed by :meth:`inject_faults`."""
        return self._faults.injected

    def _send(self, out: list[Outgoing]) -> None:
        """Send without ever blocking; an engine whose queue is full is fenced, and what
        fencing it produces (FAILED to clients, ABORT and PEERS to others) is sent in turn."""
        pending: list[Outgoing] = self._faults.apply(out)
        while pending:
            o = pending.pop(0)
            identity = self.state.address(o)
            if identity is None:  # an engine that is gone
                self.undeliverable += 1
                continue
            try:
                self._sock.send_multipart([identity, o.frame], zmq.NOBLOCK)
            except zmq.ZMQError as err:
                self.undeliverable += 1
                # Again: the peer's queue is full, it does not read (an engine is fenced).
                if isinstance(err, zmq.Again) and o.to_engine is not None:
                    self.slow_engines[o.to_engine] += 1
                    pending += self.state.fence(
                        o.to_engine, f"engine {o.to_engine} does not read its messages (fenced)"
                    )

    def _flush_outbox(self) -> None:
        while not self._outbox.empty():  # this thread is the only reader
            self._send(self._outbox.get_nowait()())

    def run_once(self, timeout_ms: int = 10) -> None:
        """Handle the messages that arrive within ``timeout_ms``, then the deadlines."""
        self._flush_outbox()
        wait = timeout_ms
        while self._sock.poll(wait):  # then everything that arrived meanwhile
            wait = 0
            try:
                identity_frame, frame = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except ValueError:  # not [identity, frame]
                self.malformed += 1
                continue
            identity = identity_frame.bytes
            # Decoded, authenticated and applied in Rust; refusals answered, never raised.
            now = time.monotonic()
            receipt, out = self.state.receive(identity, frame.bytes, now, self._auth_of(frame))
            if receipt == "refused":
                self.malformed += 1
            elif receipt == "unauthenticated":
                self.unauthenticated += 1
            self._send(out)
        self._send(self.state.poll(time.monotonic()))

    def _auth_of(self, frame: zmq.Frame) -> tuple[str, dict[str, str]] | None:
        """The CURVE key ``frame`` came with and the keys bound to engine ids (``None``
        without CURVE)."""
        if self._engine_keys is None:
            return None
        return str(frame.get("User-Id")), self._engine_keys

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
            return self.state.shutdown()

        serving = self._serving
        if serving is None or serving is threading.current_thread():
            self._send(shutdown())
        else:
            self._outbox.put(shutdown)

    def stop(self) -> None:
        """Ask :meth:`serve` to return."""
        self._stop.set()

    def close(self) -> None:
        """Close the socket (and the authenticator)."""
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._ctx.term()


class _AllowList:
    """ZAP credentials provider: a connection is allowed if its public key is listed."""

    def __init__(self, keys: Collection[bytes]) -> None:
        self._keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys
