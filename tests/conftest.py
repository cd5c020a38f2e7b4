"""Shared test configuration: hypothesis profiles chosen by DISAGG_HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch
import zmq
from hypothesis import HealthCheck, settings

from disagg_rs.control import CoordinatorServer

# NIXL/UCX in tests talk over loopback only (shared memory and TCP). On a GPU machine UCX must
# keep its CUDA transports (NIXL refuses a UCX_TLS without them when GPUs are present), so the
# restriction applies to CPU-only machines; spawned workers inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# "ci": what `make test` runs (>= 200 examples per property, no deadline: CI machines are slow
# and timing is never asserted). "dev": quick local iteration. "soak": long runs by hand.
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "soak", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("DISAGG_HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def served() -> Iterator[tuple[CoordinatorServer, threading.Thread]]:
    """A coordinator serving on its own thread (plain TCP on loopback), and that thread;
    stopped, joined and closed after the test."""
    server = CoordinatorServer(insecure=True)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server, thread
    finally:
        server.stop()
        thread.join(5)
        server.close()


@pytest.fixture
def raw_dealer(served: tuple[CoordinatorServer, threading.Thread]) -> Iterator[zmq.Socket[bytes]]:
    """A bare DEALER socket connected to the served coordinator: frames go out unchecked."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served[0].endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
