"""Host time of the decode's pull call, end to end through the public driver: how long
``NixlTransferBackend.begin_pull_blocks`` takes from call to return, and how much of it is
NIXL's own work (preparing and posting the READs) rather than the library's; and how long
the decode's intake of a handoff ticket takes.

A prefill and a decode reference engine (real NIXL over UCX loopback, one process, one virtual
clock), each served by a ``HandoffDriver`` through a ``LoopbackCoordinator``, run a few requests
to warm every cache, then the measured ones. Each pull call is timed, and inside it each NIXL
transfer it prepares and posts; the library's share is the difference, per call. The baseline
(the NIXL calls) is measured in the same run, on the same calls.

Usage: python benches/bench_pull_host.py [--requests N] [--write benches/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish, table_section
from disagg_rs.handoff import decode
from disagg_rs.transfer_backends import nixl
from driver_world import MAX_NEW, PROMPTS, World, done

_WARM = 3


def _timed(into: list[int], call: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            into.append(time.perf_counter_ns() - t)

    return run


def measure(mode: str, requests: int) -> dict[str, float]:
    """Median microseconds per pull call (the whole call, NIXL's part, the library's part) and
    per ticket checked (the decode's ticket intake, ``ticket_import``)."""
    calls: list[int] = []
    posts: list[int] = []
    tickets: list[int] = []
    per_call: list[tuple[int, int]] = []
    cls = nixl.NixlTransferBackend
    pull, post, intake = cls.begin_pull_blocks, cls._post, vars(decode)["ticket_import"]

    def pull_call(*args: Any, **kwargs: Any) -> Any:
        before = len(posts)
        out = _timed(calls, pull)(*args, **kwargs)
        per_call.append((calls[-1], sum(posts[before:])))
        return out

    cls.begin_pull_blocks = pull_call  # type: ignore[method-assign]
    cls._post = _timed(posts, post)  # type: ignore[method-assign]
    vars(decode)["ticket_import"] = _timed(tickets, intake)
    try:
        world = World(mode=mode)
        world.turn()
        prompts = list(PROMPTS.values())
        for rid in range(_WARM + requests):
            if rid == _WARM:
                per_call.clear()
                tickets.clear()
            world.client.submit(rid, prompts[rid % len(prompts)], MAX_NEW)
            world.run(lambda rid=rid: rid in done(world.events))
        world.close()
    finally:
        cls.begin_pull_blocks, cls._post = pull, post  # type: ignore[method-assign]
        vars(decode)["ticket_import"] = intake
    whole = statistics.median(c for c, _ in per_call) / 1e3
    in_nixl = statistics.median(p for _, p in per_call) / 1e3
    library = statistics.median(c - p for c, p in per_call) / 1e3
    ticket = statistics.median(tickets) / 1e3
    return {
        "calls": len(per_call), "whole": whole, "nixl": in_nixl, "library": library,
        "ticket": ticket,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30, help="measured requests per mode")
    ap.add_argument("--write", help="update this RESULTS.md section")
    args = ap.parse_args()
    rows = []
    for mode in ("direct", "staged"):
        r = measure(mode, args.requests)
        share = r["library"] / r["whole"]
        rows.append(
            f"| NIXL {mode} | {r['calls']:.0f} | {r['whole']:.0f} | {r['nixl']:.0f} "
            f"| {r['library']:.0f} | {share:.0%} | {r['ticket']:.0f} |"
        )
    text = table_section(
        "Decode pull call, host time (end to end, through HandoffDriver)",
        [
            "`begin_pull_blocks` (one call per state kind per request: KV and two SSM kinds) of",
            "the decode reference engine, served with a prefill one by `HandoffDriver`s on real",
            "NIXL over UCX loopback in one process; medians per call over",
            f"{args.requests} requests after {_WARM} warm-up ones. NIXL's part is the READs the",
            "call prepares and posts, timed inside the same calls; the library's part is the",
            "rest. The ticket check is the decode's intake of the handoff ticket (`ticket_import`,",
            "one per request: the ticket as the driver hands it over, with the prefill's ranks'",
            "metadata attached). Command: `python benches/bench_pull_host.py`.",
        ],
        [
            "read mode",
            "pull calls",
            "call us",
            "NIXL prepare+post us",
            "library us",
            "library share",
            "ticket check us",
        ],
        rows,
    )
    publish(args.write, "pull-host", text)


if __name__ == "__main__":
    main()
