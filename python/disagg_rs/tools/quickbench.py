"""``disagg-rs bench``: a self-contained compile benchmark on the docs/architecture.md §8 geometry.

Describes the caches with explicit geometries (no memory is allocated: the compiler only does
address arithmetic), compiles each scenario's transfer program for one destination rank and
reports the median compile time, descriptor count and bytes. The full benchmarks, with
same-run baselines, are the scripts in ``benches/`` (``make bench``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from disagg_rs._core import KVGeometry, KVShardLayout, compile_kv_transfer

__all__ = ["Scenario", "main", "run"]

LAYERS, HEADS, HEAD_DIM, ELEM, TOKENS_PER_BLOCK = 80, 8, 128, 2, 64


@dataclass(frozen=True)
class Scenario:
    """One compile case: source and destination TP, prompt length, block order, mode."""

    name: str
    src_tp: int
    dst_tp: int
    tokens: int
    scattered: bool
    mode: str


SCENARIOS = (
    Scenario("TP1->TP1 32K, contiguous blocks", 1, 1, 32768, False, "direct"),
    Scenario("TP1->TP1 32K, scattered blocks", 1, 1, 32768, True, "direct"),
    Scenario("TP8->TP4 8K head reshard", 8, 4, 8192, True, "staged"),
    Scenario("TP2->TP1 8K head reshard", 2, 1, 8192, True, "staged"),
)


def _geometry(tp: int, num_blocks: int, base: int) -> KVGeometry:
    """Megatron ``[2, L, B, T, H, d]`` of one rank, at a made-up base address."""
    heads = max(1, HEADS // tp)
    head_stride = HEAD_DIM * ELEM
    token_stride = heads * head_stride
    block_stride = TOKENS_PER_BLOCK * token_stride
    plane = num_blocks * block_stride
    return KVGeometry(
        num_layers=LAYERS,
        num_blocks=num_blocks,
        tokens_per_block=TOKENS_PER_BLOCK,
        num_heads=heads,
        head_dim=HEAD_DIM,
        element_size=ELEM,
        block_stride=block_stride,
        token_stride=token_stride,
        head_stride=head_stride,
        plane_bases=[base + i * plane for i in range(2 * LAYERS)],
    )


def run(s: Scenario, repeats: int = 5) -> tuple[float, int, int]:
    """Median compile seconds, descriptors (or staged fragments) and bytes of one scenario."""
    n = s.tokens // TOKENS_PER_BLOCK
    pool = 2 * n
    rng = np.random.default_rng(0)
    src_ids = rng.permutation(pool)[:n] if s.scattered else np.arange(n)
    dst_ids = rng.permutation(pool)[:n] if s.scattered else np.arange(n)
    srcs = [
        (
            KVShardLayout(LAYERS, HEADS, tp_size=s.src_tp, tp_rank=r, global_rank=r),
            _geometry(s.src_tp, pool, (r + 1) << 40),
        )
        for r in range(s.src_tp)
    ]
    dst = (
        KVShardLayout(LAYERS, HEADS, tp_size=s.dst_tp, tp_rank=0, global_rank=100),
        _geometry(s.dst_tp, pool, 1 << 50),
    )
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        program = compile_kv_transfer(srcs, dst, src_ids, dst_ids, s.tokens, s.mode)  # type: ignore[arg-type]
        for rank in program.src_ranks:
            if s.mode == "direct":
                program.descriptors(rank)
            else:
                program.gather(rank)
                program.scatter(rank)
        times.append(time.perf_counter() - t0)
    stats = program.stats
    return statistics.median(times), int(stats["descriptors"]), int(stats["bytes"])


def main() -> int:
    """Print the table; returns the exit code."""
    print(
        f"docs/architecture.md §8 geometry: {LAYERS} layers, {HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, bf16, "
        f"{TOKENS_PER_BLOCK} tokens/block; one destination rank, lists materialised as numpy"
    )
    print(f"{'scenario':<36} {'mode':<7} {'compile+lists':>14} {'descriptors':>12} {'bytes':>15}")
    for s in SCENARIOS:
        seconds, descs, nbytes = run(s)
        print(f"{s.name:<36} {s.mode:<7} {seconds * 1e3:>11.2f} ms {descs:>12,} {nbytes:>15,}")
    return 0
