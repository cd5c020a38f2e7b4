"""Control-plane faults (issue 9, item 2) on the sans-IO coordinator: messages between the
coordinator and the engines are dropped, duplicated, delayed and reordered, and engines restart
mid-run or fall silent (liveness timeout). Every request must end in exactly one outcome for
its client (DONE or FAILED, never both, never twice), by its deadline at the latest; every
request whose prefill pinned state gets a RELEASE_KV or an ABORT emitted to that prefill; and
the coordinator ends with no request."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs import control as ctl

CLIENT = b"client"
TIMEOUT = 10.0


def _msg(kind: ctl.Msg, **fields: Any) -> dict[str, Any]:
    return ctl.decode_message(ctl.encode_message(kind, **fields))


class _Net:
    """Engines played by scripts; every message on the wire may be dropped, duplicated or held."""

    def __init__(self, data: st.DataObject, state: ctl.CoordinatorState) -> None:
        self.data = data
        self.state = state
        self.inflight: list[tuple[str, dict[str, Any]]] = []  # (engine id, message to it)
        self.upstream: list[tuple[bytes, dict[str, Any]]] = []  # (identity, message to coord.)
        self.client: dict[int, list[str]] = {}
        self.releases: Counter[int] = Counter()
        self.pinned: set[int] = set()
        self.incarnation = {"p0": 1, "d0": 1}

    def identity(self, engine: str) -> bytes:
        return f"{engine}:{self.incarnation[engine]}".encode()

    def register(self, engine: str, now: float) -> None:
        role = "prefill" if engine == "p0" else "decode"
        msg = _msg(
            ctl.Msg.REGISTER,
            engine_id=engine,
            role=role,
            incarnation=self.incarnation[engine],
            meta={},
        )
        self.deliver(self.state.handle(self.identity(engine), msg, now))

    def deliver(self, out: list[ctl.Outgoing]) -> None:
        for o in out:
            if o.to_client is not None:
                if o.kind in (ctl.Msg.DONE, ctl.Msg.FAILED):
                    self.client.setdefault(int(o.fields["request_id"]), []).append(o.kind.value)
                continue
            if o.kind in (ctl.Msg.RELEASE_KV, ctl.Msg.ABORT) and o.to_engine == "p0":
                self.releases[int(o.fields["request_id"])] += 1
            fate = self.data.draw(st.sampled_from(["send", "send", "send", "drop", "dup"]))
            if fate == "drop":
                continue
            msg = {"type": o.kind, **o.fields}
            self.inflight += [(str(o.to_engine), msg)] * (2 if fate == "dup" else 1)

    def engine_step(self) -> None:
        """One engine handles one (randomly chosen: reordering) message and replies."""
        if not self.inflight:
            return
        engine, msg = self.inflight.pop(self.data.draw(st.integers(0, len(self.inflight) - 1)))
        rid, epoch = msg.get("request_id"), msg.get("epoch")
        replies: list[dict[str, Any]] = []
        kind = msg["type"]
        if kind is ctl.Msg.PREFILL:
            outcome = self.data.draw(st.sampled_from(["done", "done", "done", "failed"]))
            if outcome == "done":
                replies.append(
                    _msg(
                        ctl.Msg.PREFILL_DONE,
                        request_id=rid,
                        epoch=epoch,
                        ticket={"resume_tokens": [1]},
                    )
                )
                self.pinned.add(int(rid))
            else:
                replies.append(_msg(ctl.Msg.PREFILL_FAILED, request_id=rid, epoch=epoch, error="x"))
        elif kind is ctl.Msg.SUBMIT_REQUEST_WITH_KV:
            ok = self.data.draw(st.booleans()) or self.data.draw(st.booleans())
            replies.append(_msg(ctl.Msg.KV_IMPORTED, request_id=rid, epoch=epoch, ok=ok, error=""))
            if ok:
                replies.append(_msg(ctl.Msg.TOKENS, request_id=rid, epoch=epoch, tokens=[2]))
                replies.append(_msg(ctl.Msg.DONE, request_id=rid, epoch=epoch, tokens=[1, 2]))
        for r in replies:
            fate = self.data.draw(st.sampled_from(["send", "send", "drop", "dup"]))
            if fate != "drop":
                self.upstream += [(self.identity(engine), r)] * (2 if fate == "dup" else 1)

    def coordinator_step(self, now: float) -> None:
        if not self.upstream:
            return
        identity, msg = self.upstream.pop(self.data.draw(st.integers(0, len(self.upstream) - 1)))
        self.deliver(self.state.handle(identity, msg, now))


@settings(max_examples=200)
@given(st.data())
def test_dropped_duplicated_reordered_messages_and_restarts_end_each_request_exactly_once(
    data: st.DataObject,
) -> None:
    # Half the runs also declare engines lost after 3 s of silence (heartbeats can be lost too).
    liveness = data.draw(st.booleans())
    state = ctl.CoordinatorState(
        request_timeout_s=TIMEOUT, engine_timeout_s=3.0 if liveness else None
    )
    net = _Net(data, state)
    net.register("p0", 0.0)
    net.register("d0", 0.0)
    n = data.draw(st.integers(1, 6))
    now = 0.0
    submitted = 0
    for _ in range(data.draw(st.integers(0, 60))):
        now += data.draw(st.sampled_from([0.0, 0.1, 1.0]))
        action = data.draw(
            st.sampled_from(["submit", "engine", "engine", "coord", "coord", "restart", "beat"])
        )
        if action == "submit" and submitted < n:
            out = state.handle(
                CLIENT,
                _msg(ctl.Msg.SUBMIT, request_id=submitted, prompt=[1], max_new_tokens=2),
                now,
            )
            submitted += 1
            net.deliver(out)
        elif action == "engine":
            net.engine_step()
        elif action == "coord":
            net.coordinator_step(now)
        elif action == "beat":
            engine = data.draw(st.sampled_from(["p0", "d0"]))
            beat = _msg(ctl.Msg.HEARTBEAT, engine_id=engine, incarnation=net.incarnation[engine])
            net.upstream.append((net.identity(engine), beat))
        elif action == "restart" and data.draw(st.integers(0, 4)) == 0:
            engine = data.draw(st.sampled_from(["p0", "d0"]))
            net.incarnation[engine] += 1
            net.inflight = [(e, m) for e, m in net.inflight if e != engine]  # lost with it
            net.register(engine, now)
        net.deliver(state.poll(now))
        for outcomes in net.client.values():
            assert len(outcomes) == 1, outcomes  # never two outcomes for one request
    # Past every deadline, each request has exactly one outcome and the coordinator is empty.
    while net.upstream:
        net.coordinator_step(now)
    net.deliver(state.poll(now + TIMEOUT + 1))
    assert sorted(net.client) == list(range(submitted))
    assert all(len(v) == 1 for v in net.client.values()), net.client
    assert not state.requests
    assert state.completed + state.failed == submitted
    # Every request the prefill pinned and the coordinator learned of got a release or abort
    # emitted (a dropped one is covered by the prefill's lease).
    for rid in net.pinned:
        if net.client.get(rid) == ["DONE"]:
            assert net.releases[rid] >= 1, rid


def test_shutdown_from_another_thread_is_sent_by_the_serving_thread(
    served: tuple[ctl.CoordinatorServer, threading.Thread],
) -> None:
    # Sending on the ROUTER socket from the main thread while serve() used it aborted the
    # whole process (ZeroMQ sockets are single-threaded); the serving thread now sends it.
    server = served[0]
    link = ctl.EngineLink(server.endpoint, "p0", "prefill", incarnation=1, insecure=True)
    try:
        link.register({})
        for _ in range(20):
            server.shutdown_engines()
        got: list[ctl.Msg] = []
        for _ in range(200):
            got += [m["type"] for m in link.poll(50) if m["type"] is ctl.Msg.SHUTDOWN]
            if len(got) == 20:
                break
        assert got == [ctl.Msg.SHUTDOWN] * 20
    finally:
        link.close()
