"""Hypothesis state machine: PinLedger bindings against a small Python model of pins."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from disagg_rs import LedgerAction, PinLedger, exceptions

NUM_BLOCKS = 8
NUM_SLOTS = 2


@dataclass
class Pin:
    epoch: int
    blocks: list[int]
    slot: int | None
    lease_until: int
    pushing: bool = False
    release_waiting: bool = False


class PinLedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = PinLedger(NUM_BLOCKS, 4, NUM_SLOTS)
        self.now = 0
        self.pins: dict[int, Pin] = {}
        self.released: list[int] = []  # epochs whose release was reported

    def released_now(self, actions: list[LedgerAction]) -> None:
        for a in actions:
            assert a.kind == "release"
            assert a.epoch not in self.released, "a pin was released twice"
            self.released.append(a.epoch)
            assert self.pins.pop(a.request_id).epoch == a.epoch

    @rule(rid=st.integers(1, 5), n=st.integers(0, 4), ssm=st.booleans(), ttl=st.integers(0, 30))
    def finish_prefill_and_pin(self, rid: int, n: int, ssm: bool, ttl: int) -> None:
        pool, slots = self.ledger.block_pool, self.ledger.slot_pool
        if not pool.can_allocate(n) or (ssm and slots.num_free == 0):
            return
        blocks = pool.allocate(n)
        slot = slots.allocate() if ssm else None
        try:
            if rid in self.pins or ttl == 0:
                with pytest.raises((exceptions.DuplicateRequestError, exceptions.ArgumentError)):
                    self.ledger.pin(rid, blocks, slot, lease_until=self.now + ttl, now=self.now)
                if slot is not None:
                    slots.free(slot)
                return
            epoch = self.ledger.pin(rid, blocks, slot, lease_until=self.now + ttl, now=self.now)
            self.pins[rid] = Pin(epoch, blocks, slot, self.now + ttl)
        finally:
            pool.release(blocks)  # the prefill request drops its own references

    @rule(rid=st.integers(0, 6), which=st.sampled_from(["none", "current", "stale"]))
    def release_kv(self, rid: int, which: str) -> None:
        pin = self.pins.get(rid)
        epoch = None if which == "none" or pin is None else pin.epoch + (which == "stale") * 99
        acts = self.ledger.release(rid, epoch)
        if pin is None or which == "stale":
            assert acts == []
        elif pin.pushing:
            assert acts == []
            pin.release_waiting = True
        self.released_now(acts)

    @rule(rid=st.integers(0, 6))
    def push(self, rid: int) -> None:
        pin = self.pins.get(rid)
        if pin is None:
            return
        if pin.pushing:
            self.released_now(self.ledger.push_settled(rid, pin.epoch))
            if rid in self.pins:
                pin.pushing = False
        else:
            self.ledger.begin_push(rid, pin.epoch)
            pin.pushing = True

    @rule(dt=st.integers(0, 15))
    def advance_clock(self, dt: int) -> None:
        self.now += dt
        acts = self.ledger.expire(self.now)
        for a in acts:
            assert self.pins[a.request_id].lease_until <= self.now
        self.released_now(acts)

    @rule()
    def reset(self) -> None:
        if any(p.pushing for p in self.pins.values()):
            with pytest.raises(exceptions.ResetRefusedError):
                self.ledger.reset()
            return
        self.released_now(self.ledger.reset())
        assert not self.pins

    @invariant()
    def conservation_holds(self) -> None:
        self.ledger.check()
        pool = self.ledger.block_pool
        held: dict[int, int] = {}
        for p in self.pins.values():
            for b in p.blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            assert pool.refcount(b) == held.get(b, 0)
        slots_held = [p.slot for p in self.pins.values() if p.slot is not None]
        assert self.ledger.slot_pool.num_free + len(slots_held) == NUM_SLOTS
        assert self.ledger.num_pinned == len(self.pins)
        assert self.ledger.pending_kv_push_count == sum(p.pushing for p in self.pins.values())


PinLedgerMachine.TestCase.settings = settings(stateful_step_count=100)
test_pin_ledger_state_machine = PinLedgerMachine.TestCase
