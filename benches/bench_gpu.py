"""GPU bench (one H200, or any CUDA GPU): pack/scatter kernels and same-GPU staged handoffs.

One command: ``python benches/bench_gpu.py --write benches/RESULTS.md`` (about a minute on an
H200, under 12 GiB of GPU memory, no NIXL needed). Measures, in one run:

- device copy ceiling: one 1 GiB ``copy_`` (payload GB/s, bytes counted once);
- gather and scatter kernel GB/s for 32 KiB, 1 KiB and 256 B fragments (1 GiB in all, at
  shuffled positions), against torch ``index_select`` / ``index_copy_`` (``staging.pack_torch``
  / ``scatter_torch``, the CPU path) on the same fragments; the kernel's launch shape is swept
  and the best and default are both shown;
- same-GPU handoff of 1 GiB of KV in 32,768 slices of 32 KiB: staged (pack -> one copy of the
  packed region -> scatter, effective GB/s from pack start to scatter end), staged pipelined
  (``kernels.pipelined_handoff``, three streams), and the per-slice baseline (32,768 ``copy_``
  calls, what one descriptor per slice costs without NIXL's extra ~8 us each);
- TP2 -> TP1 head reshard of an 8K-token prompt in docs/architecture.md §8 geometry (80 layers,
  8 KV heads, head_dim 128, bf16, 64 tokens/block, Megatron layout): scatter fragments of
  1 KiB; both sources packed, moved, scattered; strided runs and flat lists;
- compile + submit host time per handoff for an 8K-token prompt (compile, lists, run table
  to the device, launches; the GPU work itself is not waited for).

Timings are CUDA events, median of repeats after warm-up. Ratios come from this one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import machine_line, write_section
from disagg_rs import KVGeometry, KVShardLayout, compile_kv_transfer
from disagg_rs.transfer_backends import kernels, staging

GIB = 1 << 30
#: Device the buffers live on (a CPU dry run of the script's logic swaps it).
DEVICE = "cuda"
CONFIGS = [
    kernels.DEFAULT_CONFIG,
    kernels.KernelConfig(block=1024, sub=4, num_warps=4),
    kernels.KernelConfig(block=2048, sub=8, num_warps=8),
    kernels.KernelConfig(block=512, sub=32, num_warps=4),
]
# docs/architecture.md §8 geometry.
LAYERS, HEADS, DIM, TPB = 80, 8, 128, 64


def cuda_ms(fn: Callable[[], Any], repeat: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` on the current stream (events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(repeat):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    """Payload GB/s (10**9 bytes per second), bytes counted once."""
    return nbytes / (ms * 1e-3) / 1e9


def shuffled_fragments(frag: int, total: int, seed: int) -> np.ndarray:
    """Byte offsets of ``total // frag`` fragments at shuffled slots of a ``total`` buffer."""
    return np.random.default_rng(seed).permutation(total // frag).astype(np.int64) * frag


def bench_copy(total: int) -> float:
    """Device-to-device copy ceiling for one ``total``-byte copy."""
    a = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    ms = cuda_ms(lambda: b.copy_(a))
    return gbps(total, ms)


def bench_kernels(frag: int, total: int) -> dict[str, Any]:
    """Gather and scatter of ``total`` bytes in ``frag``-byte fragments: kernel and torch."""
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=DEVICE)
    region = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    n = total // frag
    offs = shuffled_fragments(frag, total, seed=frag)
    packed = np.arange(n, dtype=np.int64) * frag
    lens = np.full(n, frag, dtype=np.int64)
    gather = np.stack([offs, lens, packed], axis=1).astype(np.uint64)
    scatter_list = np.stack([packed, offs, lens], axis=1).astype(np.uint64)
    t0 = time.perf_counter()
    g = kernels.build_run_table(
        gather, "gather", 0, device=DEVICE, other_limit=total, packed_limit=total
    )
    host_ms = (time.perf_counter() - t0) * 1e3
    s = kernels.build_run_table(
        scatter_list, "scatter", 0, device=DEVICE, other_limit=total, packed_limit=total
    )
    assert g is not None and s is not None
    out: dict[str, Any] = {"frag": frag, "n": n, "table_ms": host_ms, "configs": {}}
    for cfg in CONFIGS:

        def do_gather(c: kernels.KernelConfig = cfg) -> None:
            kernels.copy_runs(g, src, region, gather=True, config=c)

        def do_scatter(c: kernels.KernelConfig = cfg) -> None:
            kernels.copy_runs(s, dst, region, gather=False, config=c)

        out["configs"][cfg] = (gbps(total, cuda_ms(do_gather)), gbps(total, cuda_ms(do_scatter)))
    # Correctness of what was just timed (byte-exact against the torch path).
    ref = torch.empty_like(region)
    staging.pack_torch(src, 0, gather, ref)
    kernels.copy_runs(g, src, region, gather=True)
    torch.cuda.synchronize()
    assert torch.equal(ref, region), "gather kernel differs from torch"
    out["torch_gather"] = gbps(total, cuda_ms(lambda: staging.pack_torch(src, 0, gather, ref), 5))
    out["torch_scatter"] = gbps(
        total, cuda_ms(lambda: staging.scatter_torch(ref, dst, 0, scatter_list), 5)
    )
    rows = src.view(torch.int64).view(n, frag // 8)
    index = torch.from_numpy(offs // frag).to(DEVICE)
    out["index_select"] = gbps(total, cuda_ms(lambda: torch.index_select(rows, 0, index), 5))
    return out


def bench_handoff(total: int, frag: int) -> dict[str, float]:
    """Same-GPU handoff of ``total`` bytes in ``frag``-byte slices, three ways."""
    n = total // frag
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros(total, dtype=torch.uint8, device=DEVICE)
    src_region = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    dst_region = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    s_off = shuffled_fragments(frag, total, seed=1)
    d_off = shuffled_fragments(frag, total, seed=2)
    packed = np.arange(n, dtype=np.int64) * frag
    lens = np.full(n, frag, dtype=np.int64)
    gather = np.stack([s_off, lens, packed], axis=1).astype(np.uint64)
    scatter_list = np.stack([packed, d_off, lens], axis=1).astype(np.uint64)
    g = kernels.build_run_table(
        gather, "gather", 0, device=DEVICE, other_limit=total, packed_limit=total
    )
    s = kernels.build_run_table(
        scatter_list, "scatter", 0, device=DEVICE, other_limit=total, packed_limit=total
    )
    assert g is not None and s is not None

    def staged() -> None:
        kernels.copy_runs(g, src, src_region, gather=True)
        dst_region.copy_(src_region)
        kernels.copy_runs(s, dst, dst_region, gather=False)

    def staged_with_tables() -> None:
        gt = kernels.build_run_table(
            gather, "gather", 0, device=DEVICE, other_limit=total, packed_limit=total
        )
        st_ = kernels.build_run_table(
            scatter_list, "scatter", 0, device=DEVICE, other_limit=total, packed_limit=total
        )
        assert gt is not None and st_ is not None
        kernels.copy_runs(gt, src, src_region, gather=True)
        dst_region.copy_(src_region)
        kernels.copy_runs(st_, dst, dst_region, gather=False)

    new_stream = torch.cuda.Stream
    streams = (new_stream(), new_stream(), new_stream())  # type: ignore[no-untyped-call]

    def pipelined(chunk: int) -> Callable[[], None]:
        def run() -> None:
            done = kernels.pipelined_handoff(
                g, src, src_region, s, dst, dst_region, chunk_bytes=chunk, streams=streams
            )
            torch.cuda.current_stream().wait_event(done)

        return run

    s_idx, d_idx = (s_off // frag).tolist(), (d_off // frag).tolist()
    src_rows, dst_rows = src.view(n, frag), dst.view(n, frag)

    def per_slice() -> None:
        for a, b in zip(s_idx, d_idx, strict=True):  # the baseline loops on purpose
            dst_rows[b].copy_(src_rows[a])

    out = {
        "staged": gbps(total, cuda_ms(staged)),
        "staged_host_tables": gbps(total, cuda_ms(staged_with_tables, 5)),
        "per_slice": gbps(total, cuda_ms(per_slice, 3, 1)),
    }
    for chunk in (64 << 20, 128 << 20, 256 << 20):
        out[f"pipelined_{chunk >> 20}MiB"] = gbps(total, cuda_ms(pipelined(chunk)))
    # Byte-exact check of the staged path.
    dst.zero_()
    staged()
    want = torch.zeros_like(dst)
    want.view(n, frag)[torch.from_numpy(d_off // frag).to(DEVICE)] = src.view(n, frag)[
        torch.from_numpy(s_off // frag).to(DEVICE)
    ]
    torch.cuda.synchronize()
    assert torch.equal(dst, want), "staged handoff differs from the direct copy"
    return out


def _kv_shape(blocks: int, heads: int) -> tuple[int, ...]:
    return (2, LAYERS, blocks, TPB, heads, DIM)


def bench_head_reshard(tokens: int) -> dict[str, Any]:
    """TP2 -> TP1 (8 heads -> 4 per source) over scattered blocks: staged, runs and flat."""
    nblk = -(-tokens // TPB)
    rng = np.random.default_rng(7)
    src_ids = [int(x) for x in rng.permutation(nblk + 8)[:nblk]]
    dst_ids = [int(x) for x in rng.permutation(nblk + 8)[:nblk]]
    bufs, srcs = [], []
    for r in range(2):
        t = torch.empty(_kv_shape(nblk + 8, HEADS // 2), dtype=torch.bfloat16, device=DEVICE)
        t.view(torch.int16).random_()
        bufs.append(t)
        srcs.append((KVShardLayout(LAYERS, HEADS, 2, r, global_rank=r), KVGeometry.from_tensor(t)))
    dst = torch.zeros(_kv_shape(nblk + 8, HEADS), dtype=torch.bfloat16, device=DEVICE)
    dl = KVShardLayout(LAYERS, HEADS, global_rank=9)
    program = compile_kv_transfer(
        srcs, (dl, KVGeometry.from_tensor(dst)), src_ids, dst_ids, tokens, "staged"
    )
    total = sum(program.packed_bytes(r) for r in program.src_ranks)
    regions = {
        r: (
            torch.empty(program.packed_bytes(r), dtype=torch.uint8, device=DEVICE),
            torch.empty(program.packed_bytes(r), dtype=torch.uint8, device=DEVICE),
        )
        for r in program.src_ranks
    }
    out: dict[str, Any] = {"bytes": total}
    for form in ("runs", "flat"):
        tables = {}
        frags = 0
        gf: kernels.ListForm
        sf: kernels.ListForm
        for r in program.src_ranks:
            src_reg, dst_reg = regions[r]
            if form == "runs":
                gl, sl = program.gather_runs(r), program.scatter_runs(r)
                gf, sf = "gather_runs", "scatter_runs"
            else:
                gl, sl = program.gather(r), program.scatter(r)
                gf, sf = "gather", "scatter"
            frags += len(sl)
            gt = kernels.build_run_table(
                gl, gf, bufs[r].data_ptr(), device=DEVICE,
                other_limit=bufs[r].numel() * 2, packed_limit=src_reg.numel(),
            )  # fmt: skip
            st_ = kernels.build_run_table(
                sl, sf, dst.data_ptr(), device=DEVICE,
                other_limit=dst.numel() * 2, packed_limit=dst_reg.numel(),
            )  # fmt: skip
            assert gt is not None and st_ is not None, "compiled lists are canonical"
            tables[r] = (gt, st_)

        def handoff(t: dict[int, Any] = tables) -> None:
            for r in program.src_ranks:
                src_reg, dst_reg = regions[r]
                kernels.copy_runs(t[r][0], bufs[r], src_reg, gather=True)
                dst_reg.copy_(src_reg)
                kernels.copy_runs(t[r][1], dst, dst_reg, gather=False)

        out[form] = (gbps(total, cuda_ms(handoff)), frags)
    # Byte-exact check against the torch path with flat lists.
    want = torch.zeros_like(dst)
    for r in program.src_ranks:
        src_reg, _ = regions[r]
        staging.pack_torch(bufs[r], bufs[r].data_ptr(), program.gather(r), src_reg)
        staging.scatter_torch(src_reg, want, dst.data_ptr(), program.scatter(r))
    dst.zero_()
    for r in program.src_ranks:
        src_reg, _ = regions[r]
        kernels.pack(bufs[r], bufs[r].data_ptr(), program.gather_runs(r), src_reg,
                     form="gather_runs")  # fmt: skip
        kernels.scatter(src_reg, dst, dst.data_ptr(), program.scatter_runs(r),
                        form="scatter_runs")  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16)), "reshard differs"
    return out


def bench_submit(tokens: int, repeat: int = 50) -> dict[str, float]:
    """Host microseconds per handoff: compile + lists + run tables + launches (no wait)."""
    nblk = -(-tokens // TPB)
    rng = np.random.default_rng(3)
    out: dict[str, float] = {}
    for name, tp in (("TP1->TP1", 1), ("TP2->TP1", 2)):
        bufs, srcs = [], []
        for r in range(tp):
            t = torch.zeros(_kv_shape(nblk + 8, HEADS // tp), dtype=torch.bfloat16, device=DEVICE)
            bufs.append(t)
            srcs.append((KVShardLayout(LAYERS, HEADS, tp, r, global_rank=r),
                         KVGeometry.from_tensor(t)))  # fmt: skip
        dst = torch.zeros(_kv_shape(nblk + 8, HEADS), dtype=torch.bfloat16, device=DEVICE)
        dl = KVShardLayout(LAYERS, HEADS, global_rank=9)
        dgeom = KVGeometry.from_tensor(dst)
        region = torch.empty(dst.numel() * 2, dtype=torch.uint8, device=DEVICE)
        src_ids = [int(x) for x in rng.permutation(nblk + 8)[:nblk]]
        dst_ids = [int(x) for x in rng.permutation(nblk + 8)[:nblk]]
        for form in ("runs", "flat"):
            times = []
            for i in range(repeat + 3):
                t0 = time.perf_counter()
                program = compile_kv_transfer(srcs, (dl, dgeom), src_ids, dst_ids, tokens,
                                              "staged")  # fmt: skip
                for r in program.src_ranks:
                    n = program.packed_bytes(r)
                    if form == "runs":
                        kernels.pack(bufs[r], bufs[r].data_ptr(), program.gather_runs(r),
                                     region[:n], form="gather_runs")  # fmt: skip
                    else:
                        kernels.pack(bufs[r], bufs[r].data_ptr(), program.gather(r), region[:n])
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append((t1 - t0) * 1e6)
            out[f"{name} {form}"] = statistics.median(times)
        if tp == 1:
            # What a direct (no staging) NIXL submit needs before its one post call: compile
            # in direct mode and write the descriptors into arrays kept between handoffs.
            rows = 2 * LAYERS * nblk + 16
            keep = (np.empty((rows, 3), np.uint64), np.empty((rows, 3), np.uint64))
            times = []
            for i in range(repeat + 3):
                t0 = time.perf_counter()
                program = compile_kv_transfer(srcs, (dl, dgeom), src_ids, dst_ids, tokens, "direct")
                for r in program.src_ranks:
                    program.descriptors(r, out=keep)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1e6)
            out[f"{name} direct-descriptors"] = statistics.median(times)
    return out


def main() -> None:
    """Run every measurement and print (or write) the markdown section."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", help="results file to update (section 'gpu')")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens (head reshard, submit)")
    ap.add_argument("--mib", type=int, default=1024, help="bytes per kernel/handoff case, MiB")
    ap.add_argument(
        "--product",
        action="store_true",
        help="measure the backends between processes instead (section 'gpu-product')",
    )
    ap.add_argument("--rows", default="all", help="product rows to run (comma list of names)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        # `make bench` runs on CPU machines too: nothing to measure there.
        print("bench_gpu.py: no CUDA GPU, skipped")
        return
    if args.product:
        product_main(args.write, args.rows)
        return
    t_start = time.perf_counter()
    import triton

    dev = torch.cuda.get_device_name()
    lines = [
        "## GPU pack/scatter and same-GPU handoff (`benches/bench_gpu.py`)",
        "",
        f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d')}, GPU: {dev}; torch "
        f"{torch.__version__}, Triton {triton.__version__}; host: {machine_line()}",
        "",
        "Command: `python benches/bench_gpu.py --write benches/RESULTS.md`. CUDA-event medians; "
        "payload GB/s = bytes moved once / time. Kernel: one Triton launch per copy "
        "(`disagg_rs.transfer_backends.kernels`), 16-byte lanes.",
        "",
    ]
    total = args.mib << 20
    copy = bench_copy(total)
    lines += [f"Device copy ceiling ({args.mib} MiB `copy_`): **{copy:,.0f} GB/s**", ""]
    lines += [
        "| fragments | count | kernel gather GB/s (best cfg) | kernel scatter GB/s (best) "
        "| default cfg gather / scatter | torch pack / unpack | `index_select` | best cfg "
        "| table build ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    k_results = {}
    for frag in (32768, 1024, 256):
        r = bench_kernels(frag, total)
        k_results[frag] = r
        best = max(r["configs"], key=lambda c: sum(r["configs"][c]))
        bg, bs = r["configs"][best]
        dg, ds = r["configs"][kernels.DEFAULT_CONFIG]
        lines.append(
            f"| {frag:,} B | {r['n']:,} | {bg:,.0f} | {bs:,.0f} | {dg:,.0f} / {ds:,.0f} "
            f"| {r['torch_gather']:,.0f} / {r['torch_scatter']:,.0f} | {r['index_select']:,.0f} "
            f"| {best.block}x{best.sub}, {best.num_warps} warps | {r['table_ms']:.1f} |"
        )
    h = bench_handoff(total, 32768)
    best_pipe = max((k for k in h if k.startswith("pipelined")), key=lambda k: h[k])
    lines += [
        "",
        f"Same-GPU handoff, {args.mib} MiB of KV in {total // 32768:,} slices of 32 KiB, "
        "pack start to scatter end:",
        "",
        "| path | effective GB/s | vs per-slice |",
        "|---|---|---|",
        f"| staged (pack -> 1 copy -> scatter), tables prepared | {h['staged']:,.0f} "
        f"| {h['staged'] / h['per_slice']:,.0f}x |",
        f"| staged, incl. host run-table build + upload | {h['staged_host_tables']:,.0f} "
        f"| {h['staged_host_tables'] / h['per_slice']:,.0f}x |",
        f"| staged pipelined, 3 streams ({best_pipe.split('_')[1]} chunks) "
        f"| {h[best_pipe]:,.0f} | {h[best_pipe] / h['per_slice']:,.0f}x |",
        f"| per-slice baseline ({total // 32768:,} `copy_` calls) | {h['per_slice']:,.1f} | 1x |",
        "",
    ]
    hr = bench_head_reshard(args.tokens)
    lines += [
        f"TP2 -> TP1 head reshard, {args.tokens:,}-token prompt ({LAYERS} layers, {HEADS} KV "
        f"heads, head_dim {DIM}, bf16, {TPB} tokens/block, Megatron layout, scattered blocks), "
        f"{hr['bytes'] / GIB:.2f} GiB, scatter fragments of 1 KiB; both sources packed, "
        "copied, scattered:",
        "",
        "| lists | scatter rows | effective GB/s |",
        "|---|---|---|",
        f"| strided runs (`gather_runs`/`scatter_runs`) | {hr['runs'][1]:,} "
        f"| {hr['runs'][0]:,.0f} |",
        f"| flat lists (`gather`/`scatter`) | {hr['flat'][1]:,} | {hr['flat'][0]:,.0f} |",
        "",
    ]
    sub = bench_submit(args.tokens)
    lines += [
        f"Compile + submit host time per handoff, {args.tokens:,}-token prompt, staged "
        "(compile, lists, run table upload, pack launch; median us). `direct-descriptors`: "
        "compile in direct mode + descriptors into reused arrays (a direct NIXL submit before "
        "its post call):",
        "",
        "| scenario | lists | us |",
        "|---|---|---|",
        *[f"| {k.split()[0]} | {k.split()[1]} | {v:,.0f} |" for k, v in sub.items()],
        "",
    ]
    g32 = max(sum(v) / 2 for v in k_results[32768]["configs"].values())
    g1 = max(sum(v) / 2 for v in k_results[1024]["configs"].values())
    pipe = max(h["staged"], h[best_pipe])
    ratio = pipe / h["per_slice"]
    reshard = max(hr["runs"][0], hr["flat"][0])
    best_submit = min(sub.values())

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines += [
        "Targets:",
        "",
        f"- gather/scatter >= 1,500 GB/s at 32 KiB: {verdict(g32 >= 1500)} ({g32:,.0f})",
        f"- gather/scatter >= 1,000 GB/s at 1 KiB: {verdict(g1 >= 1000)} ({g1:,.0f})",
        f"- staged handoff >= 500 GB/s and >= 100x per-slice: "
        f"{verdict(pipe >= 500 and ratio >= 100)} ({pipe:,.0f} GB/s, {ratio:,.0f}x)",
        f"- TP2->TP1 head reshard >= 400 GB/s: {verdict(reshard >= 400)} ({reshard:,.0f})",
        f"- compile + submit <= 100 us ({args.tokens:,}-token prompt): "
        f"{verdict(best_submit <= 100)} "
        f"(best {best_submit:,.0f} us; see table)",
        "",
        f"Run time {time.perf_counter() - t_start:.0f} s; peak GPU memory "
        f"{torch.cuda.max_memory_allocated() / GIB:.1f} GiB.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "gpu", text)


#: Product rows: name -> (tokens, source TP, (prefill GPU, decode GPU), path).
PRODUCT_ROWS: dict[str, tuple[int, int, tuple[int, int], str]] = {
    "ipc-1gpu-tp1-32k": (32768, 1, (0, 0), "ipc"),
    "ipc-1gpu-tp2-8k": (8192, 2, (0, 0), "ipc"),
    "ipc-2gpu-tp1-32k": (32768, 1, (0, 1), "ipc"),
    "ipc-2gpu-tp2-8k": (8192, 2, (0, 1), "ipc"),
    "staged-2gpu-tp1-32k": (32768, 1, (0, 1), "staged"),
    "staged-2gpu-tp2-8k": (8192, 2, (0, 1), "staged"),
    "staged-1gpu-tp1-32k": (32768, 1, (0, 0), "staged"),
    "chunked-2gpu-tp1-32k": (32768, 1, (0, 1), "chunked"),
    "chunked-2gpu-tp2-8k": (8192, 2, (0, 1), "chunked"),
    "streamed-2gpu-tp1-32k": (32768, 1, (0, 1), "streamed"),
    "streamed-2gpu-tp2-8k": (8192, 2, (0, 1), "streamed"),
    # A check of the streamed harness on one GPU (UCX there may read at 0.5 GB/s; see below).
    "streamed-1gpu-tp1-2k": (2048, 1, (0, 0), "streamed"),
    "direct-2gpu-tp1-32k": (32768, 1, (0, 1), "direct"),
    "nccl-2gpu-tp1-32k": (32768, 1, (0, 1), "nccl"),
    "nccl-2gpu-tp2-8k": (8192, 2, (0, 1), "nccl"),
}


def product_main(write: str | None, rows: str) -> None:
    """The product path between processes (see ``_gpu_product``); one markdown section."""
    from _gpu_product import run_case, run_nccl_case

    n_gpu = torch.cuda.device_count()
    names = list(PRODUCT_ROWS) if rows == "all" else rows.split(",")
    lines = [
        "## GPU transfer path between processes (`benches/bench_gpu.py --product`)",
        "",
        f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d')}, {n_gpu} x "
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; host: {machine_line()}",
        "",
        "Command: `python benches/bench_gpu.py --product --write benches/RESULTS.md`. "
        f"NixlTransferBackend in separate processes, Megatron layout, {LAYERS} layers, {HEADS} "
        f"KV heads, head_dim {DIM}, bf16, {TPB} tokens/block, block ids a random permutation; "
        "stage start (or pull call) -> scatter end on the host clock, median of 3 after a "
        "warm-up; every repeat checked byte-exact. `ipc`: same host, CUDA IPC mapping + one "
        "device-plan kernel (chosen automatically); `staged`: NIXL with IPC off (pack, one "
        "READ, scatter); `chunked`: `staged` with a 256 MiB decode pool (the packed copy read in "
        "chunks through 3 slots, each scattered while the next is read); `streamed`: both "
        "pools 256 MiB (the prefill packs the copy chunk by chunk into a few slots of its pool "
        "as the decode acknowledges, announced by NIXL notifications); `direct`: NIXL with "
        "IPC off, one descriptor per (block, plane); "
        "`nccl`: NcclTransferBackend push/pull, chunks through the 256 MiB staging pool.",
        "",
        "| row | GB | path | GPUs | GB/s | byte-exact "
        "| host submit us (ipc: median of 50; staged: median of the repeats) |",
        "|---|---|---|---|---|---|---|",
    ]
    results = {}
    for name in names:
        tokens, tp, devs, path = PRODUCT_ROWS[name]
        if max(devs) >= n_gpu:
            lines.append(f"| {name} | | {path} | {devs} | not run: needs 2 GPUs | | |")
            continue
        try:
            if path == "nccl":
                r = run_nccl_case(tokens=tokens, src_tp=tp, devices=devs)
            else:
                r = run_case(tokens=tokens, src_tp=tp, devices=devs, path=path)
        except Exception as exc:  # report the row, keep going
            lines.append(f"| {name} | | {path} | {devs} | FAILED: {str(exc)[:200]!r} | | |")
            print(lines[-1], flush=True)
            continue
        results[name] = r
        sub = (
            f"{r['submit_queued_us']:,.0f} queued / {r['submit_us']:,.0f} after each landed"
            if "submit_us" in r
            else ""
        )
        if "stage_call_us" in r:
            sub = f"stage_blocks {r['stage_call_us']:,.0f} / pull {r['pull_call_us']:,.0f}"
        lines.append(
            f"| {name} | {r['bytes'] / 1e9:.1f} | {path} | GPU{devs[0]}->GPU{devs[1]} "
            f"| {r['gbps']:,.{0 if r['gbps'] >= 10 else 2}f} "
            f"| {'yes' if r['exact'] else 'NO'} | {sub} |"
        )
        print(lines[-1], flush=True)
    lines += ["", *product_targets(results)]
    text = "\n".join(lines)
    print(text)
    if write:
        write_section(write, "gpu-product", text)


def product_targets(results: dict[str, dict[str, Any]]) -> list[str]:
    """The transfer-path targets against this run's rows ("not run" where a row is missing)."""

    def row(name: str, key: str, floor: float, *, below: bool = False) -> str:
        r = results.get(name)
        if r is None or key not in r:
            return f"{name}: not run"
        v = r[key]
        ok = (v <= floor) if below else (v >= floor)
        return f"{'met' if ok else 'NOT met'} ({v:,.0f})"

    def gbps(name: str) -> str:
        r = results.get(name)
        return f"{name}: not run" if r is None else f"{r['gbps']:,.0f} GB/s"

    return [
        "Targets:",
        "",
        f"- two GPUs TP1->TP1 32K >= 340 GB/s: {row('ipc-2gpu-tp1-32k', 'gbps', 340)}",
        f"- two GPUs TP2->TP1 8K head reshard >= 300 GB/s: {row('ipc-2gpu-tp2-8k', 'gbps', 300)}",
        f"- same GPU TP1->TP1 32K >= 1,000 GB/s: {row('ipc-1gpu-tp1-32k', 'gbps', 1000)}",
        f"- same GPU TP2->TP1 8K >= 800 GB/s: {row('ipc-1gpu-tp2-8k', 'gbps', 800)}",
        "- host submit <= 100 us (8K TP2->TP1, `begin_pull_blocks` call to return, GPU queue "
        f"not drained): {row('ipc-1gpu-tp2-8k', 'submit_queued_us', 100, below=True)}; each "
        "call after the last handoff landed (the harness waits 0.5 ms between polls): "
        f"{row('ipc-1gpu-tp2-8k', 'submit_us', 100, below=True)}",
        f"- NIXL staged, two GPUs, TP1->TP1 32K (no target; vs 171 before): "
        f"{results.get('staged-2gpu-tp1-32k', {}).get('gbps', 0):,.0f} GB/s",
        f"- NCCL TP1->TP1 >= 300 GB/s: {row('nccl-2gpu-tp1-32k', 'gbps', 300)}",
        "- NIXL decode pool 256 MiB whatever the prompt (chunked rows): TP1->TP1 32K "
        f"{results.get('chunked-2gpu-tp1-32k', {}).get('gbps', 0):,.0f} GB/s, TP2->TP1 8K "
        f"{results.get('chunked-2gpu-tp2-8k', {}).get('gbps', 0):,.0f} GB/s",
        "- NIXL staging <= 256 MiB per engine on both sides (streamed rows, no target): "
        f"TP1->TP1 32K {gbps('streamed-2gpu-tp1-32k')}, TP2->TP1 8K "
        f"{gbps('streamed-2gpu-tp2-8k')}",
    ]


if __name__ == "__main__":
    main()
