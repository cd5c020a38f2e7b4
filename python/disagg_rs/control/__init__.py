"""Control plane: a coordinator and its clients over ZeroMQ (loopback by default).

Engines register once with their static transfer metadata and an incarnation epoch (a restarted
engine registers a new incarnation, and peers replace the stale one). Per request only a small
ticket travels. Message flow of one request::

    client  --SUBMIT-->                  coordinator --PREFILL--> prefill engine
    prefill --PREFILL_DONE(ticket)-->    coordinator --SUBMIT_REQUEST_WITH_KV--> decode engine
    decode  --KV_RECV_POSTED-->          coordinator --SEND_KV--> prefill        (push transports)
    decode  --KV_IMPORTED-->             coordinator --RELEASE_KV--> prefill
    decode  --TOKENS / DONE / FAILED-->  coordinator --TOKENS / DONE / FAILED--> client

The routing logic is sans-IO (:class:`CoordinatorState`: messages and the caller's ``now`` in,
addressed messages out), so tests drive it with a virtual clock; :class:`CoordinatorServer` is
the thin ZeroMQ loop around it. Every request carries an attempt ``epoch``: a message for a
finished request or an old epoch is ignored and counted, never applied. Every request has a
deadline; when it passes the client gets ``FAILED`` and the engines ``ABORT``.

Lease safety: a prefill's pinned blocks are the source of the decode's reads, so RELEASE_KV
goes out only once the decode is known not to read them any more: it reported the import done
(``KV_IMPORTED ok``, ``DONE``), reported a failure with its reads quiet (``quiet: true``), or
was never sent the ticket. Otherwise (the decode is lost, fenced, restarted, past the deadline,
or its reads may still be running) the prefill keeps the pin until its lease ends, and the
decode, which knows that end from the ticket, never starts, completes or admits the import
after it.
"""

from __future__ import annotations

from disagg_rs.control.coordinator import CoordinatorState, Outgoing
from disagg_rs.control.keys import ControlPlaneKeys, CurveKeys
from disagg_rs.control.link import ControlClient, EngineLink
from disagg_rs.control.messages import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    PROTOCOL_VERSION,
    Msg,
    check_fields,
    check_timeout,
    decode_message,
    encode_message,
)
from disagg_rs.control.server import CoordinatorServer

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_TOKENS",
    "PROTOCOL_VERSION",
    "ControlClient",
    "ControlPlaneKeys",
    "CoordinatorServer",
    "CoordinatorState",
    "CurveKeys",
    "EngineLink",
    "Msg",
    "Outgoing",
    "check_fields",
    "check_timeout",
    "decode_message",
    "encode_message",
]
