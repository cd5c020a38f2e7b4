"""The steps of a reference-design engine (its own allocator, no ledger) whose rules are
decided in the Rust core: what an import looks up in the prefix cache, the pinned-block
refusal of a reset before any transfer is waited for, and the prefill's prepared metadata.
Transport-free: the transfer handles are finished by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from disagg_rs.exceptions import HandoffStateError, ResetRefusedError
from test_reference_compat_decode import DecodeEngine, Sampling, _land, _submit


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.run_until_complete(asyncio.sleep(0))  # the engine-loop wake-ups the handoffs scheduled
    lp.close()


class _WaitCounter:
    """A transfer handle that counts the waits on it (a wait would time out)."""

    def __init__(self) -> None:
        self.waits = 0

    def poll(self) -> bool:
        return False

    def wait(self) -> None:
        self.waits += 1
        raise TimeoutError


def test_a_push_transport_looks_nothing_up_in_the_prefix_cache(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    _submit(engine, 1, list(range(8)), Sampling(1))
    assert _land(engine) == 1
    assert len(engine.context.kv_block_allocator.kv_hash_to_block_id) == 2
    # A pull reuses those two cached blocks; a push transport writes every block itself.
    engine._kv_transfer_agent.is_push = True
    _submit(engine, 2, [*range(8), 9, 9, 9], Sampling(4))
    (pending,) = engine._pending_kv_imports
    assert pending.cached_prefix_block_count == 0 and len(pending.local_blocks) == 3
    assert _land(engine) == 1


def test_a_reset_with_pinned_blocks_is_refused_before_any_transfer_is_waited_for(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    _submit(engine, 1, list(range(8)), Sampling(4))
    (pending,) = engine._pending_kv_imports
    handle = pending.handle = _WaitCounter()
    engine._pinned_handoff_blocks[9] = [0]
    with pytest.raises(ResetRefusedError, match=r"remain pinned for requests \[9\]"):
        engine._reset_pending_kv_imports()
    assert handle.waits == 0 and engine.pending_kv_import_count == 1
    # Without pins the running transfer is waited for, and still refuses the reset.
    del engine._pinned_handoff_blocks[9]
    with pytest.raises(ResetRefusedError, match="may still access cache storage"):
        engine._reset_pending_kv_imports()
    assert handle.waits == 1 and engine.pending_kv_import_count == 1


def test_a_ticket_without_prepared_metadata_is_refused_naming_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = DecodeEngine(loop)
    request = SimpleNamespace(request_id=7)
    with pytest.raises(HandoffStateError, match="request 7: no handoff metadata") as info:
        engine.capture_handoff_ticket(request)
    assert info.value.field == "prepared"
    assert 7 not in engine._pinned_handoff_blocks
