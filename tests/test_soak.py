"""Short soaks of the faults a peer, a client or a stall can cause (``make soak`` runs the long
one), and the library rules they rest on: a ticket is read only from the peer table's
incarnation of its source, and a frame the coordinator cannot decode is refused and counted.

Every soak runs on the soak's virtual clock (stalls last past the liveness timeout and the
leases on any machine) and compares every answer with the single-engine run of its prompt."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from disagg_rs._core import check_handoff_ticket
from disagg_rs.control import CoordinatorState, Msg, encode_message
from disagg_rs.driver import HandoffDriver, LoopbackCoordinator
from disagg_rs.exceptions import MetadataError
from disagg_rs.tools.soak import (
    FORGERIES,
    HOSTILE_REQUESTS,
    SoakOptions,
    VirtualClock,
    hostile_frame,
    run_soak,
)


def _soak(faults: tuple[str, ...], rate: float = 0.5, handoffs: int = 120, seed: int = 3) -> Any:
    torch.set_num_threads(1)
    report = run_soak(SoakOptions(handoffs=handoffs, fault_rate=rate, seed=seed, faults=faults))
    assert report.ok, report.format()
    assert report.unresolved == 0 and report.leaked == 0 and report.wrong == 0
    assert report.completed + report.failed == handoffs
    assert report.completed > 0, report.format()  # the engines kept serving
    return report


def test_a_decode_stalled_past_the_liveness_timeout_never_admits_and_pins_end_at_their_lease() -> (
    None
):
    # A stall fails every request the decode holds: one handoff in ten draws one.
    report = _soak(("stall_past_liveness",), rate=0.1)
    assert report.stalls > 0 and report.stalled_requests > 0, report.format()
    # Pins the decode could still read when it was declared lost were watched to their end.
    assert report.stalled_pins > 0, report.format()
    assert report.stale_admits == 0 and report.early_releases == 0


def test_forged_tickets_are_refused_unread_and_intruder_messages_are_ignored() -> None:
    report = _soak(("forged_ticket",))
    assert report.forged_sent >= len(FORGERIES), report.format()
    assert report.forged_refused == report.forged_sent
    assert report.forged_read == 0 and report.forged_accepted == 0
    assert report.intruder_sent == 4 * report.forged_sent


def test_hostile_client_requests_each_fail_alone_and_the_engines_keep_serving() -> None:
    report = _soak(("hostile_client",))
    drawn = report.faults["hostile_client"]
    assert drawn >= len(HOSTILE_REQUESTS), report.format()  # every kind, in turn
    assert report.hostile_sent + report.junk_frames == drawn
    assert report.hostile_served == 0
    assert report.failed >= report.hostile_sent
    assert report.malformed_counted >= report.junk_frames


def test_all_faults_together_with_integrity_off_end_every_request_once_and_right() -> None:
    report = _soak(
        ("stall_past_liveness", "forged_ticket", "hostile_client", "transfer_timeout"), seed=5
    )
    assert report.stalls > 0 and report.forged_sent > 0 and report.hostile_sent > 0


def test_an_unknown_fault_name_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="corrupt_transfer"):
        run_soak(SoakOptions(handoffs=1, faults=("corrupt_transfer",)))


# -- the library rules under the soak --------------------------------------------------------


def _decode_driver() -> tuple[LoopbackCoordinator, HandoffDriver, list[dict[str, Any]]]:
    """A decode driver on a loopback coordinator where a prefill is registered as ``p0``
    (incarnation 2); returns the messages to hand the decode's link on its next poll."""
    clock = VirtualClock()
    hub = LoopbackCoordinator(CoordinatorState(), clock=clock.seconds)
    prefill_meta = {"ranks": [{"kv": {"agent": "p0"}}]}
    hub.link("p0", "prefill", incarnation=2).register(prefill_meta)
    # What is under test is the driver's reading of its link, before any engine call: the
    # engine only has to register (its metadata) and is never reached.
    engine = SimpleNamespace(
        handoff_role="decode",
        handoff_now_ns=0,
        handoff_static_meta={"ranks": [{"kv": {"agent": "d0"}}]},
        abort_kv_import=None,
    )
    driver = HandoffDriver(engine, hub.link("d0", "decode"))
    injected: list[dict[str, Any]] = []
    link = driver.link
    assert link is not None
    real_poll = link.poll

    def poll(timeout_ms: int = 0) -> list[dict[str, Any]]:
        out = real_poll(timeout_ms) + injected[:]
        injected.clear()
        return out

    link.poll = poll  # type: ignore[method-assign]
    return hub, driver, injected


def _ticket_message(**ticket: Any) -> dict[str, Any]:
    return {
        "type": Msg.SUBMIT_REQUEST_WITH_KV,
        "request_id": 7,
        "epoch": 1,
        "prompt": [1, 2, 3],
        "max_new_tokens": 2,
        "ticket": {"src_block_ids": [0], "resume_tokens": [5], **ticket},
    }


@pytest.mark.parametrize(
    "provenance",
    [
        pytest.param({"prefill_engine_id": "p0", "prefill_incarnation": 1}, id="older"),
        pytest.param({"prefill_engine_id": "p0", "prefill_incarnation": 3}, id="newer"),
        pytest.param({"prefill_engine_id": "p0"}, id="no-incarnation"),
        pytest.param({}, id="no-provenance"),
        pytest.param(
            {"prefill_engine_id": "p9", "prefill_incarnation": 2, "prefill_meta": {"ranks": []}},
            id="unknown-engine-own-meta",
        ),
        pytest.param({"prefill_engine_id": ["p0"], "prefill_incarnation": 2}, id="unhashable-id"),
    ],
)
def test_a_ticket_is_given_its_source_only_from_the_peer_tables_incarnation(
    provenance: dict[str, Any],
) -> None:
    _, driver, injected = _decode_driver()
    injected.append(_ticket_message(**provenance))
    (msg,) = [m for m in driver.receive() if m["type"] is Msg.SUBMIT_REQUEST_WITH_KV]
    assert "prefill_meta" not in msg["ticket"]  # refused: the import cannot name a source
    assert driver.state.counters()["forged"] == 1


def test_a_ticket_from_the_registered_incarnation_gets_the_peer_tables_metadata() -> None:
    _, driver, injected = _decode_driver()
    forged_meta = {"ranks": [{"kv": {"agent": "intruder"}}]}
    injected.append(
        _ticket_message(prefill_engine_id="p0", prefill_incarnation=2, prefill_meta=forged_meta)
    )
    (msg,) = [m for m in driver.receive() if m["type"] is Msg.SUBMIT_REQUEST_WITH_KV]
    assert msg["ticket"]["prefill_meta"] == {"ranks": [{"kv": {"agent": "p0"}}]}
    assert driver.state.counters()["forged"] == 0


@pytest.mark.parametrize("kind", HOSTILE_REQUESTS)
def test_a_hostile_client_frame_is_refused_counted_and_answered_when_its_id_is_readable(
    kind: str,
) -> None:
    hub = LoopbackCoordinator(CoordinatorState(), clock=VirtualClock().seconds)
    client = hub.client()
    hub.deliver(client.identity, hostile_frame(kind, 11, [1, 2, 3], 4))
    events = client.events()
    if kind.startswith("junk_"):
        assert events == []  # no request id to answer
        assert hub.malformed + sum(hub.state.malformed.values()) == 1
    elif kind == "out_of_vocabulary":  # well-formed: the prefill engine refuses it (no engine)
        assert [e["type"] for e in events] == [Msg.FAILED]
    else:
        assert [(e["type"], e["request_id"]) for e in events] == [(Msg.FAILED, 11)]
        assert hub.malformed + sum(hub.state.malformed.values()) == 1
    assert hub.state.requests == {}
    # The coordinator goes on serving: a valid request from the same client is routed.
    hub.deliver(
        client.identity, encode_message(Msg.SUBMIT, request_id=12, prompt=[1], max_new_tokens=1)
    )
    assert 12 in {e["request_id"] for e in client.events()}  # no prefill yet: FAILED, at once


@pytest.mark.parametrize("kind", [Msg.RELEASE_KV, Msg.SEND_KV, Msg.PREFILL])
def test_a_decode_driver_drops_a_message_meant_for_a_prefill_without_reaching_its_engine(
    kind: Msg,
) -> None:
    # Found by the fuzzer: RELEASE_KV handed to a decode's driver raised out of its loop.
    _, driver, _ = _decode_driver()  # the stand-in engine has none of the prefill's calls
    msg = {"type": kind, "request_id": 3, "epoch": 1, "prompt": [1], "max_new_tokens": 1}
    driver.on_message(msg)
    driver.on_message({"type": Msg.SHUTDOWN})
    assert driver.state.stopping  # still serving messages


@pytest.mark.parametrize("resume", [None, []])
def test_a_ticket_without_the_prefills_sampled_token_is_refused_before_any_import(
    resume: list[int] | None,
) -> None:
    # Found by the fuzzer: such a ticket was imported, then its admission raised out of the
    # decode's serving loop (nothing to continue from).
    ticket: dict[str, Any] = {"src_block_ids": [0, 1], "lease_ns": 10**9}
    if resume is not None:
        ticket["resume_tokens"] = resume
    with pytest.raises(MetadataError) as err:
        check_handoff_ticket(ticket)
    assert err.value.field == "resume_tokens"
    check_handoff_ticket({**ticket, "resume_tokens": [7]})
