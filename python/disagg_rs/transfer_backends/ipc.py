"""Same-host direct path: map a peer's registered GPU buffer through CUDA IPC and copy
straight from it into this rank's blocks with one kernel (no staging, no pack).

A rank exports, beside its transport metadata, an ``ipc`` dict (:func:`export`): the host
name and boot id, the process id, the GPU's UUID, and torch's own CUDA IPC handle of the
buffer's storage (``UntypedStorage._share_cuda_``, base64 for JSON and msgpack). A peer on
the same host (same host name and boot id) whose GPU is visible to it opens the handle once
per peer incarnation (:class:`IpcMapper`) and gets a tensor over the peer's buffer; the
device-plan kernel (``device_plan.copy``, source side = the mapped buffer) then reads peer
memory over NVLink (or the same GPU) straight into its own blocks. Two backends of ONE
process (tests, a single-process demo) cannot open their own handles: they find each
other's buffers in a process-local table instead.

Anything that rules the path out (other host, GPU not visible, host memory, a handle that
fails to open) makes :meth:`IpcMapper.open` return ``None``: the transport falls back to its
network path. Nothing here mutates anything before the mapping succeeded.
``DISAGG_CUDA_IPC=0`` in a rank's environment turns the path off for it.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from disagg_rs import _core

__all__ = ["IpcMapper", "export", "same_host"]

logger = logging.getLogger(__name__)

#: Buffers exported by this process, by their handle, for peers in the same process.
_LOCAL: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
_LOCAL_LOCK = threading.Lock()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device ``index`` as torch reports it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def export(buffer: torch.Tensor) -> dict[str, Any] | None:
    """The ``ipc`` metadata of a registered buffer, or ``None`` for host memory, when CUDA
    IPC is unavailable, or when ``DISAGG_CUDA_IPC=0`` turns the direct path off."""
    if not buffer.is_cuda or os.environ.get("DISAGG_CUDA_IPC", "1") == "0":
        return None
    storage = buffer.untyped_storage()
    try:
        (dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = (
            storage._share_cuda_()  # type: ignore[no-untyped-call]
        )
    except Exception as exc:  # no IPC support (e.g. expandable segments): network path only
        logger.info("CUDA IPC export unavailable: %r", exc)
        return None
    b64 = base64.b64encode(bytes(handle)).decode()
    with _LOCAL_LOCK:
        _LOCAL[b64] = buffer
    index = buffer.get_device()  # a CUDA tensor's device index
    return {
        "hostname": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": os.getpid(),
        "device_uuid": device_uuid(index),
        "storage_device": int(dev),
        "handle": b64,
        "storage_bytes": int(size),
        "storage_offset": int(offset),
        "ref_counter_handle": base64.b64encode(bytes(rc_handle)).decode(),
        "ref_counter_offset": int(rc_offset),
        "event_handle": base64.b64encode(bytes(ev_handle or b"")).decode(),
        "event_sync_required": bool(ev_sync),
        "tensor_offset": int(buffer.storage_offset() * buffer.element_size()),
        "nbytes": int(buffer.numel() * buffer.element_size()),
    }


def same_host(mine: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> bool:
    """Whether two ``ipc`` exports come from one host (host name and boot id agree)."""
    return _core.ipc_same_host(mine, theirs)


def _local_index(uuid: str) -> int | None:
    """The index of the local CUDA device with UUID ``uuid`` (``None``: not visible here)."""
    uuids = [device_uuid(i) for i in range(torch.cuda.device_count())]
    return uuids.index(uuid) if uuid in uuids else None


class IpcMapper:
    """Opens peers' buffers once per (agent, incarnation) and keeps them until ``close``."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, torch.Tensor | None]] = {}
        self._lock = threading.Lock()

    def open(
        self,
        meta: Mapping[str, Any],
        mine: Mapping[str, Any] | None,
        local_device: torch.device | None = None,
    ) -> torch.Tensor | None:
        """A flat ``uint8`` tensor over the peer's buffer (``meta``: its transport metadata),
        or ``None`` when the direct path is not available from this rank (``mine``: this
        rank's own ``ipc`` export). ``local_device``: the GPU whose kernels will read it (peer
        access to the buffer's GPU is enabled once, here)."""
        theirs = meta.get("ipc")
        if not isinstance(theirs, Mapping) or not same_host(mine, theirs):
            return None
        name, inc = str(meta["agent_name"]), int(meta["incarnation"])
        with self._lock:
            known = self._maps.get(name)
            if known is not None and known[0] == inc:
                return known[1]
        mapped = self._open(theirs, local_device)
        with self._lock:
            self._maps[name] = (inc, mapped)
        return mapped

    def _open(self, ipc: Mapping[str, Any], local: torch.device | None) -> torch.Tensor | None:
        nbytes = int(ipc["nbytes"])
        if int(ipc["pid"]) == os.getpid():
            with _LOCAL_LOCK:
                same = _LOCAL.get(str(ipc["handle"]))
            # Another GPU's buffer of this process: kernels here could not read it without
            # peer access, which only an IPC mapping enables; the network path takes it.
            if same is None:
                return None
            # Read on ``local``'s GPU (no index: the current one), else on the buffer's.
            gpu = same.get_device()
            if _core.ipc_reader_gpu(gpu, local, torch.cuda.current_device()) != gpu:
                return None
            return same.reshape(-1).view(torch.uint8)[:nbytes]
        home = _local_index(str(ipc["device_uuid"]))
        if home is None:
            return None
        # Map into the context of the GPU whose kernels read it: CUDA enables peer access to
        # the buffer's GPU for that mapping (torch opens with cudaIpcMemLazyEnablePeerAccess).
        index = _core.ipc_reader_gpu(home, local, 0)
        if index != home and not torch.cuda.can_device_access_peer(index, home):
            return None
        try:
            with torch.cuda.device(index):
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    base64.b64decode(ipc["handle"]),
                    int(ipc["storage_bytes"]),
                    int(ipc["storage_offset"]),
                    base64.b64decode(ipc["ref_counter_handle"]),
                    int(ipc["ref_counter_offset"]),
                    base64.b64decode(ipc["event_handle"]) or None,
                    bool(ipc["event_sync_required"]),
                )
        except Exception as exc:
            logger.info("CUDA IPC open failed, using the network path: %r", exc)
            return None
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        flat.set_(storage, int(ipc["tensor_offset"]), (nbytes,))  # type: ignore[call-overload]
        return flat

    def forget(self, agent_name: str) -> None:
        """Drop the mapping of one peer (it restarted or left)."""
        with self._lock:
            self._maps.pop(agent_name, None)

    def close(self) -> None:
        """Drop every mapping."""
        with self._lock:
            self._maps.clear()
