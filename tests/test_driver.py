"""The public engine driver: a prefill and a decode reference engine in one process (real NIXL
over UCX loopback), each served by a HandoffDriver through a LoopbackCoordinator, driven with a
virtual clock."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_rs.control import Msg
from disagg_rs.reference import EngineConfig, ReferenceEngine
from driver_world import MAX_NEW, MODEL, PROMPTS, World
from driver_world import done as _done


@pytest.fixture
def world() -> World:
    return World()


def test_requests_served_by_two_drivers_answer_like_the_colocated_engine(world: World) -> None:
    for rid, prompt in PROMPTS.items():
        world.client.submit(rid, prompt, MAX_NEW)
    world.run(lambda: len(_done(world.events)) == len(PROMPTS))
    expected = ReferenceEngine(MODEL, EngineConfig(num_blocks=64)).generate(PROMPTS, MAX_NEW)
    assert _done(world.events) == expected
    reports = world.close()
    assert reports["decode"]["admitted"] == sorted(PROMPTS)
    for r in reports.values():
        assert r["leaked_blocks"] == 0 and r["quarantined"] == 0 and r["pinned"] == 0


def test_a_prompt_larger_than_both_staging_pools_streams_through_the_drivers() -> None:
    """Staged pulls with 16 KiB pools: the first prompt's packed copy (about 51 KiB) is
    streamed, advanced by the prefill driver's turns; every answer is the colocated one and
    both pools end empty."""
    world = World(staging_bytes=16 << 10, mode="staged")
    for rid, prompt in PROMPTS.items():
        world.client.submit(rid, prompt, MAX_NEW)
    world.run(lambda: len(_done(world.events)) == len(PROMPTS))
    expected = ReferenceEngine(MODEL, EngineConfig(num_blocks=64)).generate(PROMPTS, MAX_NEW)
    assert _done(world.events) == expected
    pools = {role: e._kv_backend.staging_stats() for role, e in world.engines.items()}
    assert pools["prefill"]["streamed"] >= 1
    for stats in pools.values():
        assert stats["in_use"] == stats["streams"] == 0
    reports = world.close()
    for r in reports.values():
        assert r["leaked_blocks"] == 0 and r["pinned"] == 0


def test_a_duplicated_ticket_is_imported_once_and_counted(world: World) -> None:
    dec = world.drivers["decode"]
    original = dec.receive

    def twice() -> list[dict[str, Any]]:
        msgs = original()
        return msgs + [m for m in msgs if m["type"] is Msg.SUBMIT_REQUEST_WITH_KV]

    dec.receive = twice  # type: ignore[method-assign]
    world.client.submit(0, PROMPTS[0], MAX_NEW)
    world.run(lambda: 0 in _done(world.events))
    assert dec.state.counters()["duplicates"] == 1
    assert [e["type"] for e in world.events].count(Msg.DONE) == 1
    reports = world.close()
    assert reports["decode"]["stats"]["imports_started"] == 1
    assert reports["decode"]["leaked_blocks"] == 0


def test_a_prompt_the_engine_refuses_fails_that_request_alone(world: World) -> None:
    world.client.submit(7, [70_000], MAX_NEW)  # a token outside the vocabulary
    world.client.submit(0, PROMPTS[0], MAX_NEW)
    world.run(
        lambda: 0 in _done(world.events) and any(e["type"] is Msg.FAILED for e in world.events)
    )
    failed = [e for e in world.events if e["type"] is Msg.FAILED]
    assert [int(e["request_id"]) for e in failed] == [7]
    assert "outside the vocabulary" in failed[0]["error"]  # the engine's refusal, reported
    reports = world.close()
    assert reports["prefill"]["pinned"] == 0


def test_messages_with_a_bad_request_id_are_dropped_and_counted(world: World) -> None:
    pre = world.drivers["prefill"]
    for bad in ("seven", None, -1, 2.5, [1]):
        pre.on_message({"type": Msg.PREFILL, "request_id": bad, "epoch": 1, "prompt": [1]})
        pre.on_message({"type": Msg.RELEASE_KV, "request_id": bad, "epoch": 1})
    pre.on_message({"type": Msg.PREFILL, "request_id": 3, "prompt": [1], "max_new_tokens": 1})
    assert pre.state.counters()["malformed"] == 11
    assert not world.engines["prefill"].has_work
    world.close()


def test_after_shutdown_an_idle_driver_stops_and_a_busy_one_waits_for_its_pins(
    world: World,
) -> None:
    world.client.submit(0, PROMPTS[0], MAX_NEW)
    pre = world.drivers["prefill"]
    # Run until the prefill pinned the request's blocks (its ticket is on its way).
    world.run(lambda: pre.busy and not world.engines["prefill"].has_work)
    pre.on_message({"type": Msg.SHUTDOWN})
    assert pre.running  # pins are held: it keeps serving until RELEASE_KV or the grace period
    world.run(lambda: 0 in _done(world.events))
    world.run(lambda: not pre.running)
    assert world.close()["prefill"]["pinned"] == 0
