"""How to queue one same-host pull with the least host time: the ways of launching the
device-plan copy of an 8K-token TP2 -> TP1 handoff (80 layers, 8 KV heads, head_dim 128,
bf16, 64 tokens/block, random block ids), each timed on the host with
``time.perf_counter_ns``, warm and after 0.5 ms idle, and the GPU time of the copy.

Rows: the library's call (``PullRoute.run``: ids checked and written by Rust, upload,
launch, event); Triton's launcher alone with prepared arguments; the upload + launch
captured once in a CUDA graph and replayed; the kernel reading the block ids straight from
the pinned host slot (no upload); a trivial torch launch as the host's floor. Every variant
is checked byte-exact against the library's call. Needs a CUDA GPU and NIXL.

Command: ``python benches/bench_launch_paths.py [--device cuda:0] [--repeat 200]``.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from _ipc_case import TPB, build, options
from _ipc_case import stage as timed
from bench_gpu import cuda_ms as gpu_ms
from disagg_rs import _core
from disagg_rs.transfer_backends import nixl
from disagg_rs.transfer_backends.device_plan import BLOCK


def main() -> None:
    args = options(__doc__)
    dev_index = torch.device(args.device).index or 0
    case = build(args.device, random_sources=True)
    dec, metas, sids, dids, tokens = case.dec, case.metas, case.sids, case.dids, case.tokens
    dst = dec.memory_buffer
    want = dst.clone()
    stage = functools.partial(timed, repeat=args.repeat)

    def check(name: str) -> None:
        torch.cuda.synchronize()
        ok = bool(torch.equal(dst, want))
        print(f"  {name}: byte-exact {ok}", flush=True)
        dst.zero_()
        torch.cuda.synchronize()

    peers, ids = dec._resolve_peers(metas, sids)
    route = dec._ipc_routes[tuple(map(id, peers))]
    assert isinstance(route, nixl._IpcRoute) and route.copy is not None
    pr = route.copy
    assert len(pr.copies) == 1, "the two source ranks' plans should merge"
    launch, first_set = pr.copies[0]
    kw2: dict[str, Any] = {
        "local_num_blocks": dec.expected_num_blocks,
        "local_tokens_per_block": dec.tokens_per_block,
        "tokens_per_block": pr.tokens_per_block,
    }
    run_kw = {"local_num_blocks": dec.expected_num_blocks, "local_tokens_per_block": TPB}
    print("| stage (host us, median) | us |\n|---|---:|")
    stage(
        "whole call, begin_pull_blocks",
        lambda: dec.begin_pull_blocks(metas, sids, dids, num_tokens=tokens),
    )
    stage(
        "whole call, after 0.5 ms idle",
        lambda: dec.begin_pull_blocks(metas, sids, dids, num_tokens=tokens),
        idle_s=0.0005,
    )
    stage("PullRoute.run", lambda: pr.run(peers, ids, dids, tokens, **run_kw))
    stage(
        "PullRoute.run, after 0.5 ms idle",
        lambda: pr.run(peers, ids, dids, tokens, **run_kw),
        idle_s=0.0005,
    )
    dst.zero_()
    pr.run(peers, ids, dids, tokens, **run_kw)
    check("PullRoute.run")

    # PullRoute.run step by step (the same calls, a timestamp between each).
    up = dec._ids
    names = ["ids length", "take slot", "check + write ids (Rust)", "device guard", "ids view",
             "raw stream", "launch (PreparedCopy)", "event record", "guard exit"]  # fmt: skip

    def steps() -> list[int]:
        t = [time.perf_counter_ns()]
        n_ids = _core.pull_ids_len(dids, len(pr.ranks))
        t.append(time.perf_counter_ns())
        slot, host = up.take(n_ids)
        t.append(time.perf_counter_ns())
        got = _core.write_pull_ids(host, peers, pr.ranks, ids, dids, tokens, **kw2)
        t.append(time.perf_counter_ns())
        assert got is not None
        n_tok, _, stride, n = got
        with torch.cuda.device(pr.index):
            t.append(time.perf_counter_ns())
            dev_ids = up.view(slot, host, n)
            t.append(time.perf_counter_ns())
            raw_s = torch._C._cuda_getCurrentRawStream(pr.index)
            t.append(time.perf_counter_ns())
            launch(n_tok, dev_ids[(first_set + 1) * stride :], dev_ids, raw_s, a_set=stride)
            t.append(time.perf_counter_ns())
            pr._record(slot, raw_s)
            t.append(time.perf_counter_ns())
        t.append(time.perf_counter_ns())
        return [b - a for a, b in itertools.pairwise(t)]

    for idle in (0.0, 0.0005):
        rows: list[list[int]] = []
        for _ in range(args.repeat):
            if idle:
                time.sleep(idle)
            rows.append(steps())
            torch.cuda.synchronize()
        med = [statistics.median(col) / 1e3 for col in zip(*rows, strict=False)]
        label = "after 0.5 ms idle" if idle else "warm"
        parts = ", ".join(f"{nm} {v:.1f}" for nm, v in zip(names, med, strict=False))
        print(f"PullRoute.run steps ({label}): {parts}; sum {sum(med):.1f}")

    # The ids of one handoff in a slot of the uploader, on the device.
    n_ids = _core.pull_ids_len(dids, len(pr.ranks))
    slot, host = dec._ids.take(n_ids)
    got = _core.write_pull_ids(host, peers, pr.ranks, ids, dids, tokens, **kw2)
    assert got is not None
    stride, n = got[2], got[3]
    hview = dec._ids.view(slot, host, n)
    dev = hview.to(args.device)
    raw = torch._C._cuda_getCurrentRawStream(dev_index)
    stage("ids view of the slot (no copy)", lambda: dec._ids.view(slot, host, n))
    stage(
        "PreparedCopy call",
        lambda: launch(tokens, dev[(first_set + 1) * stride :], dev, raw, a_set=stride),
    )
    stage(
        "PreparedCopy call, after 0.5 ms idle",
        lambda: launch(tokens, dev[(first_set + 1) * stride :], dev, raw, a_set=stride),
        idle_s=0.0005,
    )
    dst.zero_()
    launch(tokens, dev[(first_set + 1) * stride :], dev, raw, a_set=stride)
    check("PreparedCopy")

    # Triton's launcher alone, arguments prepared once.
    key = (dev[(first_set + 1) * stride :].data_ptr() % 16 == 0, dev.data_ptr() % 16 == 0)
    compiled = launch._compiled[key]
    grid = launch.plan.num_planes * launch.plan.num_blocks(tokens)

    def raw_args_b(a_ptr: int, b_ptr: int) -> tuple[Any, ...]:
        return (*launch._ptrs, a_ptr, b_ptr, launch.plan.num_blocks(tokens), tokens,
                launch.plan.tokens_per_block, 0, *launch._consts, stride, 0, False, False,
                launch._vec, BLOCK)  # fmt: skip

    dev_args = raw_args_b(dev[(first_set + 1) * stride :].data_ptr(), dev.data_ptr())

    def triton_raw(a: tuple[Any, ...] = dev_args) -> None:
        compiled.run(grid, 1, 1, raw, compiled.function, compiled.packed_metadata, None, None,
                     None, *a)  # fmt: skip

    stage("Triton launcher alone (compiled.run, prepared arguments)", triton_raw)
    stage("Triton launcher alone, after 0.5 ms idle", triton_raw, idle_s=0.0005)
    dst.zero_()
    triton_raw()
    check("Triton launcher")
    print(f"  GPU time, ids on the device: {gpu_ms(triton_raw):.3f} ms", flush=True)

    # The kernel reading the ids from the pinned host slot (UVA: host pointer usable on device).
    hslot = dec._ids._slots[slot][0]
    host_args = raw_args_b(hslot[(first_set + 1) * stride :].data_ptr(), hslot.data_ptr())
    stage("launch reading ids from pinned host memory (no upload)", lambda: triton_raw(host_args))
    stage(
        "launch reading ids from pinned host memory, after 0.5 ms idle",
        lambda: triton_raw(host_args),
        idle_s=0.0005,
    )
    dst.zero_()
    triton_raw(host_args)
    check("ids from pinned host memory")
    print(
        f"  GPU time, ids in pinned host memory: {gpu_ms(lambda: triton_raw(host_args)):.3f} ms",
        flush=True,
    )

    # Upload + launch captured once in a CUDA graph.
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            dev.copy_(hview, non_blocking=True)
            launch(tokens, dev[(first_set + 1) * stride :], dev, side.cuda_stream, a_set=stride)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(g):
            cap = torch.cuda.current_stream().cuda_stream
            dev.copy_(hview, non_blocking=True)
            launch(tokens, dev[(first_set + 1) * stride :], dev, cap, a_set=stride)
        stage("CUDA graph replay (upload + launch)", g.replay)
        stage("CUDA graph replay, after 0.5 ms idle", g.replay, idle_s=0.0005)
        dst.zero_()
        g.replay()
        check("CUDA graph")
    except Exception as exc:  # report and go on: the other rows stand
        print(f"  CUDA graph capture failed: {exc!r}", flush=True)
    dec._ids.settle(slot, None)

    small = torch.zeros(16, device=args.device)
    # The same variants interleaved (shuffled order each round), so that host drift during
    # the run weighs on all of them alike: the fair comparison.
    from triton import knobs

    def triton_with_chains() -> None:  # how a launch with Triton's hook chains passed costs
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = compiled.launch_metadata((grid, 1, 1), raw, *dev_args)
        compiled.run(grid, 1, 1, raw, compiled.function, compiled.packed_metadata, meta, enter,
                     leave, *dev_args)  # fmt: skip

    hv = hslot[:n]
    dev_a, hv_a = dev[(first_set + 1) * stride :], hv[(first_set + 1) * stride :]

    def route_call() -> None:
        pr.run(peers, ids, dids, tokens, **run_kw)

    variants: dict[str, Callable[[], Any]] = {
        "PullRoute.run (the library's route call)": route_call,
        "PreparedCopy, ids on the device": lambda: launch(tokens, dev_a, dev, raw, a_set=stride),
        "PreparedCopy, ids in the pinned slot": lambda: launch(tokens, hv_a, hv, raw, a_set=stride),
        "Triton launcher, no hooks": triton_raw,
        "Triton launcher, empty hook chains passed (as before)": triton_with_chains,
        "trivial torch launch": lambda: small.add_(1),
    }
    order = list(variants)
    shuffle = np.random.default_rng(1)
    for idle in (0.0, 0.0005):
        samples: dict[str, list[int]] = {k: [] for k in order}
        for _ in range(args.repeat):
            shuffle.shuffle(order)
            for k in order:
                torch.cuda.synchronize()
                if idle:
                    time.sleep(idle)
                t0 = time.perf_counter_ns()
                variants[k]()
                samples[k].append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        label = "after 0.5 ms idle" if idle else "warm"
        for k, v in samples.items():
            q1, med, q3 = np.percentile(np.asarray(v) / 1e3, [25, 50, 75])
            print(f"| interleaved, {label}: {k} | {med:,.1f} (p25 {q1:,.1f}, p75 {q3:,.1f}) |")
    stage("baseline: one trivial torch kernel launch", lambda: small.add_(1))
    stage("baseline: trivial torch launch, after 0.5 ms idle", lambda: small.add_(1), idle_s=0.0005)
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    cur = torch.cuda.current_stream()
    stage("event record (kept event)", lambda: ev.record(cur))

    def device_guard() -> None:
        with torch.cuda.device(dev_index):
            pass

    stage("torch.cuda.device(i) enter + exit", device_guard)
    case.close()


if __name__ == "__main__":
    main()
