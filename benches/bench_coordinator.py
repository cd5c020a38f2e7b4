"""Coordinator time per request: what one request costs the coordinator, by prompt length.

A ``LoopbackCoordinator`` (the coordinator's state and routing, with every message encoded
and decoded as on the wire, no sockets) serves one prefill and one decode engine whose
messages are scripted: SUBMIT, PREFILL_DONE with a ticket of one block id per 64 tokens,
KV_IMPORTED, a TOKENS per generated token, DONE. Timed: the coordinator's calls that take
these frames in and hand out every message they cause (to the engines and the client). One
coordinator serves every engine and client of a deployment, so this is the work that bounds
how many requests per second it routes.

Baseline in the same run: the same frames through ``msgpack.unpackb`` (every frame it
receives) and ``msgpack.packb`` (every message it sends): what a coordinator that checked
and decided nothing would still pay in Python.

Usage: python benches/bench_coordinator.py [--requests N] [--write benches/RESULTS.md]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import bench_args, publish, table_section
from disagg_rs.control import CoordinatorState, Msg, encode_message
from disagg_rs.driver import LoopbackCoordinator

CLIENT, PREFILL, DECODE = b"client", b"prefill:p0:1", b"decode:d0:1"
NEW_TOKENS = 16
TOKENS_PER_BLOCK = 64


def _hub() -> LoopbackCoordinator:
    hub = LoopbackCoordinator(CoordinatorState(request_timeout_s=3600.0), clock=lambda: 1.0)
    for ident, eid, role in ((PREFILL, "p0", "prefill"), (DECODE, "d0", "decode")):
        meta = {"ranks": [{"global_rank": 0}]}
        hub.deliver(
            ident, encode_message(Msg.REGISTER, engine_id=eid, role=role, incarnation=1, meta=meta)
        )
    for ident in (PREFILL, DECODE, CLIENT):
        hub.frames(ident)
    return hub


def _request(
    hub: LoopbackCoordinator, rid: int, prompt: list[int]
) -> tuple[float, list[bytes], list[bytes]]:
    """One request through the coordinator: seconds inside it, frames in, frames out."""
    spent = 0.0
    sent: list[bytes] = []
    received: list[bytes] = []

    def deliver(ident: bytes, frame: bytes) -> None:
        nonlocal spent
        received.append(frame)
        t0 = time.perf_counter()
        hub.deliver(ident, frame)
        spent += time.perf_counter() - t0
        for box in (PREFILL, DECODE, CLIENT):
            sent.extend(hub.frames(box))

    deliver(
        CLIENT, encode_message(Msg.SUBMIT, request_id=rid, prompt=prompt, max_new_tokens=NEW_TOKENS)
    )
    epoch = msgpack.unpackb(sent[0])["epoch"]
    blocks = list(range(max(1, len(prompt) // TOKENS_PER_BLOCK)))
    ticket = {"blocks": blocks, "num_tokens": len(prompt), "first_token": 5}
    deliver(PREFILL, encode_message(Msg.PREFILL_DONE, request_id=rid, epoch=epoch, ticket=ticket))
    deliver(DECODE, encode_message(Msg.KV_IMPORTED, request_id=rid, epoch=epoch, ok=True))
    for t in range(NEW_TOKENS - 1):
        deliver(DECODE, encode_message(Msg.TOKENS, request_id=rid, epoch=epoch, tokens=[t]))
    done = list(range(NEW_TOKENS))
    deliver(DECODE, encode_message(Msg.DONE, request_id=rid, epoch=epoch, tokens=done))
    assert hub.state.completed == rid + 1, "the request did not complete"
    return spent, received, sent


def _floor(received: list[bytes], sent: list[bytes]) -> float:
    """Seconds to unpack what came in and pack what went out with Python's msgpack."""
    decoded = [msgpack.unpackb(f) for f in sent]
    t0 = time.perf_counter()
    for f in received:
        msgpack.unpackb(f)
    for m in decoded:
        msgpack.packb(m, use_bin_type=True)
    return time.perf_counter() - t0


def measure(prompt_tokens: int, requests: int) -> tuple[float, float, int, int]:
    """Median microseconds per request (coordinator, floor), messages in and out."""
    hub = _hub()
    prompt = list(range(prompt_tokens))
    ours, floor = [], []
    shape = (0, 0)
    for rid in range(requests + 1):
        spent, received, sent = _request(hub, rid, prompt)
        if rid:  # the first request warms the caches
            ours.append(spent)
            floor.append(_floor(received, sent))
            shape = (len(received), len(sent))
    return statistics.median(ours) * 1e6, statistics.median(floor) * 1e6, *shape


INTRO = """One request through a `LoopbackCoordinator` (the coordinator's state and routing,
every message encoded and decoded as on the wire, no sockets): SUBMIT, PREFILL_DONE,
KV_IMPORTED, one TOKENS per generated token (16), DONE, scripted; medians over {n} requests
after one warm-up. Baseline in the same run: `msgpack.unpackb` of every frame received plus
`msgpack.packb` of every message sent (what a coordinator that checked and decided nothing
would pay). Command: `python benches/bench_coordinator.py`."""
COLUMNS = ["prompt tokens", "messages in / out", "coordinator us", "unpack+pack floor us", "ratio"]


def main() -> None:
    args = bench_args(__doc__, "coordinator", requests=40)
    rows = []
    for tokens in (16, 4096, 32768):
        ours, floor, n_in, n_out = measure(tokens, args.requests)
        cells = [tokens, f"{n_in} / {n_out}", f"{ours:.0f}", f"{floor:.0f}", f"{ours / floor:.2f}x"]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    title = "Coordinator time per request (benches/bench_coordinator.py)"
    intro = [INTRO.format(n=args.requests)]
    publish(args.write, "coordinator", table_section(title, intro, COLUMNS, rows))


if __name__ == "__main__":
    main()
