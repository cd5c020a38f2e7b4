"""Control plane: sans-IO routing with a virtual clock, and a real ZeroMQ round trip."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from disagg_rs.control import (
    PROTOCOL_VERSION,
    ControlClient,
    CoordinatorServer,
    CoordinatorState,
    EngineLink,
    Msg,
    Outgoing,
    decode_message,
    encode_message,
)
from disagg_rs.exceptions import ArgumentError, MetadataError

CLIENT = b"client-1"
PREFILL = b"prefill:p0:1"
DECODE = b"decode:d0:1"


def _msg(kind: Msg, **fields: Any) -> dict[str, Any]:
    return decode_message(encode_message(kind, **fields))


def _kinds(out: list[Outgoing]) -> list[tuple[str | None, str]]:
    return [(o.to_engine or "client", o.kind.value) for o in out]


def _registered(push: bool = False, timeout: float = 10.0) -> CoordinatorState:
    state = CoordinatorState(request_timeout_s=timeout, push_transport=push)
    state.handle(
        PREFILL, _msg(Msg.REGISTER, engine_id="p0", role="prefill", incarnation=1, meta={}), 0
    )
    state.handle(
        DECODE, _msg(Msg.REGISTER, engine_id="d0", role="decode", incarnation=1, meta={}), 0
    )
    return state


def _submit(state: CoordinatorState, rid: int = 7, now: float = 0.0) -> int:
    out = state.handle(
        CLIENT, _msg(Msg.SUBMIT, request_id=rid, prompt=[1, 2], max_new_tokens=3), now
    )
    assert _kinds(out) == [("p0", "PREFILL")]
    return int(out[0].fields["epoch"])


def test_a_request_flows_prefill_decode_release_done() -> None:
    state = _registered()
    epoch = _submit(state)
    out = state.handle(
        PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={"blocks": [3]}), 1
    )
    assert _kinds(out) == [("d0", "SUBMIT_REQUEST_WITH_KV")]
    assert out[0].fields["ticket"]["prefill_engine_id"] == "p0"
    out = state.handle(DECODE, _msg(Msg.KV_IMPORTED, request_id=7, epoch=epoch, ok=True), 2)
    assert _kinds(out) == [("p0", "RELEASE_KV")]
    out = state.handle(DECODE, _msg(Msg.TOKENS, request_id=7, epoch=epoch, tokens=[5]), 2)
    assert _kinds(out) == [("client", "TOKENS")]
    out = state.handle(DECODE, _msg(Msg.DONE, request_id=7, epoch=epoch, tokens=[5, 6]), 3)
    assert _kinds(out) == [("client", "DONE")]
    assert state.completed == 1 and not state.requests


def test_push_transport_sends_send_kv_after_the_decode_posted_receives() -> None:
    state = _registered(push=True)
    epoch = _submit(state)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    out = state.handle(DECODE, _msg(Msg.KV_RECV_POSTED, request_id=7, epoch=epoch), 1)
    assert _kinds(out) == [("p0", "SEND_KV")]
    assert out[0].fields["decode_engine_id"] == "d0"


def test_receives_posted_for_a_request_the_prefill_will_not_push_are_answered_with_fillers() -> (
    None
):
    # Messages match by post order per pair (NCCL): receives no send answers would take the
    # prefill's next push to that decode, so the prefill is told to send fillers instead.
    state = _registered(push=True)
    epoch = _submit(state)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    posted = {"request_id": 7, "epoch": epoch, "prefill_engine_id": "p0", "transfer": {"n": 1}}
    out = state.handle(DECODE, _msg(Msg.KV_RECV_POSTED, **posted), 1)
    assert _kinds(out) == [("p0", "SEND_KV")] and out[0].fields["abort"] is False
    # The request fails (its deadline) while the decode's receives are posted: a late or
    # repeated KV_RECV_POSTED still reaches the prefill it names, as a filler request.
    state.poll(100.0)
    assert not state.requests
    out = state.handle(DECODE, _msg(Msg.KV_RECV_POSTED, **posted), 101)
    assert _kinds(out) == [("p0", "SEND_KV")]
    assert out[0].fields["abort"] is True and out[0].fields["transfer"] == {"n": 1}
    assert out[0].fields["decode_engine_id"] == "d0" and state.aborted_pushes == 1
    # Not heard: a name that is no registered prefill, or a sender that is no decode.
    for identity, name in ((DECODE, "nobody"), (DECODE, "d0"), (PREFILL, "p0")):
        named = {**posted, "prefill_engine_id": name}
        assert state.handle(identity, _msg(Msg.KV_RECV_POSTED, **named), 102) == []
    assert state.ignored["KV_RECV_POSTED"] == 3


def test_a_one_sided_transport_ignores_posted_receives() -> None:
    state = _registered(push=False)
    epoch = _submit(state)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    posted = {"request_id": 7, "epoch": epoch, "prefill_engine_id": "p0"}
    assert state.handle(DECODE, _msg(Msg.KV_RECV_POSTED, **posted), 1) == []


def test_a_late_message_with_an_old_epoch_is_ignored_and_counted() -> None:
    state = _registered()
    epoch = _submit(state)
    out = state.handle(
        PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch + 99, ticket={}), 1
    )
    assert out == []
    assert state.ignored["PREFILL_DONE"] == 1


def test_a_duplicate_prefill_done_is_ignored() -> None:
    state = _registered()
    epoch = _submit(state)
    done = _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={})
    assert state.handle(PREFILL, done, 1)
    assert state.handle(PREFILL, done, 1) == []
    assert state.ignored["PREFILL_DONE"] == 1


def test_a_message_from_an_engine_not_serving_the_request_is_ignored() -> None:
    state = _registered()
    epoch = _submit(state)
    out = state.handle(DECODE, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    assert out == [] and state.ignored["PREFILL_DONE"] == 1


def test_deadline_fails_the_request_and_leaves_pins_the_decode_may_read_to_their_lease() -> None:
    state = _registered(timeout=5.0)
    epoch = _submit(state, now=0.0)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    assert state.poll(4.9) == []
    out = state.poll(5.0)
    # The decode holds the ticket and may still be reading: no RELEASE_KV, the lease decides.
    assert sorted(_kinds(out)) == [("client", "FAILED"), ("d0", "ABORT"), ("p0", "ABORT")]
    assert state.failed == 1 and not state.requests and state.left_to_lease == 1
    # A completion arriving after the failure touches nothing.
    assert state.handle(DECODE, _msg(Msg.DONE, request_id=7, epoch=epoch, tokens=[]), 6) == []


@pytest.mark.parametrize("quiet", [True, False, None])
def test_failed_import_fails_once_and_releases_pins_only_when_the_decode_reads_are_quiet(
    quiet: bool | None,
) -> None:
    state = _registered()
    epoch = _submit(state)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    extra = {} if quiet is None else {"quiet": quiet}
    out = state.handle(
        DECODE, _msg(Msg.KV_IMPORTED, request_id=7, epoch=epoch, ok=False, error="x", **extra), 2
    )
    assert ("client", "FAILED") in _kinds(out)
    assert (("p0", "RELEASE_KV") in _kinds(out)) is (quiet is True)
    assert state.handle(DECODE, _msg(Msg.FAILED, request_id=7, epoch=epoch, error="again"), 2) == []


def test_restarted_prefill_fails_its_requests_and_replaces_the_peer() -> None:
    state = _registered()
    _submit(state)
    out = state.handle(
        b"prefill:p0:2",
        _msg(Msg.REGISTER, engine_id="p0", role="prefill", incarnation=2, meta={"x": 1}),
        1,
    )
    assert ("client", "FAILED") in _kinds(out)
    assert ("p0", "RELEASE_KV") not in _kinds(out)
    assert state.engines["p0"].incarnation == 2
    peers = next(o for o in out if o.kind is Msg.PEERS).fields["peers"]
    assert peers["p0"]["meta"] == {"x": 1}


def _reregister(state: CoordinatorState, role: str, engine: str, now: float) -> list[Outgoing]:
    return state.handle(
        f"{role}:{engine}:2".encode(),
        _msg(Msg.REGISTER, engine_id=engine, role=role, incarnation=2, meta={}),
        now,
    )


def _imported(state: CoordinatorState, rid: int, now: float = 1.0) -> int:
    epoch = _submit(state, rid, now)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=rid, epoch=epoch, ticket={}), now)
    out = state.handle(DECODE, _msg(Msg.KV_IMPORTED, request_id=rid, epoch=epoch, ok=True), now)
    assert _kinds(out) == [("p0", "RELEASE_KV")]
    return epoch


def test_restarted_prefill_spares_requests_whose_state_the_decode_already_imported() -> None:
    state = _registered()
    done_epoch = _imported(state, 1)  # imported: lives on the decode only
    pulling = _submit(state, 2)  # handed off, the decode still reads the prefill's pins
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=2, epoch=pulling, ticket={}), 1)
    _submit(state, 3)  # still prefilling
    out = _reregister(state, "prefill", "p0", 2)
    failed = sorted(o.fields["request_id"] for o in out if o.kind is Msg.FAILED)
    assert failed == [2, 3]
    assert all("restarted" in o.fields["error"] for o in out if o.kind is Msg.FAILED)
    # No RELEASE_KV to the new incarnation (its pins died with the old one); the decode aborts
    # the read of request 2.
    assert ("p0", "RELEASE_KV") not in _kinds(out) and ("d0", "ABORT") in _kinds(out)
    out = state.handle(DECODE, _msg(Msg.DONE, request_id=1, epoch=done_epoch, tokens=[4]), 3)
    assert _kinds(out) == [("client", "DONE")]
    assert not state.requests and (state.completed, state.failed) == (1, 2)


def test_restarted_decode_fails_its_requests_and_hands_prefilling_ones_to_the_new_one() -> None:
    state = _registered()
    _imported(state, 1)
    pulling = _submit(state, 2)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=2, epoch=pulling, ticket={}), 1)
    prefilling = _submit(state, 3)
    out = _reregister(state, "decode", "d0", 2)
    failed = sorted(o.fields["request_id"] for o in out if o.kind is Msg.FAILED)
    assert failed == [1, 2]
    # Request 2's pins stay until their lease (the old decode process may still be reading
    # them); request 3 was never on the decode.
    assert [o for o in out if o.kind is Msg.RELEASE_KV] == [] and state.left_to_lease == 1
    new_decode = b"decode:d0:2"
    out = state.handle(
        PREFILL, _msg(Msg.PREFILL_DONE, request_id=3, epoch=prefilling, ticket={}), 3
    )
    assert _kinds(out) == [("d0", "SUBMIT_REQUEST_WITH_KV")]
    assert state.engines["d0"].identity == new_decode
    # The old incarnation's identity is no longer an engine: its late messages are ignored.
    assert (
        state.handle(DECODE, _msg(Msg.KV_IMPORTED, request_id=3, epoch=prefilling, ok=True), 4)
        == []
    )
    assert state.handle(
        new_decode, _msg(Msg.KV_IMPORTED, request_id=3, epoch=prefilling, ok=True), 4
    )


def test_a_stale_incarnation_cannot_re_register() -> None:
    state = _registered()
    out = state.handle(
        b"old", _msg(Msg.REGISTER, engine_id="p0", role="prefill", incarnation=0, meta={}), 1
    )
    assert out == [] and state.engines["p0"].identity == PREFILL


def test_duplicate_submit_is_refused_without_touching_the_first() -> None:
    state = _registered()
    _submit(state)
    out = state.handle(CLIENT, _msg(Msg.SUBMIT, request_id=7, prompt=[1], max_new_tokens=1), 0)
    assert _kinds(out) == [("client", "FAILED")]
    assert 7 in state.requests


def test_submit_without_a_prefill_engine_fails_cleanly() -> None:
    state = CoordinatorState()
    out = state.handle(CLIENT, _msg(Msg.SUBMIT, request_id=1, prompt=[1], max_new_tokens=1), 0)
    assert _kinds(out) == [("client", "FAILED")]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"\xc1", "<frame>"),
        (encode_message(Msg.SHUTDOWN)[:-1] + bytes([PROTOCOL_VERSION + 1]), "v"),
    ],
)
def test_malformed_messages_raise_metadata_error(raw: bytes, field: str) -> None:
    with pytest.raises(MetadataError) as info:
        decode_message(raw)
    assert info.value.field == field


def test_a_message_without_a_required_field_is_refused_at_decode() -> None:
    with pytest.raises(MetadataError, match="request_id"):
        decode_message(encode_message(Msg.SUBMIT, prompt=[1], max_new_tokens=1))


def _wait_for(link: EngineLink, kind: Msg, timeout_s: float = 5.0) -> dict[str, Any]:
    """The first message of ``kind`` that reaches ``link`` (other messages are dropped)."""
    for _ in range(int(timeout_s * 10)):
        for msg in link.poll(100):
            if msg["type"] is kind:
                return msg
    raise AssertionError(f"no {kind.value} within {timeout_s} s")


def test_real_zeromq_round_trip_through_the_coordinator(
    served: tuple[CoordinatorServer, threading.Thread],
) -> None:
    server = served[0]
    prefill = EngineLink(server.endpoint, "p0", "prefill", incarnation=1, insecure=True)
    decode = EngineLink(server.endpoint, "d0", "decode", incarnation=1, insecure=True)
    client = ControlClient(server.endpoint, insecure=True)
    try:
        prefill.register({"agent": "p0"})
        peers = decode.register({"agent": "d0"})
        assert set(peers) == {"p0", "d0"}
        client.submit(42, [1, 2, 3], 2)
        req = _wait_for(prefill, Msg.PREFILL)
        prefill.send(Msg.PREFILL_DONE, request_id=42, epoch=req["epoch"], ticket={"first": 9})
        imp = _wait_for(decode, Msg.SUBMIT_REQUEST_WITH_KV)
        assert imp["ticket"]["first"] == 9
        decode.send(Msg.KV_IMPORTED, request_id=42, epoch=imp["epoch"], ok=True)
        decode.send(Msg.DONE, request_id=42, epoch=imp["epoch"], tokens=[9, 4])
        events = []
        for event in client.events(5.0):
            events.append(event)
            if event["type"] is Msg.DONE:
                break
        assert events[-1]["tokens"] == [9, 4]
        assert _wait_for(prefill, Msg.RELEASE_KV)["request_id"] == 42
    finally:
        for sock in (prefill, decode, client):
            sock.close()


def _beat(state: CoordinatorState, identity: bytes, engine: str, now: float) -> list[Outgoing]:
    return state.handle(identity, _msg(Msg.HEARTBEAT, engine_id=engine, incarnation=1), now)


def test_a_silent_engine_is_declared_lost_and_its_requests_fail_before_their_deadline() -> None:
    state = CoordinatorState(request_timeout_s=60.0, engine_timeout_s=5.0)
    for identity, engine, role in ((PREFILL, "p0", "prefill"), (DECODE, "d0", "decode")):
        state.handle(
            identity, _msg(Msg.REGISTER, engine_id=engine, role=role, incarnation=1, meta={}), 0
        )
    epoch = _submit(state, 7, now=1.0)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 2.0)
    ack = {"engine_id": "p0", "incarnation": 1}
    acked = _beat(state, PREFILL, "p0", 4.0)
    assert [(o.to_engine, o.kind, o.fields) for o in acked] == [("p0", Msg.HEARTBEAT_ACK, ack)]
    assert state.poll(5.0) == []  # the decode was last heard at 0: not yet past 5 s
    out = state.poll(5.5)
    # No RELEASE_KV: the silent decode may only be stalled and read the pins when it continues;
    # the prefill keeps them until their lease ends.
    assert sorted(_kinds(out)) == [("client", "FAILED"), ("p0", "ABORT"), ("p0", "PEERS")]
    failed = next(o for o in out if o.kind is Msg.FAILED).fields["error"]
    assert "d0" in failed and "silent" in failed
    assert set(state.engines) == {"p0"} and state.lost["d0"] == 1
    assert set(next(o for o in out if o.kind is Msg.PEERS).fields["peers"]) == {"p0"}
    # Heartbeats keep the prefill alive; the fenced decode's messages are ignored.
    _beat(state, PREFILL, "p0", 9.0)
    assert state.poll(13.0) == [] and "p0" in state.engines
    fenced = _beat(state, DECODE, "d0", 13.0)  # answered: register again
    assert [(o.to_client, o.kind) for o in fenced] == [(DECODE, Msg.FENCED)]
    assert state.ignored["HEARTBEAT"] == 1 and "d0" not in state.engines
    assert state.handle(DECODE, _msg(Msg.DONE, request_id=7, epoch=epoch, tokens=[1]), 13) == []
    # A request that reaches PREFILL_DONE with no decode left fails at once.
    epoch = _submit(state, 8, now=13.0)
    out = state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=8, epoch=epoch, ticket={}), 13)
    assert ("client", "FAILED") in _kinds(out) and ("p0", "RELEASE_KV") in _kinds(out)
    # The decode registers again and gets work again.
    state.handle(
        b"decode:d0:2",
        _msg(Msg.REGISTER, engine_id="d0", role="decode", incarnation=2, meta={}),
        14,
    )
    epoch = _submit(state, 9, now=14.0)
    out = state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=9, epoch=epoch, ticket={}), 14)
    assert _kinds(out) == [("d0", "SUBMIT_REQUEST_WITH_KV")]


def test_without_an_engine_timeout_silence_is_not_loss() -> None:
    state = _registered()
    assert state.poll(10.0**6) == [] and set(state.engines) == {"p0", "d0"}
    with pytest.raises(ValueError, match="engine_timeout_s"):
        CoordinatorState(engine_timeout_s=0)


def test_engine_link_heartbeats_only_when_it_has_been_quiet() -> None:
    server = CoordinatorServer(engine_timeout_s=30.0, insecure=True)
    link = EngineLink(server.endpoint, "p0", "prefill", incarnation=1, insecure=True)
    try:
        assert link.heartbeat(interval_s=3600.0) is False  # just created: counts as sent
        assert link.heartbeat(interval_s=0.0) is True
    finally:
        link.close()
        server.close()


def test_a_fenced_engine_link_registers_again_by_itself() -> None:
    # Declared lost while alive (a long stall): its next heartbeat is answered with FENCED and
    # the link registers again with the same incarnation and metadata.
    server = CoordinatorServer(engine_timeout_s=30.0, insecure=True)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    link = EngineLink(server.endpoint, "p0", "prefill", incarnation=7, insecure=True)
    try:
        link.register({"agent": "a"})
        # Run the liveness check an hour ahead on the serving thread (it owns the state).
        server._outbox.put(lambda: server.state.poll(time.monotonic() + 3600.0))
        deadline = time.monotonic() + 10.0
        while "p0" in server.state.engines and time.monotonic() < deadline:
            link.poll(10)
        assert "p0" not in server.state.engines and server.state.lost["p0"] == 1
        link.heartbeat(interval_s=0.0)
        while "p0" not in server.state.engines and time.monotonic() < deadline:
            link.poll(10)
        assert link.fenced == 1
        engine = server.state.engines["p0"]
        assert (engine.incarnation, engine.meta) == (7, {"agent": "a"})
    finally:
        server.stop()
        serving.join(5)
        link.close()
        server.close()


def test_engines_told_to_shut_down_go_silent_without_being_declared_lost() -> None:
    state = CoordinatorState(request_timeout_s=60.0, engine_timeout_s=5.0)
    for identity, engine, role in ((PREFILL, "p0", "prefill"), (DECODE, "d0", "decode")):
        state.handle(
            identity, _msg(Msg.REGISTER, engine_id=engine, role=role, incarnation=1, meta={}), 0
        )
    assert _kinds(state.shutdown()) == [("d0", "SHUTDOWN"), ("p0", "SHUTDOWN")]
    assert state.poll(100.0) == []
    assert not state.lost and set(state.engines) == {"p0", "d0"}


def test_work_arriving_with_the_registered_reply_is_not_lost() -> None:
    # The coordinator counts an engine as registered before the engine reads REGISTERED, so
    # the first PREFILL can arrive in the same batch; register() used to drop it (the demo's
    # requests then hung until their deadline).
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    link = EngineLink(
        router.getsockopt_string(zmq.LAST_ENDPOINT), "p0", "prefill", incarnation=1, insecure=True
    )
    prefill = encode_message(
        Msg.PREFILL, request_id=5, epoch=1, prompt=[1], max_new_tokens=2, decode_engine_id="d0"
    )
    try:
        sent = threading.Event()

        def coordinator() -> None:
            identity, _ = router.recv_multipart()  # REGISTER
            registered = encode_message(
                Msg.REGISTERED, engine_id="p0", incarnation=1, peers={"p0": {}}
            )
            router.send_multipart([identity, registered])
            router.send_multipart([identity, prefill])
            sent.set()

        thread = threading.Thread(target=coordinator, daemon=True)
        thread.start()
        assert set(link.register({}, timeout_s=10.0)) == {"p0"}
        assert sent.wait(10.0)
        deadline = time.monotonic() + 10.0
        got: list[dict[str, Any]] = []
        while not got and time.monotonic() < deadline:
            got = link.poll(50)
        assert [(m["type"], m["request_id"]) for m in got] == [(Msg.PREFILL, 5)]
        thread.join(5)
    finally:
        link.close()
        router.close(0)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 0.0, True, "5", 1e9])
def test_a_submit_with_a_timeout_that_never_or_already_expired_fails_alone_with_a_typed_error(
    timeout_s: object,
) -> None:
    state = _registered()
    out = state.handle(
        CLIENT,
        {
            "type": Msg.SUBMIT,
            "v": PROTOCOL_VERSION,
            "request_id": 3,
            "prompt": [1],
            "max_new_tokens": 2,
            "timeout_s": timeout_s,
        },
        0.0,
    )
    assert _kinds(out) == [("client", "FAILED")]
    assert "ArgumentError" not in out[0].fields["error"]  # the message names the field
    assert "timeout_s=" in out[0].fields["error"] and not state.requests
    # The coordinator keeps serving: a good request after it flows.
    _submit(state, 4)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -0.5])
def test_the_client_refuses_a_timeout_that_would_never_expire(timeout_s: float) -> None:
    client = ControlClient("tcp://127.0.0.1:1", insecure=True)
    try:
        with pytest.raises(ArgumentError) as info:
            client.submit(1, [1], 1, timeout_s=timeout_s)
        assert info.value.field == "timeout_s"
    finally:
        client.close()


def test_a_decode_failure_at_submit_is_quiet_and_releases_the_pins_at_once() -> None:
    state = _registered()
    epoch = _submit(state)
    state.handle(PREFILL, _msg(Msg.PREFILL_DONE, request_id=7, epoch=epoch, ticket={}), 1)
    out = state.handle(
        DECODE, _msg(Msg.FAILED, request_id=7, epoch=epoch, error="refused", quiet=True), 2
    )
    assert ("p0", "RELEASE_KV") in _kinds(out) and state.left_to_lease == 0
