"""Fuzzing (issue 9, item 3) of the wire decoders and validators with hypothesis: any input is
either rejected with a typed ``DisaggError`` or yields a valid object; no panic crosses into
Python (a PyO3 ``PanicException`` is a ``BaseException``, caught and failed on here); a
rejection changes no state. Inputs are mutations of valid values (so the validators see
near-misses, not only garbage) plus arbitrary JSON-like values."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import disagg_rs
from disagg_rs import ImportLedger, KVGeometry, KVShardLayout, SSMGeometry, SSMShardLayout
from disagg_rs.control import PROTOCOL_VERSION, Msg, decode_message, encode_message
from disagg_rs.exceptions import DisaggError
from disagg_rs.integrity import IntegrityTable
from disagg_rs.transfer_backends.base import check_meta_fields
from disagg_rs.transfer_backends.nixl import NixlTransferBackend

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**80), 2**80),  # past 64 bits: still a typed rejection
    st.integers(-3, 70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)

DIMS = disagg_rs.SSMStateDims(num_heads=4, head_dim=2, d_state=3, n_groups=2, d_conv=4)
VALID: dict[str, dict[str, Any]] = {
    "kv_layout": KVShardLayout(8, 4, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1).to_dict(),
    "ssm_layout": SSMShardLayout(4, DIMS, tp_size=2, tp_rank=1).to_dict(),
    "kv_geometry": KVGeometry.from_tensor(torch.zeros(2, 2, 4, 16, 2, 8)).to_dict(),
    "ssm_geometry": SSMGeometry.from_tensors(
        conv=torch.zeros(2, 3, 8, 4), recurrent=torch.zeros(2, 3, 2, 2, 3)
    ).to_dict(),
}


def _paths(d: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """``base`` with a few fields replaced by arbitrary values, deleted, or added."""
    pick = draw(st.integers(0, 19))
    if pick == 0:  # not a map at all: a list, a scalar, None
        return draw(JSONISH)
    if pick <= 2:  # any map at all
        return draw(st.dictionaries(st.text(max_size=12), JSONISH, max_size=6))
    d = copy.deepcopy(base)
    paths = _paths(d)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        parent = d
        try:
            for key in path[:-1]:
                parent = parent[key]
            op = draw(st.sampled_from(["set", "delete", "add"]))
            if op == "delete" and isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif op == "add" and isinstance(parent, dict):
                parent[draw(st.text(max_size=6))] = draw(SCALARS)
            else:
                parent[path[-1]] = draw(JSONISH)
        except (KeyError, IndexError, TypeError):
            continue
    return d


def _typed_or_valid(build: Callable[[Any], Any], value: Any) -> Any:
    """Run ``build``; a typed rejection returns None, anything else untyped fails the test."""
    try:
        return build(value)
    except DisaggError:
        return None
    except BaseException as e:  # a panic or an untyped error crossing the boundary
        raise AssertionError(f"untyped {type(e).__name__}: {e!r} for input {value!r}") from e


@pytest.mark.parametrize(
    ("key", "cls"),
    [
        ("kv_layout", KVShardLayout),
        ("ssm_layout", SSMShardLayout),
        ("kv_geometry", KVGeometry),
        ("ssm_geometry", SSMGeometry),
    ],
)
@given(data=st.data())
def test_layouts_and_geometries_from_dict_reject_typed_or_round_trip(
    key: str, cls: Any, data: st.DataObject
) -> None:
    got = _typed_or_valid(cls.from_dict, data.draw(mutated(VALID[key])))
    if got is not None:
        assert cls.from_dict(got.to_dict()) == got


INTEGRITY_LAYOUT = KVShardLayout(3, 2)
INTEGRITY_SHAPES = IntegrityTable.shapes(INTEGRITY_LAYOUT, None)
VALID_INTEGRITY = IntegrityTable(
    {n: np.arange(int(np.prod(s)), dtype=np.uint64).reshape(s) for n, s in INTEGRITY_SHAPES.items()}
).to_wire()


@given(mutated(VALID_INTEGRITY))
def test_ticket_integrity_table_rejects_typed_or_has_the_model_shapes(wire: Any) -> None:
    got = _typed_or_valid(lambda w: IntegrityTable.from_wire(w, INTEGRITY_SHAPES), wire)
    if got is not None:
        assert {n: t.shape for n, t in got.tables.items()} == INTEGRITY_SHAPES


def _peer_meta() -> dict[str, Any]:
    b = NixlTransferBackend("fuzz-meta", torch.zeros(2, 2, 4, 16, 2, 8), 4)
    try:
        return b.export_meta()
    finally:
        b.close()


PEER_META = _peer_meta()
# A real backend of the same geometry that validates the (mutated) peers as a puller would.
PULLER = NixlTransferBackend("fuzz-puller", torch.zeros(2, 2, 4, 16, 2, 8), 4)


@given(mutated(PEER_META))
def test_backend_metadata_check_rejects_typed_or_accepts_a_well_typed_dict(meta: Any) -> None:
    got = _typed_or_valid(lambda m: check_meta_fields(m, "nixl"), meta)
    if got is not None:
        assert isinstance(got["layout"], dict) and isinstance(got["num_blocks"], int)
        assert got["version"] == 1 and got["backend"] == "nixl"


@given(
    metas=st.lists(mutated(PEER_META), min_size=1, max_size=2),
    src=st.lists(st.integers(-2, 6), max_size=5),
    dst=st.lists(st.integers(-2, 6), max_size=5),
    num_tokens=st.one_of(st.none(), st.integers(-1, 80)),
)
def test_peer_validation_before_a_pull_rejects_typed_or_bounds_every_id(
    metas: list[Any], src: list[int], dst: list[int], num_tokens: int | None
) -> None:
    def go(_: None) -> Any:
        peers = PULLER._resolve_peers(metas, None)[0]
        return PULLER._validate_peers(peers, src, dst, num_tokens, local_is_dst=True)

    got = _typed_or_valid(go, None)
    if got is not None:
        assert all(0 <= i < 4 for i in dst) and len(set(dst)) == len(dst)
        assert 1 <= got <= len(dst) * 16


MESSAGES = [
    encode_message(Msg.SUBMIT, request_id=1, prompt=[1, 2, 3], max_new_tokens=4),
    encode_message(Msg.RELEASE_KV, request_id=1, epoch=2),
    encode_message(Msg.PREFILL_DONE, request_id=1, epoch=2, ticket={"src_block_ids": [0, 1]}),
]


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    choice = draw(st.integers(0, 2))
    if choice == 0:
        return draw(st.binary(max_size=64))
    if choice == 1:  # a valid frame with bytes flipped, cut or appended
        raw = bytearray(draw(st.sampled_from(MESSAGES)))
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
        return bytes(raw[: draw(st.integers(0, len(raw)))]) + draw(st.binary(max_size=3))
    raw = draw(st.sampled_from(MESSAGES))
    try:
        return bytes(msgpack.packb(draw(mutated(msgpack.unpackb(raw))), use_bin_type=True))
    except OverflowError:  # an int past 64 bits has no msgpack encoding: no frame carries it
        return raw


@given(frames())
def test_control_decoder_rejects_typed_or_yields_a_known_complete_message(raw: bytes) -> None:
    msg = _typed_or_valid(decode_message, raw)
    if msg is not None:
        assert isinstance(msg["type"], Msg)
        assert msg["v"] == PROTOCOL_VERSION


LEDGER = ImportLedger(16, 4, 2)
LEDGER.submit(1, list(range(9)), src_block_ids=[0, 1, 2], has_ssm=True, deadline=10**6, now=0)


def _ledger_state() -> tuple[Any, ...]:
    return (
        LEDGER.block_pool.num_free,
        LEDGER.slot_pool.num_free,
        LEDGER.deferred_ids(),
        LEDGER.num_importing,
        sorted(LEDGER.counters().items()),
    )


@given(
    request_id=st.integers(-2, 2**33),
    n=st.integers(-1, 80),
    src=st.lists(st.integers(-2, 2**33), max_size=24),
    src_bs=st.integers(-1, 9),
    resume=st.integers(-1, 2**33),
    has_ssm=st.booleans(),
    deadline=st.integers(-1, 2**40),
    now=st.integers(-1, 2**20),
)
def test_ledger_submit_rejects_typed_and_unchanged_or_starts_a_consistent_import(
    request_id: int,
    n: int,
    src: list[int],
    src_bs: int,
    resume: int,
    has_ssm: bool,
    deadline: int,
    now: int,
) -> None:
    before = _ledger_state()

    def go(_: None) -> Any:
        return LEDGER.submit(
            request_id,
            num_prompt_tokens=n,
            src_block_ids=src,
            src_block_size_tokens=src_bs,
            resume_tokens=resume,
            has_ssm=has_ssm,
            deadline=deadline,
            now=now,
        )

    actions = _typed_or_valid(go, None)
    if actions is None:
        assert _ledger_state() == before
        return
    LEDGER.check()
    assert len(set(src)) == len(src) and n >= 1 and src_bs >= 1 and deadline > now
    LEDGER.abort(request_id, now)  # undo, so every example starts from the same state
    for a in actions:
        LEDGER.settle(request_id, a.epoch)
    LEDGER.check()
    assert _ledger_state()[:3] == before[:3]


def test_a_frame_whose_map_key_is_a_map_is_a_metadata_error() -> None:
    # Found by the fuzzer above: msgpack raised a bare TypeError (unhashable key).
    raw = b"\x85\x80type\xa6SUB"
    try:
        decode_message(raw)
    except DisaggError as e:
        assert e.field == "<frame>"
    else:
        raise AssertionError("a corrupted frame was accepted")
