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


def _abort(stream: int) -> bytes:
    """The ``Abort`` notification of ``stream``: what a source that gives up sends."""
    (msg,) = _core.StreamSource(stream, [(0, 1, 0, 8)], [0]).close(True)
    return msg


def test_the_device_plan_cuts_chunks_with_the_cores_schedule() -> None:
    plan = _plan()
    got = plan.chunks(10, 64)
    assert got == [(0, 2, 0, 32), (2, 4, 32, 72), (4, 6, 72, 120)]
    assert plan.packed.chunks(10, 64) == got
    assert got[-1][3] == plan.packed_bytes(10)


def test_a_stream_moves_every_chunk_through_its_slot_in_order() -> None:
    chunks = [(k, k + 1, 100 * k, 100 * k + 100) for k in range(5)]
    src = _core.StreamSource(4, chunks, [0, 4096])
    sink = _core.StreamSink(4, chunks, [0, 4096], 100, 2)
    assert src.first() == [(0, 0), (1, 1)]  # queued as the ticket leaves
    assert sink.reads() == []  # nothing is read before it is announced
    for msg in src.announce([True, True]):  # once their packs have completed
        assert sink.receive(msg) == "ready"
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
    for k in (0, 1):
        sink.receive(src.ready(k))
    sink.reads()
    with pytest.raises(MetadataError) as info:
        src.receive(_abort(4)[:-1])  # truncated
    assert info.value.field == "stream_msg"
    with pytest.raises(MetadataError) as info:
        sink.receive(src.ready(0))  # announced already
    assert info.value.field == "stream_msg.chunk"
    with pytest.raises(MetadataError) as info:
        src.receive(_abort(5))
    assert info.value.field == "stream_msg.stream"
    ack = sink.landed(1)
    assert src.receive(ack) == "ack"
    with pytest.raises(MetadataError) as info:
        src.receive(ack)
    assert info.value.field == "stream_msg.chunk"
    with pytest.raises(ArgumentError):
        sink.landed(1)
    assert sink.receive(_abort(4)) == "abort"
    assert sink.aborted and sink.reads() == []


def test_a_whole_copy_is_read_once_announced_and_an_early_announcement_waits() -> None:
    ticket = {"src_rank": 0, "incarnation": 1, "staged": True, "offset": 256, "nbytes": 96,
              "ready": 7}  # fmt: skip
    src = _core.StreamSource.whole(7, 256, 96)
    sink = _core.StreamSink.one_piece(ticket)
    assert sink.stream_id == 7 and sink.chunks == [[0, 0, 0, 96]]
    assert src.announce([False]) == [] and sink.reads() == []  # the pack has not completed
    (ready,) = src.announce([True])
    assert src.done and _core.staging_release(ticket) == (7, [256])
    # The announcement reaches the decode before the ticket: it waits for the read to open.
    boxes = _core.StreamMailboxes()
    boxes.route([("pre", [ready])], 0.0, 30.0)
    assert boxes.early == 1 and boxes.dropped == 0
    box = boxes.open("pre", 7)
    assert sink.take(*boxes.take(box)) is None
    assert [(k, slot, at) for k, slot, at, _ in sink.reads()] == [(0, 0, 256)]
    with pytest.raises(MetadataError) as info:
        stream = {"id": 1, "chunk_bytes": 8, "slot_bytes": 8, "offsets": [0]}
        _core.StreamSink.one_piece({**ticket, "stream": stream})
    assert info.value.field == "ticket.ready"
    # A decode that reads the source directly drops what the ticket's stream received.
    boxes.route([("pre", [ready])], 1.0, 30.0)
    boxes.forget_ticket("pre", ticket)
    assert boxes.take(box) == ([], False) and boxes.early == 0
    # One whose stream never opens here waits no longer than a stream could run.
    boxes.route([("gone", [ready])], 2.0, 30.0)
    boxes.route([], 32.5, 30.0)
    assert boxes.early == 0 and boxes.dropped == 1
