"""Coverage-guided fuzzing (atheris) of every decoder that takes bytes or dicts from a peer,
of the coordinator (``CoordinatorState.handle``) and of the engine driver loop
(``HandoffDriver.on_message`` and ``tick``).

Each input is a msgpack frame. It goes to ``control.decode_message`` as is, and, when it
unpacks (to a map or any other value), to ``KVShardLayout.from_dict``, ``SSMShardLayout.from_dict``,
``KVGeometry.from_dict``, ``SSMGeometry.from_dict``, the ticket's integrity table and the
transport metadata check. A frame that decodes goes to the coordinator (from a registered
prefill and decode) and to the drivers of a prefill and a decode reference engine (state moved
by real NIXL over loopback), as the link hands it over (a ticket gets the prefill's metadata
from the peer table); the drivers then serve turns on a virtual clock, and the request is
aborted so the next input starts from idle engines. Every decoder call must either succeed or
raise a :class:`disagg_rs.exceptions.DisaggError`; the coordinator and the drivers must never
raise; anything else (another exception, a PyO3 panic, a crash) is a finding and stops the
fuzzer.

Run: ``python tests/fuzz_atheris.py -runs=20000`` (``tests/test_fuzz_atheris.py`` does, in
``make test``); add a corpus directory to keep what it learns.
"""

from __future__ import annotations

import contextlib
import os
import sys

import atheris

# Heavy dependencies (torch via the transport metadata check) are imported before the
# instrumented block: instrumenting them costs minutes and adds no coverage of our code.
import disagg_rs
from disagg_rs.exceptions import DisaggError
from disagg_rs.integrity import IntegrityTable
from disagg_rs.reference import EngineConfig, ModelConfig
from disagg_rs.transfer_backends.base import check_meta_fields

os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

with atheris.instrument_imports():
    import msgpack

    from disagg_rs import control, driver
    from disagg_rs.reference.handoff import HandoffReferenceEngine

INTEGRITY_SHAPES = IntegrityTable.shapes(disagg_rs.KVShardLayout(3, 2), None)

DECODERS = (
    lambda d: IntegrityTable.from_wire(d, INTEGRITY_SHAPES),
    disagg_rs.KVShardLayout.from_dict,
    disagg_rs.SSMShardLayout.from_dict,
    disagg_rs.KVGeometry.from_dict,
    disagg_rs.SSMGeometry.from_dict,
    lambda d: check_meta_fields(d, "nixl"),
)


def _state() -> control.CoordinatorState:
    state = control.CoordinatorState(engine_timeout_s=1e9)
    for ident, eid, role in ((b"prefill:p0:1", "p0", "prefill"), (b"decode:d0:1", "d0", "decode")):
        frame = control.encode_message(
            control.Msg.REGISTER, engine_id=eid, role=role, incarnation=1, meta={}
        )
        state.handle(ident, control.decode_message(frame), 0.0)
    return state


STATE = _state()


class _Engines:
    """A prefill and a decode reference engine (two attention layers, 16 blocks) behind
    handoff drivers without links (nothing is sent), on a virtual clock."""

    TURN_NS = 1_000_000_000

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        model = ModelConfig(layer_kinds=("attention",) * 2)
        self.pre = HandoffReferenceEngine(model, EngineConfig(role="prefill", num_blocks=16))
        self.dec = HandoffReferenceEngine(model, EngineConfig(role="decode", num_blocks=16))
        self.now = 10**12
        for e, role in ((self.pre, "prefill"), (self.dec, "decode")):
            e.handoff_now_ns = self.now
            e.setup_kv_transfer(role, "nixl", mode="direct")
        self.pre.handoff_lease_ns = self.TURN_NS  # pins end a turn later
        self.drivers = [driver.HandoffDriver(e, None) for e in (self.pre, self.dec)]

    def serve(self, msg: dict[str, object]) -> None:
        """Hand ``msg`` to both drivers, serve a few turns, abort its request, serve until
        idle: never raises."""
        ticket = msg.get("ticket")
        if msg["type"] is control.Msg.SUBMIT_REQUEST_WITH_KV and isinstance(ticket, dict):
            ticket["prefill_meta"] = self.pre.handoff_static_meta  # as the peer table gives it
        for d in self.drivers:
            if d.state.stopping:  # a SHUTDOWN: serve on with a fresh driver state
                d.state = driver.EngineDriverState()
            d.on_message(dict(msg))
        self.turns(3, step_ns=1_000_000)  # within the lease: imports may complete
        rid = msg.get("request_id")
        if type(rid) is int:
            for d in self.drivers:
                d.on_message({"type": control.Msg.ABORT, "request_id": rid, "epoch": 0})
        self.turns(50, until_idle=True)  # leases, deadlines and drain horizons pass

    def turns(self, n: int, until_idle: bool = False, step_ns: int = TURN_NS) -> None:
        for _ in range(n):
            if until_idle and not any(d.busy for d in self.drivers):
                return
            self.now += step_ns
            for d in self.drivers:
                d.tick(self.now)


ENGINES = _Engines()


def one_input(data: bytes) -> None:
    """Fuzz target: every decoder accepts or raises a typed error; the coordinator and the
    engine drivers never raise."""
    try:
        msg = control.decode_message(data)
    except DisaggError:
        msg = None
    if msg is not None:
        # A decoded frame reaches the coordinator, with engines registered so that every
        # message type finds a state to act on; handle() must never raise.
        STATE.handle(b"prefill:p0:1", dict(msg), 1.0)
        STATE.handle(b"decode:d0:1", dict(msg), 2.0)
        STATE.poll(3.0)
        ENGINES.serve(msg)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # not a frame at all: nothing more to decode
        return
    for decode in DECODERS:  # a map or anything else a peer could send
        with contextlib.suppress(DisaggError):
            decode(obj)


def main() -> None:
    """Entry point (libFuzzer flags pass through)."""
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
