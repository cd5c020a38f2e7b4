"""CURVE authentication of the control plane, over real ZeroMQ sockets."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from disagg_rs.control import ControlClient, CoordinatorServer, EngineLink, Msg
from disagg_rs.control.keys import CurveKeys, generate
from disagg_rs.exceptions import TransferTimeout

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
        server = CoordinatorServer()
    server.close()
    assert any("without CURVE keys" in r.getMessage() for r in caplog.records)
