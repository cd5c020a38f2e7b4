"""One named test per lifecycle scenario of the reference design (DESIGN §5)."""

from __future__ import annotations

import pytest

from disagg_rs import CompletionQuorum, ImportLedger, LedgerAction, PinLedger, exceptions

BS = 4
FAR = 1_000_000


def submit(
    ledger: ImportLedger,
    rid: int,
    n_tokens: int,
    *,
    now: int = 0,
    deadline: int = FAR,
    **kw: object,
) -> list[LedgerAction]:
    tokens = [rid * 1000 + i for i in range(n_tokens)]
    src = list(range(-(-n_tokens // BS)))
    return ledger.submit(rid, tokens, src_block_ids=src, deadline=deadline, now=now, **kw)  # type: ignore[arg-type]


def kinds(actions: list[LedgerAction]) -> list[tuple[str, int]]:
    return [(a.kind, a.request_id) for a in actions]


def test_capacity_miss_defers_before_any_transfer() -> None:
    ledger = ImportLedger(4, BS)
    assert kinds(submit(ledger, 1, 12)) == [("start", 1)]
    free_before = ledger.block_pool.num_free
    assert submit(ledger, 2, 8) == []
    assert ledger.state_of(2) == "deferred"
    assert ledger.block_pool.num_free == free_before  # deferred: zero side effects
    assert ledger.pending_kv_import_count == 2
    ledger.check()


def test_deferred_queue_is_fifo_and_a_small_later_request_never_overtakes() -> None:
    ledger = ImportLedger(4, BS)
    submit(ledger, 1, 12)
    submit(ledger, 2, 8)  # needs 2 blocks, only 1 free: deferred
    assert submit(ledger, 3, 4) == []  # would fit, but must not overtake request 2
    assert ledger.deferred_ids() == [2, 3]
    ledger.report(1, ledger.epoch_of(1) or 0, 0, "ok", 1)
    acts = ledger.admit(1)
    assert kinds(acts) == [("admit", 1)]
    ledger.block_pool.release(acts[0].block_ids)  # the request finished
    assert kinds(ledger.poll(2)) == [("start", 2), ("start", 3)]
    ledger.check()


def test_failed_peer_rank_quarantines_while_the_local_handle_runs() -> None:
    ledger = ImportLedger(8, BS, world_size=2, rank=0, drain_horizon=100)
    (start,) = submit(ledger, 1, 8)
    (fail,) = ledger.report(1, start.epoch, 1, "error", 5)
    assert (fail.kind, fail.reason, fail.quarantined) == ("fail", "rank_error", True)
    assert ledger.num_quarantined == 1
    assert ledger.block_pool.num_free == 6  # the running local handle may still write
    (rel,) = ledger.report(1, start.epoch, 0, "ok", 6)  # the local handle settles
    assert (rel.kind, rel.reason) == ("release", "settled")
    assert ledger.block_pool.num_free == 8
    ledger.check()


def test_quarantine_drains_after_the_drain_horizon() -> None:
    ledger = ImportLedger(8, BS, drain_horizon=100)
    (start,) = submit(ledger, 1, 8)
    (fail,) = ledger.report(1, start.epoch, 0, "may_still_write", 10)
    assert fail.quarantined
    assert ledger.poll(109) == []
    (rel,) = ledger.poll(110)
    assert (rel.kind, rel.reason) == ("release", "horizon")
    assert ledger.counters()["drained_horizon"] == 1
    assert ledger.block_pool.num_free == 8


def test_errored_local_handle_releases_at_once() -> None:
    ledger = ImportLedger(8, BS)
    (start,) = submit(ledger, 1, 8)
    (fail,) = ledger.report(1, start.epoch, 0, "error", 1)
    assert not fail.quarantined
    assert ledger.block_pool.num_free == 8


def test_completed_import_waits_when_the_batch_is_full() -> None:
    ledger = ImportLedger(8, BS)
    (start,) = submit(ledger, 1, 8)
    ledger.report(1, start.epoch, 0, "ok", 1)
    assert ledger.has_admittable_kv_import
    assert ledger.admit(0) == []
    assert ledger.state_of(1) == "ready"
    assert kinds(ledger.admit(1)) == [("admit", 1)]
    assert not ledger.has_admittable_kv_import


def test_resume_token_already_satisfies_the_request() -> None:
    ledger = ImportLedger(8, BS)
    (start,) = submit(ledger, 1, 8, resume_tokens=1, finished=True)
    ledger.report(1, start.epoch, 0, "ok", 1)
    (done,) = ledger.admit(0)  # needs no place in the batch
    assert done.kind == "complete"
    assert ledger.block_pool.num_free == 8
    assert ledger.pending_kv_import_count == 0


def test_resume_and_lookahead_tokens_reserve_continuation_blocks() -> None:
    ledger = ImportLedger(8, BS, lookahead_tokens=2)
    (start,) = submit(ledger, 1, 8, resume_tokens=1)
    assert len(start.dst_block_ids) == 2
    assert len(start.continuation_block_ids) == 1


def test_admitted_request_owns_its_blocks_and_its_detached_slot() -> None:
    ledger = ImportLedger(8, BS, 2)
    (start,) = submit(ledger, 1, 6, has_ssm=True)
    assert start.ssm_slot is not None
    ledger.report(1, start.epoch, 0, "ok", 1)
    (adm,) = ledger.admit(4)
    assert adm.block_ids == start.dst_block_ids
    assert ledger.slot_pool.state(adm.ssm_slot or 0) == "detached"
    ledger.check()
    ledger.block_pool.release(adm.block_ids)
    ledger.slot_pool.free(adm.ssm_slot or 0)
    assert ledger.slot_pool.num_free == 2
    ledger.check()


def test_pull_transport_reuses_the_decode_prefix_cache_and_pulls_only_the_suffix() -> None:
    ledger = ImportLedger(16, BS)
    tokens = list(range(10))
    (a,) = ledger.submit(1, tokens, src_block_ids=[0, 1, 2], deadline=FAR, now=0)
    ledger.report(1, a.epoch, 0, "ok", 1)
    (adm,) = ledger.admit(1)
    ledger.block_pool.release(adm.block_ids)  # cached full blocks become evictable
    assert ledger.block_pool.num_evictable == 2
    (b,) = ledger.submit(2, tokens, src_block_ids=[5, 6, 7], deadline=FAR, now=2)
    assert b.cached_block_ids == adm.block_ids[:2]
    assert b.token_start == 8
    assert b.src_block_ids == [7]
    assert len(b.dst_block_ids) == 1
    assert ledger.counters()["prefix_blocks_reused"] == 2
    ledger.check()


def test_push_transport_never_trims_the_prefix() -> None:
    ledger = ImportLedger(16, BS, pull=False)
    tokens = list(range(8))
    (a,) = ledger.submit(1, tokens, src_block_ids=[0, 1], deadline=FAR, now=0)
    ledger.report(1, a.epoch, 0, "ok", 1)
    ledger.block_pool.release(ledger.admit(1)[0].block_ids)
    (b,) = ledger.submit(2, tokens, src_block_ids=[0, 1], deadline=FAR, now=2)
    assert b.cached_block_ids == []
    assert b.token_start == 0
    assert b.src_block_ids == [0, 1]


def test_reuse_alignment_trims_the_prefix_to_its_multiples_and_zero_is_refused() -> None:
    # An integrity digest chunked by 8 tokens asks for reuse in multiples of 8 only.
    ledger = ImportLedger(16, 4)
    tokens = list(range(16))
    (a,) = ledger.submit(1, tokens, src_block_ids=[0, 1, 2, 3], deadline=FAR, now=0)
    ledger.report(1, a.epoch, 0, "ok", 1)
    ledger.block_pool.release(ledger.admit(1)[0].block_ids)
    other = [*tokens[:12], 99, 98, 97, 96]  # 3 cached blocks of 4 = 12 tokens match
    with pytest.raises(exceptions.ArgumentError) as info:
        ledger.submit(
            2, other, src_block_ids=[4, 5, 6, 7], deadline=FAR, now=2, reuse_align_tokens=0
        )
    assert info.value.field == "reuse_align_tokens"
    (b,) = ledger.submit(
        2, other, src_block_ids=[4, 5, 6, 7], deadline=FAR, now=2, reuse_align_tokens=8
    )
    assert (b.token_start, len(b.cached_block_ids), b.src_block_ids) == (8, 2, [6, 7])
    (c,) = ledger.submit(
        3, other, src_block_ids=[8, 9, 10, 11], deadline=FAR, now=2, reuse_align_tokens=32
    )
    assert (c.token_start, c.cached_block_ids) == (0, [])  # no multiple of 32 is cached
    ledger.check()


def test_block_size_mismatch_trims_only_whole_multiples_of_both_block_sizes() -> None:
    ledger = ImportLedger(16, 4)
    tokens = list(range(16))
    (a,) = ledger.submit(
        1, tokens, src_block_ids=[0, 1], src_block_size_tokens=8, deadline=FAR, now=0
    )
    ledger.report(1, a.epoch, 0, "ok", 1)
    ledger.block_pool.release(ledger.admit(1)[0].block_ids)
    # 3 cached blocks of 4 = 12 tokens, but the source block is 8 tokens: reuse 8.
    other = [*tokens[:12], 99, 98, 97, 96]
    (b,) = ledger.submit(
        2, other, src_block_ids=[4, 5], src_block_size_tokens=8, deadline=FAR, now=2
    )
    assert b.token_start == 8
    assert len(b.cached_block_ids) == 2
    assert b.src_block_ids == [5]
    assert len(b.dst_block_ids) == 2


def test_late_report_for_an_old_epoch_never_touches_the_current_attempt() -> None:
    ledger = ImportLedger(8, BS)
    (first,) = submit(ledger, 1, 4)
    ledger.abort(1, 1)  # the running handle may still write: quarantined
    (second,) = submit(ledger, 1, 4, now=2)
    assert second.epoch != first.epoch
    assert ledger.report(1, first.epoch + 100, 0, "ok", 3) == []
    assert ledger.counters()["ignored_messages"] == 1
    assert ledger.state_of(1) == "importing"
    (rel,) = ledger.report(1, first.epoch, 0, "ok", 3)  # the old handle settles
    assert rel.kind == "release"
    assert ledger.state_of(1) == "importing"
    ledger.check()


def test_duplicate_report_is_ignored_and_counted() -> None:
    ledger = ImportLedger(8, BS, world_size=2)
    (s,) = submit(ledger, 1, 4)
    ledger.report(1, s.epoch, 1, "ok", 1)
    assert ledger.report(1, s.epoch, 1, "ok", 2) == []
    assert ledger.counters()["ignored_messages"] == 1


def test_conflicting_reports_from_one_rank_raise_and_change_nothing() -> None:
    ledger = ImportLedger(8, BS, world_size=2)
    (s,) = submit(ledger, 1, 4)
    ledger.report(1, s.epoch, 1, "ok", 1)
    with pytest.raises(exceptions.HandoffStateError):
        ledger.report(1, s.epoch, 1, "error", 2)
    assert ledger.state_of(1) == "importing"
    assert kinds(ledger.report(1, s.epoch, 0, "ok", 3)) == []
    assert ledger.state_of(1) == "ready"


def test_rejected_submit_changes_nothing() -> None:
    ledger = ImportLedger(8, BS)
    with pytest.raises(exceptions.BlockIdError) as info:
        ledger.submit(1, list(range(8)), src_block_ids=[0], deadline=FAR, now=0)
    assert info.value.field == "src_block_ids"
    assert "len(src_block_ids)=1" in str(info.value)
    assert "=2" in str(info.value)
    with pytest.raises(exceptions.ArgumentError):
        ledger.submit(1, list(range(8)), src_block_ids=[0, 1], deadline=5, now=5)
    assert ledger.pending_kv_import_count == 0
    assert ledger.counters()["submitted"] == 0
    assert ledger.block_pool.num_free == 8


def test_request_larger_than_the_whole_pool_is_a_capacity_error() -> None:
    ledger = ImportLedger(2, BS)
    with pytest.raises(exceptions.CapacityError) as info:
        submit(ledger, 1, 12)
    assert info.value.field == "blocks"
    with pytest.raises(exceptions.CapacityError):
        submit(ledger, 2, 4, has_ssm=True)  # no SSM slots at all


def test_duplicate_request_id_in_flight_is_rejected() -> None:
    ledger = ImportLedger(8, BS)
    submit(ledger, 1, 4)
    with pytest.raises(exceptions.DuplicateRequestError):
        submit(ledger, 1, 4)


def test_deadline_expires_an_importing_handoff_into_quarantine() -> None:
    ledger = ImportLedger(8, BS, drain_horizon=50)
    submit(ledger, 1, 4, deadline=10)
    submit(ledger, 2, 4, deadline=20)
    (fail,) = ledger.poll(10)
    assert (fail.request_id, fail.reason, fail.quarantined) == (1, "deadline", True)
    assert [a.request_id for a in ledger.poll(20) if a.kind == "fail"] == [2]


@pytest.mark.parametrize("stage", ["deferred", "importing", "ready"])
def test_abort_at_each_stage_fails_once_and_leaks_nothing(stage: str) -> None:
    ledger = ImportLedger(2, BS, drain_horizon=10)
    (blocker,) = submit(ledger, 9, 8)
    submit(ledger, 1, 4)
    if stage != "deferred":
        ledger.abort(9, 1)
        ledger.settle(9, blocker.epoch)
    if stage == "ready":
        ledger.report(1, ledger.epoch_of(1) or 0, 0, "ok", 2)
    assert ledger.state_of(1) == stage
    acts = ledger.abort(1, 3)
    fails = [a for a in acts if a.kind == "fail"]
    assert [(a.request_id, a.reason) for a in fails] == [(1, "aborted")]
    assert fails[0].quarantined == (stage == "importing")
    assert ledger.abort(1, 4) == []  # a second abort is a counted no-op
    ledger.poll(100)
    for key in (9, 1):
        ledger.abort(key, 101)
    ledger.poll(1000)
    assert ledger.block_pool.num_free == 2
    ledger.check()


def test_reset_refuses_while_an_import_may_still_write_and_changes_nothing() -> None:
    ledger = ImportLedger(8, BS)
    submit(ledger, 1, 4)
    with pytest.raises(exceptions.ResetRefusedError) as info:
        ledger.reset(1)
    assert "request 1" in str(info.value)
    assert ledger.state_of(1) == "importing"


def test_reset_cancels_deferred_work_and_releases_what_is_safe() -> None:
    ledger = ImportLedger(2, BS)
    (a,) = submit(ledger, 1, 8)
    submit(ledger, 2, 4)
    ledger.report(1, a.epoch, 0, "ok", 1)
    acts = ledger.reset(2)
    assert sorted((x.request_id, x.reason) for x in acts) == [(1, "reset"), (2, "reset")]
    assert ledger.pending_kv_import_count == 0
    assert ledger.block_pool.num_free == 2


def test_duplicate_release_is_a_no_op() -> None:
    pins = PinLedger(8, BS, 2)
    blocks = pins.block_pool.allocate(3)
    slot = pins.slot_pool.allocate()
    epoch = pins.pin(1, blocks, slot, lease_until=100, now=0)
    pins.block_pool.release(blocks)  # the prefill request itself finished
    (rel,) = pins.release(1, epoch)
    assert (rel.kind, rel.reason) == ("release", "release_kv")
    assert pins.release(1, epoch) == []
    assert pins.release(42) == []  # unknown id: no-op
    assert pins.counters()["ignored_messages"] == 2
    assert pins.block_pool.num_free == 8
    assert pins.slot_pool.num_free == 2
    pins.check()


def test_lease_expiry_releases_the_pin() -> None:
    pins = PinLedger(8, BS)
    blocks = pins.block_pool.allocate(2)
    pins.pin(1, blocks, lease_until=50, now=0)
    pins.block_pool.release(blocks)
    assert pins.expire(49) == []
    (rel,) = pins.expire(50)
    assert rel.reason == "lease_expired"
    assert pins.block_pool.num_free == 8


def test_release_waits_for_an_in_flight_push() -> None:
    pins = PinLedger(8, BS)
    blocks = pins.block_pool.allocate(2)
    epoch = pins.pin(1, blocks, lease_until=50, now=0)
    pins.block_pool.release(blocks)
    pins.begin_push(1, epoch)
    assert pins.pending_kv_push_count == 1
    assert pins.release(1, epoch) == []
    with pytest.raises(exceptions.ResetRefusedError):
        pins.reset()
    (rel,) = pins.push_settled(1, epoch)
    assert rel.reason == "release_kv"
    assert pins.pending_kv_push_count == 0
    assert pins.block_pool.num_free == 8


def test_quorum_needs_every_rank_and_reports_the_first_failure_once() -> None:
    q = CompletionQuorum(3)
    assert q.report(1, 1, 0, "ok") is None
    assert q.report(1, 1, 1, "ok") is None
    assert q.report(1, 1, 2, "ok") == ("success", None, None)
    assert q.report(2, 1, 2, "timeout") == ("failure", 2, "timeout")
    assert q.report(2, 1, 0, "error") is None
    with pytest.raises(exceptions.HandoffStateError):
        q.report(2, 1, 0, "ok")
    with pytest.raises(exceptions.ArgumentError):
        q.report(2, 1, 3, "ok")


def test_engine_releasing_a_block_the_ledger_holds_fails_the_conservation_check() -> None:
    ledger = ImportLedger(8, BS)
    (start,) = submit(ledger, 1, 4)
    ledger.block_pool.release(start.dst_block_ids)  # a bug in the engine
    with pytest.raises(exceptions.ConservationError) as info:
        ledger.check()
    assert f"block {start.dst_block_ids[0]}" in str(info.value)


def test_readme_example_admits_after_every_rank_reports_ok() -> None:
    ledger = ImportLedger(
        num_blocks=64, block_size_tokens=16, num_ssm_slots=4, world_size=2, rank=0
    )
    (start,) = ledger.submit(
        7, list(range(40)), src_block_ids=[3, 4, 5], resume_tokens=1, has_ssm=True,
        deadline=10_000, now=0,
    )  # fmt: skip
    assert ledger.report(7, start.epoch, rank=0, outcome="ok", now=5) == []
    assert ledger.report(7, start.epoch, rank=1, outcome="ok", now=6) == []
    (adm,) = ledger.admit(batch_room=8)
    assert (adm.kind, adm.block_ids, adm.ssm_slot) == ("admit", start.dst_block_ids, start.ssm_slot)
    ledger.check()
