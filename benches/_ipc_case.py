"""The handoff the submit benches time: 8K tokens, TP2 -> TP1 head reshard, 80 layers, 8 KV
heads, head_dim 128, bf16, 64 tokens/block, random block ids, both sources and the decode
in this process on one GPU (the CUDA IPC path finds the sources' buffers in the
process-local table); and the host timer they share."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from disagg_rs.transfer_backends.nixl import NixlTransferBackend

LAYERS, HEADS, DIM, TPB = 80, 8, 128, 64
N_BLK = 128


@dataclass
class IpcCase:
    """The decode, the two source ranks, their metadata and one handoff's block ids."""

    dec: NixlTransferBackend
    sources: list[NixlTransferBackend]
    metas: list[Any]
    sids: dict[int, list[int]]
    dids: list[int]
    tokens: int

    def pull(self) -> Any:
        """One ``begin_pull_blocks`` of the handoff."""
        return self.dec.begin_pull_blocks(self.metas, self.sids, self.dids, num_tokens=self.tokens)

    def close(self) -> None:
        for b in (*self.sources, self.dec):
            b.close()


def options(
    doc: str | None, extra: Callable[[argparse.ArgumentParser], Any] | None = None
) -> argparse.Namespace:
    """The command line the submit benches share: ``--device`` and ``--repeat`` (``extra``
    adds a bench's own)."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--repeat", type=int, default=200)
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def build(
    device: str, *, random_sources: bool = False, staging_bytes: int | None = None
) -> IpcCase:
    """The case on ``device``; without ``staging_bytes`` its route opened by one pull that
    has landed, with them every rank gets a staging pool of that size (staged pulls)."""
    blocks = N_BLK + 8

    def cache(heads: int, fill: bool) -> torch.Tensor:
        shape = (2, LAYERS, blocks, TPB, heads, DIM)
        if fill:
            return torch.randn(shape, dtype=torch.bfloat16, device=device)
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)

    kw: dict[str, Any] = {"num_kv_heads_global": HEADS, "mode": "staged"}
    if staging_bytes is not None:
        kw["staging_bytes"] = staging_bytes
    dec = NixlTransferBackend("dec", cache(HEADS, False), blocks, **kw)
    root = NixlTransferBackend(
        "pre", cache(HEADS // 2, random_sources), blocks, tp_size=2, tp_rank=0, global_rank=0, **kw
    )
    other = root.new_registered_buffer(
        memory_buffer=cache(HEADS // 2, random_sources),
        expected_num_blocks=blocks,
        tp_size=2,
        tp_rank=1,
        global_rank=1,
        **kw,
    )
    rng = np.random.default_rng(0)
    case = IpcCase(
        dec=dec,
        sources=[other, root],
        metas=[b.export_meta() for b in (root, other)],
        sids={r: [int(x) for x in rng.permutation(blocks)[:N_BLK]] for r in range(2)},
        dids=[int(x) for x in rng.permutation(blocks)[:N_BLK]],
        tokens=N_BLK * TPB,
    )
    if staging_bytes is None:
        first = case.pull()
        first.wait()
        print("modes", first.stats.get("modes"))
    return case


def stage(name: str, fn: Callable[[], Any], repeat: int, idle_s: float = 0.0) -> float:
    """Median host time of ``fn`` in us over ``repeat`` calls, the GPU queue drained between
    calls (``idle_s``: a sleep before each, so the call starts on an idle core); printed as a
    table row."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
    med = statistics.median(times) / 1e3
    print(f"| {name} | {med:,.1f} |", flush=True)
    return med
