"""Named fault scenarios (issue 9, item 1) through the handoff mixin: a prefill and a decode
reference engine in this process, state moved by real NIXL over loopback UCX; plus the short
soak (many handoffs with injected faults; ``make soak`` runs the long one)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from disagg_rs import exceptions
from disagg_rs.inference_state_handoff import InferenceStateHandoffMixin
from disagg_rs.inference_state_handoff import RankImport as PendingKvImport
from disagg_rs.reference import EngineConfig, ModelConfig, ReferenceEngine
from disagg_rs.reference.engine import encode_text
from disagg_rs.reference.handoff import HandoffReferenceEngine
from disagg_rs.tools.soak import FAULTS, FaultInjectingBackend, SoakOptions, run_soak

os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

PROMPT = encode_text("a prompt long enough to fill a few blocks of the paged cache")
MAX_NEW = 3


def _pair(model: ModelConfig) -> tuple[HandoffReferenceEngine, HandoffReferenceEngine]:
    cfg = {"num_blocks": 16, "num_ssm_slots": 4}
    pre = HandoffReferenceEngine(model, EngineConfig(role="prefill", **cfg))  # type: ignore[arg-type]
    dec = HandoffReferenceEngine(model, EngineConfig(role="decode", **cfg))  # type: ignore[arg-type]
    pre.handoff_now_ns = dec.handoff_now_ns = time.monotonic_ns()
    pre.setup_kv_transfer("prefill", "nixl")
    dec.setup_kv_transfer("decode", "nixl")
    return pre, dec


@pytest.fixture
def hybrid() -> Iterator[tuple[HandoffReferenceEngine, HandoffReferenceEngine]]:
    pre, dec = _pair(ModelConfig())
    yield pre, dec
    dec.close_kv_transfer()
    pre.close_kv_transfer()


def _ticket(pre: HandoffReferenceEngine, rid: int) -> tuple[Any, dict[str, Any]]:
    pre.add_request(rid, PROMPT, MAX_NEW)
    (h,) = pre.step().handoffs
    ticket = pre.capture_handoff_ticket(h)
    ticket["prefill_meta"] = pre.handoff_static_meta
    return h, ticket


def _run_until_idle(pre: HandoffReferenceEngine, dec: HandoffReferenceEngine) -> dict[int, Any]:
    """Drive the decode loop (poll, admit, step) until nothing is pending; RELEASE_KV after."""
    done: dict[int, Any] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        dec.handoff_now_ns = time.monotonic_ns()
        dec.poll_kv_imports()
        dec.admit_kv_imports()
        for rid, failed in dec.drain_handoff_outcomes():
            pre.release_handoff_blocks(rid)
            done[rid] = "failed" if failed else "admitted"
        if dec.has_work:
            for f in dec.step().finished:
                done[f.request_id] = f.tokens
        if (
            not dec.has_work
            and not dec.pending_kv_import_count
            and not dec.num_quarantined_kv_imports
        ):
            return done
    raise AssertionError("the handoff did not settle within 30 s")


def _assert_all_free(*engines: HandoffReferenceEngine) -> None:
    for e in engines:
        e.check_pools()
        assert e.leaked_blocks() == 0
        assert e.ssm_slot_pool is None or e.ssm_slot_pool.num_free == e.ssm_slot_pool.num_slots
    engines[0].pin_ledger.check()
    assert engines[0].pin_ledger.num_pinned == 0


def _release_and_assert_all_free(
    pre: HandoffReferenceEngine, dec: HandoffReferenceEngine, request_id: int
) -> None:
    """The decode is done with ``request_id``: the prefill releases it, nothing stays held."""
    pre.release_handoff_blocks(request_id)
    _assert_all_free(pre, dec)


def test_ssm_ticket_on_a_non_hybrid_decode_and_none_on_a_hybrid_one_are_metadata_errors(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    h, ticket = _ticket(pre, 1)
    for bad in (
        {**ticket, "src_ssm_slot": None},
        {k: v for k, v in ticket.items() if k != "prefill_meta"},
    ):
        with pytest.raises(exceptions.MetadataError) as info:
            dec.add_request_with_kv_handoff(1, h.prompt, MAX_NEW, bad, ticket["src_block_ids"])
        assert info.value.field in ("src_ssm_slot", "prefill_meta")
    assert dec.pending_kv_import_count == 0
    attention = HandoffReferenceEngine(
        ModelConfig(layer_kinds=("attention",) * 2), EngineConfig(role="decode", num_blocks=16)
    )
    with pytest.raises(exceptions.MetadataError) as info:
        attention.add_request_with_kv_handoff(1, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    assert info.value.field == "src_ssm_slot"
    assert attention.pending_kv_import_count == 0
    _release_and_assert_all_free(pre, dec, 1)


def test_a_request_id_already_in_flight_is_refused_and_the_first_import_still_completes(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    expected = ReferenceEngine(ModelConfig(), EngineConfig()).generate({7: PROMPT}, MAX_NEW)
    h, ticket = _ticket(pre, 7)
    dec.add_request_with_kv_handoff(7, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    with pytest.raises(exceptions.DuplicateRequestError):
        dec.add_request_with_kv_handoff(7, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    assert _run_until_idle(pre, dec)[7] == expected[7]
    _assert_all_free(pre, dec)


def test_a_start_that_throws_after_posting_the_kv_pull_fails_once_and_frees_everything(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    conv = FaultInjectingBackend(dec.ssm_transfer_backends["conv"], "conv")
    conv.faults[3], conv.current = "start_raises", 3
    dec.ssm_transfer_backends["conv"] = conv
    h, ticket = _ticket(pre, 3)
    dec.add_request_with_kv_handoff(3, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    pending = dec.pending_kv_import(3)
    assert pending is not None and pending.failed_locally is not None
    assert len(pending.handles) == 1  # the KV pull was posted before the throw
    assert _run_until_idle(pre, dec) == {3: "failed"}
    _assert_all_free(pre, dec)


class _Running:
    """A handle that is still running (its transport has not finished)."""

    done = False

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def poll(self) -> bool:
        return False


def test_a_failed_import_names_the_rank_and_the_transport_error_it_saw(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    kv = FaultInjectingBackend(dec.kv_transfer_backend, "kv")
    kv.faults[4], kv.current = "transfer_error", 4
    dec.kv_transfer_backend = kv  # type: ignore[assignment]
    h, ticket = _ticket(pre, 4)
    dec.add_request_with_kv_handoff(4, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    reasons: dict[int, str | None] = {}
    deadline = time.monotonic() + 30
    while not reasons and time.monotonic() < deadline:
        dec.handoff_now_ns = time.monotonic_ns()
        dec.poll_kv_imports()
        for rid, failed in dec.drain_handoff_outcomes():
            assert failed
            reasons[rid] = dec.pop_handoff_failure_reason(rid)
    why = "model-parallel rank 0: TransferError: injected transfer error"
    assert reasons[4] is not None and why in reasons[4], reasons
    assert dec.pop_handoff_failure_reason(4) is None  # taken once
    assert any(e[:2] == ("failed", 4) and why in e[2] for e in dec.handoff_events)
    _release_and_assert_all_free(pre, dec, 4)


def test_a_failed_start_is_not_reported_while_an_already_posted_part_may_still_write() -> None:
    pending = PendingKvImport(1, 1, handles=[_Running()], failed_locally="SSM start threw")
    assert InferenceStateHandoffMixin.rank_import_outcome(pending) is None
    pending.handles = []
    assert InferenceStateHandoffMixin.rank_import_outcome(pending) == "error"


def test_close_with_transfers_in_flight_is_refused_and_changes_nothing(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    h, ticket = _ticket(pre, 4)
    dec.add_request_with_kv_handoff(4, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    pending = dec.pending_kv_import(4)
    assert pending is not None
    pending.handles.append(_Running())
    with pytest.raises(exceptions.ResetRefusedError, match=r"\[4\]"):
        dec.close_kv_transfer()
    assert dec.kv_transfer_backend is not None
    pending.handles.pop()
    _run_until_idle(pre, dec)
    _assert_all_free(pre, dec)


def test_short_soak_with_faults_at_every_stage_leaks_nothing_and_answers_right() -> None:
    torch.set_num_threads(1)
    report = run_soak(SoakOptions(handoffs=120, fault_rate=0.5, seed=1))
    assert report.unresolved == 0 and report.leaked == 0 and report.wrong == 0, report.format()
    assert report.completed + report.failed == 120
    assert report.completed > 0 and report.failed > 0 and report.quarantined_then_drained > 0
    assert set(report.faults) == set(FAULTS)


def test_short_soak_with_integrity_catches_every_corrupted_transfer_and_nothing_else() -> None:
    # Concurrent handoffs of repeated prompts: before a verifying decode stopped reusing its
    # prefix cache, clean imports failed the check on prefixes another batch had prefilled.
    torch.set_num_threads(1)
    report = run_soak(SoakOptions(handoffs=120, fault_rate=0.5, seed=2, verify_integrity=True))
    assert report.ok, report.format()
    assert report.faults["corrupt_transfer"] > 0
    # Besides the corrupted transfers, a read that a stalled decode let land after the prefill's
    # lease (on reused blocks) fails the check too: never admitted either way.
    caught = report.faults["corrupt_transfer"] + report.stale_reads_caught
    assert report.integrity_failures == caught, report.format()
    assert report.undetected == 0 and report.false_alarms == 0


def test_an_import_that_would_read_after_the_prefill_lease_fails_and_is_never_admitted() -> None:
    model = ModelConfig(layer_kinds=("attention",) * 2)
    pre = HandoffReferenceEngine(model, EngineConfig(role="prefill", num_blocks=8))
    # Room for one import at a time: the second waits for capacity (DEFERRED, nothing read).
    dec = HandoffReferenceEngine(model, EngineConfig(role="decode", num_blocks=3))
    pre.handoff_now_ns = dec.handoff_now_ns = 0  # virtual clocks, one per engine
    pre.handoff_lease_ns = 1_000_000
    pre.setup_kv_transfer("prefill", "nixl")
    dec.setup_kv_transfer("decode", "nixl")
    try:
        prompt = encode_text("twenty-six tokens of prompt")
        tickets = {}
        for rid in (1, 2):
            pre.add_request(rid, prompt, MAX_NEW)
            (h,) = pre.step().handoffs
            tickets[rid] = (h, pre.capture_handoff_ticket(h))
            tickets[rid][1]["prefill_meta"] = pre.handoff_static_meta
            dec.add_request_with_kv_handoff(
                rid, h.prompt, MAX_NEW, tickets[rid][1], tickets[rid][1]["src_block_ids"]
            )
        assert dec.import_ledger.state_of(2) == "deferred"
        # The prefill lease ends; its blocks go back to the pool and a new prompt reuses them.
        pre.handoff_now_ns = 1_000_000
        assert pre.expire_handoff_pins() == 2
        pre.add_request(3, encode_text("another prompt overwrites the freed blocks"), MAX_NEW)
        (h3,) = pre.step().handoffs
        # The decode's clock passes half the lease before request 2 could start reading.
        dec.handoff_now_ns = 600_000
        dec.poll_kv_imports()
        failed = dict(dec.drain_handoff_outcomes())
        assert failed == {1: True, 2: True}
        assert not any(e[:2] == ("importing", 2) for e in dec.handoff_events)
        assert dec.handoff_stats["imports_admitted"] == 0
        for _ in range(1000):  # request 1's read was in flight: it drains from quarantine
            if dec.num_quarantined_kv_imports == 0:
                break
            dec.poll_kv_imports()
            time.sleep(0.001)
        pre.capture_handoff_ticket(h3)
        _release_and_assert_all_free(pre, dec, 3)
    finally:
        dec.close_kv_transfer()
        pre.close_kv_transfer()


def test_a_ticket_with_a_mistyped_lease_is_a_metadata_error(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    h, ticket = _ticket(pre, 5)
    with pytest.raises(exceptions.MetadataError) as info:
        dec.add_request_with_kv_handoff(
            5, h.prompt, MAX_NEW, {**ticket, "lease_ns": "soon"}, ticket["src_block_ids"]
        )
    assert info.value.field == "lease_ns" and dec.pending_kv_import_count == 0
    _release_and_assert_all_free(pre, dec, 5)


@pytest.mark.parametrize(
    "prefill_meta",
    [{}, {"ranks": []}, {"ranks": [{}]}, {"ranks": "x"}, {"ranks": [{"kv": None, "conv": 1}]}],
)
def test_a_ticket_without_a_source_for_state_the_decode_must_read_is_refused_unreserved(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine], prefill_meta: dict[str, Any]
) -> None:
    # Before: prefill_meta={} reserved blocks, posted nothing, reported "ok" and admitted the
    # request with unwritten blocks.
    pre, dec = hybrid
    h, ticket = _ticket(pre, 1)
    with pytest.raises(exceptions.MetadataError) as info:
        dec.add_request_with_kv_handoff(
            1, h.prompt, MAX_NEW, {**ticket, "prefill_meta": prefill_meta}, ticket["src_block_ids"]
        )
    assert info.value.field == "prefill_meta"
    assert dec.pending_kv_import_count == 0 and dec.handoff_stats["imports_started"] == 0
    _release_and_assert_all_free(pre, dec, 1)


WALL = 1_700_000_000_000_000_000  # a wall clock reading, virtual


def test_a_ticket_that_arrives_after_the_prefill_lease_ended_is_refused_before_any_read(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    # The decode was stopped while the ticket waited: by the prefill's wall clock the lease
    # (10 s) is over when the decode reads the ticket, whatever the decode's own clock says.
    pre, dec = hybrid
    pre.handoff_lease_ns = 10_000_000_000
    pre.handoff_wall_now_ns = WALL
    h, ticket = _ticket(pre, 1)
    assert ticket["lease_until_wall_ns"] == WALL + 10_000_000_000
    dec.handoff_wall_now_ns = WALL + 9_500_000_000  # within 1 s (clock offset bound) of the end
    with pytest.raises(exceptions.ArgumentError) as info:
        dec.add_request_with_kv_handoff(1, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    assert info.value.field == "lease_until_wall"
    assert dec.pending_kv_import_count == 0 and dec.handoff_stats["imports_started"] == 0
    _release_and_assert_all_free(pre, dec, 1)


def test_an_import_observed_complete_after_the_lease_is_neither_admitted_nor_cached(
    hybrid: tuple[HandoffReferenceEngine, HandoffReferenceEngine],
) -> None:
    pre, dec = hybrid
    pre.handoff_lease_ns = 10_000_000_000
    pre.handoff_wall_now_ns = dec.handoff_wall_now_ns = WALL
    h, ticket = _ticket(pre, 1)
    start = dec.handoff_now_ns
    dec.add_request_with_kv_handoff(1, h.prompt, MAX_NEW, ticket, ticket["src_block_ids"])
    for _ in range(5000):  # the read completes and is reported (ready), within the lease
        dec.poll_kv_imports()
        if dec.import_ledger.num_ready:
            break
        time.sleep(0.001)
    assert dec.import_ledger.num_ready == 1
    # The decode stalls; its next clock reading is past the lease (9 s left after the bound).
    dec.handoff_now_ns = start + 9_000_000_000
    assert dec.admit_kv_imports() == 0
    assert dict(dec.drain_handoff_outcomes()) == {1: True}
    assert dec.pop_handoff_failure_reason(1) == "lease_expired"
    assert dec.import_ledger.counters()["lease_expired"] == 1
    # Nothing of it entered the prefix cache: the same prompt is pulled from token 0 again.
    assert (
        dec.import_ledger.block_pool.match_prefix(
            dec.import_ledger.block_pool.block_hashes(h.prompt)
        )
        == []
    )
    _release_and_assert_all_free(pre, dec, 1)
