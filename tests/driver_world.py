"""Two reference engines (a prefill and a decode, real NIXL over UCX loopback, in one
process), each served by a :class:`~disagg_rs.driver.HandoffDriver` through a
:class:`~disagg_rs.driver.LoopbackCoordinator`, on one virtual clock: the world the driver
and parse-count tests run requests through."""

from __future__ import annotations

import os
from typing import Any

from disagg_rs.control import CoordinatorState, Msg
from disagg_rs.driver import HandoffDriver, LoopbackCoordinator
from disagg_rs.reference import EngineConfig, hybrid_model
from disagg_rs.reference.handoff import HandoffReferenceEngine

os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

MODEL = hybrid_model()
PROMPTS = {
    0: list(b"Disaggregated prefill then decode."),
    1: list(b"A second, longer prompt goes here!"),
    2: list(b"Short."),
}
MAX_NEW = 4
STEP_NS = 1_000_000


class World:
    """Two engines, their drivers, a loopback coordinator and one client, on one clock."""

    def __init__(self, **backend_kwargs: Any) -> None:
        self.now_ns = 1_000_000_000
        self.hub = LoopbackCoordinator(
            CoordinatorState(request_timeout_s=600.0), clock=lambda: self.now_ns / 1e9
        )
        self.engines: dict[str, Any] = {}
        self.drivers: dict[str, HandoffDriver] = {}
        for rank, role in enumerate(("prefill", "decode")):
            eng = HandoffReferenceEngine(
                MODEL, EngineConfig(role=role, ranks=(rank,), num_blocks=32, num_ssm_slots=4)
            )
            eng.handoff_now_ns = self.now_ns
            eng.setup_kv_transfer(role, "nixl", **{"staging_bytes": 8 << 20, **backend_kwargs})
            self.engines[role] = eng
            self.drivers[role] = HandoffDriver(eng, self.hub.link(role, role), shutdown_grace_s=5.0)
        self.client = self.hub.client()
        self.events: list[dict[str, Any]] = []

    def turn(self) -> None:
        self.now_ns += STEP_NS
        for d in self.drivers.values():
            for msg in d.receive():
                d.on_message(msg)
            d.tick(self.now_ns)
        self.hub.pump()
        self.events += self.client.events()

    def run(self, until: Any, turns: int = 5_000) -> None:
        for _ in range(turns):
            if until():
                return
            self.turn()
        raise AssertionError(f"not done after {turns} turns; events {self.events}")

    def close(self) -> dict[str, dict[str, Any]]:
        for d in self.drivers.values():
            d.on_message({"type": Msg.SHUTDOWN})
        self.run(lambda: not any(d.running for d in self.drivers.values()))
        reports = {role: d.drain() for role, d in self.drivers.items()}
        for e in self.engines.values():
            e.close_kv_transfer()
        return reports


def done(events: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The tokens of every finished request, by request id."""
    return {int(e["request_id"]): list(e["tokens"]) for e in events if e["type"] is Msg.DONE}
