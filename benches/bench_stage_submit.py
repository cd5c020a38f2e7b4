"""Host time of ``stage_blocks`` (NIXL staged path, no CUDA IPC) for an 8K-token TP2 ->
TP1 handoff (the geometry of ``_ipc_case``): each source rank stages its copy for the
decode and releases it, the GPU queue drained between calls; ``--profile`` prints where the
call spends its time (cProfile, by own time). ``--pool-mib 256``: a pool smaller than the
copy, which is then streamed. ``--queued N``: also N calls back to back (the ranks by turns,
the GPU queue not drained: each call finds the packs of the ones before still queued),
then one drain and the releases; the median over every call but each round's first.
``--busy-ms T``: each call also with the GPU queue not drained, for a streamed copy too
(a pool smaller than the copy): a kernel of about T ms is queued before the call, so the
call's packs queue behind it; then one drain and the release.

Command: ``python benches/bench_stage_submit.py [--device cuda:0] [--repeat 50]
[--pool-mib 4096] [--queued 8 --pool-mib 16384] [--busy-ms 3 --pool-mib 256] [--profile]``.
Needs a CUDA GPU and NIXL.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

os.environ["DISAGG_CUDA_IPC"] = "0"  # the network path: staged pack, READ, scatter

from _ipc_case import build, options


def main() -> None:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--pool-mib", type=int, default=4096, help="staging pool per rank")
        ap.add_argument("--profile", action="store_true", help="cProfile 20 more calls")
        ap.add_argument("--queued", type=int, default=0, help="calls back to back per round")
        ap.add_argument("--busy-ms", type=float, default=0.0, help="GPU kept busy per call")

    args = options(__doc__, extra)
    case = build(args.device, staging_bytes=args.pool_mib << 20)
    dec, (other, root) = case.dec, case.sources
    dst_meta = dec.export_meta()
    ranks = [(root, 0), (other, 1)]
    stage_us: list[float] = []
    busy: list[float] = []
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_980_000)  # SM clock
    cycles = int(args.busy_ms * khz)

    def stage_only(times: list[float] = stage_us, sleep: int = 0) -> None:
        """Each rank stages its copy and releases it (no read: the host time of the call);
        with ``sleep``, behind a kernel of that many GPU cycles (its packs queue)."""
        for b, r in ranks:
            if sleep:
                torch.cuda._sleep(sleep)  # type: ignore[no-untyped-call]
            t0 = time.perf_counter_ns()
            t = b.stage_blocks(dst_meta, case.sids[r], src_metas=case.metas,
                               num_tokens=case.tokens)  # fmt: skip
            times.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            b.poll_streams()
            b.release_staged(t)

    stage_only()
    stage_us.clear()
    for _ in range(args.repeat):
        stage_only()
    print(f"| stage_blocks, each source rank (median of {len(stage_us)}) | "
          f"{statistics.median(stage_us):,.1f} us |")  # fmt: skip
    if args.queued > 1:
        queued: list[float] = []
        for _ in range(max(args.repeat // args.queued, 3)):
            tickets = []
            for k in range(args.queued):
                b, r = ranks[k % 2]
                t0 = time.perf_counter_ns()
                tickets.append((b, b.stage_blocks(dst_meta, case.sids[r], src_metas=case.metas,
                                                  num_tokens=case.tokens)))  # fmt: skip
                queued.append((time.perf_counter_ns() - t0) / 1e3 if k else -1.0)
                assert tickets[-1][1]["staged"] and "stream" not in tickets[-1][1], "pool too small"
            torch.cuda.synchronize()
            for b, t in tickets:
                b.poll_streams()
                b.release_staged(t)
        kept = [q for q in queued if q >= 0]
        print(f"| stage_blocks, {args.queued} back to back, GPU queue not drained (median of "
              f"{len(kept)}) | {statistics.median(kept):,.1f} us |")  # fmt: skip
    if args.busy_ms > 0:
        for _ in range(args.repeat):
            stage_only(busy, cycles)
        print(f"| stage_blocks, GPU busy {args.busy_ms:g} ms before each call (median of "
              f"{len(busy)}) | {statistics.median(busy):,.1f} us |")  # fmt: skip
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            stage_only(busy, cycles)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    case.close()


if __name__ == "__main__":
    main()
