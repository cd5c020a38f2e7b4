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

With ``--sockets N``: N requests through a ``CoordinatorServer`` in its own process over
ZeroMQ, the engines' links and the client in another (a window of requests in flight); it
reports the coordinator process's CPU time per request and the requests per second.

Usage: python benches/bench_coordinator.py [--requests N] [--sockets N] [--write benches/RESULTS.md]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import bench_args, publish, table_section
from disagg_rs.control import (
    ControlClient,
    CoordinatorServer,
    CoordinatorState,
    EngineLink,
    Msg,
    encode_message,
)
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


def _coordinator(endpoint_out: Any, stop: Any) -> None:
    """The coordinator's process: serve until ``stop``; report its CPU seconds."""
    server = CoordinatorServer(request_timeout_s=3600.0, engine_timeout_s=None, insecure=True)
    endpoint_out.put(server.endpoint)
    cpu0 = time.process_time()
    while not stop.is_set():
        server.run_once(10)
    endpoint_out.put(time.process_time() - cpu0)
    server.close()


def _sockets(prompt_tokens: int, requests: int, window: int = 8) -> tuple[float, float]:
    """Coordinator CPU us per request and requests per second through ZeroMQ, the
    coordinator in its own process."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_coordinator, args=(out, stop))
    proc.start()
    endpoint = out.get(timeout=60)
    prefill = EngineLink(endpoint, "p0", "prefill", incarnation=1, insecure=True)
    decode = EngineLink(endpoint, "d0", "decode", incarnation=1, insecure=True)
    client = ControlClient(endpoint, insecure=True, default_timeout_s=600.0)
    prefill.register({"ranks": [{"global_rank": 0}]})
    decode.register({"ranks": [{"global_rank": 0}]})
    prompt = list(range(prompt_tokens))
    blocks = list(range(max(1, prompt_tokens // TOKENS_PER_BLOCK)))
    submitted = done = 0
    t0 = time.perf_counter()
    while done < requests:
        while submitted < requests and submitted - done < window:
            client.submit(submitted, prompt, NEW_TOKENS)
            submitted += 1
        for m in prefill.poll(1):
            if m["type"] is Msg.PREFILL:
                ticket = {"blocks": blocks, "num_tokens": prompt_tokens, "first_token": 5}
                rid, epoch = m["request_id"], m["epoch"]
                prefill.send(Msg.PREFILL_DONE, request_id=rid, epoch=epoch, ticket=ticket)
        for m in decode.poll(1):
            if m["type"] is Msg.SUBMIT_REQUEST_WITH_KV:
                rid, epoch = m["request_id"], m["epoch"]
                decode.send(Msg.KV_IMPORTED, request_id=rid, epoch=epoch, ok=True)
                for t in range(NEW_TOKENS - 1):
                    decode.send(Msg.TOKENS, request_id=rid, epoch=epoch, tokens=[t])
                tokens = list(range(NEW_TOKENS))
                decode.send(Msg.DONE, request_id=rid, epoch=epoch, tokens=tokens)
        for ev in client.events(0.001):
            done += ev["type"] is Msg.DONE
            assert ev["type"] is not Msg.FAILED, ev
    elapsed = time.perf_counter() - t0
    stop.set()
    cpu = float(out.get(timeout=60))
    proc.join(30)
    for sock in (prefill, decode, client):
        sock.close()
    return cpu / requests * 1e6, requests / elapsed


INTRO = """One request through a `LoopbackCoordinator` (the coordinator's state and routing,
every message encoded and decoded as on the wire, no sockets): SUBMIT, PREFILL_DONE,
KV_IMPORTED, one TOKENS per generated token (16), DONE, scripted; medians over {n} requests
after one warm-up. Baseline in the same run: `msgpack.unpackb` of every frame received plus
`msgpack.packb` of every message sent (what a coordinator that checked and decided nothing
would pay). Command: `python benches/bench_coordinator.py`."""
SOCKETS_INTRO = """The same scripted requests through a `CoordinatorServer` in its own process
(plain TCP on loopback), the prefill's and the decode's `EngineLink` and a `ControlClient` in
this one, 8 requests in flight, {n} requests: the coordinator process's CPU time per request
and the requests per second. Command: `python benches/bench_coordinator.py --sockets {n}`."""
COLUMNS = ["prompt tokens", "messages in / out", "coordinator us", "unpack+pack floor us", "ratio"]


def main() -> None:
    args = bench_args(__doc__, "coordinator", requests=40, sockets=0)
    if args.sockets:
        rows = []
        for tokens in (16, 4096, 32768):
            cpu, rate = _sockets(tokens, args.sockets)
            rows.append(f"| {tokens} | {cpu:.0f} | {rate:.0f} |")
        title = (
            "Coordinator over ZeroMQ, between processes (benches/bench_coordinator.py --sockets)"
        )
        intro = [SOCKETS_INTRO.format(n=args.sockets)]
        columns = ["prompt tokens", "coordinator CPU us per request", "requests/s"]
        publish(args.write, "coordinator-sockets", table_section(title, intro, columns, rows))
        return
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
