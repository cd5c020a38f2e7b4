"""The streamed-staging schedule and notifications as Python sees them (``_core``): both sides
cut a packed copy alike, a source packs into a slot only once the decode acknowledged its last
chunk, and a notification the schedule does not allow fails with the field named."""

from __future__ import annotations

import numpy as np
import pytest

from disagg_rs import _core
from disagg_rs.exceptions import ArgumentError, MetadataError
from disagg_rs.transfer_backends import device_plan as dp


def _plan() -> dp.DevicePlan:
    """Two planes of 4 and 8 bytes per token, 4 tokens per block."""
    planes = np.array([[0, 0, 0, 4], [64, 64, 4, 8]], dtype=np.int64)
    return dp.DevicePlan(planes=planes, sets=np.zeros(2, dtype=np.int64), tokens_per_block=4,
                         src_block_stride=128, src_token_stride=16, dst_block_stride=128,
                         dst_token_stride=16)  # fmt: skip


def test_the_device_plan_cuts_chunks_with_the_cores_schedule() -> None:
    plan = _plan()
    got = plan.chunks(10, 64)
    assert got == [(0, 2, 0, 32), (2, 4, 32, 72), (4, 6, 72, 120)]
    assert [tuple(c) for c in _core.stream_chunks([(0, 4), (4, 8)], 4, 10, 64)] == got
    assert got[-1][3] == plan.packed_bytes(10)


def test_a_stream_moves_every_chunk_through_its_slot_in_order() -> None:
    chunks = [(k, k + 1, 100 * k, 100 * k + 100) for k in range(5)]
    src = _core.StreamSource(4, chunks, [0, 4096])
    sink = _core.StreamSink(4, chunks, [0, 4096], 100, 2)
    assert src.packable() == [(0, 0), (1, 1)]  # what the ticket announces
    read = []
    while not (src.done and sink.done):
        for k, _slot, off, (_, _, lo, hi) in sink.reads():
            assert off == [0, 4096][k % 2] and hi - lo == 100
            read.append(k)
            assert src.receive(sink.landed(k)) == "ack"
        for k, _ in src.packable():
            assert sink.receive(src.ready(k)) == "ready"
    assert read == [0, 1, 2, 3, 4]


def test_notifications_off_the_schedule_name_the_field() -> None:
    chunks = [(k, k + 1, 100 * k, 100 * k + 100) for k in range(4)]
    src = _core.StreamSource(4, chunks, [0, 4096])
    sink = _core.StreamSink(4, chunks, [0, 4096], 100, 2)
    src.packable()
    sink.reads()
    with pytest.raises(MetadataError) as info:
        src.receive(_core.stream_abort_msg(4)[:-1])  # truncated
    assert info.value.field == "stream_msg"
    with pytest.raises(MetadataError) as info:
        sink.receive(src.ready(0))  # announced by the ticket already
    assert info.value.field == "stream_msg.chunk"
    with pytest.raises(MetadataError) as info:
        src.receive(_core.stream_abort_msg(5))
    assert info.value.field == "stream_msg.stream"
    ack = sink.landed(1)
    assert src.receive(ack) == "ack"
    with pytest.raises(MetadataError) as info:
        src.receive(ack)
    assert info.value.field == "stream_msg.chunk"
    with pytest.raises(ArgumentError):
        sink.landed(1)
    assert _core.stream_msg_route(ack) == ("ack", 4)
    assert sink.receive(_core.stream_abort_msg(4)) == "abort"
    assert sink.aborted and sink.reads() == []
