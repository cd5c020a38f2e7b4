"""Named fault scenarios (issue 9, item 1) at the ledger level: typed errors, one outcome per
request, pools conserved. Scenarios already covered elsewhere are listed in the README's
Reliability section rather than repeated here."""

from __future__ import annotations

import pytest

from disagg_rs import ImportLedger, LedgerAction, PinLedger, exceptions

BS = 4
FAR = 1_000_000


def submit(ledger: ImportLedger, rid: int, n: int, **kw: object) -> list[LedgerAction]:
    args: dict[str, object] = {
        "src_block_ids": list(range(-(-n // BS))),
        "deadline": FAR,
        "now": 0,
        **kw,
    }
    return ledger.submit(rid, [rid * 100 + i for i in range(n)], **args)  # type: ignore[arg-type]


def snapshot(ledger: ImportLedger) -> tuple[object, ...]:
    return (
        ledger.block_pool.num_free,
        ledger.slot_pool.num_free,
        ledger.pending_kv_import_count,
        ledger.deferred_ids(),
        sorted(ledger.counters().items()),
    )


@pytest.mark.parametrize(
    ("src", "needle"),
    [
        ([0, -1, 2], "must be in"),
        ([0, 1, 2**32], "must be in"),
        ([0, 1], "!= ceil"),
        ([0, 1, 2, 3], "!= ceil"),
        ([0, 1, 0], "twice"),
    ],
    ids=["negative", "out-of-range", "too-few-for-the-prompt", "too-many", "repeated"],
)
def test_bad_source_block_ids_are_a_typed_error_that_changes_nothing(
    src: list[int], needle: str
) -> None:
    ledger = ImportLedger(8, BS)
    submit(ledger, 1, 4)
    before = snapshot(ledger)
    with pytest.raises(exceptions.BlockIdError, match=needle) as info:
        submit(ledger, 2, 10, src_block_ids=src)
    assert info.value.field == "src_block_ids"
    assert snapshot(ledger) == before
    ledger.check()


def test_destination_blocks_of_concurrent_imports_are_never_shared() -> None:
    ledger = ImportLedger(16, BS, 4)
    starts = [a for rid in range(4) for a in submit(ledger, rid, 14, has_ssm=True)]
    dsts = [b for a in starts for b in a.dst_block_ids + a.continuation_block_ids]
    slots = [a.ssm_slot for a in starts]
    assert len(dsts) == len(set(dsts)) == 16
    assert len(set(slots)) == 4
    ledger.check()


def test_kv_free_but_no_ssm_slot_defers_without_taking_blocks() -> None:
    ledger = ImportLedger(8, BS, 1)
    submit(ledger, 1, 4, has_ssm=True)
    free = ledger.block_pool.num_free
    assert submit(ledger, 2, 4, has_ssm=True) == []
    assert ledger.state_of(2) == "deferred" and ledger.block_pool.num_free == free
    acts = ledger.abort(1, 1) + ledger.settle(1, 1) + ledger.poll(2)
    assert [(a.kind, a.request_id) for a in acts if a.kind == "start"] == [("start", 2)]
    ledger.check()


def test_ssm_slot_free_but_no_kv_blocks_defers_without_taking_the_slot() -> None:
    ledger = ImportLedger(2, BS, 2)
    submit(ledger, 1, 8, has_ssm=True)
    assert submit(ledger, 2, 4, has_ssm=True) == []
    assert ledger.slot_pool.num_free == 1
    ledger.check()


def test_ssm_state_requested_from_a_decode_without_slots_is_a_capacity_error() -> None:
    ledger = ImportLedger(8, BS, 0)
    before = snapshot(ledger)
    with pytest.raises(exceptions.CapacityError) as info:
        submit(ledger, 1, 4, has_ssm=True)
    assert info.value.field == "ssm_slots"
    assert snapshot(ledger) == before


def test_one_model_parallel_rank_failing_fails_the_request_on_every_rank() -> None:
    ranks = [ImportLedger(8, BS, world_size=2, rank=r) for r in range(2)]
    starts = [submit(led, 1, 8)[0] for led in ranks]
    outcomes = [(0, "ok"), (1, "error")]
    fails = []
    for led, start in zip(ranks, starts, strict=True):
        for rank, outcome in outcomes:  # every rank sees every rank's outcome, same order
            fails += [a for a in led.report(1, start.epoch, rank, outcome, 1) if a.kind == "fail"]
    assert [(a.request_id, a.reason, a.quarantined) for a in fails] == [
        (1, "rank_error", False)
    ] * 2
    for led in ranks:
        assert led.admit(4) == [] and led.block_pool.num_free == 8
        led.check()


def test_local_timeout_quarantines_then_drains_when_the_handle_settles() -> None:
    ledger = ImportLedger(8, BS, drain_horizon=FAR)
    (start,) = submit(ledger, 1, 8)
    (fail,) = ledger.report(1, start.epoch, 0, "may_still_write", 5)
    assert fail.quarantined and ledger.num_quarantined_blocks == 2
    assert ledger.block_pool.num_free == 6  # the pool never hands out a block that may be written
    (rel,) = ledger.settle(1, start.epoch)
    assert rel.kind == "release" and ledger.block_pool.num_free == 8
    ledger.check()


def test_abort_racing_a_completion_ends_the_request_exactly_once() -> None:
    ledger = ImportLedger(8, BS)
    (start,) = submit(ledger, 1, 8)
    (fail,) = ledger.abort(1, 2)  # the abort wins: the pull may still be writing
    assert (fail.kind, fail.quarantined) == ("fail", True)
    # The late completion proves the destinations quiet: quarantine drains, nothing is admitted.
    (rel,) = ledger.report(1, start.epoch, 0, "ok", 3)
    assert (rel.kind, rel.reason) == ("release", "settled")
    assert ledger.admit(4) == [] and ledger.settle(1, start.epoch) == []
    assert ledger.block_pool.num_free == 8
    # The completion wins: the abort finds a ready import and fails it without quarantine.
    (start,) = submit(ledger, 2, 8, now=4)
    ledger.report(2, start.epoch, 0, "ok", 5)
    (fail,) = ledger.abort(2, 5)
    assert (fail.kind, fail.quarantined) == ("fail", False)
    assert ledger.abort(2, 6) == [] and ledger.block_pool.num_free == 8
    ledger.check()


def test_reset_with_work_in_every_state_refuses_itemized_then_releases_everything() -> None:
    ledger = ImportLedger(6, BS, drain_horizon=FAR)
    (importing,) = submit(ledger, 1, 8)
    (ready,) = submit(ledger, 2, 4)
    ledger.report(2, ready.epoch, 0, "ok", 1)
    (quarantined,) = submit(ledger, 3, 4)
    ledger.report(3, quarantined.epoch, 0, "may_still_write", 1)
    assert submit(ledger, 4, 16) == []  # deferred
    before = snapshot(ledger)
    with pytest.raises(exceptions.ResetRefusedError) as info:
        ledger.reset(2)
    assert "request 1" in str(info.value) and "request 3" in str(info.value)
    assert snapshot(ledger) == before
    ledger.report(1, importing.epoch, 0, "ok", 3)
    ledger.settle(3, quarantined.epoch)
    acts = ledger.reset(4)
    assert sorted(a.request_id for a in acts if a.kind == "fail") == [1, 2, 4]
    assert ledger.pending_kv_import_count == 0 and ledger.block_pool.num_free == 6
    ledger.check()


def test_pin_after_lease_expiry_is_gone_and_a_late_release_is_a_counted_no_op() -> None:
    pins = PinLedger(4, BS)
    blocks = pins.block_pool.allocate(2)
    epoch = pins.pin(1, blocks, lease_until=10, now=0)
    pins.block_pool.release(blocks)
    (exp,) = pins.expire(10)
    assert exp.reason == "lease_expired" and pins.block_pool.num_free == 4
    assert pins.epoch_of(1) is None
    assert pins.release(1, epoch) == []
    assert pins.counters()["ignored_messages"] == 1
    pins.check()
