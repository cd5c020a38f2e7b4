"""A prefill that will not push a handoff whose receives a decode posted answers them with
fillers, so the next request on the pair lands byte-exact: two engine processes on real gloo,
messages matched by post order per pair as NCCL matches them (``match_by_order=True``),
served by real :class:`~disagg_rs.driver.HandoffDriver` s.

Request A's receives are posted first, then B's (same pair). Either A's pin ended before its
SEND_KV came (the push is refused: the prefill's driver sends fillers instead), or the
coordinator no longer knows A when the decode's KV_RECV_POSTED arrives (it tells the prefill
the decode names to send fillers: SEND_KV with ``abort``). Without fillers A's receives would
take B's messages and B's bytes would be admitted as A's (``test_transport_order`` shows the
refusal the headers make of them)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from _reference_worker import spawn_gloo_world
from disagg_rs.control import CoordinatorState, Msg
from disagg_rs.driver import HandoffDriver, LoopbackCoordinator
from test_engine_contract import (
    NUM_BLOCKS,
    PROMPTS,
    TIMEOUT_S,
    ContractEngine,
    Sampling,
    _exchange,
    _prefill_and_share,
)

A, B = PROMPTS[0], PROMPTS[1]


class ServedEngine(ContractEngine):
    """The contract engine with what a driver's turn reads besides (no forward steps here)."""

    has_work = False


def _send_kv_through_a_coordinator(
    engine: ServedEngine, prefill_meta: Any, tickets: dict[int, Any]
) -> list[dict[str, Any]]:
    """Decode side: a coordinator (in this process; its prefill engine ``p0`` is a mailbox
    whose messages go to the prefill process) that never heard of A and serves B; returns
    the SEND_KV messages it sends the prefill."""
    hub = LoopbackCoordinator(CoordinatorState(push_transport=True))
    prefill = hub.link("p0", "prefill")
    prefill.register(prefill_meta)
    driver = HandoffDriver(engine, hub.link("d0", "decode"))
    now = engine.handoff_now_ns
    # A's ticket reaches the decode, but the coordinator no longer knows A (it failed there).
    ticket = {**tickets[A[0]], "prefill_engine_id": "p0", "prefill_incarnation": 1}
    prompt = {"prompt": A[1], "max_new_tokens": A[2], "ticket": ticket}
    driver.on_message(
        {"type": Msg.SUBMIT_REQUEST_WITH_KV, "request_id": A[0], "epoch": 1, **prompt}
    )
    driver.tick(now := now + 1_000)  # A's receives posted: KV_RECV_POSTED
    # B is served from its submission on.
    hub.client().submit(B[0], B[1], B[2])
    got = prefill.poll()
    (prefill_msg,) = [m for m in got if m["type"] is Msg.PREFILL]
    ticket = {k: v for k, v in tickets[B[0]].items() if k != "prefill_meta"}
    prefill.send(Msg.PREFILL_DONE, request_id=B[0], epoch=prefill_msg["epoch"], ticket=ticket)
    for msg in driver.receive():
        driver.on_message(msg)
    driver.tick(now + 1_000)  # B's receives posted: KV_RECV_POSTED
    return [m for m in got + prefill.poll() if m["type"] is Msg.SEND_KV]


def _run(rank: int, via_coordinator: bool) -> dict[str, Any]:
    role = "prefill" if rank == 0 else "decode"
    loop = asyncio.new_event_loop()
    engine = ServedEngine(role, "nccl", rank, loop)
    engine.setup_kv_transfer(role, "nccl", match_by_order=True)
    prefill_meta = _exchange(engine.handoff_static_meta if rank == 0 else None, 0)
    decode_meta = _exchange(engine.handoff_static_meta if rank == 1 else None, 1)
    engine.handoff_now_ns = now = 1_000_000
    report: dict[str, Any] = {}
    futures: dict[int, asyncio.Future[Any]] = {}
    tickets: dict[int, Any] = {}
    kv: dict[int, torch.Tensor] = {}
    for rid, prompt, _, _ in (A, B):
        tickets[rid], kv[rid] = _prefill_and_share(engine, rank, rid, prompt, prefill_meta)
    sends: list[dict[str, Any]] | None = None
    if rank == 1 and via_coordinator:
        sends = _send_kv_through_a_coordinator(engine, prefill_meta, tickets)
        report["aborts"] = [bool(m.get("abort")) for m in sends]
    elif rank == 1:  # the decode posts A's receives, then B's
        for rid, prompt, max_new, _ in (A, B):
            futures[rid] = engine.add_request_with_kv_handoff(
                rid, prompt, Sampling(max_new), tickets[rid], tickets[rid]["src_block_ids"]
            )
        posted = dict(engine.drain_posted_receives())
        sends = [
            {"type": Msg.SEND_KV, "request_id": rid, "epoch": 1, "transfer": posted[rid]}
            for rid in (A[0], B[0])
        ]
    sends = _exchange(sends, 1)
    deadline = time.monotonic() + TIMEOUT_S
    if rank == 0:
        # A's pin ended (RELEASE_KV, or its lease): a push of A is refused.
        engine.release_handoff_blocks(A[0])
        driver = HandoffDriver(engine, None)
        for msg in sends:
            driver.on_message({**msg, "decode_meta": decode_meta["ranks"]})
        while engine.pending_kv_push_count and time.monotonic() < deadline:
            engine.handoff_now_ns = now = now + 1_000
            engine.poll_kv_pushes()
        report["fillers"] = engine.handoff_stats["push_fillers"]
        report["pushes"] = engine.handoff_stats["pushes"]
    else:
        # A fails as soon as its fillers land; B is admitted.
        while engine.pending_kv_import_count and time.monotonic() < deadline:
            engine.handoff_now_ns = now = now + 1_000
            engine.poll_kv_imports()
            engine.schedule_waiting_requests()
        report["a_failure"] = [d for kind, rid, d in engine.handoff_events if kind == "failed"]
        report["a_failed"] = [rid for kind, rid, _ in engine.handoff_events if kind == "failed"]
        report["a_future"] = [str(f.exception()) for rid, f in futures.items() if rid == A[0]]
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


@pytest.mark.parametrize(
    "via_coordinator", [False, True], ids=["refused-push", "request-gone-at-coordinator"]
)
def test_receives_the_prefill_will_not_fill_get_fillers_and_the_next_request_lands_byte_exact(
    via_coordinator: bool,
) -> None:
    prefill, decode = spawn_gloo_world(2, _run, via_coordinator, timeout_s=TIMEOUT_S)
    if via_coordinator:
        assert decode["aborts"] == [True, False]  # A: SEND_KV abort; B: SEND_KV
    assert (prefill["fillers"], prefill["pushes"], prefill["free"]) == (1, 1, True)
    # A failed at once, as aborted (not at its deadline, not out of step); nothing quarantined.
    assert decode["a_failed"] == [A[0]], decode
    assert "aborted the handoff" in decode["a_failure"][0], decode
    assert all("aborted the handoff" in text for text in decode["a_future"]), decode
    assert decode["quarantined"] == 0
    assert decode["b_exact"]
