"""Each bad input a new user met gives one typed error naming the argument: a DisaggError
subclass with ``.field`` set (``ArgumentTypeError``, also a ``TypeError``, for a wrong type)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import disagg_rs as dr
from disagg_rs import exceptions as ex


def _geometry() -> dr.KVGeometry:
    return dr.KVGeometry.from_tensor(np.zeros((2, 4, 8, 4, 2, 8), np.float16))


def _program() -> dr.TransferProgram:
    src, dst = dr.KVShardLayout(4, 2), dr.KVShardLayout(4, 2, global_rank=1)
    return dr.compile_kv_transfer([(src, _geometry())], (dst, _geometry()), [0, 1], [2, 3], 8)


def _raises(cls: type[ex.DisaggError], field: str, fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls, info.value
    assert info.value.field == field, info.value
    return str(info.value)


def test_an_overflowing_bytes_per_token_is_an_address_overflow_error_not_a_panic() -> None:
    plan = dr.plan_kv_reshard([dr.KVShardLayout(4, 2)], [dr.KVShardLayout(4, 2, global_rank=1)])
    with pytest.raises(ex.AddressOverflowError, match="head_dim 99999999999"):
        plan.bytes_per_token(99999999999, 99999999999)
    with pytest.raises(ex.AddressOverflowError):
        plan[0].bytes_per_token(2**63, 2)


def test_a_default_global_rank_that_overflows_is_a_layout_error_not_a_panic() -> None:
    msg = _raises(ex.LayoutError, "global_rank", dr.KVShardLayout, 4, 2, 2**32 - 1, 0, 1, 2**32 - 1)
    assert "global_rank=" in msg


@pytest.mark.parametrize(
    ("cls", "field", "call"),
    [
        (ex.ArgumentError, "num_tokens", lambda p: dr.compile_kv_transfer(*p, num_tokens=-1)),
        (ex.ArgumentError, "src_rank", lambda p: _program().descriptors(-1)),
        (ex.ArgumentError, "src_staging", lambda p: _program().descriptors(0, -1)),
        (ex.ArgumentError, "mode", lambda p: dr.compile_kv_transfer(*p, 8, mode="fast")),
        (ex.ArgumentError, "which", lambda p: _program().row_count(0, "rows")),
        (
            ex.ArgumentError,
            "out",
            lambda p: _program().descriptors(
                0, out=(np.zeros((8, 4), np.uint64), np.zeros((8, 4), np.uint64))
            ),
        ),
        (
            ex.ArgumentError,
            "device_id",
            lambda p: dr.KVGeometry.from_tensor(np.zeros((2, 1, 2, 4, 1, 8)), device_id=-1),
        ),
        (ex.ArgumentTypeError, "tensor", lambda p: dr.KVGeometry.from_tensor(None)),
        (ex.ArgumentTypeError, "out", lambda p: _program().gather(0, out=[1, 2, 3])),
        (ex.ArgumentTypeError, "tp_size", lambda p: dr.KVShardLayout(4, 2, tp_size=True)),
        (ex.ArgumentTypeError, "n", lambda p: dr.BlockPool(8, 4).allocate(True)),
        (ex.ArgumentTypeError, "block_ids", lambda p: dr.BlockPool(8, 4).retain([True])),
        (ex.ArgumentTypeError, "num_layers", lambda p: dr.KVShardLayout(None, 2)),
        (ex.ArgumentTypeError, "dims", lambda p: dr.SSMShardLayout(4, "dims")),
        (ex.ArgumentTypeError, "srcs", lambda p: dr.plan_kv_reshard("x", [])),
        (ex.ArgumentTypeError, "pull", lambda p: dr.ImportLedger(8, 4, pull=1)),
        (ex.LayoutError, "tp_size", lambda p: dr.KVShardLayout(4, 2, tp_size=-1)),
        (ex.LayoutError, "num_layers", lambda p: dr.KVShardLayout(2**64, 2)),
        (ex.BlockIdError, "block_ids", lambda p: dr.BlockPool(8, 4).retain([-1])),
    ],
)
def test_bad_arguments_raise_one_typed_error_naming_the_argument(
    cls: type[ex.DisaggError], field: str, call: Any
) -> None:
    src, dst = dr.KVShardLayout(4, 2), dr.KVShardLayout(4, 2, global_rank=1)
    pair = ([(src, _geometry())], (dst, _geometry()), [0, 1], [2, 3])
    _raises(cls, field, call, pair)


def test_a_wrong_type_is_also_a_type_error_and_a_bad_value_also_a_value_error() -> None:
    assert issubclass(ex.ArgumentTypeError, TypeError)
    assert issubclass(ex.ArgumentTypeError, ex.ArgumentError)
    assert issubclass(ex.ArgumentError, ValueError)


def test_torch_tensors_are_block_ids_like_lists_and_numpy_arrays() -> None:
    src, dst = dr.KVShardLayout(4, 2), dr.KVShardLayout(4, 2, global_rank=1)
    want = dr.compile_kv_transfer([(src, _geometry())], (dst, _geometry()), [0, 1], [2, 3], 8)
    got = dr.compile_kv_transfer(
        [(src, _geometry())],
        (dst, _geometry()),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([2, 3]),
        8,
    )
    for a, b in zip(want.descriptors(0), got.descriptors(0), strict=True):
        np.testing.assert_array_equal(
            np.asarray(a)[:, :2] - np.asarray(a)[0, 0], np.asarray(b)[:, :2] - np.asarray(b)[0, 0]
        )
    assert want.stats["descriptors"] == got.stats["descriptors"]


def test_a_float_tensor_of_block_ids_is_refused_naming_the_list() -> None:
    src, dst = dr.KVShardLayout(4, 2), dr.KVShardLayout(4, 2, global_rank=1)
    msg = _raises(
        ex.ArgumentTypeError,
        "src_block_ids",
        dr.compile_kv_transfer,
        [(src, _geometry())],
        (dst, _geometry()),
        torch.tensor([0.0, 1.0]),
        [2, 3],
        8,
    )
    assert 'dtype kind "f"' in msg


def test_plan_coverage_errors_name_the_destination_list() -> None:
    with pytest.raises(ex.PlanCoverageError) as info:
        dr.plan_kv_reshard([dr.KVShardLayout(4, 2, 2, 0)], [dr.KVShardLayout(4, 2, global_rank=5)])
    assert info.value.field == "dsts"
