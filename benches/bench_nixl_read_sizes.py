"""One NIXL READ of growing size between two processes, raw NIXL (no disagg_rs in the path).

What UCX gives a one-sided read between two processes on this host, before any of the
library's work: the ceiling of the NIXL "staged" and "direct" paths. Each size is one READ
of one descriptor (or the same bytes cut into N descriptors), checked byte-exact; a READ not
DONE within ``--deadline`` seconds stops the run.

    python benches/bench_nixl_read_sizes.py                      # CUDA device 0 to itself
    python benches/bench_nixl_read_sizes.py --sizes-gib 0.25,1 --device cpu
    UCX_PROTO_INFO=y python benches/bench_nixl_read_sizes.py --sizes-gib 0.25   # UCX's lanes

Run on a machine with nixl installed (``pip install nixl-cu13`` or ``nixl-cu12``); prints one
line per READ: bytes, descriptors, state, seconds, GB/s, byte-exact.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

GIB = 1 << 30


def _buffer(nbytes: int, device: str, fill: int) -> Any:
    import torch

    if device != "cpu":
        torch.cuda.set_device(int(device))
        return torch.full((nbytes,), fill, dtype=torch.uint8, device=f"cuda:{device}")
    return torch.full((nbytes,), fill, dtype=torch.uint8)


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True))


def _target(conn: Any, nbytes: int, device: str) -> None:
    buf = _buffer(nbytes, device, 1)
    agent = _agent("read-sizes-target")
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    conn.recv()  # hold the buffer until the reader is done
    os._exit(0)


def _rows(base: int, size: int, pieces: int, dev: int) -> Any:
    import numpy as np

    step = -(-size // pieces)
    starts = np.arange(pieces, dtype=np.uint64) * np.uint64(step)
    lens = np.minimum(np.uint64(step), np.uint64(size) - starts)
    devs = np.full(pieces, dev, dtype=np.uint64)
    return np.stack([starts + np.uint64(base), lens, devs], axis=1)


def _reader(conn: Any, meta: bytes, addr: int, nbytes: int, device: str, cases: Any) -> None:
    buf = _buffer(nbytes, device, 0)
    agent = _agent("read-sizes-reader")
    agent.register_memory(buf)
    peer = agent.add_remote_agent(meta)
    mem, dev = ("DRAM", 0) if device == "cpu" else ("VRAM", int(device))
    deadline = float(os.environ.get("READ_DEADLINE_S", "40"))
    for size, pieces in cases:
        buf[:size].zero_()
        if device != "cpu":
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        xfer = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(_rows(buf.data_ptr(), size, pieces, dev), mem_type=mem),
            agent.get_xfer_descs(_rows(addr, size, pieces, dev), mem_type=mem),
            peer,
        )
        state = agent.transfer(xfer)
        while state not in ("DONE", "ERR") and time.perf_counter() - t0 < deadline:
            state = agent.check_xfer_state(xfer)
        secs = time.perf_counter() - t0
        exact = bool(buf[:size].min().item() == 1) if state == "DONE" else None
        conn.send((size, pieces, state, secs, size / secs / 1e9, exact))
        if state != "DONE":
            break
        agent.release_xfer_handle(xfer)
    conn.send(None)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="0", help="CUDA device index, or 'cpu' (default 0)")
    ap.add_argument(
        "--sizes-gib",
        default="1,2,3.999,4.001,8,9.965",
        help="READ sizes in GiB, one descriptor each (default: 1 to 9.965, 10.7 GB)",
    )
    ap.add_argument(
        "--pieces", default="11,43", help="the largest size again, cut into N descriptors"
    )
    ap.add_argument("--deadline", type=float, default=40.0, help="seconds per READ")
    args = ap.parse_args()
    sizes = [int(float(x) * GIB) for x in args.sizes_gib.split(",") if x]
    cases = [(s, 1) for s in sizes]
    cases += [(max(sizes), int(n)) for n in args.pieces.split(",") if n]
    nbytes = max(sizes)
    os.environ["READ_DEADLINE_S"] = str(args.deadline)
    ctx = mp.get_context("spawn")
    to_target, target_end = ctx.Pipe()
    target = ctx.Process(target=_target, args=(target_end, nbytes, args.device), daemon=True)
    target.start()
    meta, addr = to_target.recv()
    results, reader_end = ctx.Pipe()
    reader = ctx.Process(
        target=_reader, args=(reader_end, meta, addr, nbytes, args.device, cases), daemon=True
    )
    reader.start()
    print("bytes, descriptors, state, seconds, GB/s, byte-exact")
    while results.poll(args.deadline + 120):
        row = results.recv()
        if row is None:
            break
        print(f"{row[0]:,}, {row[1]}, {row[2]}, {row[3]:.3f}, {row[4]:.2f}, {row[5]}")
    to_target.send("done")


if __name__ == "__main__":
    main()
