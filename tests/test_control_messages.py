"""Control messages are decoded and checked in Rust: one schema per type, the bad field named;
the coordinator owns the provenance of the tickets it forwards."""

from __future__ import annotations

import math
import threading
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs.control import (
    PROTOCOL_VERSION,
    CoordinatorServer,
    CoordinatorState,
    Msg,
    check_fields,
    decode_message,
    encode_message,
)
from disagg_rs.exceptions import MetadataError

PREFILL = b"prefill:p0:1"
DECODE = b"decode:d0:1"
CLIENT = b"client"


def _frame(**fields: Any) -> bytes:
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def _submit(**over: Any) -> bytes:
    fields: dict[str, Any] = {
        "type": "SUBMIT",
        "v": PROTOCOL_VERSION,
        "request_id": 7,
        "prompt": [1, 2],
        "max_new_tokens": 4,
    }
    fields.update(over)
    return _frame(**fields)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_id", -1),
        ("request_id", (1 << 64) - 1),
        ("request_id", True),
        ("request_id", "7"),
        ("prompt", []),
        ("prompt", [1, -2]),
        ("prompt", [1.0]),
        ("prompt", "12"),
        ("max_new_tokens", 0),
        ("max_new_tokens", (1 << 20) + 1),
        ("timeout_s", math.nan),
        ("timeout_s", math.inf),
        ("timeout_s", -1.0),
        ("timeout_s", 0),
        ("timeout_s", 86_401),
        ("timeout_s", None),
        ("v", 1),
        ("type", "NOT_A_TYPE"),
        ("type", 3),
    ],
)
def test_a_bad_submit_field_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(MetadataError) as e:
        decode_message(_submit(**{field: value}))
    assert e.value.field == field


def test_a_missing_required_field_is_named() -> None:
    frame = _frame(type="KV_IMPORTED", v=PROTOCOL_VERSION, request_id=1, epoch=2)
    with pytest.raises(MetadataError) as e:
        decode_message(frame)
    assert e.value.field == "ok"


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x01",
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items in 5 bytes
        b"\xdf\xff\xff\xff\xff\x01",
        b"\x91" * 40,  # nested past the depth cap
        b"\x81\x90\x01",  # an unhashable key
        b"\x81\x91\x01\x01",  # a key that is a list of ints
        b"\x81\xa1t\x81\x91\x01\x02",  # the same, in a nested map (a ticket)
        b"\xa1\xff",  # not UTF-8
        _submit() + b"\x00",  # trailing bytes
    ],
)
def test_an_undecodable_frame_is_a_frame_error(frame: bytes) -> None:
    with pytest.raises(MetadataError) as e:
        decode_message(frame)
    assert e.value.field == "<frame>"


def test_a_valid_message_decodes_to_its_fields_with_the_type_as_msg() -> None:
    msg = decode_message(encode_message(Msg.SUBMIT, request_id=3, prompt=[9], max_new_tokens=2))
    assert msg == {
        "type": Msg.SUBMIT,
        "v": PROTOCOL_VERSION,
        "request_id": 3,
        "prompt": [9],
        "max_new_tokens": 2,
    }


def test_engine_bound_types_are_refused_by_the_coordinator_check_only() -> None:
    msg = decode_message(encode_message(Msg.ABORT, request_id=1, epoch=1))
    with pytest.raises(MetadataError) as e:
        check_fields(msg)
    assert e.value.field == "type"


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["type", "request_id", "epoch", "prompt", "ticket", "ok", "error"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(),
            st.text(max_size=5),
            st.sampled_from([m.value for m in Msg] + list(Msg)),
            st.lists(st.integers(), max_size=3),
            st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        ),
    )
)
def test_the_coordinator_never_raises_on_any_dict_and_counts_refusals(msg: dict[str, Any]) -> None:
    state = CoordinatorState()
    try:
        check_fields(msg)
        valid = True
    except Exception:
        valid = False
    state.handle(CLIENT, msg, 0.0)  # must not raise
    if not valid:
        assert sum(state.malformed.values()) == 1
        assert state.requests == {}


def test_the_coordinator_overwrites_the_provenance_of_a_forwarded_ticket() -> None:
    state = CoordinatorState()
    for ident, eid, role in ((PREFILL, "p0", "prefill"), (DECODE, "d0", "decode")):
        reg = encode_message(Msg.REGISTER, engine_id=eid, role=role, incarnation=5, meta={})
        state.handle(ident, decode_message(reg), 0)
    out = state.handle(
        CLIENT,
        decode_message(encode_message(Msg.SUBMIT, request_id=1, prompt=[1], max_new_tokens=1)),
        0,
    )
    epoch = out[0].fields["epoch"]
    forged = {"prefill_engine_id": "d0", "prefill_incarnation": 99, "epoch": epoch + 7, "x": 1}
    done = encode_message(Msg.PREFILL_DONE, request_id=1, epoch=epoch, ticket=forged)
    out = state.handle(PREFILL, decode_message(done), 1)
    (fwd,) = [o for o in out if o.kind is Msg.SUBMIT_REQUEST_WITH_KV]
    ticket = fwd.fields["ticket"]
    assert (ticket["prefill_engine_id"], ticket["prefill_incarnation"], ticket["epoch"]) == (
        "p0",
        5,
        epoch,
    )
    assert ticket["x"] == 1


def test_the_real_server_answers_a_submit_refused_at_decode_with_failed_naming_the_field(
    served: tuple[CoordinatorServer, threading.Thread], raw_dealer: zmq.Socket[bytes]
) -> None:
    raw_dealer.send(_submit(request_id=11, prompt=[]))
    assert raw_dealer.poll(60_000)
    event = decode_message(raw_dealer.recv())
    assert event["type"] is Msg.FAILED and event["request_id"] == 11
    assert "prompt" in event["error"] and served[0].malformed == 1


_PAYLOAD = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=40,
)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=300),
    ticket=st.dictionaries(st.text(max_size=12), _PAYLOAD, max_size=8),
)
def test_the_frames_the_coordinator_encodes_are_the_bytes_msgpack_writes(
    prompt: list[int], ticket: dict[str, Any]
) -> None:
    # Outgoing frames are encoded in Rust; a peer's msgpack writes the same bytes for the
    # same fields (every int, length and float in the same form), and they decode back.
    state = CoordinatorState()
    for ident, eid, role in ((PREFILL, "p0", "prefill"), (DECODE, "d0", "decode")):
        reg = encode_message(Msg.REGISTER, engine_id=eid, role=role, incarnation=5, meta={})
        state.handle(ident, decode_message(reg), 0)
    submit = encode_message(Msg.SUBMIT, request_id=1, prompt=prompt, max_new_tokens=4)
    out = state.receive(CLIENT, submit, 0.0)[1]
    epoch = out[0].fields["epoch"]
    done = encode_message(Msg.PREFILL_DONE, request_id=1, epoch=epoch, ticket=ticket)
    out += state.receive(PREFILL, done, 1.0)[1]
    assert [o.kind for o in out] == [Msg.PREFILL, Msg.SUBMIT_REQUEST_WITH_KV]
    assert out[0].fields["prompt"] == prompt
    provenance = {"prefill_engine_id", "prefill_incarnation", "epoch"}
    forwarded = out[1].fields["ticket"]
    assert {k: v for k, v in forwarded.items() if k not in provenance} == {
        k: v for k, v in ticket.items() if k not in provenance
    }
    for o in out:
        assert o.frame == encode_message(o.kind, **o.fields)
        assert decode_message(o.frame) == {"type": o.kind, "v": PROTOCOL_VERSION, **o.fields}
