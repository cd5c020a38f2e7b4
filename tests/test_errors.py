"""Every core error variant maps to exactly one exception class of disagg_rs.exceptions."""

from __future__ import annotations

import pytest

from disagg_rs import _core, exceptions

# Each builtin base, then the core error kinds (`Kind:ExceptionClass`) that subclass it.
_KINDS_BY_BUILTIN = {
    ValueError: "Layout:LayoutError Coverage:PlanCoverageError Block:BlockIdError "
    "Geometry:GeometryMismatchError Wire:MetadataError DuplicateRequest:DuplicateRequestError "
    "Capacity:CapacityError Argument:ArgumentError ArgumentType:ArgumentTypeError",
    OverflowError: "AddressOverflow:AddressOverflowError",
    LookupError: "UnknownRequest:UnknownRequestError",
    RuntimeError: "State:HandoffStateError HandoffState:HandoffStateError "
    "ResetRefused:ResetRefusedError "
    "Conservation:ConservationError HandoffMetadata:HandoffMetadataError "
    "MessageOrder:MessageOrderError PushAborted:PushAbortedError",
}
EXPECTED: dict[str, tuple[type[BaseException], type[BaseException]]] = {
    kind: (getattr(exceptions, name), builtin)
    for builtin, pairs in _KINDS_BY_BUILTIN.items()
    for kind, name in (pair.split(":") for pair in pairs.split())
}


def test_every_rust_error_kind_has_an_expected_class() -> None:
    assert sorted(_core._sample_errors()) == sorted(EXPECTED)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_rust_error_kind_raises_its_class(kind: str) -> None:
    cls, builtin = EXPECTED[kind]
    with pytest.raises(cls) as info:
        raise _core._sample_errors()[kind]
    assert type(info.value) is cls
    assert isinstance(info.value, exceptions.DisaggError)
    assert isinstance(info.value, builtin)
    assert str(info.value)


def test_every_exception_class_is_exported_and_derives_from_the_base() -> None:
    for name in exceptions.__all__:
        assert issubclass(getattr(exceptions, name), exceptions.DisaggError)


def test_transfer_timeout_says_destinations_may_still_be_written() -> None:
    assert exceptions.TransferTimeout.destinations_may_be_written
    assert issubclass(exceptions.TransferTimeout, TimeoutError)
    assert not exceptions.LayoutError.destinations_may_be_written


def test_layout_error_carries_the_field() -> None:
    with pytest.raises(exceptions.LayoutError) as info:
        raise _core._sample_errors()["Layout"]
    assert info.value.field == "tp_rank"


def test_handoff_metadata_error_carries_the_field_and_is_a_metadata_error() -> None:
    with pytest.raises(exceptions.HandoffMetadataError) as info:
        raise _core._sample_errors()["HandoffMetadata"]
    assert info.value.field == "lease_ns"
    assert isinstance(info.value, exceptions.MetadataError)
