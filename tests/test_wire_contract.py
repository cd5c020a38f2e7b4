"""The typed wire contract through its Python surface: peer metadata parsed once into a
``PeerTable``, size caps, field-named errors, address-range checks, handoff and staging
tickets, and a property test that any mutation of a valid export is either accepted or refused
with a typed error naming a field."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disagg_rs import _core, exceptions
from disagg_rs.transfer_backends import nixl

TYPED = (exceptions.MetadataError, exceptions.LayoutError, exceptions.GeometryMismatchError)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any]]:
    root = nixl.NixlTransferBackend("wire-root", torch.zeros(2, 1, 1, 1, 1, 1), 1)
    bufs = [torch.zeros(2, 2, 8, 4, 2, 8, dtype=torch.float32) for _ in range(2)]
    src, dst = (
        root.new_registered_buffer(memory_buffer=b, expected_num_blocks=8, staging_bytes=4096)
        for b in bufs
    )
    yield src, dst
    src.close()
    dst.close()
    root.close()


@pytest.fixture
def src_peer(pair: tuple[Any, Any]) -> tuple[dict[str, Any], Any]:
    """The source buffer's exported metadata and its parsed peer."""
    meta = pair[0].export_meta()
    return meta, _core.parse_peer_meta(meta, "nixl")


def test_a_peer_is_parsed_once_and_found_again_by_content(pair: tuple[Any, Any]) -> None:
    src, dst = pair
    meta = src.export_meta()
    dst.register_peers(meta)
    parses = _core.peer_meta_parses()
    for _ in range(5):
        peer = dst._adopt_peer(copy.deepcopy(meta))
    assert _core.peer_meta_parses() == parses
    assert (peer.global_rank, peer.num_blocks, peer.tokens_per_block) == (0, 8, 4)
    assert peer.incarnation == meta["incarnation"]


def test_plane_bases_inside_the_staging_region_are_refused_naming_the_field(
    pair: tuple[Any, Any],
) -> None:
    src, _ = pair
    meta = src.export_meta()
    bad = {**meta, "staging": {"addr": meta["geometry"]["plane_bases"][1], "nbytes": 64}}
    with pytest.raises(exceptions.MetadataError) as err:
        _core.parse_peer_meta(bad, "nixl")
    assert err.value.field in ("staging", "geometry.plane_bases")


def test_descriptor_rows_outside_the_exported_regions_name_the_field_and_both_ranges(
    src_peer: tuple[dict[str, Any], Any],
) -> None:
    meta, peer = src_peer
    addr, nbytes = meta["buffer"]["addr"], meta["buffer"]["nbytes"]
    peer.check_addresses(np.array([[addr, nbytes, 0]], dtype=np.uint64), "src")
    with pytest.raises(exceptions.MetadataError) as err:
        peer.check_addresses(np.array([[addr + nbytes - 4, 8, 0]], dtype=np.uint64), "src")
    assert err.value.field == "src"
    assert hex(addr + nbytes - 4) in str(err.value) and hex(addr + nbytes) in str(err.value)


def test_oversized_and_deeply_nested_metadata_is_refused_before_it_is_copied(
    pair: tuple[Any, Any],
) -> None:
    src, _ = pair
    meta = src.export_meta()
    with pytest.raises(exceptions.MetadataError) as err:
        _core.parse_peer_meta({**meta, "agent_name": "x" * 1000}, "nixl")
    assert err.value.field == "agent_name"
    deep: Any = 0
    for _ in range(20):
        deep = [deep]
    with pytest.raises(exceptions.MetadataError):
        _core.parse_peer_meta({**meta, "extra": deep}, "nixl")
    with pytest.raises(exceptions.MetadataError):
        _core.parse_peer_meta({**meta, "agent_metadata": "x" * (5 << 20)}, "nixl")


def test_a_handoff_ticket_with_a_negative_staging_offset_is_refused_naming_it() -> None:
    ticket = {
        "src_block_ids": [1, 2],
        "resume_tokens": [7],
        "prefill_meta": {"ranks": []},
        "staged": {0: [{"src_rank": 0, "incarnation": 1, "staged": True, "offset": 0,
                        "nbytes": 64}]},
    }  # fmt: skip
    _core.check_handoff_ticket(ticket)
    ticket["staged"][0][0]["offset"] = -64
    with pytest.raises(exceptions.HandoffMetadataError) as err:
        _core.check_handoff_ticket(ticket)
    assert err.value.field == "staged.0[0].offset"
    for key, value, field in (
        ("lease_ns", 1, "lease_ns"),
        ("src_block_ids", [-1], "src_block_ids[0]"),
        ("resume_tokens", "x", "resume_tokens"),
        ("resume_tokens", [0] * 5_000, "resume_tokens"),
        ("resume_tokens", [0] * 70_000, "ticket.resume_tokens"),  # over the size cap
    ):
        with pytest.raises(exceptions.HandoffMetadataError) as err:
            _core.check_handoff_ticket({**ticket, "staged": {}, key: value})
        assert err.value.field == field, err.value
        assert isinstance(err.value, exceptions.MetadataError)


def test_a_ticket_is_checked_against_what_the_decode_rank_reads_naming_the_field() -> None:
    ranks = [{"kv": {"agent_name": "p0"}, "conv": None}]
    ticket = {"src_block_ids": [0], "resume_tokens": [1], "prefill_meta": {"ranks": ranks}}
    _core.check_handoff_ticket(ticket, request_id=5, sources=["kv"])
    cases = [
        ({k: v for k, v in ticket.items() if k != "prefill_meta"}, {}, "prefill_meta"),
        ({**ticket, "prefill_meta": {"ranks": "x"}}, {}, "prefill_meta"),
        (ticket, {"sources": ["kv", "conv"]}, "prefill_meta"),
        (ticket, {"integrity": True}, "integrity"),
        (ticket, {"has_ssm": True}, "src_ssm_slot"),
        ({**ticket, "src_ssm_slot": 2}, {}, "src_ssm_slot"),
    ]
    for bad, needs, field in cases:
        args: dict[str, Any] = {"sources": ["kv"], **needs}
        with pytest.raises(exceptions.HandoffMetadataError) as err:
            _core.check_handoff_ticket(bad, request_id=5, **args)
        assert err.value.field == field and "request 5" in str(err.value), err.value
    # Without a request id only the ticket's own fields are checked.
    _core.check_handoff_ticket({**ticket, "src_ssm_slot": 2})


def test_a_staging_ticket_outside_the_sources_staging_region_is_refused(
    src_peer: tuple[dict[str, Any], Any],
) -> None:
    meta, peer = src_peer
    inc = meta["incarnation"]
    good = {"src_rank": 0, "incarnation": inc, "staged": True, "offset": 0, "nbytes": 4096}
    assert _core.check_staging_tickets_of([good], [peer])[0]["nbytes"] == 4096
    for bad in ({**good, "offset": 1}, {**good, "incarnation": inc + 1}, {**good, "src_rank": 3}):
        with pytest.raises(exceptions.HandoffMetadataError) as err:
            _core.check_staging_tickets_of([bad], [peer])
        assert err.value.field == "staged"


_EXPORTS: dict[int, dict[str, Any]] = {}


def _export(backend: Any) -> dict[str, Any]:
    """One export per backend, so every example mutates the same metadata."""
    return _EXPORTS.setdefault(id(backend), backend.export_meta())


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@given(data=st.data())
def test_any_mutation_of_an_export_parses_or_is_refused_with_a_typed_error(
    pair: tuple[Any, Any], data: st.DataObject
) -> None:
    meta = copy.deepcopy(_export(pair[0]))
    section = data.draw(st.sampled_from([None, "buffer", "layout", "geometry"]))
    target = meta if section is None else meta[section]
    key = data.draw(st.sampled_from(sorted(target)))
    if data.draw(st.booleans()):
        del target[key]
    else:
        target[key] = data.draw(_VALUES)
    try:
        _core.parse_peer_meta(meta, "nixl")
    except TYPED as exc:
        assert exc.field, f"{type(exc).__name__} without a field: {exc}"


def test_a_reference_design_ticket_is_refused_naming_its_first_bad_field() -> None:
    ok: dict[str, Any] = {
        "request_id": 9,
        "prefix_caching": True,
        "hybrid": True,
        "has_backend": True,
        "decode_has_ssm": True,
        "resume_tokens": 1,
        "num_speculative_tokens": 0,
        "return_log_probs": False,
        "top_n_logprobs": None,
        "src_blocks": 2,
        "prompt_tokens": 5,
        "block_size": 4,
    }
    ssm = {"conv": {}, "recurrent": {}}
    _core.check_reference("ticket", {**ok, "ssm": ssm})
    _core.check_reference("ticket", {**ok, "ssm": None, "decode_has_ssm": False, "hybrid": False})
    for meta, change, field in (
        ({"conv": {}}, {}, "ssm"),
        ([1], {}, "ssm"),
        (None, {}, "ssm"),
        (ssm, {"decode_has_ssm": False, "hybrid": False}, "ssm"),
        (ssm, {"resume_tokens": 2}, "resume_tokens"),
        (ssm, {"top_n_logprobs": 3}, "return_log_probs"),
        (ssm, {"return_log_probs": True}, "return_log_probs"),
        (ssm, {"src_blocks": 1}, "src_block_ids"),
    ):
        with pytest.raises(exceptions.HandoffMetadataError) as err:
            _core.check_reference("ticket", {**ok, "ssm": meta, **change})
        assert err.value.field == field and "request 9" in str(err.value), err.value
        assert isinstance(err.value, RuntimeError)
    # The decode's own state is checked first, naming the setting (HandoffStateError).
    for change, field in (
        ({"prefix_caching": False, "resume_tokens": 0}, "enable_prefix_caching"),
        ({"decode_has_ssm": False}, "setup_kv_transfer"),
        ({"has_backend": False}, "setup_kv_transfer"),
    ):
        with pytest.raises(exceptions.HandoffStateError) as state:
            _core.check_reference("ticket", {**ok, "ssm": ssm, **change})
        assert state.value.field == field, state.value


def test_a_reference_design_prefill_batch_is_refused_before_any_request_is_prepared() -> None:
    stages = {"kv_stages": 1, "ssm_stages": 1, "pp_size": 1, "num_speculative_tokens": 1}

    def rows(requests: list[tuple[int, int, int]]) -> list[dict[str, int]]:
        keys = ("request_id", "resume_tokens", "blocks")
        return [dict(zip(keys, r, strict=True)) for r in requests]

    _core.check_reference("prefill", {"requests": rows([(1, 2, 3), (2, 2, 1)]), **stages})
    for requests, change, field in (
        ([(1, 2, 3)], {"pp_size": 2}, "pp_metas"),
        ([(1, 2, 3), (2, 1, 1)], {}, "resume_tokens"),
        ([(1, 2, 0)], {}, "block_ids"),
    ):
        with pytest.raises(exceptions.HandoffMetadataError) as err:
            _core.check_reference("prefill", {"requests": rows(requests), **stages, **change})
        assert err.value.field == field, err.value


def test_reference_design_engine_checks_name_the_setting_that_refuses() -> None:
    for stage, facts, field in (
        ("role", {"role": "both"}, "role"),
        ("reserve_ssm", {"ledger": True, "ssm_agents": True}, "ssm_slot"),
        ("reserve_ssm", {"ledger": False, "ssm_agents": False}, "setup_kv_transfer"),
        ("ssm_slot", {"request_id": 3, "slot": -1, "block": 7}, "ssm_slot"),
    ):
        with pytest.raises(exceptions.HandoffStateError) as err:
            _core.check_reference(stage, facts)
        assert err.value.field == field, err.value
        assert isinstance(err.value, RuntimeError)
    _core.check_reference("role", {"role": "decode"})
    _core.check_reference("ssm_slot", {"request_id": 3, "slot": 0, "block": 7})
    with pytest.raises(exceptions.ArgumentError) as arg:
        _core.check_reference("teardown", {})
    assert arg.value.field == "stage"
