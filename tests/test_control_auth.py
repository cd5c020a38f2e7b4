"""CURVE authentication of the control plane, over real ZeroMQ sockets."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest

from disagg_rs.control import ControlClient, CoordinatorServer, EngineLink, Msg
from disagg_rs.control.keys import ControlPlaneKeys, CurveKeys, generate
from disagg_rs.exceptions import ArgumentError, TransferTimeout

META = {"kind": "test"}


@pytest.fixture
def keyed() -> Iterator[tuple[CoordinatorServer, CurveKeys, dict[str, CurveKeys], CurveKeys]]:
    server_keys, client_keys = generate(), generate()
    engines = {"p0": generate(), "d0": generate()}
    server = CoordinatorServer(
        keys=server_keys,
        engine_keys={e: k.public for e, k in engines.items()},
        client_keys=[client_keys.public],
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server, server_keys, engines, client_keys
    finally:
        server.stop()
        thread.join(10)
        server.close()


def test_engines_with_listed_keys_register_and_see_each_other(
    keyed: tuple[CoordinatorServer, CurveKeys, dict[str, CurveKeys], CurveKeys],
) -> None:
    server, server_keys, engines, client_keys = keyed
    links = [
        EngineLink(server.endpoint, e, r, 1, keys=engines[e], server_key=server_keys.public)
        for e, r in (("p0", "prefill"), ("d0", "decode"))
    ]
    client = ControlClient(server.endpoint, keys=client_keys, server_key=server_keys.public)
    try:
        links[0].register(META, timeout_s=60)
        peers = links[1].register(META, timeout_s=60)
        assert set(peers) == {"p0", "d0"}
        client.submit(1, [1, 2], 1)
        got: list[dict[str, object]] = []
        for _ in range(600):  # up to 60 s on a loaded machine; PEERS may come first
            got += [m for m in links[0].poll(100) if m["type"] is Msg.PREFILL]
            if got:
                break
        assert [m["request_id"] for m in got] == [1]
        assert server.unauthenticated == 0
    finally:
        for link in links:
            link.close()
        client.close()


@pytest.mark.parametrize("key_of", ["nobody", "d0"])
def test_an_engine_registers_only_with_the_key_listed_for_its_id(
    keyed: tuple[CoordinatorServer, CurveKeys, dict[str, CurveKeys], CurveKeys], key_of: str
) -> None:
    # "nobody": a key not on the list (refused in the handshake); "d0": a listed key, claiming
    # to be p0 (authenticated, but not as p0: dropped and counted).
    server, server_keys, engines, _ = keyed
    keys = engines.get(key_of) or generate()
    link = EngineLink(server.endpoint, "p0", "prefill", 1, keys=keys, server_key=server_keys.public)
    try:
        with pytest.raises(TransferTimeout):
            link.register(META, timeout_s=3)
        assert server.state.engines == {}
        assert (server.unauthenticated >= 1) == (key_of == "d0")
    finally:
        link.close()


def test_a_coordinator_without_keys_warns_that_it_is_unauthenticated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="disagg_rs.control"):
        server = CoordinatorServer(insecure=True)
    server.close()
    warnings = [r for r in caplog.records if "without CURVE keys" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: CoordinatorServer(),
        lambda: EngineLink("tcp://127.0.0.1:1", "p0", "prefill", 1),
        lambda: EngineLink("tcp://127.0.0.1:1", "p0", "prefill", 1, keys=generate()),
        lambda: ControlClient("tcp://127.0.0.1:1"),
    ],
    ids=["coordinator", "engine", "engine-without-server-key", "client"],
)
def test_every_end_of_the_control_plane_refuses_to_start_without_keys_unless_told_insecure(
    make: Callable[[], object],
) -> None:
    with pytest.raises(ArgumentError) as err:
        make()
    assert err.value.field == "keys"
    assert "insecure=True" in str(err.value)


def test_keys_together_with_insecure_are_refused_naming_insecure() -> None:
    k = generate()
    with pytest.raises(ArgumentError) as err:
        ControlClient("tcp://127.0.0.1:1", keys=k, server_key=k.public, insecure=True)
    assert err.value.field == "insecure"


def test_generated_control_plane_keys_let_engines_and_clients_through_the_allow_list() -> None:
    plane = ControlPlaneKeys.generate(["p0"])
    server = CoordinatorServer(
        keys=plane.coordinator,
        engine_keys=plane.engine_public_keys(),
        client_keys=[plane.client.public],
    )
    pub = plane.coordinator.public
    link = EngineLink(server.endpoint, "p0", "prefill", 1, keys=plane.engines["p0"], server_key=pub)
    client = ControlClient(server.endpoint, keys=plane.client, server_key=pub)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    try:
        link.register(META, timeout_s=60)
        client.submit(1, [1, 2, 3], 2)
        got = []
        for _ in range(600):  # bounded: the PREFILL arrives once the coordinator routed it
            got += link.poll(100)
            if got:
                break
        assert [m["type"] for m in got] == [Msg.PREFILL]
        assert got[0]["request_id"] == 1
    finally:
        server.stop()
        serving.join(30)
        link.close()
        client.close()
        server.close()
