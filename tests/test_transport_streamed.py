"""Streamed staging over NIXL: a packed copy several times larger than BOTH staging pools
moves chunk by chunk through a few slots of each (the prefill packs a chunk and announces it
with a NIXL notification, the decode reads it, acknowledges it and scatters it, the
acknowledgement frees the prefill's slot for the next chunk), byte-exact against the
global-tensor oracle; a decode that gives the pull up mid-stream leaves both pools free.

Real NIXL agents in spawned processes (UCX loopback), host memory, no mocks. The prefill's
side advances only when it polls (``poll_streams``, what a prefill's turn calls): the tests
poll both sides in rounds, no sleeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import transport_workers as tw
from transport_workers import Case, Side, Worker, WorkerError

pytestmark = pytest.mark.slow

TP1 = Case("tp1_to_tp1", (Side(),), (Side(),))
TP2 = Case("tp2_to_tp1", (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)), (Side(),))
#: Packed bytes per source: 40 tokens x 4 layers x 2 x (4 / tp) heads x 8 x 4 bytes.
PACKED = {"tp1_to_tp1": 40960, "tp2_to_tp1": 20480}
#: Both pools of a case: the packed copy of every source is five times larger.
POOL = {"tp1_to_tp1": 8192, "tp2_to_tp1": 4096}


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Worker]]:
    yield from tw.worker_pool("nixl", ["pre0", "pre1", "dec0"])


def _setup(
    workers: list[Worker], key: str, case: Case
) -> tuple[list[Worker], Worker, list[dict[str, Any]]]:
    """Backends of ``case`` with both pools ``POOL``; return the prefill workers, the decode
    and the tickets of every source (staged for the decode)."""
    pre, dec = workers[: len(case.srcs)], workers[2]
    pool = POOL[case.name]
    metas = [
        pre[i]("setup", key, case, s, "src", mode="staged", staging_bytes=pool)
        for i, s in enumerate(case.srcs)
    ]
    dst_meta = dec("setup", key, case, case.dsts[0], "dst", mode="staged", staging_bytes=pool)
    n = case.num_tokens
    tickets = [
        tw.stage(pre[i], key, dst_meta, tw.src_ids(case, s), src_metas=metas, num_tokens=n)
        for i, s in enumerate(case.srcs)
    ]
    src_ids = {s.global_rank: tw.src_ids(case, s) for s in case.srcs}
    tw.pull(dec, key, metas, src_ids, tw.dst_ids(case, case.dsts[0]), num_tokens=n,
            staged=tickets)  # fmt: skip
    return pre, dec, tickets


def _free(w: Worker, key: str) -> bool:
    """Whether ``w``'s staging pool holds nothing and runs no stream."""
    stats = w("call", key, "staging_stats")
    return bool(stats["in_use"] == stats["ranges"] == stats["streams"] == 0)


def _silent_read(
    pre: Worker, dec: Worker, key: str, **pull_kw: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A TP1 source and decode with 1 MiB pools, the source's copy staged and the decode's
    read of it started under a ticket naming an announcement that never comes; return the
    source's and the decode's metadata and the real ticket."""
    case, pool = TP1, 1 << 20
    meta = pre("setup", key, case, case.srcs[0], "src", mode="staged", staging_bytes=pool)
    dst_meta = dec("setup", key, case, case.dsts[0], "dst", mode="staged", staging_bytes=pool)
    n, src = case.num_tokens, {0: tw.src_ids(case, case.srcs[0])}
    ticket = tw.stage(pre, key, dst_meta, src[0], src_metas=[meta], num_tokens=n)
    silent = {**ticket, "ready": ticket["ready"] + 1000}
    tw.pull(dec, key, [meta], src, tw.dst_ids(case, case.dsts[0]), num_tokens=n,
            staged=[silent], **pull_kw)  # fmt: skip
    return meta, dst_meta, ticket


@contextlib.contextmanager
def _closing(pre: list[Worker], dec: Worker, key: str) -> Iterator[None]:
    """Close the backends of ``key`` on every worker of a test, however the test ends."""
    try:
        yield
    finally:
        for w in pre:
            w("close", key)
        dec("close", key)


@pytest.mark.parametrize("case", [TP1, TP2], ids=lambda c: c.name)
def test_a_copy_larger_than_both_pools_streams_byte_exact(
    workers: list[Worker], case: Case
) -> None:
    key = f"stream-{case.name}"
    pre, dec, tickets = _setup(workers, key, case)
    with _closing(pre, dec, key):
        pool = POOL[case.name]
        for t in tickets:
            assert t["staged"] is True and t["nbytes"] == PACKED[case.name] >= 5 * pool
            st = t["stream"]
            # Slots of the prefill's own pool, at most half of it.
            assert len(st["offsets"]) >= 2 and len(st["offsets"]) * st["slot_bytes"] <= pool // 2
        tw.drive(dec, pre, key)
        dec("wait", key)
        stats = dec("stats", key)
        assert set(stats["modes"].values()) == {"streamed"}
        chunks = stats["descriptors"] // len(case.srcs)
        assert chunks * pool >= PACKED[case.name]  # many chunks through the few slots
        got = dec("buffer", key)
        assert np.array_equal(got, tw.expected_dst(case, case.dsts[0]).numpy())
        # Every chunk was acknowledged and every slot is back in both pools, before any
        # release: the streams ended by themselves.
        for w in [*pre, dec]:
            assert _free(w, key)
        assert [w("call", key, "staging_stats")["streamed"] for w in pre] == [1] * len(pre)
        for i, t in enumerate(tickets):
            pre[i]("call", key, "release_staged", t)  # idempotent after the stream ended
            assert pre[i]("call", key, "staging_stats")["in_use"] == 0


def test_a_decode_that_gives_up_mid_stream_leaves_both_pools_free(
    workers: list[Worker],
) -> None:
    key = "stream-abort"
    pre, dec, tickets = _setup(workers, key, TP2)
    with _closing(pre, dec, key):
        for _ in range(3):  # a few chunks move, most do not
            assert dec("poll", key) is False
            for w in pre:
                w("call", key, "poll_streams")
        assert all(w("call", key, "staging_stats")["streams"] == 1 for w in pre)
        assert dec("call", key, "staging_stats")["in_use"] > 0
        dec("cancel", key)
        assert _free(dec, key)
        # The prefills learn it from the decode's abort notification on their next polls.
        for _ in range(tw.DRIVE_ROUNDS):
            if sum(int(w("call", key, "poll_streams")) for w in pre) == 0:
                break
        for w in pre:
            assert _free(w, key)
        for i, t in enumerate(tickets):
            pre[i]("call", key, "release_staged", t)  # nothing left to free: harmless


def test_releasing_a_stream_no_decode_reads_frees_the_prefill_pool(
    workers: list[Worker],
) -> None:
    """The request's lease or RELEASE_KV ends a stream whose decode never acknowledges."""
    key = "stream-release"
    pre, dst = workers[0], workers[2]
    case = TP1
    pool = POOL[case.name]
    meta = pre("setup", key, case, case.srcs[0], "src", mode="staged", staging_bytes=pool)
    dst_meta = dst("setup", key, case, case.dsts[0], "dst", mode="staged", staging_bytes=pool)
    with _closing([pre], dst, key):
        ticket = tw.stage(pre, key, dst_meta, tw.src_ids(case, case.srcs[0]), src_metas=[meta],
                          num_tokens=case.num_tokens)  # fmt: skip
        assert "stream" in ticket
        assert pre("call", key, "poll_streams") == 1  # no acknowledgement comes
        assert pre("call", key, "staging_stats")["in_use"] > 0
        pre("call", key, "release_staged", ticket)
        assert _free(pre, key)
        assert pre("call", key, "poll_streams") == 0


def test_a_stream_no_decode_acknowledges_ends_at_the_prefills_deadline(
    workers: list[Worker],
) -> None:
    """A decode that never acknowledges cannot hold the prefill's slots past ``timeout_s``
    (0 here: the first poll is past it)."""
    key = "stream-deadline"
    pre, dst = workers[0], workers[2]
    case = TP1
    pool = POOL[case.name]
    meta = pre("setup", key, case, case.srcs[0], "src", mode="staged", staging_bytes=pool,
               timeout_s=0.0)  # fmt: skip
    dst_meta = dst("setup", key, case, case.dsts[0], "dst", mode="staged", staging_bytes=pool)
    with _closing([pre], dst, key):
        ticket = tw.stage(pre, key, dst_meta, tw.src_ids(case, case.srcs[0]), src_metas=[meta],
                          num_tokens=case.num_tokens)  # fmt: skip
        assert "stream" in ticket
        assert pre("call", key, "staging_stats")["streams"] == 1
        assert pre("call", key, "poll_streams") == 0
        assert _free(pre, key)


def test_a_whole_copy_ticket_leaves_before_its_pack_is_known_complete_and_lands_byte_exact(
    workers: list[Worker],
) -> None:
    """``stage_blocks`` never waits for its pack: the ticket names an announcement
    (``ready``), the prefill sends it once the pack has completed (host memory: at once, on
    the same notification path; it reaches the decode before the ticket does), and the decode
    reads the region only after it."""
    key = "announce-whole"
    pre, dec = workers[0], workers[2]
    case, pool = TP1, 1 << 20
    meta = pre("setup", key, case, case.srcs[0], "src", mode="staged", staging_bytes=pool)
    dst_meta = dec("setup", key, case, case.dsts[0], "dst", mode="staged", staging_bytes=pool)
    n, src = case.num_tokens, {0: tw.src_ids(case, case.srcs[0])}
    dst = tw.dst_ids(case, case.dsts[0])
    with _closing([pre], dec, key):
        ticket = tw.stage(pre, key, dst_meta, src[0], src_metas=[meta], num_tokens=n)
        assert ticket["staged"] is True and "stream" not in ticket
        assert isinstance(ticket["ready"], int)
        stats = pre("call", key, "staging_stats")
        assert (stats["announced"], stats["streamed"]) == (1, 0)
        tw.pull(dec, key, [meta], src, dst, num_tokens=n, staged=[ticket])
        tw.drive(dec, [pre], key)
        dec("wait", key)
        assert set(dec("stats", key)["modes"].values()) == {"staged"}
        assert np.array_equal(dec("buffer", key), tw.expected_dst(case, case.dsts[0]).numpy())
        # The announcement is over; the region is the ticket's until it is released.
        stats = pre("call", key, "staging_stats")
        assert stats["streams"] == 0 and stats["in_use"] == PACKED[case.name]
        pre("call", key, "release_staged", ticket)
        assert _free(pre, key) and _free(dec, key)


def test_a_decode_never_reads_a_whole_copy_before_its_announcement(
    workers: list[Worker],
) -> None:
    """A ticket naming an announcement that never comes: the decode's read waits (nothing
    is read, the pull stays running) until it is given up, and both pools end free."""
    key = "announce-never"
    pre, dec = workers[0], workers[2]
    _, _, ticket = _silent_read(pre, dec, key)
    case = TP1
    with _closing([pre], dec, key):
        for _ in range(50):
            assert dec("poll", key) is False
            pre("call", key, "poll_streams")
        # Nothing was read: the destination still holds what it was set up with.
        assert not np.array_equal(dec("buffer", key), tw.expected_dst(case, case.dsts[0]).numpy())
        dec("cancel", key)
        pre("call", key, "release_staged", ticket)
        assert _free(pre, key) and _free(dec, key)


def test_a_read_waiting_for_an_announcement_fails_quietly_at_once_when_its_source_is_forgotten(
    workers: list[Worker],
) -> None:
    """A ticket naming an announcement that never comes, then the control plane's peer table
    no longer names the prefill (declared lost; a restart, a new incarnation, is the same):
    the decode forgets it and its waiting read fails at its next poll with a ``TransferError``
    (every part terminal: nothing was posted, nothing may still write; not a timeout that
    would quarantine the destinations), its staging slot back in the pool at once, the
    destination untouched."""
    key = "announce-forgotten"
    pre, dec = workers[0], workers[2]
    meta, dst_meta, ticket = _silent_read(pre, dec, key)
    before = dec("buffer", key)  # nothing was read: as set up
    with _closing([pre], dec, key):
        assert dec("poll", key) is False
        assert not _free(dec, key), "the read holds a slot while it waits"
        # Still named with the same incarnation: nothing is forgotten.
        assert meta["agent_name"] not in dec("call", key, "retain_peers", [meta, dst_meta])
        assert dec("poll", key) is False
        assert meta["agent_name"] in dec("call", key, "retain_peers", [dst_meta])
        with pytest.raises(WorkerError) as info:
            dec("poll", key)
        assert info.value.kind == "TransferError", info.value
        assert "is gone" in info.value.message
        assert _free(dec, key)
        assert np.array_equal(dec("buffer", key), before)
        pre("call", key, "release_staged", ticket)
        assert _free(pre, key)


def test_a_read_waiting_for_an_announcement_fails_quietly_once_its_source_process_died(
    workers: list[Worker],
) -> None:
    """The prefill's process dies before it announces its copy (and no control plane has
    said so yet): the decode's waiting read probes it, NIXL refuses the probe once the peer
    is disconnected, and the read fails with a ``TransferError`` (nothing posted, nothing
    quarantined) long before its deadline, its slot back in the pool."""
    key = "announce-dead"
    dec = workers[2]
    (doomed,) = tw.start_workers("nixl", ["pre-doomed"], "")
    try:
        _silent_read(doomed, dec, key, timeout_s=3600.0)
        assert dec("poll", key) is False  # the source is alive: the probe went
        doomed.proc.kill()
        doomed.proc.join(10)
        with pytest.raises(WorkerError) as info:
            for _ in range(tw.DRIVE_ROUNDS):  # a poll probes at most every PROBE_INTERVAL_S
                dec("poll", key)
        assert info.value.kind == "TransferError", info.value
        assert "is gone" in info.value.message and "DISCONNECT" in info.value.message
        assert _free(dec, key)
    finally:
        dec("close", key)
        tw.stop_workers([doomed])


def test_a_read_whose_source_never_announces_fails_quietly_at_its_deadline(
    workers: list[Worker],
) -> None:
    """Past the pull's deadline a read that posted nothing (still waiting for the
    announcement) fails with a ``TransferError``, not a ``TransferTimeout``: it cannot write
    anything, so its destinations need no quarantine; its slot is back in the pool."""
    key = "announce-deadline"
    pre, dec = workers[0], workers[2]
    _, _, ticket = _silent_read(pre, dec, key, timeout_s=0.0)  # a deadline already passed
    with _closing([pre], dec, key):
        with pytest.raises(WorkerError) as info:
            dec("poll", key)
        assert info.value.kind == "TransferError", info.value
        assert "read nothing by the deadline" in info.value.message
        assert _free(dec, key)
        pre("call", key, "release_staged", ticket)
        assert _free(pre, key)


def test_a_decode_that_reads_a_streamed_source_directly_frees_its_slots_at_once(
    workers: list[Worker],
) -> None:
    """The prefill streams (its pool is too small) but the decode reads the blocks directly:
    it gives the stream up as it posts its reads, so the prefill's slots are free at its next
    polls, before any release (not at the release, the lease or the deadline)."""
    key = "stream-direct"
    pre, dec = workers[0], workers[2]
    case = TP1
    meta = pre("setup", key, case, case.srcs[0], "src", mode="staged",
               staging_bytes=POOL[case.name])  # fmt: skip
    dst_meta = dec("setup", key, case, case.dsts[0], "dst", mode="direct",
                   staging_bytes=1 << 20)  # fmt: skip
    n, src = case.num_tokens, {0: tw.src_ids(case, case.srcs[0])}
    with _closing([pre], dec, key):
        ticket = tw.stage(pre, key, dst_meta, src[0], src_metas=[meta], num_tokens=n)
        assert "stream" in ticket
        assert pre("call", key, "staging_stats")["in_use"] > 0
        tw.pull(dec, key, [meta], src, tw.dst_ids(case, case.dsts[0]), num_tokens=n,
                staged=[ticket])  # fmt: skip
        dec("wait", key)  # a direct read needs no poll of the prefill
        assert set(dec("stats", key)["modes"].values()) == {"direct"}
        assert np.array_equal(dec("buffer", key), tw.expected_dst(case, case.dsts[0]).numpy())
        # The prefill learns it from the decode's abort notification on its next polls.
        for _ in range(tw.DRIVE_ROUNDS):
            if pre("call", key, "poll_streams") == 0:
                break
        assert _free(pre, key)
