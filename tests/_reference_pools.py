"""Pools for the reference-engine tests: the Rust ``disagg_rs.BlockPool`` / ``SlotPool`` when
this build has them, else a small Python model of the same contract (refcounts, chain hashes of
full blocks, LRU eviction of unreferenced cached blocks), which also serves as an oracle."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from disagg_rs import _core


class ModelBlockPool:
    """Python model of the BlockPool contract."""

    def __init__(self, num_blocks: int, block_size_tokens: int) -> None:
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks))[::-1]
        self._hash_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def refcount(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise ValueError(f"allocate needs {n} blocks > {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    def retain(self, ids: Sequence[int]) -> None:
        for b in ids:
            if self._ref[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"retain of free block {b}")
                del self._evictable[b]
            self._ref[b] += 1

    def release(self, ids: Sequence[int]) -> None:
        for b in ids:
            if self._ref[b] < 1:
                raise ValueError(f"release of unreferenced block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        bs = self.block_size_tokens
        out, parent = [], b"seed"
        for i in range(len(tokens) // bs):
            chunk = bytes(int(t) % 256 for t in tokens[i * bs : (i + 1) * bs])
            parent = hashlib.blake2b(parent + chunk, digest_size=8).digest()
            out.append(int.from_bytes(parent, "little"))
        return out

    def register_cached(self, ids: Sequence[int], hashes: Sequence[int]) -> None:
        for b, h in zip(ids, hashes, strict=True):
            if self._ref[b] < 1:
                raise ValueError(f"block {b} is not held")
            if b not in self._hash_of and h not in self._cached:
                self._hash_of[b] = h
                self._cached[h] = b

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        out = []
        for h in hashes:
            if h not in self._cached:
                break
            out.append(self._cached[h])
        return out

    def check(self) -> None:
        held = sum(r > 0 for r in self._ref)
        assert held + len(self._free) + len(self._evictable) == self.num_blocks


class ModelSlotPool:
    """Python model of the SlotPool contract."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))[::-1]
        self._state = ["free"] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        s = self._free.pop()
        self._state[s] = "allocated"
        return s

    def free(self, slot: int) -> None:
        assert self._state[slot] != "free", f"slot {slot} is already free"
        self._state[slot] = "free"
        self._free.append(slot)

    def detach(self, slot: int) -> None:
        assert self._state[slot] == "allocated"
        self._state[slot] = "detached"

    def check(self) -> None:
        assert self._state.count("free") == len(self._free)


def pool_factories() -> dict[str, Any]:
    """Keyword arguments for ReferenceEngine: the Rust pools if built, else the models."""
    if hasattr(_core, "BlockPool") and hasattr(_core, "SlotPool"):
        return {}
    return {"block_pool_factory": ModelBlockPool, "slot_pool_factory": ModelSlotPool}
