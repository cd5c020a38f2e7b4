"""Python -> Rust crossings per request: how many calls into ``disagg_rs._core`` one handoff
makes, end to end, through the public driver.

A prefill and a decode reference engine (real NIXL over UCX loopback, one process, one virtual
clock), each served by a ``HandoffDriver`` through a ``LoopbackCoordinator``, run one request
to warm every cache, then the measured ones. A ``sys.setprofile`` hook counts each call of a
``_core`` function or method of a ``_core`` class, by the library file that made it. Each
crossing is cheap (well under a microsecond of binding overhead); the count shows where the
handoff path is still fine-grained. No timing: the figures are counts.

Usage: python benches/bench_crossings.py [--requests N] [--write benches/RESULTS.md]
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import bench_args, publish, table_section
from driver_world import MAX_NEW, PROMPTS, STEP_NS, World, done

_CORE_MODULES = ("disagg_rs", "disagg_rs._core")
_LIBRARY = str(Path(__file__).resolve().parent.parent / "python" / "disagg_rs")


def _is_core(fn: Any) -> bool:
    owner = getattr(fn, "__self__", None)
    if getattr(fn, "__module__", None) == "disagg_rs._core":
        return True
    return owner is not None and type(owner).__module__ in _CORE_MODULES


def count(mode: str, requests: int) -> tuple[collections.Counter[str], int]:
    """Crossings by calling file over ``requests`` measured requests, after one warm-up, and
    the serving turns they took."""
    world = World(mode=mode)
    world.turn()
    by_file: collections.Counter[str] = collections.Counter()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and _is_core(arg):
            name = frame.f_code.co_filename
            by_file[name.split("disagg_rs/", 1)[1] if _LIBRARY in name else "other"] += 1

    prompts = list(PROMPTS.values())
    start = 0
    for rid in range(requests + 1):
        if rid == 1:
            start = world.now_ns
            sys.setprofile(hook)
        world.client.submit(rid, prompts[rid % len(prompts)], MAX_NEW)
        world.run(lambda rid=rid: rid in done(world.events))
    sys.setprofile(None)
    turns = (world.now_ns - start) // STEP_NS
    world.close()
    return by_file, turns


def main() -> None:
    args = bench_args(__doc__, "crossings", requests=6)
    rows = []
    for mode in ("direct", "staged"):
        n = args.requests
        by_file, turns = count(mode, n)
        top = ", ".join(f"{f} {c / n:.0f}" for f, c in by_file.most_common(5))
        rows.append(f"| NIXL {mode} | {sum(by_file.values()) / n:.0f} | {turns / n:.1f} | {top} |")
    text = table_section(
        "Python -> Rust crossings per request (end to end, through HandoffDriver)",
        [
            "Prefill and decode reference engines (hybrid model: KV and two SSM kinds) on real",
            "NIXL over UCX loopback in one process, driven by `HandoffDriver` and the loopback",
            "coordinator; calls into `disagg_rs._core` per request, after one warm-up request,",
            f"{args.requests} requests. Command: `python benches/bench_crossings.py`. Each",
            "serving turn of an engine polls its link, ledger and open transfers (a few",
            "crossings), and how many turns a request takes depends on when the real reads",
            "complete, so the count moves from run to run with the turns.",
        ],
        ["read mode", "crossings per request", "turns per request", "most from (per request)"],
        rows,
    )
    publish(args.write, "crossings", text)


if __name__ == "__main__":
    main()
