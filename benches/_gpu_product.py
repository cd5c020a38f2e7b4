"""The product path between processes (``bench_gpu.py --product``): NixlTransferBackend in a
prefill and a decode process, the Megatron layout ``[2, L, B, T, H, d]`` (80 layers, 8 KV
heads, head_dim 128, bf16, 64 tokens/block), block ids a random permutation, byte-exact
check after every row. Time: stage start (or pull call) -> scatter end, host clock
(CLOCK_MONOTONIC, shared by the processes), median of repeats after one warm-up.

Paths: "ipc" (same host: CUDA IPC mapping + one device-plan kernel per source, chosen
automatically), "staged" (NIXL over UCX with the IPC path turned off: pack on the prefill,
one READ of the packed region, scatter on the decode), "chunked" (the same with a 256 MiB
decode pool: the packed region read in chunks, each scattered while the next is read) and
"direct" (NIXL, one descriptor per (block, plane): the per-descriptor way).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np

LAYERS, HEADS, DIM, TPB = 80, 8, 128, 64


def _shape(blocks: int, heads: int) -> tuple[int, ...]:
    return (2, LAYERS, blocks, TPB, heads, DIM)


def _handoff(tokens: int, src_tp: int) -> tuple[int, list[list[int]], list[int], int]:
    """``(blocks per cache, each source's ids, the decode's ids, bytes)`` of a
    ``tokens``-token handoff: ids a random permutation of each cache (8 blocks spare)."""
    n_blk = tokens // TPB
    blocks = n_blk + 8
    rng = np.random.default_rng(tokens + src_tp)
    src_ids = [[int(x) for x in rng.permutation(blocks)[:n_blk]] for _ in range(src_tp)]
    dst_ids = [int(x) for x in rng.permutation(blocks)[:n_blk]]
    return blocks, src_ids, dst_ids, 2 * LAYERS * tokens * HEADS * DIM * 2


def _cache(blocks: int, heads: int, fill_seed: int | None) -> Any:
    """A bf16 KV cache on the current GPU: random bits from ``fill_seed``, or all ones
    (``-1`` as int16) when ``None``."""
    import torch

    buf = torch.empty(_shape(blocks, heads), dtype=torch.bfloat16, device="cuda")
    bits = buf.view(torch.int16)
    if fill_seed is None:
        bits.fill_(-1)
    else:
        g = torch.Generator(device="cuda").manual_seed(fill_seed)
        bits.copy_(torch.randint(-(2**15), 2**15, buf.shape, generator=g, device="cuda",
                                 dtype=torch.int16))  # fmt: skip
    return buf


class _LayoutKw(TypedDict):
    tp_size: int
    tp_rank: int
    global_rank: int
    num_kv_heads_global: int


def _layout(tp: int, rank: int, grank: int) -> _LayoutKw:
    """A backend's layout keywords for rank ``rank`` (global ``grank``) of a TP ``tp`` engine."""
    return {"tp_size": tp, "tp_rank": rank, "global_rank": grank, "num_kv_heads_global": HEADS}


def _worker(conn: Any, device: int, ipc: bool) -> None:
    os.environ.pop("UCX_TLS", None)
    os.environ["DISAGG_CUDA_IPC"] = "1" if ipc else "0"
    import torch

    from disagg_rs.transfer_backends.nixl import NixlTransferBackend

    torch.cuda.set_device(device)
    root: Any = None
    backends: dict[str, Any] = {}
    handles: dict[str, Any] = {}
    name = f"w{os.getpid()}"
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                conn.send((True, None))
                os._exit(0)
            if cmd == "dist_init":
                import datetime

                import torch.distributed as dist

                rank, world, port = args
                dist.init_process_group(
                    "nccl",
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=rank,
                    world_size=world,
                    timeout=datetime.timedelta(seconds=300),
                )
                conn.send((True, None))
            elif cmd == "make_nccl":
                from disagg_rs.transfer_backends.nccl import NcclTransferBackend

                key, blocks, tp, rank, grank, fill_seed = args
                buf = _cache(blocks, HEADS // tp, fill_seed)
                backends[key] = NcclTransferBackend(name, buf, blocks, **_layout(tp, rank, grank))
                torch.cuda.synchronize()
                conn.send((True, backends[key].export_meta()))
            elif cmd == "post":
                key, method, a, kw = args
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                handles[key] = getattr(backends[key], method)(*a, **kw)
                conn.send((True, (t0, time.perf_counter())))
            elif cmd == "wait":
                (key,) = args
                handles[key].wait()
                conn.send((True, (time.perf_counter(), dict(handles[key].stats))))
            elif cmd == "make":
                key, blocks, tp, rank, grank, fill_seed, staging, mode = args
                buf = _cache(blocks, HEADS // tp, fill_seed)
                kw = {**_layout(tp, rank, grank), "staging_bytes": staging, "mode": mode}
                if root is None:
                    root = NixlTransferBackend(name, buf, blocks, **kw)
                    backends[key] = root
                else:
                    backends[key] = root.new_registered_buffer(
                        memory_buffer=buf, expected_num_blocks=blocks, **kw
                    )
                torch.cuda.synchronize()
                conn.send((True, backends[key].export_meta()))
            elif cmd == "stage":
                key, dst_meta, ids, src_metas, n = args
                t0 = time.perf_counter()
                ticket = backends[key].stage_blocks(
                    dst_meta, ids, src_metas=src_metas, num_tokens=n
                )
                conn.send((True, (ticket, t0, time.perf_counter())))
            elif cmd == "pump":
                # The prefill's turn while a decode reads a streamed copy: poll until every
                # stream of this backend ended (acknowledged, given up or expired).
                key, limit_s = args
                polls, until = 0, time.perf_counter() + limit_s
                while backends[key].poll_streams() and time.perf_counter() < until:
                    polls += 1
                conn.send((True, (polls, backends[key].staging_stats())))
            elif cmd == "release":
                key, ticket = args
                backends[key].release_staged(ticket)
                conn.send((True, None))
            elif cmd == "pull":
                key, metas, sids, dids, n, tickets = args
                t0 = time.perf_counter()
                h = backends[key].begin_pull_blocks(metas, sids, dids, num_tokens=n, staged=tickets)
                t1 = time.perf_counter()
                h.wait()
                t2 = time.perf_counter()
                handles[key] = h
                conn.send((True, (t0, t1, t2, dict(h.stats))))
            elif cmd == "submit_only":
                # Host time of the call alone, the GPU queue left running; waited after.
                key, metas, sids, dids, n, reps = args
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    h = backends[key].begin_pull_blocks(metas, sids, dids, num_tokens=n)
                    times.append(time.perf_counter() - t0)
                    h.wait()
                prof_dir = os.environ.get("BENCH_PROFILE_DIR")
                if prof_dir:
                    import cProfile
                    import io
                    import pstats

                    prof = cProfile.Profile()
                    for _ in range(20):
                        prof.enable()
                        h = backends[key].begin_pull_blocks(metas, sids, dids, num_tokens=n)
                        prof.disable()
                        h.wait()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
                    with open(os.path.join(prof_dir, "submit_profile.txt"), "w") as f:
                        f.write(text.getvalue())
                conn.send((True, times))
            elif cmd == "submit_queued":
                # Host time of back-to-back calls, the GPU queue never drained between them
                # (each handoff still copying when the next is queued); waited after. Two
                # rounds, the second timed: the first grows the id ring to the depth of the
                # queue, as a serving decode's ring has grown by then (steady state).
                key, metas, sids, dids, n, reps = args
                for _ in range(2):
                    times, queued = [], []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        h = backends[key].begin_pull_blocks(metas, sids, dids, num_tokens=n)
                        times.append(time.perf_counter() - t0)
                        queued.append(h)
                    for h in queued:
                        h.wait()
                conn.send((True, times))
            elif cmd == "check":
                # dst blocks == the sources' blocks (regenerated from their seeds) head slices.
                key, sources, dids, n = args
                dst = backends[key].memory_buffer
                did = torch.tensor(dids, device="cuda")
                ok = True
                for seed, blocks, tp, rank, sids in sources:
                    heads = HEADS // tp
                    g = torch.Generator(device="cuda").manual_seed(seed)
                    src = torch.randint(
                        -(2**15),
                        2**15,
                        _shape(blocks, heads),
                        generator=g,
                        device="cuda",
                        dtype=torch.int16,
                    )
                    sid = torch.tensor(sids, device="cuda")
                    want = src.index_select(2, sid)
                    got = dst.view(torch.int16).index_select(2, did)[
                        ..., rank * heads : (rank + 1) * heads, :
                    ]
                    full = n // TPB
                    ok &= bool(torch.equal(want[:, :, :full], got[:, :, :full]))
                    del src, want, got
                torch.cuda.empty_cache()
                conn.send((True, ok))
            elif cmd == "reset":
                (key,) = args
                backends[key].memory_buffer.view(torch.int16).fill_(-1)
                torch.cuda.synchronize()
                conn.send((True, None))
            elif cmd == "close":
                for b in list(backends.values())[::-1]:
                    b.close()
                backends.clear()
                root = None
                torch.cuda.empty_cache()
                conn.send((True, None))
        except BaseException as exc:  # report, keep serving
            import traceback

            conn.send((False, f"{exc!r}\n{traceback.format_exc()}"))


def run_nccl_case(
    *, tokens: int, src_tp: int, devices: Sequence[int], repeat: int = 3
) -> dict[str, Any]:
    """NCCL push/pull between processes: prefill ranks on ``devices[0]``, decode on
    ``devices[1]``; post start (earliest of both sides) -> decode's scatter end."""
    import random

    blocks, src_ids, dst_ids, nbytes = _handoff(tokens, src_tp)
    pres = [_Proc(devices[0], False) for _ in range(src_tp)]
    dec = _Proc(devices[1], False)
    procs = [*pres, dec]
    port = random.randint(20000, 40000)
    try:
        for r, p in enumerate(procs):
            p.conn.send(("dist_init", (r, len(procs), port)))
        for p in procs:
            if not p.conn.poll(300):
                raise TimeoutError("dist_init")
            ok, value = p.conn.recv()
            if not ok:
                raise RuntimeError(value)
        src_metas = [
            p("make_nccl", "kv", blocks, src_tp, r, r, 1000 + r) for r, p in enumerate(pres)
        ]
        dst_meta = dec("make_nccl", "kv", blocks, 1, 0, src_tp, None)
        sids = {r: src_ids[r] for r in range(src_tp)}
        times, ok_all, stats = [], True, {}
        for rep in range(repeat + 1):
            dec("reset", "kv")
            tag = rep + 1
            dec.conn.send(("post", ("kv", "begin_pull_blocks", (src_metas, sids, dst_ids),
                                    {"num_tokens": tokens, "tag": tag})))  # fmt: skip
            for r, p in enumerate(pres):
                p.conn.send(("post", ("kv", "begin_push_blocks", (dst_meta, src_ids[r]),
                                      {"src_metas": src_metas, "num_tokens": tokens,
                                       "tag": tag})))  # fmt: skip
            starts = []
            for p in procs:
                ok, value = p.conn.recv()
                if not ok:
                    raise RuntimeError(value)
                starts.append(value[0])
            for p in pres:
                p("wait", "kv")
            t_end, stats = dec("wait", "kv")
            times.append(t_end - min(starts))
            ok_all &= dec(
                "check", "kv",
                [(1000 + r, blocks, src_tp, r, src_ids[r]) for r in range(src_tp)], dst_ids,
                tokens,
            )  # fmt: skip
        med = statistics.median(times[1:])
        return {"bytes": nbytes, "s": med, "gbps": nbytes / med / 1e9, "exact": ok_all,
                "stats": stats}  # fmt: skip
    finally:
        for p in procs:
            p.stop()


class _Proc:
    def __init__(self, device: int, ipc: bool) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_worker, args=(child, device, ipc), daemon=True)
        self.p.start()

    def __call__(self, cmd: str, *args: Any) -> Any:
        self.send(cmd, *args)
        return self.receive(cmd)

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def receive(self, cmd: str) -> Any:
        if not self.conn.poll(600):
            raise TimeoutError(cmd)
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self("exit")
        self.p.join(10)
        if self.p.is_alive():
            self.p.kill()


def run_case(
    *, tokens: int, src_tp: int, devices: Sequence[int], path: str, repeat: int = 3
) -> dict[str, Any]:
    """One row: ``src_tp`` prefill ranks on ``devices[0]``, the decode on ``devices[1]``."""
    ipc = path == "ipc"
    mode = {"ipc": "staged", "direct": "direct"}.get(path, "staged")
    staged = path in ("staged", "chunked", "streamed")
    blocks, src_ids, dst_ids, nbytes = _handoff(tokens, src_tp)
    pool = 256 << 20
    # "streamed": both pools 256 MiB, far smaller than the packed copy: the prefill packs it
    # chunk by chunk as the decode acknowledges. "chunked": only the decode's pool is.
    staging = 0 if not staged else (pool if path == "streamed" else nbytes // src_tp + (1 << 20))
    dst_staging = 0 if not staged else (pool if path != "staged" else nbytes + (1 << 20))
    pres = [_Proc(devices[0], ipc) for _ in range(src_tp)]
    dec = _Proc(devices[1], ipc)
    try:
        src_metas = [
            p("make", "kv", blocks, src_tp, r, r, 1000 + r, staging, mode)
            for r, p in enumerate(pres)
        ]
        dst_meta = dec("make", "kv", blocks, 1, 0, 100, None, dst_staging, mode)
        sids = {r: src_ids[r] for r in range(src_tp)}
        times, ok_all, stats = [], True, {}
        calls: list[tuple[float, float]] = []  # host time of stage_blocks (slowest rank), pull
        for _ in range(repeat + 1):
            dec("reset", "kv")
            tickets, outs = [], []
            t_start = time.perf_counter()
            if staged:
                outs = [
                    p("stage", "kv", dst_meta, src_ids[r], src_metas, tokens)
                    for r, p in enumerate(pres)
                ]
                tickets = [o[0] for o in outs]
                t_start = min(o[1] for o in outs)
            if path == "streamed":
                for p in pres:  # each prefill polls its streams while the decode reads
                    p.send("pump", "kv", 120.0)
            t_call, t_ret, t_end, stats = dec(
                "pull", "kv", src_metas, sids, dst_ids, tokens, tickets
            )
            calls.append((max((o[2] - o[1] for o in outs), default=0.0), t_ret - t_call))
            if path == "streamed":
                pumped = [p.receive("pump") for p in pres]
                assert all(s["streams"] == 0 for _, s in pumped), pumped
                assert set(stats["modes"].values()) == {"streamed"}, stats
            if not staged:
                t_start = t_call
            times.append(t_end - t_start)
            for r, p in enumerate(pres):
                if tickets:
                    p("release", "kv", tickets[r])
            ok_all &= dec(
                "check",
                "kv",
                [(1000 + r, blocks, src_tp, r, src_ids[r]) for r in range(src_tp)],
                dst_ids,
                tokens,
            )
        med = statistics.median(times[1:])
        out: dict[str, Any] = {
            "bytes": nbytes,
            "s": med,
            "gbps": nbytes / med / 1e9,
            "exact": ok_all,
            "stats": stats,
        }
        if staged:
            out["stage_call_us"] = statistics.median(c[0] for c in calls[1:]) * 1e6
            out["pull_call_us"] = statistics.median(c[1] for c in calls[1:]) * 1e6
        if path == "ipc" and src_tp == 2:
            sub = dec("submit_only", "kv", src_metas, sids, dst_ids, tokens, 50)
            out["submit_us"] = statistics.median(sub) * 1e6
            queued = dec("submit_queued", "kv", src_metas, sids, dst_ids, tokens, 50)
            out["submit_queued_us"] = statistics.median(queued) * 1e6
        return out
    finally:
        for p in [*pres, dec]:
            with contextlib.suppress(Exception):
                p("close")
            p.stop()
