"""Message tags of two-sided transfers (torch.distributed over NCCL or gloo): derived by the
library's core, injective over every accepted request id, refused beyond."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_rs._core import MAX_TWO_SIDED_REQUEST_ID, two_sided_tag, two_sided_tag_owner
from disagg_rs.exceptions import ArgumentError

KINDS = ("kv", "conv", "recurrent")


def test_request_ids_two_to_the_29_apart_never_share_a_tag() -> None:
    # Before: id * 4 + kind wrapped in a 31-bit tag, so ids 2**29 apart aliased.
    assert two_sided_tag(5, "kv") != two_sided_tag(MAX_TWO_SIDED_REQUEST_ID, "kv")
    with pytest.raises(ArgumentError) as err:
        two_sided_tag(5 + (1 << 29), "kv")
    assert err.value.field == "request_id" and str(5 + (1 << 29)) in str(err.value)


@pytest.mark.parametrize("rid", [-1, MAX_TWO_SIDED_REQUEST_ID + 1, 1 << 63, -(1 << 70)])
def test_ids_outside_the_taggable_range_are_refused_with_a_typed_error(rid: int) -> None:
    with pytest.raises(ArgumentError) as err:
        two_sided_tag(rid, "conv")
    assert err.value.field == "request_id"


def test_an_unknown_state_kind_and_a_tag_no_request_has_are_refused() -> None:
    with pytest.raises(ArgumentError) as err:
        two_sided_tag(1, "ssm")
    assert err.value.field == "kind"
    for tag in (-1, 3, 1 << 31):
        with pytest.raises(ArgumentError):
            two_sided_tag_owner(tag)


@settings(max_examples=300, derandomize=True)
@given(
    st.lists(
        st.one_of(
            st.integers(0, 64),
            st.integers(MAX_TWO_SIDED_REQUEST_ID - 64, MAX_TWO_SIDED_REQUEST_ID),
            st.integers(-(1 << 40), 1 << 40),
        ),
        min_size=1,
        max_size=32,
        unique=True,
    )
)
def test_tags_of_any_in_flight_set_are_distinct_31_bit_and_invert_to_their_request(
    ids: list[int],
) -> None:
    seen: dict[int, tuple[int, str]] = {}
    for rid in ids:
        for kind in KINDS:
            if not 0 <= rid <= MAX_TWO_SIDED_REQUEST_ID:  # the oracle: refused, never wrapped
                with pytest.raises(ArgumentError):
                    two_sided_tag(rid, kind)
                continue
            tag = two_sided_tag(rid, kind)
            assert 0 <= tag < 1 << 31
            assert two_sided_tag_owner(tag) == (rid, kind)
            assert seen.setdefault(tag, (rid, kind)) == (rid, kind)
