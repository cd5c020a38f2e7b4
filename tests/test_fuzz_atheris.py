"""Runs the atheris fuzzer of tests/fuzz_atheris.py (wire decoders, the coordinator, the engine
driver loop) for a fixed number of inputs, seeded with valid wire objects and control messages,
and fails on any finding (a non-typed exception, a panic, a crash)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

import disagg_rs as dr
from disagg_rs.control import Msg, encode_message
from disagg_rs.handoff.prefill import handoff_ticket
from disagg_rs.integrity import IntegrityTable
from ticket_samples import TICKET_FIELDS

HARNESS = Path(__file__).with_name("fuzz_atheris.py")
RUNS = int(os.environ.get("DISAGG_FUZZ_RUNS", "4000"))
SECONDS = int(os.environ.get("DISAGG_FUZZ_SECONDS", "600"))
"""Wall-clock cap; a run that stops at the cap before ``RUNS`` inputs fails."""


def _seeds() -> list[bytes]:
    dims = dr.SSMStateDims(num_heads=4, head_dim=2, d_state=3, n_groups=2, d_conv=4)
    kv = np.zeros((2, 2, 4, 8, 2, 4), dtype=np.float32)
    conv = np.zeros((2, 3, dims.conv_channels, dims.d_conv), dtype=np.float32)
    objects = [
        dr.KVShardLayout(8, 4, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1).to_dict(),
        dr.SSMShardLayout(4, dims, tp_size=2, tp_rank=0).to_dict(),
        dr.KVGeometry.from_tensor(kv).to_dict(),
        dr.SSMGeometry.from_tensors(conv=conv).to_dict(),
    ]
    shapes = IntegrityTable.shapes(dr.KVShardLayout(3, 2), None)
    objects.append(
        IntegrityTable({n: np.zeros(s, dtype=np.uint64) for n, s in shapes.items()}).to_wire()
    )
    ticket = handoff_ticket(**TICKET_FIELDS)
    # Coordinator traffic, then what the engine drivers act on: a prompt to prefill, a ticket
    # to import (two blocks of 16 tokens from the prefill), a release, an abort, a shutdown.
    messages: list[tuple[Msg, dict[str, Any]]] = [
        (Msg.SUBMIT, {"request_id": 1, "prompt": [1, 2], "max_new_tokens": 3}),
        (Msg.KV_IMPORTED, {"request_id": 1, "epoch": 2, "ok": True}),
        (Msg.PREFILL_DONE, {"request_id": 1, "epoch": 1, "ticket": {"a": [1]}}),
        (Msg.DONE, {"request_id": 1, "epoch": 1, "tokens": [4, 5]}),
        (Msg.HEARTBEAT, {"engine_id": "p0", "incarnation": 1}),
        (Msg.FAILED, {"request_id": 1, "error": "x", "quiet": True}),
        (
            Msg.PREFILL,
            {
                "request_id": 3,
                "epoch": 1,
                "prompt": list(b"a prompt of thirty-three bytes..."),
                "max_new_tokens": 2,
                "decode_engine_id": "d0",
            },
        ),
        (
            Msg.SUBMIT_REQUEST_WITH_KV,
            {
                "request_id": 4,
                "epoch": 1,
                "prompt": list(b"twenty bytes prompt."),
                "max_new_tokens": 2,
                "ticket": {**ticket, "prefill_engine_id": "p0", "prefill_incarnation": 1},
            },
        ),
        (Msg.RELEASE_KV, {"request_id": 3, "epoch": 1}),
        (Msg.ABORT, {"request_id": 4, "epoch": 1}),
        (Msg.SHUTDOWN, {}),
    ]
    frames = [msgpack.packb(o, use_bin_type=True) for o in objects]
    return frames + [encode_message(kind, **fields) for kind, fields in messages]


def test_atheris_finds_nothing_in_the_wire_decoders_the_coordinator_or_the_engine_drivers(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, frame in enumerate(_seeds()):
        (corpus / f"seed{i}").write_bytes(frame)
    proc = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            str(corpus),
            f"-runs={RUNS}",
            f"-max_total_time={SECONDS}",
            "-rss_limit_mb=4096",
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 300,
        check=False,
    )
    tail = proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert f"Done {RUNS} runs" in proc.stderr, tail  # all of them, not stopped by the cap
