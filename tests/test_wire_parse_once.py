"""Peer metadata is parsed once per peer, at registration, never on a handoff's hot path;
a handoff's block ids are checked once.

Two spawned processes with real NIXL agents (UCX over loopback, host memory): the prefill
exports its metadata, the decode registers it (as it does when the control plane announces
its peers), then runs handoffs, direct and staged, and the process-wide parse counter of the
Rust wire contract does not move. Then whole requests through two engines served by
``HandoffDriver``s (the driver registers the peers PEERS announces): no parse per handoff,
and one block-id check per side.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import transport_workers as tw
from disagg_rs import _core
from driver_world import MAX_NEW, PROMPTS, World, done
from transport_workers import Case, Side, Worker

pytestmark = pytest.mark.slow

CASE = Case("tp2_to_tp1", (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)), (Side(),))


@pytest.fixture(scope="module")
def pool() -> Iterator[list[Worker]]:
    yield from tw.worker_pool("nixl", ["pre0", "pre1", "dec0"])


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_a_decode_handoff_parses_no_peer_metadata_after_registration(
    pool: list[Worker], mode: str
) -> None:
    pre, dec = pool[:2], pool[2]
    key = f"parse-once-{mode}"
    src_metas = [pre[i]("setup", key, CASE, s, "src", mode=mode) for i, s in enumerate(CASE.srcs)]
    dst_meta = dec("setup", key, CASE, CASE.dsts[0], "dst", mode=mode)
    try:
        # Registration (REGISTER/PEERS): every peer parsed here, once.
        before = dec("peer_meta_parses")
        assert dec("call", key, "register_peers", src_metas) == len(src_metas)
        registered = dec("peer_meta_parses")
        assert registered > before
        for i in range(2):
            pre[i]("call", key, "register_peers", [dst_meta, *src_metas])
        pre_registered = [pre[i]("peer_meta_parses") for i in range(2)]
        src_ids = {s.global_rank: tw.src_ids(CASE, s) for s in CASE.srcs}
        for _ in range(3):
            tickets = []
            if mode == "staged":
                tickets = [
                    tw.stage(pre[i], key, dst_meta, tw.src_ids(CASE, s), src_metas=src_metas)
                    for i, s in enumerate(CASE.srcs)
                ]
            dst_ids = tw.dst_ids(CASE, CASE.dsts[0])
            tw.pull(dec, key, src_metas, src_ids, dst_ids, staged=tickets)
            dec("wait", key)
        got = dec("buffer", key)
        assert np.array_equal(got, tw.expected_dst(CASE, CASE.dsts[0]).numpy())
        # The hot path: lookups only, on both sides.
        assert dec("peer_meta_parses") == registered
        assert [pre[i]("peer_meta_parses") for i in range(2)] == pre_registered
    finally:
        for i in range(2):
            pre[i]("close", key)
        dec("close", key)


def test_a_restarted_peer_is_parsed_again_under_its_new_incarnation(pool: list[Worker]) -> None:
    pre, dec = pool[0], pool[2]
    case = Case("tp1_to_tp1", (Side(),), (Side(),))
    key = "parse-once-restart"
    meta = pre("setup", key, case, case.srcs[0], "src")
    dec("setup", key, case, case.dsts[0], "dst")
    try:
        dec("call", key, "register_peers", meta)
        once = dec("peer_meta_parses")
        dec("call", key, "register_peers", dict(meta))  # same content: a lookup
        assert dec("peer_meta_parses") == once
        dec("call", key, "register_peers", {**meta, "incarnation": meta["incarnation"] + 1})
        assert dec("peer_meta_parses") == once + 1
    finally:
        pre("close", key)
        dec("close", key)


@pytest.mark.parametrize(
    ("mode", "checks_per_handoff"),
    # direct: the decode checks the block ids of its pull; staged: the prefill checks its
    # own ids once when it packs, the decode once when it reads (one process counts both).
    [("direct", 1), ("staged", 2)],
)
def test_a_handoff_through_the_driver_parses_no_peer_metadata_and_checks_block_ids_once(
    mode: str, checks_per_handoff: int
) -> None:
    world = World(mode=mode)
    world.turn()  # REGISTERED/PEERS reach both drivers: every peer is parsed here
    assert all(not d.refused_peers for d in world.drivers.values())
    for rid, prompt in PROMPTS.items():
        parses, checks = _core.peer_meta_parses(), _core.block_id_checks()
        lookups = _core.peer_meta_lookups()
        world.client.submit(rid, prompt, MAX_NEW)
        world.run(lambda rid=rid: rid in done(world.events))
        assert _core.peer_meta_parses() - parses == 0
        # Not even found again by content: the parsed peers travel on.
        assert _core.peer_meta_lookups() - lookups == 0
        assert _core.block_id_checks() - checks == checks_per_handoff
    stats = world.engines["decode"].handoff_stats
    assert stats["imports_admitted"] == len(PROMPTS) and stats["imports_failed"] == 0
    reports = world.close()
    assert reports["decode"]["leaked_blocks"] == 0 and reports["prefill"]["pinned"] == 0
