"""Nothing a peer or a client sends kills a process: the coordinator counts a malformed message
and keeps serving, an engine drops an undecodable frame, the reference engine raises typed
errors for bad prompts, pool sizes past the caps are typed errors (no abort), and two-sided
message tags never alias between requests."""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from disagg_rs import BlockPool, ImportLedger, PinLedger, SlotPool
from disagg_rs import control as ctl
from disagg_rs.exceptions import ArgumentError, DisaggError
from disagg_rs.inference_state_handoff import MAX_TWO_SIDED_REQUEST_ID, _tag
from disagg_rs.reference import EngineConfig, ModelConfig, ReferenceEngine

CLIENT = b"client-1"
PREFILL = b"prefill:p0:1"
DECODE = b"decode:d0:1"


def _registered() -> ctl.CoordinatorState:
    state = ctl.CoordinatorState(request_timeout_s=10.0)
    for identity, engine, role in ((PREFILL, "p0", "prefill"), (DECODE, "d0", "decode")):
        state.handle(
            identity,
            ctl.decode_message(
                ctl.encode_message(
                    ctl.Msg.REGISTER, engine_id=engine, role=role, incarnation=1, meta={}
                )
            ),
            0,
        )
    return state


def _raw(**fields: Any) -> dict[str, Any]:
    """A message as a peer could send it (any field values), handed to ``handle`` as a dict
    (the server refuses such frames at decode already: tests/test_control_messages.py)."""
    msg: dict[str, Any] = {"v": ctl.PROTOCOL_VERSION, **fields}
    msg["type"] = ctl.Msg(msg["type"])
    return msg


def _flows(state: ctl.CoordinatorState, rid: int = 99) -> None:
    """A good request still reaches the prefill: the coordinator kept serving."""
    out = state.handle(CLIENT, _raw(type="SUBMIT", request_id=rid, prompt=[1], max_new_tokens=1), 1)
    assert [(o.to_engine, o.kind) for o in out] == [("p0", ctl.Msg.PREFILL)]


def test_a_shutdown_frame_sent_to_the_coordinator_is_counted_not_fatal() -> None:
    # Before: the 18-byte frame {"type": "SHUTDOWN", "v": 2} raised KeyError out of handle().
    frame = msgpack.packb({"type": "SHUTDOWN", "v": ctl.PROTOCOL_VERSION})
    assert len(frame) == 18
    for identity in (CLIENT, PREFILL):
        state = _registered()
        assert state.handle(identity, ctl.decode_message(frame), 1) == []
        assert state.malformed["SHUTDOWN"] == 1
        _flows(state)


def test_the_real_server_survives_a_shutdown_frame_and_answers_the_next_client(
    served: tuple[ctl.CoordinatorServer, threading.Thread], raw_dealer: zmq.Socket[bytes]
) -> None:
    server, thread = served
    sock = raw_dealer
    client = ctl.ControlClient(server.endpoint, insecure=True)
    try:
        sock.send(msgpack.packb({"type": "SHUTDOWN", "v": ctl.PROTOCOL_VERSION}))
        # Sent on the same socket, so it arrives after the SHUTDOWN frame. No engines: answered
        # FAILED, by a live coordinator.
        sock.send(ctl.encode_message(ctl.Msg.SUBMIT, request_id=1, prompt=[1, 2], max_new_tokens=1))
        assert sock.poll(60_000)
        event = ctl.decode_message(sock.recv())
        assert event["type"] is ctl.Msg.FAILED and "no prefill engine" in event["error"]
        assert thread.is_alive() and server.state.malformed["SHUTDOWN"] == 1
    finally:
        client.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": [1, 2]},  # unhashable
        {"request_id": {"a": 1}},
        {"request_id": "7"},
        {"request_id": -1},
        {"request_id": 2**64 - 1},
        {"request_id": 1.5},
        {"max_new_tokens": "5"},
        {"max_new_tokens": 0},
        {"max_new_tokens": 2**40},
        {"prompt": "abc"},
        {"prompt": []},
        {"prompt": [-1]},
        {"prompt": [1.0]},
        {"prompt": [True]},
        {"prompt": [1] * ((1 << 20) + 1)},
        {"timeout_s": "x"},
    ],
)
def test_a_submit_with_a_bad_field_fails_alone_and_changes_nothing(fields: dict[str, Any]) -> None:
    # Before: an unhashable request id raised TypeError, a bad int()/float() field ValueError,
    # out of handle(): the coordinator died and every client got nothing.
    state = _registered()
    msg = {"type": "SUBMIT", "request_id": 5, "prompt": [1, 2], "max_new_tokens": 3, **fields}
    out = state.handle(CLIENT, _raw(**msg), 1)
    assert all(o.kind is ctl.Msg.FAILED and o.to_client == CLIENT for o in out)
    assert not state.requests and state.malformed["SUBMIT"] == 1
    _flows(state)


@pytest.mark.parametrize(
    "msg",
    [
        {"type": "REGISTER", "engine_id": "p9", "role": "prefill", "incarnation": "a", "meta": {}},
        {"type": "REGISTER", "engine_id": ["p9"], "role": "prefill", "incarnation": 1, "meta": 1},
        {"type": "REGISTER", "engine_id": "p9", "role": "admin", "incarnation": 1, "meta": {}},
        {"type": "HEARTBEAT", "engine_id": {"x": 1}, "incarnation": 1},
        {"type": "PREFILL_DONE", "request_id": [7], "epoch": 1, "ticket": {}},
        {"type": "PREFILL_DONE", "request_id": 7, "epoch": 1, "ticket": [1]},
        {"type": "KV_IMPORTED", "request_id": 7, "epoch": 1, "ok": "yes"},
        {"type": "TOKENS", "request_id": 7, "tokens": 5},
        {"type": "DONE", "request_id": 7, "tokens": ["a"]},
        {"type": "FAILED", "request_id": 7, "error": 5},
        {"type": "RELEASE_KV", "request_id": 7, "epoch": 1},
        {"type": "PEERS", "peers": {}},
    ],
)
def test_an_engine_message_with_a_bad_field_is_counted_and_changes_nothing(
    msg: dict[str, Any],
) -> None:
    state = _registered()
    _flows(state, 7)
    before = (dict(state.requests), dict(state.engines))
    assert state.handle(PREFILL, _raw(**msg), 2) == []
    assert (dict(state.requests), dict(state.engines)) == before
    assert sum(state.malformed.values()) == 1


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_value = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = sorted(
    {
        "request_id",
        "epoch",
        "prompt",
        "max_new_tokens",
        "timeout_s",
        "ticket",
        "ok",
        "error",
        "quiet",
        "tokens",
        "engine_id",
        "role",
        "incarnation",
        "meta",
        "peers",
        "transfer",
        "decode_engine_id",
    }
)


@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([CLIENT, PREFILL, DECODE, b"stranger"]),
            st.sampled_from([m.value for m in ctl.Msg]),
            st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=6),
            st.floats(min_value=0, max_value=100),
        ),
        max_size=12,
    )
)
def test_arbitrary_messages_never_raise_out_of_the_coordinator(
    steps: list[tuple[bytes, str, dict[str, Any], float]],
) -> None:
    state = _registered()
    state.engine_timeout_s = 30.0
    for identity, kind, fields, now in steps:
        try:
            msg = _raw(type=kind, **fields)
        except DisaggError:
            continue  # refused by ctl.decode_message (missing field): the server counts it
        state.handle(identity, msg, now)
        state.poll(now)
    assert all(type(r) is int for r in state.requests)
    # Still serving: a good request gets an answer (PREFILL, or FAILED if engines were lost).
    good = _raw(type="SUBMIT", request_id=2**40, prompt=[1], max_new_tokens=1)
    assert [o.kind for o in state.handle(CLIENT, good, 200)] in (
        [ctl.Msg.PREFILL],
        [ctl.Msg.FAILED],
    )


@given(frames=st.lists(st.one_of(st.binary(max_size=40), _value.map(msgpack.packb)), max_size=8))
def test_an_engine_link_drops_undecodable_frames_and_reads_the_next_good_one(
    frames: list[bytes],
) -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    link = ctl.EngineLink(
        router.getsockopt_string(zmq.LAST_ENDPOINT), "d0", "decode", incarnation=1, insecure=True
    )
    try:
        link.send(ctl.Msg.HEARTBEAT, engine_id="d0", incarnation=1)
        identity, _ = router.recv_multipart()
        for f in frames:
            router.send_multipart([identity, f])
        router.send_multipart([identity, ctl.encode_message(ctl.Msg.ABORT, request_id=3, epoch=1)])
        got: list[dict[str, Any]] = []
        for _ in range(100):
            got += link.poll(100)
            if any(m["type"] is ctl.Msg.ABORT and m.get("request_id") == 3 for m in got):
                break
        assert any(m["type"] is ctl.Msg.ABORT and m.get("request_id") == 3 for m in got)
    finally:
        link.close()
        router.close(0)


@pytest.mark.parametrize("prompt", [[], [1, 256], [-1], ["a"], [1.5], [True], 7, [None]])
def test_the_reference_engine_refuses_a_bad_prompt_with_a_typed_error(prompt: Any) -> None:
    # Before: a plain ValueError / TypeError, which the demo's prefill loop did not catch.
    engine = ReferenceEngine(ModelConfig(), EngineConfig(num_blocks=16, num_ssm_slots=2))
    with pytest.raises(ArgumentError) as info:
        engine.add_request(1, prompt, 2)
    assert info.value.field == "prompt" and not engine.has_work


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: BlockPool(2**31, 16), "num_blocks"),
        (lambda: SlotPool(2**31), "num_ssm_slots"),
        (lambda: ImportLedger(2**31, 16), "num_blocks"),
        (lambda: ImportLedger(8, 16, 2**31), "num_ssm_slots"),
        (lambda: PinLedger(8, 16, 2**31), "num_ssm_slots"),
    ],
)
def test_a_pool_past_its_cap_is_a_typed_error_not_an_allocation_abort(
    make: Any, field: str
) -> None:
    # Before: BlockPool(2**31, 16) aborted the process ("memory allocation of 34359738368
    # bytes failed").
    with pytest.raises(ArgumentError) as info:
        make()
    assert info.value.field == field


def test_two_sided_tags_of_ids_2_to_the_29_apart_no_longer_alias() -> None:
    # Before: _tag(0, "kv") == _tag(2**29, "kv"): one request's receive could match another's.
    assert _tag(0, "kv") == 0
    with pytest.raises(ArgumentError) as info:
        _tag(2**29, "kv")
    assert info.value.field == "request_id"
    with pytest.raises(ArgumentError):
        _tag(-1, "conv")


@given(
    a=st.tuples(
        st.integers(0, MAX_TWO_SIDED_REQUEST_ID), st.sampled_from(["kv", "conv", "recurrent"])
    ),
    b=st.tuples(
        st.integers(0, MAX_TWO_SIDED_REQUEST_ID), st.sampled_from(["kv", "conv", "recurrent"])
    ),
)
def test_two_sided_tags_are_distinct_for_distinct_requests_and_kinds(
    a: tuple[int, str], b: tuple[int, str]
) -> None:
    ta, tb = _tag(*a), _tag(*b)
    assert 0 <= ta < 2**31 and 0 <= tb < 2**31
    assert (ta == tb) == (a == b)
