"""Cost of the optional integrity digest (``verify_integrity``, ``disagg_rs.integrity``).

One request's KV state on one rank (bf16, head_dim 128, 64 tokens per block, Megatron layout,
blocks shuffled in the pool), digested with ``integrity.kv_entries``; baseline measured in the
same run: a plain torch gather copy of the same bytes (``index_select`` of the request's blocks
per (kv, layer) plane, what a staged transfer's pack does). Reports GB/s of both and the ratio
digest time / copy time, on CPU (1 thread) and, when present, on CUDA (no host copy).

Usage: python benches/bench_integrity.py [--write benches/RESULTS.md]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from _results import publish, table_section
from disagg_rs import KVGeometry, KVShardLayout, SSMGeometry, SSMShardLayout, SSMStateDims
from disagg_rs.integrity import conv_pieces, kv_entries, recurrent_pieces

# (layers, KV heads on this rank, prompt tokens): docs/architecture.md §8 head_dim/dtype/block,
# scaled so a 2-core CPU run takes seconds; the CUDA rows use the TP8 rank of the 80-layer 8K
# prompt.
CPU_CASES = [(8, 1, 2048), (8, 8, 2048)]
CUDA_CASES = [(80, 1, 8192), (80, 8, 8192)]
HEAD_DIM, BLOCK = 128, 64
# SSM state of one request (one slot) on one rank: (SSM layers, SSM heads), Mamba2 head_dim 64,
# d_state 128, 8 groups, d_conv 4; conv state bf16, recurrent state fp32. CUDA: a
# Nemotron-H-sized 52-layer, 128-head model on one rank.
SSM_CPU_CASES = [(8, 16)]
SSM_CUDA_CASES = [(52, 128)]


def _best(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(layers: int, heads: int, tokens: int, device: str) -> tuple[int, float, float]:
    """(bytes digested, digest seconds, gather-copy seconds) of one request on one rank."""
    nb = -(-tokens // BLOCK)
    pool = nb * 2
    cache = torch.randn((2, layers, pool, BLOCK, heads, HEAD_DIM), device=device).to(torch.bfloat16)
    layout = KVShardLayout(layers, heads)
    geometry = KVGeometry.from_tensor(cache)
    ids = torch.randperm(pool, device=device)[:nb]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def digest() -> object:
        return kv_entries(cache, geometry, layout, ids.tolist(), tokens)

    def copy() -> object:
        return [cache[kv, layer].index_select(0, ids) for kv in range(2) for layer in range(layers)]

    nbytes = 2 * layers * tokens * heads * HEAD_DIM * 2
    repeats = 5 if device == "cuda" else 3
    return nbytes, _best(digest, sync, repeats), _best(copy, sync, repeats)


def measure_ssm(layers: int, heads: int, device: str) -> tuple[int, float, float]:
    """(bytes digested, digest seconds, copy seconds) of one slot's conv + recurrent state."""
    dims = SSMStateDims(num_heads=heads, head_dim=64, d_state=128, n_groups=8, d_conv=4)
    layout = SSMShardLayout(layers, dims)
    slots = 4
    conv = torch.randn((layers, slots, dims.conv_channels, 4), device=device).to(torch.bfloat16)
    rec = torch.randn((layers, slots, heads, 64, 128), device=device)
    geometry = SSMGeometry.from_tensors(conv=conv, recurrent=rec)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def digest() -> object:
        return conv_pieces(conv, geometry, layout, 2) + recurrent_pieces(rec, geometry, layout, 2)

    def copy() -> object:
        return conv[:, 2].clone(), rec[:, 2].clone()

    nbytes = conv[:, 2].numel() * 2 + rec[:, 2].numel() * 4
    repeats = 5 if device == "cuda" else 3
    return nbytes, _best(digest, sync, repeats), _best(copy, sync, repeats)


TITLE = "Integrity digest (`benches/bench_integrity.py`)"
INTRO = (
    "KV: one request on one rank (layers x KV heads x tokens; bf16, head_dim 128,\n"
    "64-token blocks, shuffled ids), `integrity.kv_entries` vs a torch gather copy of the\n"
    "same bytes (`index_select` per (kv, layer) plane). SSM: one slot's conv (bf16) and\n"
    "recurrent (fp32) state (head_dim 64, d_state 128, 8 groups), `conv_pieces` +\n"
    "`recurrent_pieces` vs a copy of the slot. Same run; best of 3 (CPU, 1 thread) or 5\n"
    "(CUDA)."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--write", help="results file to update")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    runs = [("cpu", c) for c in CPU_CASES]
    if torch.cuda.is_available():
        runs += [("cuda", c) for c in CUDA_CASES]
    ssm_runs = [("cpu", c) for c in SSM_CPU_CASES]
    if torch.cuda.is_available():
        ssm_runs += [("cuda", c) for c in SSM_CUDA_CASES]
    cases = [
        (d, f"KV {a} x {b} x {c}", functools.partial(measure, a, b, c, d)) for d, (a, b, c) in runs
    ]
    cases += [
        (d, f"SSM {a} x {b} heads, 1 slot", functools.partial(measure_ssm, a, b, d))
        for d, (a, b) in ssm_runs
    ]
    for device, what, run in cases:
        nbytes, t_digest, t_copy = run()
        rows.append(
            f"| {device} | {what} | {nbytes / 2**20:,.1f} MiB | "
            f"{t_digest * 1e3:,.1f} ms ({nbytes / t_digest / 1e9:.2f} GB/s) | "
            f"{t_copy * 1e3:,.1f} ms ({nbytes / t_copy / 1e9:.2f} GB/s) | "
            f"{t_digest / t_copy:.1f}x |"
        )
        print(rows[-1], flush=True)
    columns = ["device", "state", "bytes", "digest", "copy", "digest / copy"]
    publish(args.write, "integrity", table_section(TITLE, [INTRO], columns, rows))


if __name__ == "__main__":
    main()
