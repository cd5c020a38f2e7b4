"""Sans-IO handoff ledgers (Rust): events in, actions out, caller-supplied time.

Time (``now``, ``deadline``, ``lease_until``, ``drain_horizon``) is an ``int`` in a unit the
caller picks (``time.monotonic_ns()`` in the drivers, a virtual counter in tests); nothing in
the ledgers reads a clock. Every mutating call returns a ``list[LedgerAction]``: one small
frozen record per request (never one object per block), tagged by ``kind``:

``"start"``
    Post the transfers of one import: source blocks ``src_block_ids`` hold prompt tokens
    ``[token_start, n)`` and go to local ``dst_block_ids``; ``cached_block_ids`` (decode prefix
    cache, pull transports only) already hold ``[0, token_start)``;
    ``continuation_block_ids`` are empty blocks for the resume tokens; ``ssm_slot`` receives
    the SSM state. Every later report must carry the action's ``epoch``.
``"admit"``
    The import is complete and admitted: ownership of ``block_ids`` (all blocks, token order)
    and ``ssm_slot`` moved to the live request; resolve its future.
``"complete"``
    The resume tokens already satisfy the request: finish it without a forward step (the
    ledger released its blocks).
``"fail"``
    The handoff failed (``reason``: ``rank_error``, ``rank_timeout``, ``deadline``,
    ``aborted``, ``reset``); ``quarantined`` says whether its destinations may still be
    written and were kept out of the pool.
``"release"``
    A quarantine drained or a prefill pin ended (``reason``: ``settled``, ``horizon``,
    ``release_kv``, ``lease_expired``, ``reset``).

:class:`ImportLedger` (decode side, docs/architecture.md §5) owns its block and slot pools
(``ledger.block_pool``, ``ledger.slot_pool``). ``submit`` validates (a rejected submit raises
a typed error and changes nothing), queues FIFO in DEFERRED, and starts every queued handoff
whose reservation (cached prefix, imported blocks, continuation blocks, one SSM slot) fits, all
or nothing, never letting a later request overtake an older one. ``report(request_id, epoch,
rank, outcome, now)`` feeds each rank's terminal outcome (``"ok"``, ``"error"``, ``"timeout"``,
``"may_still_write"``) to a :class:`CompletionQuorum`; a complete import waits for
``admit(batch_room)`` at an admission point. Failed imports release their blocks only when the
local handle is provably quiet, else quarantine them until ``settle`` (or a quiet local report)
or until ``poll(now)`` passes the drain horizon. ``abort``, ``poll`` (deadlines), ``reset`` and
the counters complete the surface; ``pending_kv_import_count`` and ``has_admittable_kv_import``
are the reference design's names. Duplicate, late (old epoch) and unknown messages are counted
no-ops.

:class:`PinLedger` (prefill side) pins a finished handoff's blocks and SSM slot until
``release`` (RELEASE_KV; idempotent, unknown ids are no-ops) or ``expire(now)`` passes the
lease; a push in flight (``begin_push`` .. ``push_settled``) delays the release until it
settles. ``pending_kv_push_count`` is the reference design's name.

Example::

    from disagg_rs.ledger import ImportLedger

    ledger = ImportLedger(num_blocks=64, block_size_tokens=16, num_ssm_slots=4)
    (start,) = ledger.submit(7, list(range(40)), src_block_ids=[3, 4, 5], resume_tokens=1,
                             has_ssm=True, deadline=10_000, now=0)
    # ... post transfers start.src_block_ids -> start.dst_block_ids, then on completion:
    ledger.report(7, start.epoch, rank=0, outcome="ok", now=5)
    (admitted,) = ledger.admit(batch_room=8)
    assert admitted.kind == "admit"
    ledger.check()
"""

from disagg_rs._core import CompletionQuorum, ImportLedger, LedgerAction, PinLedger

__all__ = ["CompletionQuorum", "ImportLedger", "LedgerAction", "PinLedger"]
