"""CURVE keys of the control plane (ZeroMQ's public-key encryption and authentication).

The coordinator has a key pair; every engine has its own, and the coordinator is given the
allow-list ``{engine_id: engine public key}``: a connection whose key is not on the list is
refused during the handshake, and an engine id is bound to its key (a message that claims an
engine id with another key is dropped and counted).

Keys are required by default: :class:`~disagg_rs.control.CoordinatorServer`,
:class:`~disagg_rs.control.EngineLink` and :class:`~disagg_rs.control.ControlClient` refuse to
start without them unless the operator opts in to plain TCP with ``insecure=True``, which logs
one warning (any process that reaches the port is then trusted).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zmq

from disagg_rs._core import curve_mode

logger = logging.getLogger("disagg_rs.control")


@dataclass(frozen=True)
class CurveKeys:
    """One CURVE key pair (Z85 text, as ZeroMQ takes it)."""

    public: bytes
    secret: bytes


def generate() -> CurveKeys:
    """A fresh key pair."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret)


@dataclass(frozen=True)
class ControlPlaneKeys:
    """Every key pair of one control plane: the coordinator's, one per engine id, and one
    shared by the clients (what a deployment, or the demo per run, generates)."""

    coordinator: CurveKeys
    engines: dict[str, CurveKeys]
    client: CurveKeys

    @classmethod
    def generate(cls, engine_ids: Iterable[str]) -> ControlPlaneKeys:
        """Fresh keys for the coordinator, the clients and each of ``engine_ids``."""
        return cls(generate(), {e: generate() for e in engine_ids}, generate())

    def engine_public_keys(self) -> dict[str, bytes]:
        """The coordinator's allow-list: engine id -> public key."""
        return {e: k.public for e, k in self.engines.items()}

    def server_args(self) -> dict[str, Any]:
        """The key arguments of :class:`~disagg_rs.control.CoordinatorServer`."""
        clients = [self.client.public]
        return {
            "keys": self.coordinator,
            "engine_keys": self.engine_public_keys(),
            "client_keys": clients,
        }

    def engine_args(self, engine_id: str) -> dict[str, Any]:
        """The key arguments of :class:`~disagg_rs.control.EngineLink` for ``engine_id``."""
        return {"keys": self.engines[engine_id], "server_key": self.coordinator.public}

    def client_args(self) -> dict[str, Any]:
        """The key arguments of :class:`~disagg_rs.control.ControlClient`."""
        return {"keys": self.client, "server_key": self.coordinator.public}


INSECURE: dict[str, Any] = {"insecure": True}
"""The arguments that run any end of the control plane as plain TCP (logs a warning)."""


def use_curve(keys: object, peer_key: object, insecure: bool, what: str, where: str) -> bool:
    """Whether ``what`` (at ``where``) runs CURVE: it must have its keys (``keys`` and, for a
    client end, ``peer_key``), or plain TCP must be asked for with ``insecure=True`` (one
    warning is logged). Neither, or both, raise :class:`ArgumentError` naming ``keys``."""
    have = keys is not None and peer_key is not None
    curve = curve_mode(what, have, insecure)  # refuses neither and both, in Rust
    if insecure:
        logger.warning(
            "%s on %s runs plain TCP without CURVE keys: any process that reaches it is trusted",
            what,
            where,
        )
    return curve


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
