"""Transfer backends: NIXL one-sided reads and torch.distributed two-sided send/recv.

Backend selection is explicit: the launcher names a backend and
``construct_kv_transfer_backend_class(name)`` returns its class. Modules import lazily, so
``import disagg_rs`` never imports NIXL or initialises a process group.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disagg_rs.transfer_backends.base import TransferBackendBase

__all__ = ["BACKENDS", "construct_kv_transfer_backend_class"]

#: Backend name -> (module, class) of the explicit registry.
BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("disagg_rs.transfer_backends.nixl", "NixlTransferBackend"),
    "nccl": ("disagg_rs.transfer_backends.nccl", "NcclTransferBackend"),
}


def construct_kv_transfer_backend_class(name: str) -> type[TransferBackendBase]:
    """Return the backend class registered as ``name`` ("nixl" or "nccl")."""
    try:
        module_name, class_name = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; known: {sorted(BACKENDS)}") from None
    cls: type[TransferBackendBase] = getattr(importlib.import_module(module_name), class_name)
    return cls
