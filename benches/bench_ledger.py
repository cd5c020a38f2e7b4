"""Ledger throughput: submit -> start -> report -> admit -> finish per handoff, prefix cache on.

Every request has a 1,024-token prompt (16 blocks of 64 tokens) whose first 512 tokens are a
shared system prompt, so from the second request on the decode prefix cache serves 8 blocks
and only the suffix is "pulled". The admitted request then finishes (its blocks go back to the
pool, the full ones stay cached). We time the whole loop through the Python bindings, as an
engine would drive it, and the same loop on a plain-Python baseline ledger (dicts and lists,
per-block Python loops: the style of the reference design) in the same run.

Usage: python benches/bench_ledger.py [--handoffs N] [--write benches/RESULTS.md]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from _results import machine_line, publish
from disagg_rs import ImportLedger

BLOCK = 64
PROMPT = 1024
SHARED = 512
POOL = 4096


def prompts(n: int) -> list[list[int]]:
    shared = list(range(SHARED))
    return [shared + [100_000 + i * PROMPT + j for j in range(PROMPT - SHARED)] for i in range(n)]


def run_disagg(tokens: Sequence[Sequence[int] | npt.NDArray[np.int64]]) -> tuple[float, int]:
    ledger = ImportLedger(POOL, BLOCK)
    pool = ledger.block_pool
    src = list(range(PROMPT // BLOCK))
    far = 1 << 62
    reused = 0
    t0 = time.perf_counter_ns()
    for rid, toks in enumerate(tokens):
        (start,) = ledger.submit(rid, toks, src_block_ids=src, deadline=far, now=rid)
        ledger.report(rid, start.epoch, 0, "ok", rid)
        (adm,) = ledger.admit(1)
        pool.release(adm.block_ids)
    dt = time.perf_counter_ns() - t0
    ledger.check()
    reused = ledger.counters()["prefix_blocks_reused"]
    return dt / len(tokens), reused


class PyBaselineLedger:
    """The same bookkeeping in plain Python, one loop iteration per block."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.cached: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.live: dict[int, dict[str, object]] = {}
        self.ready: list[int] = []

    def hashes(self, tokens: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = hash((parent, tuple(tokens[i : i + BLOCK])))
            out.append(parent)
        return out

    def allocate(self, n: int) -> list[int]:
        got = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.cached[self.hash_of.pop(b)]
            self.ref[b] = 1
            got.append(b)
        return got

    def submit(self, rid: int, tokens: list[int]) -> dict[str, object]:
        hs = self.hashes(tokens)
        cached = []
        for h in hs:
            b = self.cached.get(h)
            if b is None:
                break
            cached.append(b)
        for b in cached:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1
        new = self.allocate(-(-len(tokens) // BLOCK) - len(cached))
        entry: dict[str, object] = {"hashes": hs, "blocks": cached + new, "cached": len(cached)}
        self.live[rid] = entry
        return entry

    def report_ok(self, rid: int) -> None:
        self.ready.append(rid)

    def admit(self) -> list[int]:
        rid = self.ready.pop(0)
        e = self.live.pop(rid)
        blocks: list[int] = e["blocks"]  # type: ignore[assignment]
        hs: list[int] = e["hashes"]  # type: ignore[assignment]
        for b, h in zip(blocks, hs, strict=False):
            if b not in self.hash_of and h not in self.cached:
                self.hash_of[b] = h
                self.cached[h] = b
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.lru[b] = None
                else:
                    self.free.append(b)


def run_baseline(tokens: list[list[int]]) -> tuple[float, int]:
    ledger = PyBaselineLedger(POOL)
    reused = 0
    t0 = time.perf_counter_ns()
    for rid, toks in enumerate(tokens):
        entry = ledger.submit(rid, toks)
        reused += entry["cached"]  # type: ignore[operator]
        ledger.report_ok(rid)
        ledger.release(ledger.admit())
    dt = time.perf_counter_ns() - t0
    return dt / len(tokens), reused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handoffs", type=int, default=100_000)
    ap.add_argument("--write", default=None, help="results file to update (section: ledger)")
    args = ap.parse_args()
    tokens = prompts(args.handoffs)
    arrays = [np.asarray(t, dtype=np.int64) for t in tokens]
    ours, reused = run_disagg(tokens)
    ours_np, reused_np = run_disagg(arrays)
    base, base_reused = run_baseline(tokens)
    assert reused == base_reused == reused_np, (reused, base_reused, reused_np)
    lines = [
        "## Ledger throughput (submit -> start -> report -> admit -> finish)",
        "",
        machine_line(),
        "",
        f"{args.handoffs:,} handoffs, prompt {PROMPT} tokens = {PROMPT // BLOCK} blocks of "
        f"{BLOCK}, first {SHARED} tokens shared (prefix cache on: {reused:,} blocks reused), "
        f"pool {POOL} blocks, world size 1. Command: `python benches/bench_ledger.py`.",
        "",
        "| ledger | ns per handoff | ratio |",
        "|---|---:|---:|",
        f"| plain-Python baseline (per-block loops) | {base:,.0f} | 1.00x |",
        f"| disagg_rs ImportLedger, prompt as a Python list | {ours:,.0f} | {base / ours:.2f}x |",
        f"| disagg_rs ImportLedger, prompt as an int64 ndarray | {ours_np:,.0f} | "
        f"{base / ours_np:.2f}x |",
        "",
        "Most of the list case is converting 1,024 Python ints (about 13 ns each); the hash",
        "chain itself costs about 1 ns per token. Engines that keep token ids in numpy or pass",
        "`prompt_hashes` skip that conversion. The remaining per-handoff cost is four binding",
        "calls (submit, report, admit, release) and their small action records.",
    ]
    text = "\n".join(lines)
    publish(args.write, "ledger", text)


if __name__ == "__main__":
    main()
