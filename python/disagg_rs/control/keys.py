"""CURVE keys of the control plane (ZeroMQ's public-key encryption and authentication).

The coordinator has a key pair; every engine has its own, and the coordinator is given the
allow-list ``{engine_id: engine public key}``: a connection whose key is not on the list is
refused during the handshake, and an engine id is bound to its key (a message that claims an
engine id with another key is dropped and counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class CurveKeys:
    """One CURVE key pair (Z85 text, as ZeroMQ takes it)."""

    public: bytes
    secret: bytes


def generate() -> CurveKeys:
    """A fresh key pair."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret)


def serve_with(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server with ``keys`` (before bind)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def connect_with(sock: zmq.Socket[bytes], keys: CurveKeys, server_public: bytes) -> None:
    """Make ``sock`` a CURVE client with ``keys`` that trusts ``server_public`` (before connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public
