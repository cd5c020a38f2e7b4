"""Control-plane messages: types, the wire encoding, limits."""

from __future__ import annotations

import enum
from typing import Any

import msgpack

from disagg_rs._core import decode_control_message, timeout_seconds
from disagg_rs.exceptions import MetadataError

PROTOCOL_VERSION = 3
"""Version 2 added HEARTBEAT and FENCED (coordinator liveness), 3 HEARTBEAT_ACK (engines' view
of the coordinator's liveness)."""

MAX_TIMEOUT_S = 86_400.0
"""Largest request timeout a SUBMIT may ask for (one day)."""


def check_timeout(value: Any, field: str = "timeout_s") -> float:
    """``value`` as a timeout in seconds: a real number in ``(0, MAX_TIMEOUT_S]``. NaN, inf,
    zero, negative, bool and non-numbers raise :class:`ArgumentError` naming ``field`` (a NaN
    deadline would never pass). Checked in Rust."""
    return timeout_seconds(value, field)


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
    HEARTBEAT_ACK = "HEARTBEAT_ACK"


MAX_PROMPT_TOKENS = 1 << 20
"""Longest prompt a SUBMIT may carry."""
MAX_NEW_TOKENS = 1 << 20
"""Largest ``max_new_tokens`` a SUBMIT may ask for."""
MAX_ID = (1 << 63) - 1
"""Largest request id, epoch or incarnation (they travel as signed 64-bit ints)."""
MAX_TEXT = 4096
"""Longest engine id or error text."""
MAX_FRAME_BYTES = 16 << 20
"""Largest control frame a socket accepts (ZeroMQ ``MAXMSGSIZE``); a peer that sends a larger
one is disconnected."""
DEFAULT_LIVENESS_TIMEOUT_S = 10.0
"""Default liveness timeout, both ways: the coordinator declares an engine lost, and an engine
declares the coordinator lost, after this long without a message from the other."""
DEFAULT_SEND_HWM = 1000
"""Default number of messages queued per peer before a send fails (the peer does not read)."""


def encode_message(kind: Msg, **fields: Any) -> bytes:
    """Pack one message (msgpack, versioned). The receiver checks it against its type's schema."""
    packed: bytes = msgpack.packb(
        {"type": kind.value, "v": PROTOCOL_VERSION, **fields}, use_bin_type=True
    )
    return packed


def decode_message(data: bytes) -> dict[str, Any]:
    """Unpack one message and check it against its type's schema (in Rust: types, ranges, size
    caps, NaN and inf refused); raises :class:`MetadataError` naming the bad field."""
    msg = decode_control_message(data)
    msg["type"] = Msg(msg["type"])
    return msg


def message_frame(msg: dict[str, Any]) -> bytes:
    """The frame of a message the coordinator accepts, given as a dict (its ``type`` must be a
    :class:`Msg`; its ``v`` is replaced by this version's); raises :class:`MetadataError` when
    it has no such type or cannot be encoded."""
    fields = dict(msg)
    kind = fields.pop("type", None)
    fields.pop("v", None)
    if not isinstance(kind, Msg):
        raise MetadataError(f"message type {kind!r:.40} is not a Msg", "type")
    try:
        return encode_message(kind, **fields)
    except (TypeError, ValueError, OverflowError) as e:  # unpackable fields
        raise MetadataError(f"message cannot be encoded: {e}", "<frame>") from None


def check_fields(msg: dict[str, Any]) -> None:
    """Check a message the coordinator accepts against its type's schema (the same check
    :func:`decode_message` makes; its ``type`` must be a :class:`Msg`); raises
    :class:`MetadataError` naming the first bad field."""
    decode_control_message(message_frame(msg), True)


def submit_frame(
    request_id: int, prompt: list[int], max_new_tokens: int, timeout_s: float | None = None
) -> bytes:
    """A client's SUBMIT frame (``timeout_s``: ``None`` for the coordinator's default)."""
    extra = {} if timeout_s is None else {"timeout_s": timeout_s}
    return encode_message(
        Msg.SUBMIT, request_id=request_id, prompt=prompt, max_new_tokens=max_new_tokens, **extra
    )
