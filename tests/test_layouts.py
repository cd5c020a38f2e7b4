"""Layouts: validation errors name the field and both values; wire, pickle, eq, hash, repr."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from hypothesis import given

import disagg_rs as dr
from disagg_rs.exceptions import LayoutError, MetadataError
from layout_strategies import kv_cases, ssm_cases

DIMS = dr.SSMStateDims(num_heads=8, head_dim=4, d_state=16, n_groups=2, d_conv=4)

KV_ERRORS: list[tuple[dict[str, Any], str, list[str]]] = [
    ({"num_layers": 0, "num_kv_heads": 8}, "num_layers", ["num_layers=0"]),
    ({"num_layers": 8, "num_kv_heads": 0}, "num_kv_heads", ["num_kv_heads=0"]),
    ({"num_layers": 8, "num_kv_heads": 8, "tp_size": 0}, "tp_size", ["tp_size=0"]),
    (
        {"num_layers": 8, "num_kv_heads": 8, "tp_size": 2, "tp_rank": 2},
        "tp_rank",
        ["tp_rank=2", "tp_size=2"],
    ),
    (
        {"num_layers": 8, "num_kv_heads": 8, "pp_size": 2, "pp_rank": 3},
        "pp_rank",
        ["pp_rank=3", "pp_size=2"],
    ),
    (
        {"num_layers": 8, "num_kv_heads": 6, "tp_size": 4},
        "num_kv_heads",
        ["num_kv_heads=6", "tp_size=4"],
    ),
    (
        {"num_layers": 8, "num_kv_heads": 4, "tp_size": 6},
        "tp_size",
        ["tp_size=6", "num_kv_heads=4"],
    ),
    (
        {"num_layers": 9, "num_kv_heads": 4, "pp_size": 2},
        "num_layers",
        ["num_layers=9", "pp_size=2"],
    ),
    (
        {"num_layers": 2, "num_kv_heads": 4, "pp_size": 3, "pp_rank": 0},
        "pp_size",
        ["pp_size=3", "num_layers=2"],
    ),
    ({"num_layers": 8, "num_kv_heads": 4, "layer_start": 2}, "num_local_layers", ["layer_start=2"]),
    (
        {"num_layers": 8, "num_kv_heads": 4, "num_local_layers": 2},
        "layer_start",
        ["num_local_layers=2"],
    ),
    (
        {"num_layers": 8, "num_kv_heads": 4, "layer_start": 6, "num_local_layers": 3},
        "num_local_layers",
        ["layer_start=6", "num_local_layers=3", "num_layers=8"],
    ),
    ({"num_layers": 8, "num_kv_heads": 4, "tp_rank": -1}, "tp_rank", ["tp_rank=-1"]),
    (
        {"num_layers": 8, "num_kv_heads": 4, "global_rank": 2**40},
        "global_rank",
        ["global_rank=1099511627776"],
    ),
]


@pytest.mark.parametrize(("kwargs", "field", "needles"), KV_ERRORS)
def test_invalid_kv_layout_raises_layout_error_naming_field_and_values(
    kwargs: dict[str, Any], field: str, needles: list[str]
) -> None:
    with pytest.raises(LayoutError) as info:
        dr.KVShardLayout(**kwargs)
    assert info.value.field == field
    for needle in needles:
        assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("args", "field", "needle"),
    [
        ((0, 4, 16, 1, 4), "num_heads", "num_heads=0"),
        ((8, 4, 16, 3, 4), "n_groups", "n_groups=3"),
        ((8, 4, 16, 2, 0), "d_conv", "d_conv=0"),
    ],
)
def test_invalid_ssm_dims_raise_layout_error(
    args: tuple[int, ...], field: str, needle: str
) -> None:
    with pytest.raises(LayoutError, match=needle) as info:
        dr.SSMStateDims(*args)
    assert info.value.field == field


def test_ssm_layout_rejects_heads_not_divisible_by_tp() -> None:
    with pytest.raises(LayoutError, match="num_heads=8 is not divisible by tp_size=3"):
        dr.SSMShardLayout(4, DIMS, tp_size=3)


def test_ssm_band_helper_rejects_unknown_band() -> None:
    with pytest.raises(LayoutError, match="band"):
        dr.SSMShardLayout(4, DIMS).band("z")  # type: ignore[arg-type]


def test_default_global_rank_follows_pp_major_order() -> None:
    assert dr.KVShardLayout(8, 8, tp_size=4, tp_rank=1, pp_size=2, pp_rank=1).global_rank == 5


def test_kv_layout_exposes_the_seed_backend_fields() -> None:
    layout = dr.KVShardLayout(8, 8, tp_size=4, tp_rank=1, pp_size=2, pp_rank=1)
    assert (layout.layer_start, layout.layer_end, layout.num_local_layers) == (4, 8, 4)
    assert (layout.head_start, layout.head_end, layout.heads_per_partition) == (2, 4, 2)
    assert "layers=[4, 8) of 8" in repr(layout)
    assert "heads=[2, 4) of 8" in repr(layout)


@given(kv_cases())
def test_kv_layouts_round_trip_through_json_and_pickle(case) -> None:
    for layout in case[0] + case[1]:
        wire = json.loads(json.dumps(layout.to_dict()))
        assert dr.KVShardLayout.from_dict(wire) == layout
        again = pickle.loads(pickle.dumps(layout))
        assert again == layout
        assert hash(again) == hash(layout)


@given(ssm_cases())
def test_ssm_layouts_round_trip_through_json_and_pickle(case) -> None:
    for layout in case[0] + case[1]:
        wire = json.loads(json.dumps(layout.to_dict()))
        assert dr.SSMShardLayout.from_dict(wire) == layout
        assert pickle.loads(pickle.dumps(layout)) == layout
        assert pickle.loads(pickle.dumps(layout.dims)) == layout.dims


def test_layouts_differing_in_one_field_are_unequal() -> None:
    a = dr.KVShardLayout(8, 8, tp_size=2, tp_rank=0)
    b = dr.KVShardLayout(8, 8, tp_size=2, tp_rank=0, global_rank=7)
    assert a != b
    assert len({a, b, dr.KVShardLayout(8, 8, tp_size=2, tp_rank=0)}) == 2


def test_from_dict_rejects_a_missing_field() -> None:
    wire = dr.KVShardLayout(8, 8).to_dict()
    del wire["tp_size"]
    with pytest.raises(MetadataError, match="missing") as info:
        dr.KVShardLayout.from_dict(wire)
    assert info.value.field == "tp_size"


def test_from_dict_rejects_an_unknown_field() -> None:
    wire = dr.KVShardLayout(8, 8).to_dict()
    wire["tp_szie"] = 2
    with pytest.raises(MetadataError) as info:
        dr.KVShardLayout.from_dict(wire)
    assert info.value.field == "tp_szie"


def test_from_dict_rejects_a_wrong_type() -> None:
    wire = dr.SSMShardLayout(4, DIMS).to_dict()
    wire["tp_rank"] = "0"
    with pytest.raises(MetadataError, match="expected an int"):
        dr.SSMShardLayout.from_dict(wire)
    wire = dr.SSMShardLayout(4, DIMS).to_dict()
    wire["dims"] = [8, 4]
    with pytest.raises(MetadataError, match="expected a dict"):
        dr.SSMShardLayout.from_dict(wire)


def test_from_dict_validates_like_the_constructor() -> None:
    wire = dr.KVShardLayout(8, 8, tp_size=2).to_dict()
    wire["tp_rank"] = 5
    with pytest.raises(LayoutError, match="tp_rank=5"):
        dr.KVShardLayout.from_dict(wire)
