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
  be 0);
- a decode stalled past the liveness timeout (``stall_past_liveness``) never admits a request
  the coordinator failed while it was silent (``stale_admits`` must be 0), and the prefill
  frees those requests' pinned blocks at their lease's end, not earlier (``early_releases``
  must be 0);
- every forged ticket (``forged_ticket``) is refused before anything is read
  (``forged_read`` and ``forged_accepted`` must be 0);
- every hostile client request (``hostile_client``) ends FAILED, alone
  (``hostile_served`` must be 0).

Faults are injected by wrapping the decode engine's transport backends
(:class:`FaultInjectingBackend`), into the messages the drivers receive (aborts, bad
tickets, duplicated, late and forged messages), by frames from a client or an intruder, and by
not serving the decode for a while; the library itself carries no fault hooks. All of it runs
on one virtual clock (:class:`VirtualClock`: the coordinator's liveness and deadlines, the
engines' leases and import deadlines), which advances by a fixed step per serving turn and by
large steps while the decode is stalled, so a stall lasts as long as it must on any machine.
Time to first token (TTFT) is measured in real time from the client's submit to its first
streamed token.

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
    "FORGERIES",
    "HOSTILE_REQUESTS",
    "FaultInjectingBackend",
    "SoakOptions",
    "SoakReport",
    "main",
    "run_soak",
    "track_posting_request",
    "VirtualClock",
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
    "stall_past_liveness",  # the decode goes silent past the liveness timeout, then resumes
    "forged_ticket",  # tickets with guessed block ids: forged provenance, or from an intruder
    "hostile_client",  # a malformed, oversized, NaN/inf or out-of-vocabulary request
)
#: What a ``hostile_client`` handoff sends (one, drawn per handoff). The first ones carry a
#: usable request id and must end FAILED; the ``junk_`` ones cannot be answered (no id, or no
#: frame at all): the coordinator counts them and the handoff's real request follows.
HOSTILE_REQUESTS = (
    "string_prompt",
    "empty_prompt",
    "negative_token",
    "out_of_vocabulary",
    "nan_timeout",
    "inf_max_new_tokens",
    "huge_max_new_tokens",
    "float_token",
    "oversized_prompt",
    "junk_unhashable_id",
    "junk_not_msgpack",
    "junk_oversized_frame",
)
#: How a ``forged_ticket`` reaches the decode over its link (one, drawn per handoff).
FORGERIES = ("other_incarnation", "no_provenance", "unknown_engine_own_meta")
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
        #: Every request a pull was posted for.
        self.posted: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def begin_pull_blocks(self, *args: Any, **kwargs: Any) -> Any:
        """Post the real pull, then apply this request's fault to it."""
        fault = self.faults.get(self.current if self.current is not None else -1, "none")
        if fault == "start_raises" and self.kind != "kv":
            raise TransferError(f"injected: {self.kind} transfer start threw")
        handle = self._inner.begin_pull_blocks(*args, **kwargs)
        if self.current is not None:
            self.posted.add(self.current)
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


class VirtualClock:
    """The soak's time in nanoseconds: it moves only when told (``advance``). The coordinator
    reads it in seconds (:meth:`seconds`), the drivers as their monotonic and wall clocks."""

    WALL_ORIGIN_NS = 1_800_000_000 * 10**9
    """Where the wall clock stands when the monotonic one reads 0."""

    def __init__(self, start_ns: int = 10**12) -> None:
        self.ns = start_ns

    def advance(self, ns: int) -> None:
        """Move time forward by ``ns``."""
        self.ns += ns

    def seconds(self) -> float:
        """Monotonic time in seconds (the coordinator's clock)."""
        return self.ns / 1e9

    def wall_ns(self) -> int:
        """Wall-clock time in nanoseconds (leases carried in tickets)."""
        return self.ns + self.WALL_ORIGIN_NS


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
    """Prefill pin lease (virtual seconds): how long the blocks of a handoff whose decode may
    still read them stay pinned."""
    engine_timeout_s: float = 2.0
    """The coordinator's liveness timeout (virtual seconds)."""
    turn_ms: float = 1.0
    """Virtual time per serving turn."""
    stall_step_ms: float = 50.0
    """Virtual time per turn while the decode is stalled."""
    faults: tuple[str, ...] | None = None
    """The faults to draw from (default: every fault of :data:`FAULTS`, and of
    :data:`INTEGRITY_FAULTS` with ``verify_integrity``)."""


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
    """Requests without an outcome, or ended only by their deadline (hangs; must be 0)."""
    timed_out: int = 0
    """Requests the coordinator failed at their deadline (counted in ``unresolved``)."""
    integrity_failures: int = 0
    """Imports the decode refused because the digest did not match."""
    undetected: int = 0
    """``corrupt_transfer`` handoffs that were admitted anyway (must be 0)."""
    false_alarms: int = 0
    """Integrity failures of handoffs nothing corrupted (must be 0)."""
    stale_reads_caught: int = 0
    """Integrity failures of reads a stall delayed past the lease (reused blocks were read;
    the import was never admitted)."""
    stalls: int = 0
    """Stalls past the liveness timeout the decode went through."""
    stalled_requests: int = 0
    """Requests the coordinator failed because the decode was silent."""
    stale_admits: int = 0
    """Of those, requests the decode admitted after it resumed (must be 0)."""
    stalled_pins: int = 0
    """Of those, requests whose pin the prefill still held when the decode was declared lost
    (each must end at its lease)."""
    early_releases: int = 0
    """Of those, pins the prefill freed before their lease ended (must be 0)."""
    forged_sent: int = 0
    """Forged tickets that reached the decode over its link."""
    forged_refused: int = 0
    """Tickets the decode refused for their provenance (must equal ``forged_sent``)."""
    forged_read: int = 0
    """Forged tickets a pull was posted for (must be 0)."""
    intruder_sent: int = 0
    """Messages an unregistered process sent the coordinator for other requests."""
    forged_accepted: int = 0
    """Forged tickets the decode did not refuse plus intruder messages the coordinator acted
    on (must be 0)."""
    hostile_sent: int = 0
    """Hostile client requests with a usable request id."""
    hostile_served: int = 0
    """Of those, requests that did not end FAILED (must be 0)."""
    junk_frames: int = 0
    """Frames without a usable request id (the coordinator counts and drops them)."""
    malformed_counted: int = 0
    """Frames and messages the coordinator refused and counted."""
    ttft_ms: list[float] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    #: Aborts that found their request in the drawn stage (the others ended first).
    aborts_hit: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every request has one outcome, nothing leaked, every answer is right, every stall,
        forgery and hostile request ended as it must."""
        return (
            self.leaked == 0
            and self.wrong == 0
            and self.unresolved == 0
            and not self.undetected
            and not self.false_alarms
            and not self.stale_admits
            and not self.early_releases
            and not self.forged_read
            and not self.forged_accepted
            and self.forged_refused == self.forged_sent
            and not self.hostile_served
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
                f"({self.undetected} corruptions undetected, {self.false_alarms} false alarms, "
                f"{self.stale_reads_caught} stale reads after a stall)",
                f"  unresolved (hangs)         {self.unresolved}",
                f"  decode stalls              {self.stalls} past the liveness timeout, "
                f"{self.stalled_requests} requests failed by it: {self.stale_admits} admitted "
                f"after resuming; {self.stalled_pins} still pinned, {self.early_releases} "
                "freed before their lease",
                f"  forged tickets             {self.forged_refused} of {self.forged_sent} "
                f"refused, {self.forged_read} read; {self.intruder_sent} intruder messages, "
                f"{self.forged_accepted} acted on",
                f"  hostile client requests    {self.hostile_sent} sent, "
                f"{self.hostile_served} not FAILED; {self.junk_frames} junk frames; "
                f"{self.malformed_counted} refused by the coordinator",
                f"  TTFT p50 / p99             {self.percentile(50):.2f} / "
                f"{self.percentile(99):.2f} ms",
                f"  faults injected            {faults}",
                "  aborts that hit the stage  "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.aborts_hit.items())),
            ]
        )


def hostile_frame(kind: str, request_id: int, prompt: list[int], max_new_tokens: int) -> bytes:
    """The frame a hostile client sends instead of ``prompt`` (``kind`` from
    :data:`HOSTILE_REQUESTS`), built with msgpack directly: nothing checks it before the
    coordinator does."""
    import msgpack

    from disagg_rs.control.messages import MAX_FRAME_BYTES, MAX_PROMPT_TOKENS, PROTOCOL_VERSION

    if kind == "junk_not_msgpack":
        return b"\xc1\xff" + bytes(range(40))
    if kind == "junk_oversized_frame":
        return b"\x00" * (MAX_FRAME_BYTES + 1)
    fields: dict[str, Any] = {
        "type": "SUBMIT",
        "v": PROTOCOL_VERSION,
        "request_id": request_id,
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
    }
    changes: dict[str, dict[str, Any]] = {
        "string_prompt": {"prompt": "a prompt as a string"},
        "empty_prompt": {"prompt": []},
        "negative_token": {"prompt": [*prompt[:-1], -1]},
        "out_of_vocabulary": {"prompt": [*prompt[:-1], 256]},  # byte vocabulary: 0..255
        "nan_timeout": {"timeout_s": float("nan")},
        "inf_max_new_tokens": {"max_new_tokens": float("inf")},
        "huge_max_new_tokens": {"max_new_tokens": 1 << 40},
        "float_token": {"prompt": [*prompt[:-1], 0.5]},
        "oversized_prompt": {"prompt": [1] * (MAX_PROMPT_TOKENS + 1)},
        "junk_unhashable_id": {"request_id": [request_id]},
    }
    fields.update(changes[kind])
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def _engines(opts: SoakOptions) -> tuple[Any, Any, Any]:
    from disagg_rs.reference import EngineConfig, ModelConfig, ReferenceEngine
    from disagg_rs.reference.handoff import HandoffReferenceEngine

    model = ModelConfig()
    common = {"num_blocks": opts.num_blocks, "num_ssm_slots": opts.max_in_flight + 2}
    pre = HandoffReferenceEngine(model, EngineConfig(role="prefill", **common))  # type: ignore[arg-type]
    dec = HandoffReferenceEngine(model, EngineConfig(role="decode", max_batch=4, **common))  # type: ignore[arg-type]
    colocated = ReferenceEngine(model, EngineConfig(num_blocks=256))
    return pre, dec, colocated


class _Stall:
    """One ``stall_past_liveness`` at a time: the decode is not served (no messages read, no
    turns, no heartbeats) while virtual time runs on; the coordinator declares it lost and
    fails the requests it held; their pins end with their lease; a few other prompts then run
    on the prefill (reusing its blocks; they fail: no decode); then the decode resumes and
    reads what waited for it."""

    def __init__(self) -> None:
        self.active = False
        self.starting = False
        self.lost_before = 0
        self.lost_at: int | None = None
        self.started_at = 0
        self.admitted_before: set[int] = set()
        self.victims: set[int] = set()
        self.held: list[dict[str, Any]] = []  # messages read but not yet acted on
        self.fillers: set[int] = set()
        self.filler_budget = 0
        self.drawn: set[int] = set()  # requests whose stall was run (or skipped)


def run_soak(opts: SoakOptions) -> SoakReport:
    """Run ``opts.handoffs`` handoffs with injected faults and return the report.

    Both engines are served by :class:`~disagg_rs.driver.HandoffDriver` through a
    :class:`~disagg_rs.driver.LoopbackCoordinator` (the coordinator's routing, in this process),
    and a client submits the prompts: the same loop as the demo's engines. Faults the driver
    must absorb (duplicated, late, forged and malformed messages, bad tickets, aborts) are
    injected into the messages it receives; transport faults by wrapping the decode's backends;
    hostile requests and intruder messages as frames to the coordinator; stalls by not serving
    the decode while the :class:`VirtualClock` runs on."""
    import copy

    import torch

    if not torch.cuda.is_available():  # with GPUs present NIXL needs UCX's CUDA transports
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from disagg_rs.control import CoordinatorState, Msg, decode_message, encode_message
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
    clock = VirtualClock()
    turn_ns, stall_ns = int(opts.turn_ms * 1e6), int(opts.stall_step_ms * 1e6)
    lease_ns = int(opts.lease_s * 1e9)
    pre.handoff_now_ns = dec.handoff_now_ns = clock.ns
    pre.handoff_wall_now_ns = dec.handoff_wall_now_ns = clock.wall_ns()
    pre.setup_kv_transfer("prefill", "nixl", mode="direct")
    dec.setup_kv_transfer("decode", "nixl", mode="direct")
    pre.verify_integrity = dec.verify_integrity = opts.verify_integrity
    pre.handoff_lease_ns = lease_ns
    faults = FAULTS[1:] + (INTEGRITY_FAULTS if opts.verify_integrity else ())
    if opts.faults is not None:
        unknown = set(opts.faults) - set(faults)
        if unknown or not opts.faults:
            raise ValueError(f"faults={opts.faults!r}: expected some of {faults}")
        faults = tuple(opts.faults)
    backends = {"kv": FaultInjectingBackend(dec.kv_transfer_backend, "kv")}
    dec.kv_transfer_backend = backends["kv"]
    for kind, b in list(dec.ssm_transfer_backends.items()):
        backends[kind] = dec.ssm_transfer_backends[kind] = FaultInjectingBackend(b, kind)
    track_posting_request(dec, list(backends.values()))

    # No request may need its deadline: one that ends by it hung somewhere (counted).
    state = CoordinatorState(request_timeout_s=120.0, engine_timeout_s=opts.engine_timeout_s)
    hub = LoopbackCoordinator(state, clock=clock.seconds)
    drivers = {
        role: HandoffDriver(eng, hub.link(role, role), shutdown_grace_s=30.0)
        for role, eng in (("prefill", pre), ("decode", dec))
    }
    # Forged tickets reach the decode over its link, next to the coordinator's messages.
    forged_frames: list[bytes] = []
    link = drivers["decode"].link
    assert link is not None
    real_poll = link.poll

    def poll_with_forgeries(timeout_ms: int = 0) -> list[dict[str, Any]]:
        out = real_poll(timeout_ms) + [decode_message(f) for f in forged_frames]
        forged_frames.clear()
        return out

    link.poll = poll_with_forgeries  # type: ignore[method-assign]
    client = hub.client()
    intruder = hub.client("intruder")  # an unregistered process on the control plane
    report = SoakReport(handoffs=opts.handoffs)
    fault_of: dict[int, str] = {}
    prompt_of: dict[int, int] = {}
    started_at: dict[int, float] = {}
    outcome: dict[int, str] = {}
    aborts: dict[int, str] = {}  # request id -> the stage to abort it in
    replay: dict[int, dict[str, Any]] = {}  # late_report: the ticket message, replayed later
    hostile: set[int] = set()  # requests sent as hostile frames (must end FAILED)
    forged_ids: set[int] = set()
    pinned_at: dict[int, int] = {}  # prefill pins: request -> when pinned (virtual ns)
    released_at: dict[int, int] = {}
    stall = _Stall()
    victims: set[int] = set()  # every request failed because the decode was silent
    stale: set[int] = set()  # stalled requests the decode had not admitted before the stall
    watch: dict[int, int] = {}  # stalled requests still pinned -> their lease end
    next_rid = 0
    t0 = time.perf_counter()

    def finish(rid: int, result: str) -> None:
        if rid in outcome:
            raise DisaggError(f"request {rid} reached a second outcome {result!r}")
        outcome[rid] = result

    def admitted() -> set[int]:
        return {ev[1] for ev in dec.handoff_events if ev[0] == "admitted"}

    def forge(rid: int, m: dict[str, Any]) -> None:
        """Tickets naming the real prefill with another request's block ids: over the
        decode's link with forged provenance, and to the coordinator from an intruder."""
        ticket = copy.deepcopy(m["ticket"])
        meta = ticket.pop("prefill_meta", None)
        others = sorted(r for r in pinned_at if r != rid and r not in released_at)
        if others:  # the blocks of another request still pinned: what an attacker wants
            ticket["src_block_ids"] = list(pre.pin_ledger.pinned_blocks(rng.choice(others)) or [])
        else:
            n = len(ticket.get("src_block_ids", [])) or 1
            ticket["src_block_ids"] = rng.sample(range(opts.num_blocks), n)
        how = FORGERIES[report.forged_sent % len(FORGERIES)]  # each in turn
        if how == "other_incarnation":
            ticket["prefill_incarnation"] = int(ticket.get("prefill_incarnation") or 0) + 1
        elif how == "no_provenance":
            ticket.pop("prefill_engine_id", None)
            ticket.pop("prefill_incarnation", None)
        else:  # names an engine the peer table lacks, and carries the real prefill's meta
            ticket["prefill_engine_id"] = "prefill-" + str(rid)
            ticket["prefill_meta"] = meta
        fid = (1 << 40) + rid
        forged_ids.add(fid)
        fields = {k: v for k, v in m.items() if k not in ("type", "v", "ticket", "request_id")}
        forged_frames.append(encode_message(m["type"], request_id=fid, ticket=ticket, **fields))
        report.forged_sent += 1
        # An unregistered process claims the real request's prefill and its import.
        before = sum(state.ignored.values()) + sum(state.malformed.values())
        for kind, extra in (
            (Msg.PREFILL_DONE, {"ticket": ticket}),
            (
                Msg.SUBMIT_REQUEST_WITH_KV,
                {"ticket": ticket, "prompt": m["prompt"], "max_new_tokens": m["max_new_tokens"]},
            ),
            (Msg.KV_IMPORTED, {"ok": True}),
            (Msg.DONE, {"tokens": [1, 2, 3]}),
        ):
            hub.deliver(
                intruder.identity, encode_message(kind, request_id=rid, epoch=m["epoch"], **extra)
            )
            report.intruder_sent += 1
        after = sum(state.ignored.values()) + sum(state.malformed.values())
        report.forged_accepted += 4 - (after - before)

    def faulty(role: str, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The driver's messages with this turn's message faults applied."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(msgs):
            rid, kind = m.get("request_id"), m["type"]
            if not isinstance(rid, int):
                out.append(m)
                continue
            fault = fault_of.get(rid, "none")
            is_ticket = kind is Msg.SUBMIT_REQUEST_WITH_KV
            stalls = fault == "stall_past_liveness" and rid not in outcome
            if is_ticket and stalls and rid not in stall.drawn:
                stall.drawn.add(rid)  # one stall per draw; none while one runs
                if stall.active or stall.starting:
                    out.append(m)
                    continue
                stall.starting = True
                if rid % 2 == 0:  # the ticket waits unread through the stall
                    stall.held = msgs[i:]
                    break
            out.append(m)
            if is_ticket and fault == "bad_ticket":
                m["ticket"].pop("prefill_meta", None)
            if is_ticket and fault == "duplicate_submit":
                out.append(m)
            if is_ticket and fault == "late_report":
                replay[rid] = m
            if is_ticket and fault == "forged_ticket" and rid not in forged_ids:
                forge(rid, m)
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

    def submit(rid: int) -> None:
        fault = rng.choice(faults) if rng.random() < opts.fault_rate else "none"
        fault_of[rid], prompt_of[rid] = fault, rng.randrange(opts.distinct_prompts)
        report.faults[fault] += 1
        if fault.startswith("abort_"):
            aborts[rid] = fault.removeprefix("abort_")
        for b in backends.values():
            b.faults[rid] = fault
        started_at[rid] = time.perf_counter()
        prompt = prompts[prompt_of[rid]]
        if fault == "hostile_client":
            kind = HOSTILE_REQUESTS[(report.faults[fault] - 1) % len(HOSTILE_REQUESTS)]
            hub.deliver(client.identity, hostile_frame(kind, rid, prompt, opts.max_new_tokens))
            if not kind.startswith("junk_"):
                hostile.add(rid)
                report.hostile_sent += 1
                return
            report.junk_frames += 1  # nobody can be answered: the real request follows
        client.submit(rid, prompt, opts.max_new_tokens)

    def track_pins() -> None:
        pinned = set(pre.pin_ledger.pinned_request_ids())
        for rid in pinned - pinned_at.keys():
            pinned_at[rid] = clock.ns
        for rid in pinned_at.keys() - pinned - released_at.keys():
            released_at[rid] = clock.ns

    def step_stall() -> None:
        if stall.starting and not stall.active:
            stall.starting, stall.active = False, True
            stall.lost_before, stall.lost_at = state.lost["decode"], None
            stall.started_at = clock.ns
            stall.admitted_before, stall.victims = admitted(), set()
            stall.fillers, stall.filler_budget = set(), 3
            report.stalls += 1
            return
        if not stall.active:
            return
        if next_rid >= opts.handoffs:
            stall.filler_budget = 0  # nothing left to send
        if stall.lost_at is None:
            if state.lost["decode"] > stall.lost_before:
                stall.lost_at = clock.ns
            return
        if any(r in pinned_at and r not in released_at for r in stall.victims):
            return  # the victims' pins end with their lease
        if stall.filler_budget or stall.fillers - outcome.keys():
            return  # other prompts reuse the prefill's blocks first
        stall.active = False  # resume: the held messages come first

    while len(outcome) < opts.handoffs and time.perf_counter() - t0 < 3600:
        clock.advance(stall_ns if stall.active else turn_ns)
        in_flight = next_rid - len(outcome)
        while next_rid < opts.handoffs and in_flight < opts.max_in_flight:
            if stall.active and not (stall.lost_at is not None and stall.filler_budget):
                break  # while stalled, only the fillers after the loss
            if not stall.active and "decode" not in state.engines:
                break  # resumed: the decode registers again first
            if stall.active and any(r not in released_at for r in stall.victims if r in pinned_at):
                break  # fillers only once the victims' pins are free
            rid, next_rid, in_flight = next_rid, next_rid + 1, in_flight + 1
            if stall.active:
                stall.filler_budget -= 1
                stall.fillers.add(rid)
            submit(rid)
        now, wall = clock.ns, clock.wall_ns()
        for role, driver in drivers.items():
            if role == "decode" and stall.active:
                continue
            msgs = driver.receive()
            if role == "decode" and stall.held:
                msgs, stall.held = stall.held + msgs, []
            for m in faulty(role, msgs):
                driver.on_message(m)
            driver.tick(now, wall)
        track_pins()
        hub.pump()
        for ev in client.events():
            rid = int(ev["request_id"])
            if ev["type"] is Msg.TOKENS and rid not in outcome and rid in started_at:
                report.ttft_ms.append((time.perf_counter() - started_at.pop(rid)) * 1e3)
            elif ev["type"] is Msg.FAILED:
                why = str(ev.get("error", ""))
                if "passed its deadline" in why:
                    report.timed_out += 1
                if stall.active and "silent for more than" in why:
                    stall.victims.add(rid)
                    victims.add(rid)
                    report.stalled_requests += 1
                    if rid not in stall.admitted_before:
                        stale.add(rid)
                    # A pin still held when the decode is declared lost ends at its lease,
                    # not earlier: the decode may still read it when it resumes.
                    if rid in pinned_at and rid not in released_at:
                        watch[rid] = pinned_at[rid] + lease_ns
                        report.stalled_pins += 1
                finish(rid, "failed")
            elif ev["type"] is Msg.DONE:
                if fault_of[rid] == "corrupt_transfer":
                    report.undetected += 1
                if rid in hostile:
                    report.hostile_served += 1
                finish(rid, "completed")
                if list(ev["tokens"]) != expected[prompt_of[rid]]:
                    report.wrong += 1
        for rid, lease_end in list(watch.items()):
            if rid in released_at:
                del watch[rid]
                report.early_releases += released_at[rid] < lease_end
        step_stall()
        for rid in [r for r in replay if r in outcome and not stall.active]:
            drivers["decode"].on_message(replay.pop(rid))  # a late duplicate: dropped

    # What still waits for the decode (forged tickets of the last turns) is read, then every
    # quarantined import drains and every pin goes: SHUTDOWN, serve until idle.
    stall.active = False
    for m in stall.held + drivers["decode"].receive():
        drivers["decode"].on_message(m)
    for driver in drivers.values():
        driver.on_message({"type": Msg.SHUTDOWN})
    while any(d.running for d in drivers.values()):
        clock.advance(10 * turn_ns)
        for driver in drivers.values():
            driver.tick(clock.ns, clock.wall_ns())
    report.elapsed_s = time.perf_counter() - t0
    counts = Counter(outcome.values())
    report.completed, report.failed = counts["completed"], counts["failed"]
    report.integrity_failures = int(dec.handoff_stats.get("integrity_failures", 0))
    caught = {ev[1] for ev in dec.handoff_events if ev[0] == "failed" and "integrity" in ev[2]}
    # A read posted before a stall may land after the prefill's lease ended (on reused blocks):
    # never admitted; with the digest also caught as a mismatch.
    report.stale_reads_caught = len(caught & victims)
    corrupted = {r for r, f in fault_of.items() if f == "corrupt_transfer"}
    report.false_alarms = len(caught - victims - corrupted)
    report.unresolved = opts.handoffs - len(outcome) + report.timed_out
    report.stale_admits = len(stale & admitted())
    posted = set().union(*(b.posted for b in backends.values()))
    report.forged_read = len(forged_ids & posted)
    report.forged_refused = int(drivers["decode"].state.counters()["forged"])
    report.malformed_counted = hub.malformed + sum(state.malformed.values())
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
