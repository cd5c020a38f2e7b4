"""Where the host time of one same-host pull goes: ``begin_pull_blocks`` of an 8K-token
TP2 -> TP1 handoff (80 layers, 8 KV heads, head_dim 128, bf16, 64 tokens/block, random block
ids) on the CUDA IPC path, and each of its stages alone, with ``time.perf_counter_ns``.

Both sources and the decode live in this process on one GPU (the IPC path finds the
sources' buffers in the process-local table). The GPU queue is drained between calls, so
the numbers are host time only; one row sleeps 0.5 ms before each call, as the product
harness's ``wait()`` does between polls, so the call starts on an idle core. Needs a CUDA
GPU and NIXL.

Command: ``python benches/bench_submit_stages.py [--device cuda:0] [--repeat 200]``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from _ipc_case import TPB, build, options
from _ipc_case import stage as timed
from disagg_rs import _core
from disagg_rs.transfer_backends import nixl


def main() -> None:
    args = options(__doc__)
    case = build(args.device)
    dec, metas, sids, dids, tokens = case.dec, case.metas, case.sids, case.dids, case.tokens
    stage = functools.partial(timed, repeat=args.repeat)

    sa = {r: np.asarray(v) for r, v in sids.items()}
    da = np.asarray(dids)
    print("| stage | us |\n|---|---:|")
    stage(
        "whole call, ids as lists",
        lambda: dec.begin_pull_blocks(metas, sids, dids, num_tokens=tokens),
    )
    stage(
        "whole call, ids as arrays", lambda: dec.begin_pull_blocks(metas, sa, da, num_tokens=tokens)
    )
    stage(
        "whole call, ids as lists, after 0.5 ms idle (as between the product harness's polls)",
        lambda: dec.begin_pull_blocks(metas, sids, dids, num_tokens=tokens),
        idle_s=0.0005,
    )
    stage("resolve peers", lambda: dec._resolve_peers(metas, sids))
    peers, ids = dec._resolve_peers(metas, sids)
    assert ids is not None
    stage(
        "check ids, lists", lambda: dec._validate_peers(peers, ids, dids, tokens, local_is_dst=True)
    )
    stage(
        "check ids, arrays", lambda: dec._validate_peers(peers, sa, da, tokens, local_is_dst=True)
    )
    route = dec._ipc_routes[tuple(map(id, peers))]
    assert isinstance(route, nixl._IpcRoute) and route.copy is not None
    pr = route.copy
    print("launches per call", len(pr.copies))
    kw2: dict[str, Any] = {
        "local_num_blocks": dec.expected_num_blocks,
        "local_tokens_per_block": dec.tokens_per_block,
        "tokens_per_block": pr.tokens_per_block,
    }
    n_ids = _core.pull_ids_len(dids, len(pr.ranks))
    slot, host = dec._ids.take(n_ids)
    stage(
        "ids checked + written into the pinned slot by Rust, lists",
        lambda: _core.write_pull_ids(host, peers, pr.ranks, ids, dids, tokens, **kw2),
    )
    stage(
        "ids checked + written into the pinned slot by Rust, arrays",
        lambda: _core.write_pull_ids(host, peers, pr.ranks, sa, da, tokens, **kw2),
    )
    dec._ids.settle(slot, None)
    run_kw = {"local_num_blocks": dec.expected_num_blocks, "local_tokens_per_block": TPB}
    stage(
        "IPC route (ids, upload, launch, event)", lambda: pr.run(peers, ids, dids, tokens, **run_kw)
    )
    slot, host = dec._ids.take(n_ids)
    got = _core.write_pull_ids(host, peers, pr.ranks, ids, dids, tokens, **kw2)
    assert got is not None
    stride, n = got[2], got[3]
    stage("ids view of the pinned slot (no copy)", lambda: dec._ids.view(slot, host, n))
    dev = dec._ids.view(slot, host, n)
    raw = torch._C._cuda_getCurrentRawStream(0)
    launch, first = pr.copies[0]
    stage(
        "one launch (all source ranks)",
        lambda: launch(tokens, dev[(first + 1) * stride :], dev, raw, a_set=stride),
    )
    dec._ids.settle(slot, None)
    stage(
        "one launch (all source ranks), after 0.5 ms idle",
        lambda: launch(tokens, dev[(first + 1) * stride :], dev, raw, a_set=stride),
        idle_s=0.0005,
    )
    small = torch.zeros(16, device=args.device)
    stage("baseline: one trivial torch kernel launch", lambda: small.add_(1))
    stage("baseline: one trivial torch kernel launch, after 0.5 ms idle", lambda: small.add_(1),
          idle_s=0.0005)  # fmt: skip
    stage("new event + record", lambda: torch.cuda.Event().record())  # type: ignore[no-untyped-call]
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    cur = torch.cuda.current_stream()
    stage("record again on a kept event", lambda: ev.record(cur))
    stage("torch.cuda.current_stream()", torch.cuda.current_stream)
    stage("raw current stream", lambda: torch._C._cuda_getCurrentRawStream(0))
    case.close()


if __name__ == "__main__":
    main()
