"""Control-plane messages: types, the wire encoding, limits."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgpack

from disagg_rs.exceptions import ArgumentError, MetadataError

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
