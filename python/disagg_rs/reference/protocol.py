"""The pool interfaces the reference engine draws from (DESIGN §6).

``disagg_rs.BlockPool`` and ``disagg_rs.SlotPool`` (Rust) implement them; any object with the
same methods works, which is how an engine with its own allocator plugs in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["BlockPoolLike", "BlockPoolFactory", "SlotPoolFactory", "SlotPoolLike"]


class BlockPoolLike(Protocol):
    """Refcounted KV blocks with a prefix cache keyed by a chain hash of full blocks."""

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1 (evicting unreferenced cached blocks LRU first)."""
        ...

    def retain(self, ids: Sequence[int]) -> None:
        """One more reference per id (claims an evictable cached block)."""
        ...

    def release(self, ids: Sequence[int]) -> None:
        """One reference less per id; a block at zero becomes free, or evictable if cached."""
        ...

    def refcount(self, block_id: int) -> int:
        """References held on ``block_id``."""
        ...

    @property
    def num_free(self) -> int:
        """Blocks an allocate can hand out now (free plus evictable)."""
        ...

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks that still hold a published prefix."""
        ...

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed."""
        ...

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chain hashes of the full blocks of ``tokens``."""
        ...

    def register_cached(self, ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Publish held, fully written blocks under their hashes."""
        ...

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (not retained)."""
        ...

    def check(self) -> None:
        """Raise if the pool's internal accounting is inconsistent."""
        ...


class SlotPoolLike(Protocol):
    """Fixed SSM state slots."""

    def allocate(self) -> int:
        """One free slot."""
        ...

    def free(self, slot: int) -> None:
        """Return an allocated or detached slot."""
        ...

    def detach(self, slot: int) -> None:
        """Record that an allocated slot's ownership moved to a live request."""
        ...

    @property
    def num_free(self) -> int:
        """Slots ready to hand out."""
        ...

    def check(self) -> None:
        """Raise if the pool's internal accounting is inconsistent."""
        ...


BlockPoolFactory = Callable[[int, int], BlockPoolLike]
"""``(num_blocks, block_size_tokens) -> pool``."""

SlotPoolFactory = Callable[[int], SlotPoolLike]
"""``(num_slots) -> pool``."""
