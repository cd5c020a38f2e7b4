"""Block and SSM slot pools (Rust), usable as an engine's allocator.

:class:`BlockPool` holds a fixed number of KV blocks with reference counts:

- ``allocate(n)`` is all or nothing; it takes never-used blocks first, then evicts
  unreferenced cached blocks least-recently-released first, and raises
  :class:`~disagg_rs.exceptions.CapacityError` when ``n > num_free``.
- ``retain(ids)`` / ``release(ids)`` count per occurrence (an id listed twice moves its refcount
  by two); a list that would drive any refcount below zero is rejected whole
  (:class:`~disagg_rs.exceptions.BlockIdError`).
- Prefix caching: ``block_hashes(tokens)`` hashes the FULL blocks of a token list as a
  parent-aware chain (deterministic across processes; a trailing partial block gets no hash),
  ``register_cached(ids, hashes)`` publishes held blocks, ``match_prefix(hashes)`` returns the
  blocks of the longest cached prefix without retaining them; ``retain`` claims them.
- ``num_free`` counts never-used plus evictable blocks; ``num_evictable`` the latter.
- ``check()`` verifies conservation and raises :class:`~disagg_rs.exceptions.ConservationError`.

:class:`SlotPool` holds SSM state slots: ``allocate() -> slot``, ``free(slot)``, and
``detach(slot)``, which records that ownership moved on (typically to a request admitted into
the decode batch): the slot stays out of the free list but no longer counts as owned by the
allocator that handed it out (a ledger); the request's owner calls ``free`` when it finishes.

A pool made by ``BlockPool(...)`` is standalone; ``ImportLedger.block_pool`` and
``PinLedger.block_pool`` are views of the pool a ledger owns (not copies), so the engine
allocates from the same pool whose conservation the ledger checks. An engine may bring its own
allocator instead if it has the same methods: see :mod:`disagg_rs.engine_protocol`.
"""

from disagg_rs._core import BlockPool, SlotPool

__all__ = ["BlockPool", "SlotPool"]
