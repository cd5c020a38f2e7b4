"""A prefill that will not push a handoff whose receives a decode posted answers them with
fillers, through its :class:`~disagg_rs.driver.HandoffDriver` and the pin ledger, so the next
request on the pair lands byte-exact: two engine processes on real gloo, messages matched by
post order per pair as NCCL matches them (``match_by_order=True``).

Without the filler the decode's receives for request A would take B's messages (same pair,
same sizes): B's bytes would be admitted as A's (``test_transport_order`` shows the refusal
the headers make of it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from _reference_worker import spawn_gloo_world
from disagg_rs.control import Msg
from disagg_rs.driver import HandoffDriver
from test_engine_contract import NUM_BLOCKS, PROMPTS, TIMEOUT_S, ContractEngine, Sampling, _exchange

A, B = PROMPTS[0], PROMPTS[1]


def _run(rank: int) -> dict[str, Any]:
    role = "prefill" if rank == 0 else "decode"
    loop = asyncio.new_event_loop()
    engine = ContractEngine(role, "nccl", rank, loop)
    engine.setup_kv_transfer(role, "nccl", match_by_order=True)
    driver = HandoffDriver(engine, None)
    prefill_meta = _exchange(engine.handoff_static_meta if rank == 0 else None, 0)
    decode_meta = _exchange(engine.handoff_static_meta if rank == 1 else None, 1)
    engine.handoff_now_ns = now = 1_000_000
    report: dict[str, Any] = {}
    futures: dict[int, asyncio.Future[Any]] = {}
    kv: dict[int, torch.Tensor] = {}
    for rid, prompt, max_new, _ in (A, B):
        payload = None
        if rank == 0:
            finished = engine.prefill(rid, prompt)
            ticket = engine.capture_handoff_ticket(finished)
            ticket["prefill_meta"] = prefill_meta
            payload = (ticket, engine.prompt_kv(finished.block_ids, len(prompt)))
        ticket, kv[rid] = _exchange(payload, 0)
        if rank == 1:  # the decode posts A's receives, then B's
            futures[rid] = engine.add_request_with_kv_handoff(
                rid, prompt, Sampling(max_new), ticket, ticket["src_block_ids"]
            )
    posted = _exchange(dict(engine.drain_posted_receives()) if rank == 1 else None, 1)
    deadline = time.monotonic() + TIMEOUT_S
    if rank == 0:
        # A's pin ended before its SEND_KV came (RELEASE_KV, or its lease): the push is
        # refused and the driver answers A's posted receives with fillers; B is pushed.
        engine.release_handoff_blocks(A[0])
        for rid, _, _, _ in (A, B):
            send = {"type": Msg.SEND_KV, "request_id": rid, "epoch": 1, "transfer": posted[rid]}
            driver.on_message({**send, "decode_meta": decode_meta["ranks"]})
        while engine.pending_kv_push_count and time.monotonic() < deadline:
            engine.handoff_now_ns = now = now + 1_000
            engine.poll_kv_pushes()
        report["fillers"] = engine.handoff_stats["push_fillers"]
        report["pushes"] = engine.handoff_stats["pushes"]
    else:
        while not all(f.done() for f in futures.values()) and time.monotonic() < deadline:
            engine.handoff_now_ns = now = now + 1_000
            engine.poll_kv_imports()
            engine.schedule_waiting_requests()
        report["a_error"] = str(futures[A[0]].exception())
        report["b"] = futures[B[0]].result()
        got = engine.prompt_kv(engine.running[B[0]][3], len(B[1]))
        report["b_exact"] = bool(torch.equal(got, kv[B[0]]))
        report["quarantined"] = engine.num_quarantined_kv_imports
    _exchange(None, 1)  # the decode admitted B: RELEASE_KV
    if rank == 0:
        engine.release_handoff_blocks(B[0])
        report["free"] = engine.block_pool.num_free == NUM_BLOCKS
    loop.close()
    engine.close_kv_transfer()
    return report


def test_a_refused_push_is_answered_with_fillers_and_the_next_request_lands_byte_exact() -> None:
    prefill, decode = spawn_gloo_world(2, _run, timeout_s=TIMEOUT_S)
    assert (prefill["fillers"], prefill["pushes"], prefill["free"]) == (1, 1, True)
    # A failed at once, as aborted (not at its deadline, not out of step); nothing quarantined.
    assert "aborted the handoff" in decode["a_error"], decode["a_error"]
    assert decode["quarantined"] == 0
    assert decode["b"] == B[0] and decode["b_exact"]
