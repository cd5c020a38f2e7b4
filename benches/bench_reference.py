"""Reference engine throughput on CPU: prompt and decode tokens per second of the one-process
hybrid model, per KV cache layout and block size, as ratios to megatron/16 of the same run.

The reference engine exists for correctness (demo and tests), not speed; this bench keeps its
cost visible (the demo must finish in seconds on 2 cores) and shows the layouts cost the same.

Usage: python benches/bench_reference.py [--write benches/RESULTS.md] [--requests N]
"""

from __future__ import annotations

import argparse
import time

import torch

from _results import publish, table_section
from disagg_rs.reference import (
    CacheLayoutName,
    EngineConfig,
    ReferenceEngine,
    encode_text,
    hybrid_model,
)

TEXT = "Disaggregated serving moves a finished prompt's state to a decode engine. "


def run(
    layout: CacheLayoutName, block_size: int, requests: int, max_new: int
) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of one engine serving ``requests`` prompts."""
    e = ReferenceEngine(
        hybrid_model(),
        EngineConfig(
            cache_layout=layout,
            block_size_tokens=block_size,
            num_blocks=256,
            num_ssm_slots=requests,
            max_batch=requests,
        ),
    )
    for i in range(requests):
        e.add_request(i, encode_text(TEXT * 3 + str(i)), max_new)
    t0 = time.perf_counter()
    e.step()  # every prompt in one forward
    t1 = time.perf_counter()
    while e.has_work:
        e.step()
    t2 = time.perf_counter()
    return e.stats.prompt_tokens_computed / (t1 - t0), e.stats.decode_tokens / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--write", help="results file to update")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run("megatron", 16, 2, 2)  # warm-up
    rows = []
    base: tuple[float, float] | None = None
    layouts: tuple[CacheLayoutName, ...] = ("megatron", "nhd", "hnd")
    for layout in layouts:
        for bs in (16, 64):
            # Best of three: the machine is shared, the minimum is the least disturbed run.
            runs = [run(layout, bs, args.requests, args.max_new) for _ in range(3)]
            pre, dec = max(r[0] for r in runs), max(r[1] for r in runs)
            base = base or (pre, dec)
            rows.append(
                f"| {layout} | {bs} | {pre:,.0f} | {pre / base[0]:.2f} | {dec:,.0f} "
                f"| {dec / base[1]:.2f} |"
            )
    md = table_section(
        "Reference engine (CPU, one process, hybrid model, float64, 1 thread)",
        [
            f"`python benches/bench_reference.py` — {args.requests} prompts of "
            f"{len(TEXT) * 3 + 1} bytes, {args.max_new} new tokens each, one batch. "
            "Best of 3 runs each; ratios against megatron/16 of this run.",
        ],
        ["cache layout", "block", "prompt tok/s", "ratio", "decode tok/s", "ratio"],
        rows,
    )
    publish(args.write, "reference", md)


if __name__ == "__main__":
    main()
