"""Every public constructor, function and method, fed arbitrary Python values, either succeeds or
raises a DisaggError subclass with ``.field`` set: never a bare TypeError / OverflowError /
AttributeError, never a PyO3 PanicException (a BaseException that ``except Exception`` misses).

Each example takes one call with valid arguments and replaces some of them with values drawn from
None, bools, negative and > 2**64 ints, floats (nan, inf), strings, lists, numpy arrays and torch
tensors, wrong objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import disagg_rs
from disagg_rs import (
    BlockPool,
    CompletionQuorum,
    DisaggError,
    ImportLedger,
    KVGeometry,
    KVShardLayout,
    PinLedger,
    SlotPool,
    SSMGeometry,
    SSMShardLayout,
    SSMStateDims,
    compile_kv_transfer,
    compile_ssm_transfer,
    plan_kv_reshard,
    plan_ssm_reshard,
)

# Ints: negative, small, around the pool caps (2**24 blocks, 2**20 SSM slots) and 2**31, and
# beyond every native width. Sizes above a cap are refused with CapacityError before anything is
# allocated.
INTS = st.one_of(
    st.integers(-(2**70), -1),
    st.integers(0, 40),
    st.sampled_from([2**20, 2**20 + 1, 2**24, 2**24 + 1, 2**31 - 1, 2**31, 2**32 - 1]),
    st.integers(2**32, 2**32 + 2),
    st.integers(2**64 - 2, 2**70),
)
ARBITRARY: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(INTS, max_size=4),
    st.tuples(INTS, INTS),
    st.lists(INTS, max_size=4).map(lambda v: np.array(v, dtype=object)),
    st.lists(st.integers(-5, 40), max_size=4).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.floats(-5, 40), max_size=4).map(lambda v: np.array(v, dtype=np.float32)),
    st.lists(st.integers(-5, 40), max_size=4).map(lambda v: torch.tensor(v, dtype=torch.int64)),
    st.just(np.zeros((2, 3), np.uint64)),
    st.just(torch.zeros(2, 3)),
    st.just({}),
    st.just({"tp_size": 1}),
    st.just(object()),
    st.just(KVShardLayout(4, 2)),
)


def _kv_geometry() -> KVGeometry:
    return KVGeometry.from_tensor(np.zeros((2, 4, 8, 4, 2, 8), np.float16))


def _ssm_setup() -> tuple[SSMShardLayout, SSMGeometry]:
    dims = SSMStateDims(4, 8, 8, 2, 4)
    lay = SSMShardLayout(2, dims)
    conv = np.zeros((2, 4, dims.conv_channels, 4), np.float32)
    rec = np.zeros((2, 4, 4, 8, 8), np.float32)
    return lay, SSMGeometry.from_tensors(conv, rec)


def _program() -> Any:
    src, dst = KVShardLayout(4, 2), KVShardLayout(4, 2, global_rank=1)
    return compile_kv_transfer([(src, _kv_geometry())], (dst, _kv_geometry()), [0, 1], [2, 3], 8)


def _ledger() -> ImportLedger:
    return ImportLedger(16, 4, 2)


def _pin_ledger() -> PinLedger:
    return PinLedger(16, 4, 2)


# (name, function of the receiver-free call, valid keyword arguments)
Call = tuple[str, Callable[..., Any], dict[str, Any]]


def _calls() -> list[Call]:
    lay, lay1 = KVShardLayout(4, 2), KVShardLayout(4, 2, global_rank=1)
    ssm_lay, ssm_geo = _ssm_setup()
    ssm_lay1 = SSMShardLayout(2, SSMStateDims(4, 8, 8, 2, 4), global_rank=1)
    plan = plan_kv_reshard([lay], [lay1])
    prog = _program()
    pool, slots = BlockPool(16, 4), SlotPool(4)
    ledger, pins, quorum = _ledger(), _pin_ledger(), CompletionQuorum(2)
    dims = SSMStateDims(4, 8, 8, 2, 4)
    out = np.zeros((8, 3), np.uint64)
    return [
        (
            "KVShardLayout",
            KVShardLayout,
            dict(num_layers=4, num_kv_heads=2, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0)
            | dict(
                global_rank=None, ep_rank=0, etp_rank=0, layer_start=None, num_local_layers=None
            ),
        ),
        ("KVShardLayout.from_dict", KVShardLayout.from_dict, dict(d=lay.to_dict())),
        (
            "SSMStateDims",
            SSMStateDims,
            dict(num_heads=4, head_dim=8, d_state=8, n_groups=2, d_conv=4),
        ),
        (
            "SSMShardLayout",
            SSMShardLayout,
            dict(num_layers=2, dims=dims, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0),
        ),
        ("SSMShardLayout.band", ssm_lay.band, dict(name="x")),
        ("plan_kv_reshard", plan_kv_reshard, dict(srcs=[lay], dsts=[lay1])),
        ("plan_ssm_reshard", plan_ssm_reshard, dict(src_layouts=[ssm_lay], dst_layouts=[ssm_lay1])),
        ("KVReshardPlan.bytes_per_token", plan.bytes_per_token, dict(head_dim=8, element_size=2)),
        (
            "KVReshardTransfer.bytes_per_token",
            plan[0].bytes_per_token,
            dict(head_dim=8, element_size=2),
        ),
        ("KVReshardPlan.for_src", plan.for_src, dict(global_rank=0)),
        ("KVReshardPlan.for_dst", plan.for_dst, dict(global_rank=1)),
        (
            "KVGeometry",
            KVGeometry,
            dict(num_layers=1, num_blocks=4, tokens_per_block=4, num_heads=2, head_dim=8)
            | dict(element_size=2, block_stride=256, token_stride=64, head_stride=16)
            | dict(plane_bases=[4096, 8192], num_kv=2, device_id=0, dtype=None),
        ),
        (
            "KVGeometry.from_tensor",
            KVGeometry.from_tensor,
            dict(
                tensor=np.zeros((2, 4, 8, 4, 2, 8), np.float16),
                axes="kv layer block token head dim",
                device_id=None,
            ),
        ),
        (
            "KVGeometry.from_layer_tensors",
            KVGeometry.from_layer_tensors,
            dict(tensors=[np.zeros((2, 8, 4, 2, 8), np.float16)], device_id=None),
        ),
        (
            "KVGeometry.from_mla_tensor",
            KVGeometry.from_mla_tensor,
            dict(tensor=np.zeros((4, 8, 4, 8), np.float16), device_id=None),
        ),
        ("KVGeometry.from_dict", KVGeometry.from_dict, dict(d=_kv_geometry().to_dict())),
        (
            "SSMGeometry.from_tensors",
            SSMGeometry.from_tensors,
            dict(conv=np.zeros((2, 4, 48, 4), np.float32), recurrent=None, device_id=None),
        ),
        ("SSMGeometry", SSMGeometry, dict(conv=None, recurrent=None, device_id=0)),
        ("SSMGeometry.from_dict", SSMGeometry.from_dict, dict(d=ssm_geo.to_dict())),
        (
            "compile_kv_transfer",
            compile_kv_transfer,
            dict(src=[(lay, _kv_geometry())], dst=(lay1, _kv_geometry()), num_tokens=8)
            | dict(src_block_ids=[0, 1], dst_block_ids=[2, 3], mode="auto", token_start=0)
            | dict(per_descriptor_s=8e-6, link_bytes_per_s=388e9, gather_bytes_per_s=1.6e12),
        ),
        (
            "compile_ssm_transfer",
            compile_ssm_transfer,
            dict(src=[(ssm_lay, ssm_geo)], dst=(ssm_lay1, ssm_geo), src_slot=0, dst_slot=1)
            | dict(mode="auto", per_descriptor_s=8e-6),
        ),
        ("TransferProgram.mode", prog.mode, dict(src_rank=0)),
        ("TransferProgram.packed_bytes", prog.packed_bytes, dict(src_rank=0)),
        (
            "TransferProgram.descriptors",
            prog.descriptors,
            dict(src_rank=0, src_staging=0, dst_staging=0, out=None),
        ),
        ("TransferProgram.row_count", prog.row_count, dict(src_rank=0, which="gather")),
        ("TransferProgram.direct_descriptors", prog.direct_descriptors, dict(src_rank=0)),
        ("TransferProgram.gather", prog.gather, dict(src_rank=0, out=out)),
        ("TransferProgram.scatter", prog.scatter, dict(src_rank=0, out=None)),
        ("TransferProgram.gather_runs", prog.gather_runs, dict(src_rank=0)),
        ("TransferProgram.scatter_runs", prog.scatter_runs, dict(src_rank=0)),
        ("BlockPool", BlockPool, dict(num_blocks=8, block_size_tokens=4)),
        ("BlockPool.can_allocate", pool.can_allocate, dict(n=1)),
        ("BlockPool.allocate", pool.allocate, dict(n=1)),
        ("BlockPool.retain", pool.retain, dict(block_ids=[0])),
        ("BlockPool.release", pool.release, dict(block_ids=[0])),
        ("BlockPool.refcount", pool.refcount, dict(block_id=0)),
        ("BlockPool.block_hashes", pool.block_hashes, dict(tokens=[1, 2, 3, 4])),
        ("BlockPool.register_cached", pool.register_cached, dict(block_ids=[0], hashes=[7])),
        ("BlockPool.match_prefix", pool.match_prefix, dict(hashes=[7])),
        ("SlotPool", SlotPool, dict(num_slots=4)),
        ("SlotPool.free", slots.free, dict(slot=0)),
        ("SlotPool.detach", slots.detach, dict(slot=0)),
        ("SlotPool.state", slots.state, dict(slot=0)),
        (
            "ImportLedger",
            ImportLedger,
            dict(num_blocks=16, block_size_tokens=4, num_ssm_slots=2, world_size=1, rank=0)
            | dict(pull=True, lookahead_tokens=0, drain_horizon=10),
        ),
        (
            "ImportLedger.submit",
            ledger.submit,
            dict(request_id=1, prompt_tokens=[1, 2, 3, 4, 5], src_block_ids=[0, 1])
            | dict(src_block_size_tokens=None, resume_tokens=0, has_ssm=False, finished=False)
            | dict(deadline=100, now=0, reuse_align_tokens=1),
        ),
        (
            "ImportLedger.report",
            ledger.report,
            dict(request_id=1, epoch=1, rank=0, outcome="ok", now=1),
        ),
        ("ImportLedger.settle", ledger.settle, dict(request_id=1, epoch=1)),
        ("ImportLedger.abort", ledger.abort, dict(request_id=1, now=2)),
        ("ImportLedger.poll", ledger.poll, dict(now=3)),
        ("ImportLedger.admit", ledger.admit, dict(batch_room=1)),
        ("ImportLedger.state_of", ledger.state_of, dict(request_id=1)),
        ("ImportLedger.epoch_of", ledger.epoch_of, dict(request_id=1)),
        ("PinLedger", PinLedger, dict(num_blocks=16, block_size_tokens=4, num_ssm_slots=1)),
        (
            "PinLedger.pin",
            pins.pin,
            dict(request_id=1, block_ids=[0, 1], ssm_slot=None, lease_until=10, now=0),
        ),
        ("PinLedger.begin_push", pins.begin_push, dict(request_id=1, epoch=1)),
        ("PinLedger.push_settled", pins.push_settled, dict(request_id=1, epoch=1)),
        ("PinLedger.release", pins.release, dict(request_id=1, epoch=None)),
        ("PinLedger.expire", pins.expire, dict(now=5)),
        ("PinLedger.epoch_of", pins.epoch_of, dict(request_id=1)),
        ("CompletionQuorum", CompletionQuorum, dict(world_size=2)),
        (
            "CompletionQuorum.report",
            quorum.report,
            dict(request_id=1, epoch=1, rank=0, outcome="ok"),
        ),
        ("CompletionQuorum.forget", quorum.forget, dict(request_id=1, epoch=1)),
    ]


CALLS = _calls()


def _check(call: Call, kwargs: dict[str, Any]) -> None:
    name, fn, _ = call
    try:
        fn(**kwargs)
    except DisaggError as e:
        assert e.field is None or isinstance(e.field, str), (name, kwargs, e)
        assert str(e), (name, kwargs)
    except BaseException as e:  # a PanicException is a BaseException
        pytest.fail(f"{name}(**{kwargs!r}) raised {type(e).__name__}: {e}")


def test_the_valid_baseline_calls_succeed_or_raise_a_typed_error() -> None:
    for call in CALLS:
        _check(call, call[2])


@pytest.mark.parametrize("call", CALLS, ids=[c[0] for c in CALLS])
@given(data=st.data())
def test_arbitrary_arguments_give_success_or_a_disagg_error(
    call: Call, data: st.DataObject
) -> None:
    names = sorted(call[2])
    valid = call[2]
    replaced = data.draw(st.sets(st.sampled_from(names), min_size=1), label="replaced")
    kwargs = dict(valid)
    for k in replaced:
        kwargs[k] = data.draw(ARBITRARY, label=k)
    _check(call, kwargs)


@pytest.mark.parametrize("call", CALLS, ids=[c[0] for c in CALLS])
def test_a_wrong_type_names_the_argument_and_is_also_a_type_error(call: Call) -> None:
    name, fn, valid = call
    for k in sorted(valid):
        if k in {"global_rank", "layer_start", "num_local_layers", "dtype", "out", "epoch"}:
            continue  # None is valid for these
        if valid[k] is None or isinstance(valid[k], dict):
            continue
        kwargs = dict(valid) | {k: object()}
        with pytest.raises(DisaggError) as info:
            fn(**kwargs)
        assert info.value.field is not None, (name, k)


def test_every_error_class_is_exported_at_the_top_level() -> None:
    from disagg_rs import exceptions

    for cls_name in exceptions.__all__:
        assert cls_name in disagg_rs.__all__, cls_name
        assert getattr(disagg_rs, cls_name) is getattr(exceptions, cls_name)
