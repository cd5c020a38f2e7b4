"""BlockPool and SlotPool: examples named as sentences and a stateful test against a model."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from disagg_rs import BlockPool, SlotPool, exceptions
from disagg_rs.engine_protocol import BlockAllocator, SlotAllocator


def test_pools_satisfy_the_engine_allocator_protocols() -> None:
    assert isinstance(BlockPool(4, 16), BlockAllocator)
    assert isinstance(SlotPool(2), SlotAllocator)


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(exceptions.CapacityError) as info:
        pool.allocate(2)
    assert "needs 2" in str(info.value)
    assert pool.num_free == 1
    assert not pool.can_allocate(2)


def test_release_counts_each_occurrence_of_a_repeated_block() -> None:
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    pool.retain([b, b])
    pool.release([b, b])
    assert pool.refcount(b) == 1
    with pytest.raises(exceptions.BlockIdError):
        pool.release([b, b])
    assert pool.refcount(b) == 1  # rejected whole


def test_negative_or_out_of_range_block_ids_are_typed_errors() -> None:
    pool = BlockPool(4, 16)
    with pytest.raises(exceptions.BlockIdError):
        pool.release([-1])
    with pytest.raises(exceptions.BlockIdError):
        pool.refcount(4)
    with pytest.raises(exceptions.BlockIdError):
        pool.retain([0])  # never allocated


def test_prefix_cache_evicts_least_recently_released_first() -> None:
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    hashes = pool.block_hashes([1, 2, 3, 4, 5, 6])
    pool.register_cached(blocks, hashes)
    pool.release([blocks[2]])
    pool.release([blocks[0]])
    pool.release([blocks[1]])
    assert pool.num_evictable == 3
    assert pool.match_prefix(hashes) == blocks
    assert pool.allocate(1) == [blocks[2]]
    assert pool.match_prefix(hashes) == blocks[:2]
    pool.retain(pool.match_prefix(hashes[:1]))  # a hit claims the block
    assert pool.num_evictable == 1
    pool.check()


def test_block_hashes_are_parent_aware_and_ignore_the_partial_tail() -> None:
    pool = BlockPool(4, 2)
    a = pool.block_hashes([1, 2, 3, 4, 5])
    b = pool.block_hashes([7, 7, 3, 4])
    assert len(a) == 2
    assert a[1] != b[1]
    assert a == pool.block_hashes([1, 2, 3, 4])


def test_block_hashes_are_identical_in_another_process() -> None:
    tokens = list(range(64))
    here = BlockPool(4, 16).block_hashes(tokens)
    code = f"from disagg_rs import BlockPool; print(BlockPool(4, 16).block_hashes({tokens}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == str(here)


def test_slot_pool_detach_moves_ownership_until_free() -> None:
    slots = SlotPool(2)
    s = slots.allocate()
    slots.detach(s)
    assert slots.state(s) == "detached"
    assert slots.num_free == 1
    with pytest.raises(exceptions.BlockIdError):
        slots.detach(s)
    slots.free(s)
    with pytest.raises(exceptions.BlockIdError):
        slots.free(s)
    slots.allocate()
    slots.allocate()
    with pytest.raises(exceptions.CapacityError):
        slots.allocate()
    slots.check()


class BlockPoolMachine(RuleBasedStateMachine):
    """Refcounts, free counts and cache hits against a dict model."""

    N = 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.N, 2)
        self.refs: Counter[int] = Counter()
        self.published: dict[int, int] = {}  # hash -> block

    @rule(n=st.integers(0, 7))
    def allocate(self, n: int) -> None:
        if n > self.pool.num_free:
            with pytest.raises(exceptions.CapacityError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert len(set(got)) == n
        for b in got:
            assert self.refs[b] == 0
            self.refs[b] = 1
            for h in [h for h, x in self.published.items() if x == b]:
                del self.published[h]  # evicted

    @precondition(lambda self: bool(+self.refs))
    @rule(data=st.data())
    def retain_or_release(self, data: st.DataObject) -> None:
        held = sorted(+self.refs)
        ids = data.draw(st.lists(st.sampled_from(held), max_size=4))
        if data.draw(st.booleans()):
            self.pool.retain(ids)
            self.refs.update(ids)
            return
        drops = Counter(ids)
        if any(drops[b] > self.refs[b] for b in drops):
            with pytest.raises(exceptions.BlockIdError):
                self.pool.release(ids)
            return
        self.pool.release(ids)
        self.refs.subtract(ids)

    @precondition(lambda self: bool(+self.refs))
    @rule(data=st.data(), family=st.integers(0, 3))
    def publish(self, data: st.DataObject, family: int) -> None:
        b = data.draw(st.sampled_from(sorted(+self.refs)))
        if b in self.published.values():
            return
        (h,) = self.pool.block_hashes([family, b])
        self.pool.register_cached([b], [h])
        self.published.setdefault(h, b)

    @precondition(lambda self: bool(self.published))
    @rule(data=st.data())
    def claim_cache_hit(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.published)))
        (b,) = self.pool.match_prefix([h])
        assert b == self.published[h]
        self.pool.retain([b])
        self.refs[b] += 1

    @invariant()
    def counts_match_the_model(self) -> None:
        self.pool.check()
        for b in range(self.N):
            assert self.pool.refcount(b) == self.refs[b]
        evictable = {b for b in self.published.values() if self.refs[b] == 0}
        assert self.pool.num_evictable == len(evictable)
        assert self.pool.num_free == self.N - len(+self.refs)


BlockPoolMachine.TestCase.settings = settings(stateful_step_count=50)
test_block_pool_state_machine = BlockPoolMachine.TestCase
