"""Backpressure and loss of the coordinator, over real ZeroMQ sockets.

A registered engine that does not read is fenced instead of blocking the coordinator; an
oversized frame disconnects its sender; engines detect a silent coordinator through
acknowledged heartbeats and abort the work they were given; clients are told FAILED by their
deadline. Deadlines are decided on virtual clocks; real time only bounds the waits for
sockets (generous, never asserted on)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from disagg_rs.control import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    ControlClient,
    CoordinatorServer,
    EngineLink,
    Msg,
    encode_message,
)
from disagg_rs.control.messages import MAX_FRAME_BYTES

os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

META = {"kind": "test"}
WAIT_ROUNDS = 3000  # bound on socket waits of 20 ms each (a loaded machine may be slow)


class Clock:
    """A virtual clock in seconds."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[CoordinatorServer]:
    srv = CoordinatorServer(insecure=True, engine_timeout_s=None)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.stop()
        thread.join(30)
        srv.close()


def _until(pred: Callable[[], bool], step: Callable[[], Any]) -> None:
    for _ in range(WAIT_ROUNDS):
        if pred():
            return
        step()
    raise AssertionError("condition not reached")


def _raw_engine(endpoint: str, engine_id: str, role: str) -> zmq.Socket[bytes]:
    """A hostile engine: registers, then never reads (tiny receive queue and buffer)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.IDENTITY, f"{role}:{engine_id}:1".encode())
    sock.connect(endpoint)
    sock.send(
        encode_message(Msg.REGISTER, engine_id=engine_id, role=role, incarnation=1, meta=META)
    )
    return sock


def test_a_registered_engine_that_never_reads_is_fenced_and_its_requests_fail() -> None:
    # Before: blocking sends with ROUTER_MANDATORY froze the serving thread after 1,000
    # queued messages. Here the coordinator is driven from this thread: run_once returning
    # at all is the proof that no send blocked.
    srv = CoordinatorServer(insecure=True, engine_timeout_s=None, send_hwm=4)
    hostile = _raw_engine(srv.endpoint, "p0", "prefill")
    clock = Clock()
    client = ControlClient(srv.endpoint, insecure=True, clock=clock)
    try:
        _until(lambda: "p0" in srv.state.engines, lambda: srv.run_once(20))
        prompt = [70_000] * 100_000  # ~500 kB per PREFILL: queues and buffers fill quickly
        submitted = 0
        while not srv.slow_engines and submitted < 400:
            client.submit(submitted, prompt, 1)
            submitted += 1
            _until(lambda n=submitted: _handled(srv) == n, lambda: srv.run_once(20))
        assert srv.slow_engines == {"p0": 1}
        assert "p0" not in srv.state.engines and not srv.state.requests
        assert srv.state.failed == submitted
        ended: list[tuple[int, str]] = []
        for _ in range(5):
            srv.run_once(20)
            ended += _failures(client)
        # A FAILED the client's own queue (4 deep) could not take is dropped, counted, and
        # the client reports that request FAILED itself at its deadline.
        clock.now += 100.0
        ended += _failures(client)
        assert sorted(rid for rid, _ in ended) == list(range(submitted))  # each ends once
        assert "does not read" in dict(ended)[0]
    finally:
        hostile.close(0)
        client.close()
        srv.close()


def _handled(srv: CoordinatorServer) -> int:
    """SUBMITs the coordinator has acted on (each is live or has failed)."""
    return srv.state.failed + len(srv.state.requests)


def _failures(client: ControlClient) -> list[tuple[int, str]]:
    out = []
    for e in client.events(0.02):
        assert e["type"] is Msg.FAILED
        out.append((e["request_id"], e["error"]))
    return out


def test_a_frame_over_the_size_cap_disconnects_its_sender_and_serving_goes_on() -> None:
    srv = CoordinatorServer(insecure=True, engine_timeout_s=None)
    hostile: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(srv.endpoint)
    client = ControlClient(srv.endpoint, insecure=True)
    try:
        hostile.send(b"\x00" * (MAX_FRAME_BYTES + 1))  # the default cap, plus one byte
        client.submit(1, [1, 2], 1)
        answers: dict[int, str] = {}
        _until(
            lambda: 1 in answers,
            lambda: (srv.run_once(20), answers.update(dict(_failures(client)))),
        )
        assert "no prefill engine" in answers[1]
        # The oversized frame never reached the decoder (it would count as malformed).
        assert srv.malformed == 0 and srv.state.failed == 1
    finally:
        hostile.close(0)
        client.close()
        srv.close()


def test_a_smaller_frame_cap_can_be_set_and_a_frame_within_it_is_served() -> None:
    srv = CoordinatorServer(insecure=True, engine_timeout_s=None, max_frame_bytes=1 << 12)
    big, small = (
        ControlClient(srv.endpoint, insecure=True),
        ControlClient(srv.endpoint, insecure=True),
    )
    try:
        big.submit(1, [70_000] * 2_000, 1)  # 10 kB > 4 kB: dropped with its connection
        small.submit(2, [1], 1)
        answers: dict[int, str] = {}
        _until(
            lambda: 2 in answers, lambda: (srv.run_once(20), answers.update(dict(_failures(small))))
        )
        assert srv.state.failed == 1 and 1 not in srv.state.requests
    finally:
        big.close()
        small.close()
        srv.close()


def test_the_coordinator_acknowledges_heartbeats_so_a_live_one_is_never_declared_lost(
    server: CoordinatorServer,
) -> None:
    clock = Clock()
    link = EngineLink(server.endpoint, "p0", "prefill", 1, insecure=True, clock=clock)
    try:
        link.register(META, timeout_s=60)
        # Five rounds of 0.9 timeouts each: without the acks the coordinator, which sends
        # nothing else to an idle engine, would be declared lost in the second.
        for _ in range(5):
            clock.now += DEFAULT_LIVENESS_TIMEOUT_S * 0.45
            assert link.heartbeat(1.0)
            got: list[dict[str, Any]] = []
            heard = link.liveness.last_heard
            _until(
                lambda heard=heard: link.liveness.last_heard > heard,
                lambda got=got: got.extend(link.poll(20)),
            )
            assert got == []  # the ack is consumed by the link, never handed to the engine
            clock.now += DEFAULT_LIVENESS_TIMEOUT_S * 0.45
            assert link.poll(0) == [] and not link.coordinator_lost
        assert link.liveness.counters()["losses"] == 0
    finally:
        link.close()


def test_an_engine_declares_a_silent_coordinator_lost_and_aborts_what_it_was_given() -> None:
    srv = CoordinatorServer(insecure=True, engine_timeout_s=None)
    clock = Clock()
    link = EngineLink(srv.endpoint, "p0", "prefill", 1, insecure=True, clock=clock, send_hwm=8)
    client = ControlClient(srv.endpoint, insecure=True)
    serving = threading.Thread(target=srv.serve, daemon=True)
    serving.start()
    try:
        link.register(META, timeout_s=60)
        client.submit(3, [1, 2, 3], 2)
        client.submit(4, [4, 5], 2)
        given: list[dict[str, Any]] = []
        _until(lambda: len(given) == 2, lambda: given.extend(link.poll(20)))
        assert [m["type"] for m in given] == [Msg.PREFILL, Msg.PREFILL]
        link.send(Msg.PREFILL_FAILED, request_id=4, epoch=given[1]["epoch"], error="refused")
        answer: list[dict[str, Any]] = []  # the coordinator aborts 4 on the engine
        _until(lambda: bool(answer), lambda: answer.extend(link.poll(20)))
        assert [(m["type"], m["request_id"]) for m in answer] == [(Msg.ABORT, 4)]
    finally:
        srv.stop()
        serving.join(30)
        srv.close()  # the coordinator is gone
    try:
        clock.now += DEFAULT_LIVENESS_TIMEOUT_S  # not yet past the timeout
        assert link.poll(0) == [] and not link.coordinator_lost
        for _ in range(100):  # sends to a dead coordinator never block
            link.send(Msg.HEARTBEAT, engine_id="p0", incarnation=1)
        assert link.unsent > 0
        clock.now += 1.0
        aborts = link.poll(0)
        # Only request 3 is still this engine's; 4 ended with its PREFILL_FAILED.
        assert aborts == [{"type": Msg.ABORT, "request_id": 3, "epoch": given[0]["epoch"]}]
        assert link.coordinator_lost
        assert link.liveness.counters() == {"losses": 1, "abandoned": 1}
        clock.now += 100.0
        assert link.poll(0) == [] and link.liveness.counters()["losses"] == 1  # declared once
    finally:
        link.close()
        client.close()


def test_a_client_gets_failed_by_its_deadline_when_the_coordinator_is_gone() -> None:
    clock = Clock()
    client = ControlClient("tcp://127.0.0.1:1", insecure=True, clock=clock, grace_s=1.0)
    try:
        client.submit(5, [1, 2], 3, timeout_s=2.0)
        client.submit(6, [1, 2], 3)  # the client's default timeout (60 s)
        assert list(client.events(0.01)) == []
        clock.now += 3.0  # past request 5's deadline plus the grace
        events = list(client.events(0.01))
        assert [(e["type"], e["request_id"]) for e in events] == [(Msg.FAILED, 5)]
        assert "deadline" in events[0]["error"]
        clock.now += 58.0
        assert [e["request_id"] for e in client.events(0.01)] == [6]
        assert list(client.events(0.01)) == []  # each request is failed once
    finally:
        client.close()


def test_an_answer_before_the_deadline_is_never_followed_by_a_failed(
    server: CoordinatorServer,
) -> None:
    clock = Clock()
    client = ControlClient(server.endpoint, insecure=True, clock=clock)
    try:
        client.submit(9, [1, 2], 1, timeout_s=5.0)  # no engines: the coordinator fails it
        events: list[dict[str, Any]] = []
        _until(lambda: bool(events), lambda: events.extend(client.events(0.02)))
        assert [(e["type"], e["request_id"]) for e in events] == [(Msg.FAILED, 9)]
        assert "no prefill engine" in events[0]["error"]
        clock.now += 100.0
        assert list(client.events(0.01)) == []
    finally:
        client.close()


def test_engines_abort_their_work_when_the_coordinator_dies_and_leak_nothing() -> None:
    """A prefill and a decode reference engine (real NIXL over UCX loopback), each served by a
    HandoffDriver over a real EngineLink; the coordinator dies while a request is decoding.
    Every valid outcome is accepted for the other requests (done before the loss, or
    aborted); afterwards nothing is leaked, no pin outlives its lease, and the client hears
    FAILED for every unanswered request by its deadline."""
    from disagg_rs.driver import HandoffDriver
    from disagg_rs.reference import EngineConfig, hybrid_model
    from disagg_rs.reference.handoff import HandoffReferenceEngine

    clock = Clock(1.0)
    srv = CoordinatorServer(insecure=True, engine_timeout_s=None)
    serving = threading.Thread(target=srv.serve, daemon=True)
    serving.start()
    engines: dict[str, Any] = {}
    drivers: dict[str, HandoffDriver] = {}
    links: dict[str, EngineLink] = {}
    client = ControlClient(srv.endpoint, insecure=True, clock=clock, default_timeout_s=30.0)
    try:
        for rank, role in enumerate(("prefill", "decode")):
            eng = HandoffReferenceEngine(
                hybrid_model(),
                EngineConfig(role=role, ranks=(rank,), num_blocks=64, num_ssm_slots=4),
            )
            eng.handoff_now_ns = int(clock.now * 1e9)
            eng.setup_kv_transfer(role, "nixl", staging_bytes=8 << 20)
            engines[role] = eng
            links[role] = EngineLink(srv.endpoint, role, role, 1, insecure=True, clock=clock)
            drivers[role] = HandoffDriver(eng, links[role], shutdown_grace_s=5.0)
        events: list[dict[str, Any]] = []

        def turn(dt: float) -> None:
            clock.now += dt
            for d in drivers.values():
                for msg in d.receive():
                    d.on_message(msg)
                d.tick(int(clock.now * 1e9))
            events.extend(client.events(0.0))

        prompts = {0: list(b"A prompt that decodes for long."), 1: list(b"Another one.")}
        for rid, prompt in prompts.items():
            client.submit(rid, prompt, 120)
        _until(lambda: any(e["type"] is Msg.TOKENS for e in events), lambda: turn(0.001))
    finally:
        srv.stop()
        serving.join(30)
        srv.close()  # the coordinator dies with work in flight
    try:
        answered = {e["request_id"] for e in events if e["type"] in (Msg.DONE, Msg.FAILED)}
        # Virtual time runs past the liveness timeout, the pins' lease and the deadlines.
        _until(
            lambda: (
                all(lk.coordinator_lost for lk in links.values())
                and not any(d.busy for d in drivers.values())
            ),
            lambda: turn(0.25),
        )
        for _ in range(40):  # 80 virtual seconds: past every deadline
            turn(2.0)
        ends = [e for e in events if e["type"] in (Msg.DONE, Msg.FAILED)]
        assert sorted(e["request_id"] for e in ends) == sorted(prompts)  # each ends once
        late = [e for e in ends if e["request_id"] not in answered]
        assert late and all(e["type"] is Msg.FAILED for e in late)
        assert all(lk.liveness.counters()["losses"] == 1 for lk in links.values())
        assert (
            links["decode"].liveness.counters()["abandoned"] >= 1
        )  # the decoding request was aborted, not finished
        for d in drivers.values():
            d.on_message({"type": Msg.SHUTDOWN})
        _until(lambda: not any(d.running for d in drivers.values()), lambda: turn(0.25))
        for d in drivers.values():
            report = d.drain()  # raises if a block, slot or pin is not back
            assert report["leaked_blocks"] == 0 and report["pinned"] == 0
            assert report["quarantined"] == 0
        assert engines["decode"].has_work is False
    finally:
        for eng in engines.values():
            eng.close_kv_transfer()
        for lk in links.values():
            lk.close()
        client.close()
