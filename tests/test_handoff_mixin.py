"""The handoff mixin through the real reference engine: a prefill and a decode engine in one
process, each with its own NIXL agent (UCX over loopback), driven step by step with a virtual
clock. Scenarios of the reference design's lifecycle, each named as a sentence."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_rs import ImportLedger
from disagg_rs.exceptions import HandoffStateError, MetadataError, ResetRefusedError
from disagg_rs.handoff.prefill import handoff_ticket
from disagg_rs.reference import EngineConfig, ReferenceEngine, hybrid_model
from disagg_rs.reference.handoff import HandoffReferenceEngine
from ticket_samples import TICKET_FIELDS

os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

MODEL = hybrid_model()
PROMPTS = [list(b"Disaggregated prefill then decode."), list(b"A second, longer prompt here!!")]


class Pair:
    """A prefill and a decode engine plus the glue a control plane would provide."""

    def __init__(self, decode_blocks: int = 32, max_batch: int = 8, max_new: int = 5) -> None:
        self.max_new = max_new
        self.prefill = HandoffReferenceEngine(
            MODEL, EngineConfig(role="prefill", ranks=(0,), num_blocks=32, num_ssm_slots=4)
        )
        self.decode = HandoffReferenceEngine(
            MODEL,
            EngineConfig(
                role="decode",
                ranks=(1,),
                num_blocks=decode_blocks,
                num_ssm_slots=4,
                max_batch=max_batch,
            ),
        )
        self.now = 1_000
        self.prefill.setup_kv_transfer("prefill", "nixl")
        self.decode.setup_kv_transfer("decode", "nixl")
        self.tickets: dict[int, dict[str, Any]] = {}
        self.answers: dict[int, list[int]] = {}

    def tick(self) -> None:
        self.now += 1_000_000
        self.prefill.handoff_now_ns = self.decode.handoff_now_ns = self.now

    def run_prefill(self, rid: int, prompt: list[int]) -> dict[str, Any]:
        self.tick()
        self.prefill.add_request(rid, prompt, self.max_new)
        while self.prefill.has_work:
            for h in self.prefill.step().handoffs:
                ticket = self.prefill.capture_handoff_ticket(h)
                ticket["prefill_meta"] = self.prefill.handoff_static_meta
                self.tickets[h.request_id] = ticket
        return self.tickets[rid]

    def submit(self, rid: int, prompt: list[int], max_new: int | None = None) -> None:
        self.tick()
        ticket = self.tickets[rid]
        self.decode.add_request_with_kv_handoff(
            rid, prompt, max_new or self.max_new, ticket, ticket["src_block_ids"]
        )

    def hand_off(self, rid: int, prompt: list[int], max_new: int | None = None) -> None:
        """Prefill ``prompt`` and submit its handoff to the decode."""
        self.run_prefill(rid, prompt)
        self.submit(rid, prompt, max_new)

    def step_decode(self) -> None:
        self.tick()
        self.decode.poll_kv_imports()
        self.decode.admit_kv_imports()
        if self.decode.has_work:
            for done in self.decode.step().finished:
                self.answers[done.request_id] = done.tokens

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step until idle; the transfers are real, so this waits on wall time (bounded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.step_decode()
            if not self.decode.has_work and self.decode.pending_kv_import_count == 0:
                return
        raise AssertionError(f"decode did not settle within {timeout_s} s")

    def close(self) -> None:
        self.prefill.close_kv_transfer()
        self.decode.close_kv_transfer()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _colocated(prompt: list[int], max_new: int) -> list[int]:
    engine = ReferenceEngine(MODEL, EngineConfig(num_blocks=32, num_ssm_slots=4))
    return engine.generate({0: prompt}, max_new)[0]


def test_a_handoff_continues_decoding_exactly_like_the_colocated_run(pair: Pair) -> None:
    pair.hand_off(1, PROMPTS[0])
    pair.settle()
    assert pair.answers[1] == _colocated(PROMPTS[0], pair.max_new)
    pair.prefill.release_handoff_blocks(1)
    assert pair.prefill.pin_ledger.num_pinned == 0
    assert pair.prefill.leaked_blocks() == 0 and pair.decode.leaked_blocks() == 0


def test_release_kv_frees_prefill_pins_and_a_duplicate_release_is_a_no_op(pair: Pair) -> None:
    pair.run_prefill(1, PROMPTS[0])
    assert pair.prefill.pin_ledger.num_pinned == 1
    assert pair.prefill.leaked_blocks() > 0
    pair.prefill.release_handoff_blocks(1)
    pair.prefill.release_handoff_blocks(1)
    pair.prefill.release_handoff_blocks(999)
    assert pair.prefill.pin_ledger.num_pinned == 0
    assert pair.prefill.leaked_blocks() == 0


def test_capacity_miss_defers_before_any_transfer() -> None:
    # Room for one request's blocks only: the second waits in DEFERRED with no transfer posted.
    pair = Pair(decode_blocks=4, max_new=2)
    try:
        for rid, prompt in ((1, PROMPTS[0]), (2, PROMPTS[1])):
            pair.hand_off(rid, prompt)
        assert pair.decode.import_ledger.deferred_ids() == [2]
        assert pair.decode.pending_kv_import(2) is None
        assert pair.decode.pending_kv_import_count == 2
        pair.settle()
        assert pair.answers[1] == _colocated(PROMPTS[0], 2)
        assert pair.answers[2] == _colocated(PROMPTS[1], 2)
        assert pair.decode.leaked_blocks() == 0
    finally:
        pair.close()


def test_completed_import_waits_when_the_batch_is_full() -> None:
    pair = Pair(max_batch=1, max_new=4)
    try:
        for rid, prompt in ((1, PROMPTS[0]), (2, PROMPTS[1])):
            pair.hand_off(rid, prompt)
        deadline = time.monotonic() + 30
        while not pair.decode.import_ledger.num_ready and time.monotonic() < deadline:
            pair.step_decode()
        # One request runs; the other is complete but not admitted while the batch is full.
        assert pair.decode.num_running == 1
        assert pair.decode.has_admittable_kv_import
        pair.settle()
        assert set(pair.answers) == {1, 2}
        assert pair.answers[2] == _colocated(PROMPTS[1], 4)
    finally:
        pair.close()


def test_resume_token_that_already_finishes_the_request_needs_no_forward(pair: Pair) -> None:
    pair.hand_off(1, PROMPTS[0], max_new=1)
    pair.settle()
    # The ledger completes it at the admission point; the decode never runs a forward step.
    assert pair.decode.handoff_stats["imports_completed_without_forward"] == 1
    assert pair.decode.stats.steps == 0
    assert pair.answers[1] == pair.tickets[1]["resume_tokens"]
    assert pair.decode.leaked_blocks() == 0


def test_reset_with_an_import_in_flight_is_refused_and_changes_nothing(pair: Pair) -> None:
    pair.hand_off(1, PROMPTS[0])
    assert pair.decode.import_ledger.num_importing == 1
    with pytest.raises(ResetRefusedError, match="request 1"):
        pair.decode.reset_kv_imports()
    assert pair.decode.import_ledger.num_importing == 1
    pair.settle()
    assert 1 in pair.answers


def test_reset_after_transfers_settle_fails_pending_imports_and_frees_their_blocks(
    pair: Pair,
) -> None:
    pair.hand_off(1, PROMPTS[0])
    assert pair.decode.wait_for_kv_import_transfers(1)
    pair.decode.poll_kv_imports()  # local outcome known: nothing may still write
    pair.decode.reset_kv_imports()
    assert pair.decode.pending_kv_import_count == 0
    assert pair.decode.handoff_stats["imports_failed"] == 1
    assert pair.decode.leaked_blocks() == 0
    pair.decode.import_ledger.check()


def test_abort_while_importing_releases_nothing_until_the_transfer_is_quiet(pair: Pair) -> None:
    pair.hand_off(1, PROMPTS[0])
    pair.decode.abort_kv_import(1)
    # The read may still land: the destinations stay out of the pool until it settles.
    assert pair.decode.num_quarantined_kv_imports + pair.decode.leaked_blocks() > 0
    deadline = time.monotonic() + 30
    while pair.decode.num_quarantined_kv_imports and time.monotonic() < deadline:
        pair.step_decode()
    assert pair.decode.num_quarantined_kv_imports == 0
    assert pair.decode.leaked_blocks() == 0
    assert 1 not in pair.answers


def test_scheduling_a_decode_engine_admits_completed_imports_when_no_prompt_waits(
    pair: Pair,
) -> None:
    # The reference engine refuses prompts on a decode engine up front, so nothing waits and
    # the scheduling point only admits (the refusal itself: test_reference_api_lifecycle.py).
    with pytest.raises(HandoffStateError, match="decode engines only admit"):
        pair.decode.add_request(9, PROMPTS[0], 2)
    pair.hand_off(1, PROMPTS[0])
    deadline = time.monotonic() + 60
    while not pair.decode.has_admittable_kv_import and time.monotonic() < deadline:
        pair.tick()
        pair.decode.poll_kv_imports()
    pair.decode.schedule_waiting_requests()
    assert pair.decode.handoff_stats["imports_admitted"] == 1
    pair.prefill.schedule_waiting_requests()


def test_metrics_record_bytes_latency_and_queue_depths_and_serve_over_http(pair: Pair) -> None:
    import socket
    import urllib.request

    from prometheus_client import generate_latest

    from disagg_rs.metrics import HandoffMetrics

    pair.decode.handoff_metrics = HandoffMetrics("decode", 1)
    pair.hand_off(1, PROMPTS[0])
    pair.settle()
    text = generate_latest(pair.decode.handoff_metrics.registry).decode()
    moved = pair.decode.handoff_stats["bytes_pulled"]
    assert moved > 0
    assert f'disagg_transfer_bytes_total{{rank="1",role="decode"}} {float(moved)}' in text
    assert 'disagg_import_transfer_seconds_count{rank="1",role="decode"} 1.0' in text
    assert 'disagg_handoff_queue_depth{rank="1",role="decode",state="importing"} 0.0' in text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = pair.decode.handoff_metrics.serve(port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"disagg_transfer_bytes_total" in resp.read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# -- the ticket and the decisions the decode side takes from the ledger ----------------------------
def test_the_prefill_ticket_is_assembled_in_one_place_with_optional_fields_only_when_set() -> None:
    plain = handoff_ticket(**TICKET_FIELDS, staged={})
    assert plain == TICKET_FIELDS
    full = handoff_ticket(
        **TICKET_FIELDS, lease_until_wall_ns=0, integrity={"v": 1}, staged={1: [{"staged": True}]}
    )
    assert full["lease_until_wall_ns"] == 0 and full["integrity"] == {"v": 1}
    assert full["staged"] == {1: [{"staged": True}]}


@pytest.mark.parametrize("lease", [True, 1.5, "soon", 1, -4])
def test_a_ticket_lease_that_is_not_an_int_of_at_least_two_is_a_metadata_error_naming_it(
    lease: Any,
) -> None:
    with pytest.raises(MetadataError) as info:
        ImportLedger.import_deadline(1, 100, 1_000, lease)
    assert info.value.field == "lease_ns"
    assert ImportLedger.import_deadline(1, 100, 1_000, 600) == 400  # half the lease, sooner


def test_a_source_lease_end_is_read_only_against_a_wall_clock_and_must_be_an_int() -> None:
    assert ImportLedger.source_lease(1, 50, None) == (None, None)
    assert ImportLedger.source_lease(1, None, 40) == (None, None)
    assert ImportLedger.source_lease(1, 50, 40) == (50, 40)
    with pytest.raises(MetadataError) as info:
        ImportLedger.source_lease(1, "later", 40)
    assert info.value.field == "lease_until_wall_ns"
