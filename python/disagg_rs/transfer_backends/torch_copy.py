"""Vectorised pack and scatter of fragment lists with torch index ops (any device).

A staged transfer moves many small fragments as one packed region: the source gathers its
fragments into a contiguous staging region (pack), one large descriptor or message moves
the region, and the destination scatters it into its paged buffer (scatter). The fragment
lists come from the Rust descriptor compiler as ``uint64`` arrays:

- gather: ``M x 3`` rows ``(src_addr, len, packed_offset)``
- scatter: ``M x 3`` rows ``(packed_offset, dst_addr, len)``

Each fragment covers the half-open byte range ``[addr, addr + len)``. Both functions run a
handful of array ops per call whatever the fragment count (an index build with numpy
``repeat`` + ``arange``, then one ``index_select`` or ``index_copy_`` when the packed side is
canonical, i.e. back to back in list order): Python never loops over fragments. This is the
host path and the fallback of the Triton kernels (``kernels.py``), which import it; nothing
here imports them.

The index is built by the core (``disagg_core::runs::row_copy``, which also checks both
sides' bounds) in rows of ``g`` bytes, ``g`` the greatest common divisor of every offset and
length, so a list of 256-byte head slices indexes 256-byte rows, not single bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs import _core

__all__ = ["byte_view", "pack_torch", "scatter_torch"]

_U64Array = npt.NDArray[np.uint64]

# Element type of each row-view unit (``_core.row_copy`` picks the widest: wider copies faster).
_UNIT_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return a flat ``uint8`` view of a contiguous tensor's bytes (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("staging needs a contiguous buffer (got a strided view)")
    return tensor.reshape(-1).view(torch.uint8)


def _rows(flat_u8: torch.Tensor, row_bytes: int, unit: int) -> torch.Tensor:
    """View ``flat_u8`` as ``[n, row_bytes / unit]`` of ``unit``-byte elements."""
    n = flat_u8.numel() // row_bytes
    return flat_u8[: n * row_bytes].view(_UNIT_DTYPES[unit]).view(n, row_bytes // unit)


def _row_copy(
    rows: _U64Array, form: str, base: int, side: torch.Tensor, packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, npt.NDArray[np.int64], npt.NDArray[np.int64] | None, int]:
    """Rust's row copy of a fragment list between the byte views ``side`` and ``packed``:
    both viewed as rows of the widest unit their storage allows, the scattered-side rows,
    the packed-side rows (``None``: back to back from 0) and the bytes moved."""
    row_list = (_u64_rows(rows), form, base, (side.numel(), packed.numel()))
    offsets = (int(side.storage_offset()), int(packed.storage_offset()))
    g, (su, pu), side_rows, packed_rows, total = _core.row_copy(row_list, offsets)
    return _rows(side, g, su), _rows(packed, g, pu), side_rows, packed_rows, total


def _u64_rows(rows: _U64Array) -> _U64Array:
    return np.ascontiguousarray(rows, dtype=np.uint64).reshape(-1, 3)


def _index(rows: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(rows).to(device, non_blocking=True)


def pack_torch(
    buffer: torch.Tensor, buffer_addr: int, gather: _U64Array, staging: torch.Tensor
) -> int:
    """Copy the fragments of ``gather`` out of ``buffer`` into ``staging``; return bytes packed.

    ``buffer_addr`` is the address ``gather``'s ``src_addr`` column is relative to (the
    registered buffer's base); ``staging`` is a contiguous region whose byte 0 is packed
    offset 0. The copy is queued on the current stream; the caller synchronises before it
    announces the region to a reader.
    """
    src_u8, out_u8 = byte_view(buffer), byte_view(staging)
    src_rows, out_rows, take, at, total = _row_copy(gather, "gather", buffer_addr, src_u8, out_u8)
    taken = _index(take, src_u8.device)
    if at is None:
        # Canonical packing: select straight into the staging rows, one copy in all.
        torch.index_select(src_rows, 0, taken, out=out_rows[: len(take)])
    else:
        out_rows.index_copy_(0, _index(at, out_u8.device), src_rows[taken])
    return total


def scatter_torch(
    staging: torch.Tensor, buffer: torch.Tensor, buffer_addr: int, scatter_list: _U64Array
) -> int:
    """Copy packed fragments from ``staging`` into ``buffer`` with torch index ops.

    ``scatter_list`` rows are ``(packed_offset, dst_addr, len)``; ``buffer_addr`` is the
    address the ``dst_addr`` column is relative to. Returns the bytes written.
    """
    in_u8, dst_u8 = byte_view(staging), byte_view(buffer)
    dst_rows, in_rows, put, at, total = _row_copy(
        scatter_list, "scatter", buffer_addr, dst_u8, in_u8
    )
    moved = in_rows[: len(put)] if at is None else in_rows.index_select(0, _index(at, in_u8.device))
    dst_rows.index_copy_(0, _index(put, dst_u8.device), moved)
    return total
