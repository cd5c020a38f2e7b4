"""Exception classes of disagg_rs, defined once here and raised from Rust and Python alike.

Every class derives from :class:`DisaggError` and from the built-in exception engines already
catch (``ValueError``, ``TimeoutError``, ...). Facts a caller must act on are class attributes:
``destinations_may_be_written`` says whether the destination blocks of a failed transfer may
still be written by the transport, i.e. must stay quarantined rather than go back to the pool.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "HandoffMetadataError",
    "AddressOverflowError",
    "ArgumentError",
    "ArgumentTypeError",
    "BlockIdError",
    "CapacityError",
    "ConservationError",
    "DisaggError",
    "DuplicateRequestError",
    "GeometryMismatchError",
    "HandoffStateError",
    "IntegrityError",
    "LayoutError",
    "MessageOrderError",
    "MetadataError",
    "PlanCoverageError",
    "PushAbortedError",
    "ResetRefusedError",
    "TransferError",
    "TransferStartError",
    "TransferTimeout",
    "UnknownRequestError",
]


class DisaggError(Exception):
    """Base class of every error raised by disagg_rs.

    ``field`` names the offending input field where there is one (``None`` otherwise).
    """

    destinations_may_be_written: ClassVar[bool] = False

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class LayoutError(DisaggError, ValueError):
    """A layout or dims field is out of range or disagrees with another field."""


class PlanCoverageError(DisaggError, ValueError):
    """A reshard plan leaves a destination cell unwritten or writes it twice."""


class BlockIdError(DisaggError, ValueError):
    """A block or slot id list is invalid: out of range, duplicated or of the wrong length."""


class GeometryMismatchError(DisaggError, ValueError):
    """Two memory geometries disagree on head_dim, element size, dtype, block count or axes."""


class AddressOverflowError(DisaggError, OverflowError):
    """Address arithmetic would overflow 64 bits: the geometry describes impossible memory."""


class MetadataError(DisaggError, ValueError):
    """Peer handoff metadata is missing a field, has a wrong type or an unknown version."""


class HandoffMetadataError(MetadataError, RuntimeError):
    """Malformed or mismatched handoff metadata met on the reference design's engine path,
    which reports it as a ``RuntimeError`` (so it is both)."""


class UnknownRequestError(DisaggError, LookupError):
    """A request id is unknown where it must be known."""


class DuplicateRequestError(DisaggError, ValueError):
    """A request id is already in flight."""


class CapacityError(DisaggError, ValueError):
    """A request needs more blocks or SSM slots than the whole pool holds."""


class HandoffStateError(DisaggError, RuntimeError):
    """An event is not allowed in the handoff's current state."""


class ResetRefusedError(DisaggError, RuntimeError):
    """A reset was refused because something may still be written or read; nothing changed."""

    destinations_may_be_written: ClassVar[bool] = True


class TransferError(DisaggError, RuntimeError):
    """A transport reported an error for a transfer (every part of it is terminal)."""


class TransferStartError(TransferError):
    """Posting a transfer failed after the transport may already own some of its storage.

    ``cleanup_handles`` are the handles of the parts that were posted before the failure;
    poll them until they settle before reusing the storage. ``storage_safe`` is True when
    nothing was posted or every posted part has settled (the reference design's contract).
    ``resources`` keeps buffers and descriptors alive while the storage is not yet safe.
    Python-only (no Rust variant): only the Python drivers post transfers.
    """

    def __init__(
        self,
        message: str,
        *,
        storage_safe: bool,
        resources: Any = None,
        cleanup_handles: list[Any] | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message, field)
        self._storage_safe = bool(storage_safe)
        self.resources = resources
        self.cleanup_handles = list(cleanup_handles or [])

    @property
    def destinations_may_be_written(self) -> bool:  # type: ignore[override]
        """True while a posted part may still read or write the storage."""
        return not self.storage_safe

    @property
    def storage_safe(self) -> bool:
        """Whether the failure happened before anything was posted, or every posted part
        has settled since."""
        return self._storage_safe or (
            bool(self.cleanup_handles) and all(bool(h.storage_safe) for h in self.cleanup_handles)
        )


class MessageOrderError(TransferError):
    """A two-sided message's header is not what its receive was posted for (another
    request's, incarnation's, chunk's or size's message): the bytes were not admitted and the
    peer pair is out of step. ``field`` names the header field that differs; the message
    gives both values."""


class PushAbortedError(TransferError):
    """A two-sided handoff's sender answered the posted receives with fillers (it will not
    send the handoff: unknown or unpinned request, refused push, lease over). The import
    failed at once; the peer pair is still in step."""


class IntegrityError(TransferError):
    """The state written on decode does not match the prefill's integrity digest
    (``verify_integrity=True``): the request was not admitted and, the transfers having
    finished, its destinations went back to the pools.

    ``mismatch`` names the first differing cell (a
    :class:`disagg_rs.integrity.IntegrityMismatch`: table, kv, layer, head or band unit,
    expected and got), ``None`` if unknown. Python-only (no Rust variant): only the Python
    driver compares digests.
    """

    def __init__(self, message: str, field: str | None = "integrity", mismatch: Any = None):
        super().__init__(message, field)
        self.mismatch = mismatch


class TransferTimeout(DisaggError, TimeoutError):
    """A transfer passed its deadline; its destinations may still be written."""

    destinations_may_be_written: ClassVar[bool] = True


class ArgumentError(DisaggError, ValueError):
    """A plain argument is out of range (a rank >= world size, a zero block size, ...)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument has the wrong type (``None``, a bool, a float or a string where an int is
    needed, an object that is not a tensor, ...). Also a ``TypeError``, as Python code expects.
    Python-only class (no Rust variant): the bindings raise it while reading arguments."""


class ConservationError(DisaggError, RuntimeError):
    """A pool or ledger check found a leaked, doubly owned or miscounted block or slot."""
