"""Soak: many handoffs through the reference engine with faults injected at every stage.

One process holds a prefill and a decode
:class:`~disagg_rs.reference.handoff.HandoffReferenceEngine` (hybrid attention + Mamba
model) whose state moves over real NIXL (UCX on loopback). Each engine is served by the same
:class:`~disagg_rs.driver.HandoffDriver` as the demo's engines, through an in-process
coordinator (:class:`~disagg_rs.driver.LoopbackCoordinator`), and a client submits the
prompts. Each handoff draws one fault (or none) from :data:`FAULTS`; the soak checks at the
end:

- every request reached exactly one outcome (completed or failed);
- every completed answer equals the colocated run of its prompt (``wrong`` must be 0);
- every block, SSM slot and pin is back in its pool (``leaked`` must be 0), and every
  quarantined import drained;
- with ``verify_integrity`` (``--verify-integrity``), handoffs may also draw
  ``corrupt_transfer`` (:data:`INTEGRITY_FAULTS`: a byte of a destination block flips as the
  read completes), and every one of them must fail the integrity check (``undetected`` must
  be 0).

Faults are injected by wrapping the decode engine's transport backends
(:class:`FaultInjectingBackend`) and into the messages the drivers receive (aborts, bad
tickets, duplicated and late messages); the library itself carries no fault hooks. Time to
first token (TTFT) is measured from the client's submit to its first streamed token.

Run it with ``make soak`` (2,000 handoffs) or ``python -m disagg_rs.tools.soak --handoffs N``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from disagg_rs.exceptions import DisaggError, TransferError, TransferTimeout

__all__ = [
    "FAULTS",
    "INTEGRITY_FAULTS",
    "FaultInjectingBackend",
    "SoakOptions",
    "SoakReport",
    "main",
    "run_soak",
    "track_posting_request",
]

#: The faults a handoff can draw; ``none`` is a clean handoff.
FAULTS = (
    "none",
    "start_raises",  # the SSM start throws after the KV pull was posted (partial submission)
    "transfer_error",  # the transport reports an error once every part is terminal
    "transfer_timeout",  # the handle times out (may still write), settles a few polls later
    "abort_deferred",  # abort while waiting for capacity
    "abort_importing",  # abort while the pull runs
    "abort_ready",  # abort after the transfer, before admission
    "bad_ticket",  # the ticket reaches the decode without its prefill metadata
    "duplicate_submit",  # the decode receives the same ticket message twice
    "duplicate_release",  # RELEASE_KV twice, plus one for an unknown id
    "late_report",  # the ticket message arrives again after the request ended
)
#: Faults drawn only with ``verify_integrity``: without the digest nothing could notice them.
INTEGRITY_FAULTS = (
    "corrupt_transfer",  # one byte of a destination block flips as the KV read completes
)


class _FaultyHandle:
    """A real transfer handle whose outcome is overridden once the real transfer settled."""

    def __init__(self, inner: Any, fault: str, settle_polls: int, corrupt: Any = None) -> None:
        self._inner = inner
        self._fault = fault
        self._left = settle_polls
        self._corrupt = corrupt  # called once when the real transfer completes

    @property
    def stats(self) -> dict[str, Any]:
        """The real handle's statistics."""
        return dict(self._inner.stats)

    @property
    def done(self) -> bool:
        """Whether the (overridden) handle is terminal: never before the real one is."""
        return bool(self._inner.done) and (self._fault != "transfer_timeout" or self._left <= 0)

    def poll(self) -> bool:
        """Advance the real handle, then report the injected outcome."""
        if not self._inner.poll():
            return False
        if self._corrupt is not None:
            self._corrupt, corrupt = None, self._corrupt
            corrupt()
        if self._fault == "corrupt_transfer":
            return True
        if self._fault == "transfer_error":
            raise TransferError("injected transfer error (every part terminal)")
        if self._left > 0:
            self._left -= 1
            raise TransferTimeout("injected timeout; the destinations may still be written")
        return True


class FaultInjectingBackend:
    """Wraps a transport backend; the next pull of an armed request fails as told."""

    def __init__(self, inner: Any, kind: str) -> None:
        self._inner = inner
        self.kind = kind
        #: request id -> fault, set by the driver before the request's transfers start.
        self.faults: dict[int, str] = {}
        #: The request whose transfers are being posted now (set by the decode engine).
        self.current: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def begin_pull_blocks(self, *args: Any, **kwargs: Any) -> Any:
        """Post the real pull, then apply this request's fault to it."""
        fault = self.faults.get(self.current if self.current is not None else -1, "none")
        if fault == "start_raises" and self.kind != "kv":
            raise TransferError(f"injected: {self.kind} transfer start threw")
        handle = self._inner.begin_pull_blocks(*args, **kwargs)
        if fault in ("transfer_error", "transfer_timeout") and self.kind == "kv":
            return _FaultyHandle(handle, fault, settle_polls=3)
        if fault == "corrupt_transfer" and self.kind == "kv":
            dst = int(next(iter(args[2] if len(args) > 2 else kwargs["dst_block_ids"])))
            return _FaultyHandle(handle, fault, 0, corrupt=lambda: self._flip_a_byte(dst))
        return handle

    def _flip_a_byte(self, block: int) -> None:
        """Flip one bit of the first K element of destination ``block`` (layer 0, token 0,
        head 0): inside the request's state, as a faulty link would."""
        import torch

        buf = self._inner.memory_buffer  # [2, layers, blocks, ...] (Megatron layout)
        cell = buf[0, 0, block].reshape(-1)[:1].view(torch.uint8)
        cell[0] ^= 0x10


def track_posting_request(engine: Any, backends: list[FaultInjectingBackend]) -> None:
    """Tell ``backends`` which request's transfers ``engine`` (a decode using them) is
    posting, so that faults armed per request hit the right pulls."""
    start = engine._start_import

    def start_import(action: Any) -> None:
        for b in backends:
            b.current = action.request_id
        start(action)

    engine._start_import = start_import


@dataclass
class SoakOptions:
    """What the soak runs."""

    handoffs: int = 2000
    fault_rate: float = 0.3
    seed: int = 0
    max_new_tokens: int = 3
    max_in_flight: int = 6
    num_blocks: int = 24
    distinct_prompts: int = 8
    verify_integrity: bool = False
    """Digest on prefill, verify on decode, and draw :data:`INTEGRITY_FAULTS` too."""
    lease_s: float = 3.0
    """Prefill pin lease: how long the blocks of an import that failed with its reads possibly
    still running stay pinned."""


@dataclass
class SoakReport:
    """Counts and latencies of one soak; ``ok`` when nothing leaked and no answer is wrong."""

    handoffs: int = 0
    completed: int = 0
    failed: int = 0
    quarantined_then_drained: int = 0
    leaked: int = 0
    wrong: int = 0
    unresolved: int = 0
    integrity_failures: int = 0
    """Imports the decode refused because the digest did not match."""
    undetected: int = 0
    """``corrupt_transfer`` handoffs that were admitted anyway (must be 0)."""
    false_alarms: int = 0
    """Integrity failures of handoffs nothing corrupted (must be 0)."""
    ttft_ms: list[float] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    #: Aborts that found their request in the drawn stage (the others ended first).
    aborts_hit: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every request has one outcome, nothing leaked, every answer is right."""
        return (
            self.leaked == 0
            and self.wrong == 0
            and self.unresolved == 0
            and not self.undetected
            and not self.false_alarms
        )

    def percentile(self, p: int) -> float:
        """The ``p``-th percentile of TTFT in ms (nearest rank; 0 when nothing completed)."""
        values = sorted(self.ttft_ms)
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, round(p / 100 * len(values)) - 1))]

    def format(self) -> str:
        """Human-readable summary."""
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return "\n".join(
            [
                f"soak: {self.handoffs} handoffs in {self.elapsed_s:.1f} s",
                f"  completed                  {self.completed}",
                f"  failed                     {self.failed}",
                f"  quarantined-then-drained   {self.quarantined_then_drained}",
                f"  leaked                     {self.leaked}",
                f"  wrong answers              {self.wrong}",
                f"  integrity failures         {self.integrity_failures} "
                f"({self.undetected} corruptions undetected, {self.false_alarms} false alarms)",
                f"  unresolved                 {self.unresolved}",
                f"  TTFT p50 / p99             {self.percentile(50):.2f} / "
                f"{self.percentile(99):.2f} ms",
                f"  faults injected            {faults}",
                "  aborts that hit the stage  "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.aborts_hit.items())),
            ]
        )


def _engines(opts: SoakOptions) -> tuple[Any, Any, Any]:
    from disagg_rs.reference import EngineConfig, ModelConfig, ReferenceEngine
    from disagg_rs.reference.handoff import HandoffReferenceEngine

    model = ModelConfig()
    common = {"num_blocks": opts.num_blocks, "num_ssm_slots": opts.max_in_flight + 2}
    pre = HandoffReferenceEngine(model, EngineConfig(role="prefill", **common))  # type: ignore[arg-type]
    dec = HandoffReferenceEngine(model, EngineConfig(role="decode", max_batch=4, **common))  # type: ignore[arg-type]
    colocated = ReferenceEngine(model, EngineConfig(num_blocks=256))
    return pre, dec, colocated


def run_soak(opts: SoakOptions) -> SoakReport:
    """Run ``opts.handoffs`` handoffs with injected faults and return the report.

    Both engines are served by :class:`~disagg_rs.driver.HandoffDriver` through a
    :class:`~disagg_rs.driver.LoopbackCoordinator` (the coordinator's routing, in this process),
    and a client submits the prompts: the same loop as the demo's engines. Faults the driver
    must absorb (duplicated, late and malformed messages, bad tickets, aborts) are injected
    into the messages it receives; transport faults by wrapping the decode's backends."""
    import torch

    if not torch.cuda.is_available():  # with GPUs present NIXL needs UCX's CUDA transports
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from disagg_rs.control import CoordinatorState, Msg
    from disagg_rs.driver import HandoffDriver, LoopbackCoordinator
    from disagg_rs.reference.engine import encode_text

    rng = random.Random(opts.seed)
    pre, dec, colocated = _engines(opts)
    words = ["prefill", "decode", "handoff", "block", "slot", "lease", "quorum", "epoch", "drain"]
    prompts = [
        encode_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        for _ in range(opts.distinct_prompts)
    ]
    expected = colocated.generate(dict(enumerate(prompts)), opts.max_new_tokens)
    pre.handoff_now_ns = dec.handoff_now_ns = time.monotonic_ns()
    pre.setup_kv_transfer("prefill", "nixl", mode="direct")
    dec.setup_kv_transfer("decode", "nixl", mode="direct")
    pre.verify_integrity = dec.verify_integrity = opts.verify_integrity
    # A failed import whose reads may still run leaves the prefill's pins to their lease.
    pre.handoff_lease_ns = int(opts.lease_s * 1e9)
    faults = FAULTS[1:] + (INTEGRITY_FAULTS if opts.verify_integrity else ())
    backends = {"kv": FaultInjectingBackend(dec.kv_transfer_backend, "kv")}
    dec.kv_transfer_backend = backends["kv"]
    for kind, b in list(dec.ssm_transfer_backends.items()):
        backends[kind] = dec.ssm_transfer_backends[kind] = FaultInjectingBackend(b, kind)
    track_posting_request(dec, list(backends.values()))

    hub = LoopbackCoordinator(CoordinatorState(request_timeout_s=3600.0))
    drivers = {
        role: HandoffDriver(eng, hub.link(role, role), shutdown_grace_s=30.0)
        for role, eng in (("prefill", pre), ("decode", dec))
    }
    client = hub.client()
    report = SoakReport(handoffs=opts.handoffs)
    fault_of: dict[int, str] = {}
    prompt_of: dict[int, int] = {}
    started_at: dict[int, float] = {}
    outcome: dict[int, str] = {}
    aborts: dict[int, str] = {}  # request id -> the stage to abort it in
    replay: dict[int, dict[str, Any]] = {}  # late_report: the ticket message, replayed later
    next_rid = 0
    t0 = time.perf_counter()

    def finish(rid: int, result: str) -> None:
        if rid in outcome:
            raise DisaggError(f"request {rid} reached a second outcome {result!r}")
        outcome[rid] = result

    def faulty(role: str, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The driver's messages with this turn's message faults applied."""
        out: list[dict[str, Any]] = []
        for m in msgs:
            rid, kind = m.get("request_id"), m["type"]
            out.append(m)
            if not isinstance(rid, int):
                continue
            fault = fault_of.get(rid, "none")
            if kind is Msg.SUBMIT_REQUEST_WITH_KV and fault == "bad_ticket":
                m["ticket"].pop("prefill_meta", None)
            if kind is Msg.SUBMIT_REQUEST_WITH_KV and fault == "duplicate_submit":
                out.append(m)
            if kind is Msg.SUBMIT_REQUEST_WITH_KV and fault == "late_report":
                replay[rid] = m
            if kind is Msg.RELEASE_KV and fault == "duplicate_release":
                out += [m, {**m, "request_id": 10**9 + rid}]
        if role == "decode":
            for rid, stage in list(aborts.items()):
                if rid in outcome:
                    del aborts[rid]  # ended before reaching its stage: a clean handoff
                elif dec.import_ledger.state_of(rid) == stage:
                    del aborts[rid]
                    report.aborts_hit[stage] += 1
                    out.append({"type": Msg.ABORT, "request_id": rid, "epoch": 0})
        return out

    while len(outcome) < opts.handoffs and time.perf_counter() - t0 < 600:
        in_flight = next_rid - len(outcome)
        while next_rid < opts.handoffs and in_flight < opts.max_in_flight:
            rid, next_rid, in_flight = next_rid, next_rid + 1, in_flight + 1
            fault = rng.choice(faults) if rng.random() < opts.fault_rate else "none"
            fault_of[rid], prompt_of[rid] = fault, rng.randrange(opts.distinct_prompts)
            report.faults[fault] += 1
            if fault.startswith("abort_"):
                aborts[rid] = fault.removeprefix("abort_")
            for b in backends.values():
                b.faults[rid] = fault
            started_at[rid] = time.perf_counter()
            client.submit(rid, prompts[prompt_of[rid]], opts.max_new_tokens)
        now = time.monotonic_ns()
        for role, driver in drivers.items():
            for m in faulty(role, driver.receive()):
                driver.on_message(m)
            driver.tick(now)
        hub.pump()
        for ev in client.events():
            rid = int(ev["request_id"])
            if ev["type"] is Msg.TOKENS and rid not in outcome and rid in started_at:
                report.ttft_ms.append((time.perf_counter() - started_at.pop(rid)) * 1e3)
            elif ev["type"] is Msg.FAILED:
                why = str(ev.get("error", ""))
                if "integrity" in why and fault_of[rid] != "corrupt_transfer":
                    report.false_alarms += 1
                finish(rid, "failed")
            elif ev["type"] is Msg.DONE:
                if fault_of[rid] == "corrupt_transfer":
                    report.undetected += 1
                finish(rid, "completed")
                if list(ev["tokens"]) != expected[prompt_of[rid]]:
                    report.wrong += 1
        for rid in [r for r in replay if r in outcome]:
            drivers["decode"].on_message(replay.pop(rid))  # a late duplicate: dropped

    # Let every quarantined import drain and every pin go: SHUTDOWN, serve until idle.
    for driver in drivers.values():
        driver.on_message({"type": Msg.SHUTDOWN})
    while any(d.running for d in drivers.values()):
        now = time.monotonic_ns()
        for driver in drivers.values():
            driver.tick(now)
    report.elapsed_s = time.perf_counter() - t0
    counts = Counter(outcome.values())
    report.completed, report.failed = counts["completed"], counts["failed"]
    report.integrity_failures = int(dec.handoff_stats.get("integrity_failures", 0))
    report.unresolved = opts.handoffs - len(outcome)
    ledger_counts = dec.import_ledger.counters()
    report.quarantined_then_drained = int(ledger_counts["quarantined"])
    drained = int(ledger_counts["drained_settled"]) + int(ledger_counts["drained_horizon"])
    finals = {role: d.drain() for role, d in drivers.items()}  # raises on a conservation bug
    report.leaked = (
        sum(
            int(r["leaked_blocks"]) + int(r["pinned"]) + int(r["quarantined"])
            for r in finals.values()
        )
        + (dec.ssm_slot_pool.num_slots - dec.ssm_slot_pool.num_free)
        + (pre.ssm_slot_pool.num_slots - pre.ssm_slot_pool.num_free)
        + (report.quarantined_then_drained - drained)
    )
    dec.close_kv_transfer()
    pre.close_kv_transfer()
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m disagg_rs.tools.soak``: run the soak, print the report, exit 1 unless ok."""
    p = argparse.ArgumentParser(prog="disagg-rs-soak", description=__doc__.splitlines()[0])
    p.add_argument("--handoffs", type=int, default=2000)
    p.add_argument("--fault-rate", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify-integrity",
        action="store_true",
        help="digest and verify every handoff; also inject corrupted transfers",
    )
    args = p.parse_args(argv)
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("disagg_rs.handoff").setLevel(logging.ERROR)  # injected faults are expected
    report = run_soak(
        SoakOptions(
            handoffs=args.handoffs,
            fault_rate=args.fault_rate,
            seed=args.seed,
            verify_integrity=args.verify_integrity,
        )
    )
    sys.stdout.write(report.format() + "\n")
    sys.stdout.write(("OK" if report.ok else "FAILED") + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
