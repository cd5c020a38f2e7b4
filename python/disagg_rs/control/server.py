"""The coordinator's ZeroMQ loop."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import zmq

from disagg_rs.control.coordinator import CoordinatorState, Outgoing
from disagg_rs.control.messages import MAX_FRAME_BYTES, Msg, decode_message, encode_message
from disagg_rs.exceptions import MetadataError


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
