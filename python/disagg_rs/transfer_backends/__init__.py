"""Transfer backends: NIXL one-sided reads and torch.distributed two-sided send/recv.

Backend selection is explicit: the launcher names a backend and
``construct_kv_transfer_backend_class(name)`` returns its class. Modules import lazily, so
``import disagg_rs`` never imports NIXL or initialises a process group.
"""

from __future__ import annotations

from disagg_rs.transfer_backends.base import BACKENDS, construct_kv_transfer_backend_class

__all__ = ["BACKENDS", "construct_kv_transfer_backend_class"]
