"""Planner benchmark: Rust `plan_kv_reshard` against a plain-Python planner, same run.

Usage: python benches/bench_planner.py [--write benches/RESULTS.md]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import disagg_rs as dr  # noqa: E402
from _results import machine_line, write_section  # noqa: E402
from disagg_rs.cli import ParallelSpec, layouts_for  # noqa: E402
from oracle_planner import Holding, plan_rects  # noqa: E402

LAYERS, HEADS = 80, 8
SCENARIOS = [
    ("1x1 (TP1 -> TP1)", ParallelSpec(tp=1), ParallelSpec(tp=1)),
    ("8x4 (TP8 -> TP4)", ParallelSpec(tp=8), ParallelSpec(tp=4)),
    ("64x64 (TP8xPP8 -> TP16xPP4, GQA x2)", ParallelSpec(tp=8, pp=8), ParallelSpec(tp=16, pp=4)),
]


def _median_seconds(fn: Callable[[], object], min_time: float = 0.2, max_reps: int = 2000) -> float:
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps and (time.perf_counter() - start < min_time or len(samples) < 3):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", type=Path, help="results file to update")
    args = parser.parse_args()
    rows = []
    for name, src_spec, dst_spec in SCENARIOS:
        srcs = layouts_for(src_spec, LAYERS, HEADS)
        dsts = layouts_for(dst_spec, LAYERS, HEADS, rank_offset=len(srcs))
        hs = [Holding(s.global_rank, *s.layers, *s.heads) for s in srcs]
        hd = [Holding(d.global_rank, *d.layers, *d.heads) for d in dsts]
        plan = dr.plan_kv_reshard(srcs, dsts)
        assert len(plan) == len(plan_rects(hs, hd)), "planners disagree"
        rust = _median_seconds(functools.partial(dr.plan_kv_reshard, srcs, dsts))
        python = _median_seconds(functools.partial(plan_rects, hs, hd), max_reps=20)
        rows.append((name, len(plan), rust, python))
        print(
            f"{name:40s} {len(plan):5d} transfers  rust {rust * 1e6:9.1f} us  "
            f"python {python * 1e3:9.2f} ms  x{python / rust:,.0f}"
        )
    md = [
        "## Reshard planner (`make bench`: benches/bench_planner.py)",
        "",
        f"Machine: {machine_line()}. {LAYERS} layers, {HEADS} KV heads; median of repeated runs.",
        "Baseline: the plain-Python planner of `tests/oracle_planner.py` (cell by cell).",
        "",
        "| scenario | transfers | Rust plan | plain Python | speed-up |",
        "|---|---:|---:|---:|---:|",
    ]
    md += [
        f"| {n} | {t} | {r * 1e6:.1f} us | {p * 1e3:.2f} ms | {p / r:,.0f}x |"
        for n, t, r, p in rows
    ]
    if args.write:
        write_section(args.write, "planner", "\n".join(md))
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
