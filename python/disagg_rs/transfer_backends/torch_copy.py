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

The index is built in units of the largest power of two (up to 8 bytes) that divides every
offset and length, and rows of ``g`` bytes where ``g`` is their greatest common divisor, so a
list of 256-byte head slices indexes 256-byte rows, not single bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["byte_view", "pack_torch", "scatter_torch"]

_U64Array = npt.NDArray[np.uint64]

# Element types tried for the row view, widest first: wider elements copy faster.
_UNIT_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return a flat ``uint8`` view of a contiguous tensor's bytes (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("staging needs a contiguous buffer (got a strided view)")
    return tensor.reshape(-1).view(torch.uint8)


def _as_i64(column: _U64Array) -> npt.NDArray[np.int64]:
    # Byte offsets inside one registered buffer fit in int64 (torch has no uint64 index type).
    return np.ascontiguousarray(column).astype(np.int64, copy=False)


def _row_bytes(*columns: npt.NDArray[np.int64]) -> int:
    """Largest row size dividing every offset and length (1 when the lists are empty)."""
    joined = np.concatenate([c for c in columns if c.size])
    if joined.size == 0:
        return 1
    g = int(np.gcd.reduce(joined))
    return g if g > 0 else 1


def _rows(flat_u8: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """View ``flat_u8`` as ``[n, row_bytes / unit]`` of the widest unit the storage allows."""
    n = flat_u8.numel() // row_bytes
    head = flat_u8[: n * row_bytes]
    for unit, dtype in _UNIT_DTYPES:
        if row_bytes % unit == 0 and head.storage_offset() % unit == 0:
            return head.view(dtype).view(n, row_bytes // unit)
    raise AssertionError("unit 1 always divides")  # pragma: no cover


def _row_index(
    starts: npt.NDArray[np.int64], lens: npt.NDArray[np.int64], row_bytes: int, device: torch.device
) -> torch.Tensor:
    """Row numbers covered by fragments ``[start, start + len)``, fragment by fragment."""
    counts = lens // row_bytes
    # Exclusive prefix sum: row j of fragment i sits at position excl[i] + j of the output.
    excl = np.cumsum(counts) - counts
    index = np.repeat(starts // row_bytes - excl, counts) + np.arange(int(counts.sum()))
    return torch.from_numpy(index).to(device, non_blocking=True)


def _is_dense(packed: npt.NDArray[np.int64], lens: npt.NDArray[np.int64]) -> bool:
    """Whether the packed side is back to back from 0 in list order (the canonical packing)."""
    return bool(packed[0] == 0 and np.array_equal(packed[1:], np.cumsum(lens)[:-1]))


def _check_bounds(
    name: str, starts: npt.NDArray[np.int64], lens: npt.NDArray[np.int64], limit: int
) -> None:
    if starts.size == 0:
        return
    if int(starts.min()) < 0:
        raise ValueError(f"{name}: fragment starts below the buffer (offset {int(starts.min())})")
    end = int((starts + lens).max())
    if end > limit:
        raise ValueError(f"{name}: fragment ends at byte {end}, past the buffer's {limit} bytes")


def pack_torch(
    buffer: torch.Tensor, buffer_addr: int, gather: _U64Array, staging: torch.Tensor
) -> int:
    """Copy the fragments of ``gather`` out of ``buffer`` into ``staging``; return bytes packed.

    ``buffer_addr`` is the address ``gather``'s ``src_addr`` column is relative to (the
    registered buffer's base); ``staging`` is a contiguous region whose byte 0 is packed
    offset 0. The copy is queued on the current stream; the caller synchronises before it
    announces the region to a reader.
    """
    src_u8 = byte_view(buffer)
    out_u8 = byte_view(staging)
    if gather.shape[0] == 0:
        return 0
    src = _as_i64(gather[:, 0]) - buffer_addr
    lens = _as_i64(gather[:, 1])
    packed = _as_i64(gather[:, 2])
    _check_bounds("gather source", src, lens, src_u8.numel())
    _check_bounds("gather packed", packed, lens, out_u8.numel())
    g = _row_bytes(src, lens, packed)
    src_rows = _rows(src_u8, g)
    out_rows = _rows(out_u8, g)
    take = _row_index(src, lens, g, src_u8.device)
    total = int(lens.sum())
    if _is_dense(packed, lens):
        # Canonical packing: select straight into the staging rows, one copy in all.
        torch.index_select(src_rows, 0, take, out=out_rows[: total // g])
    else:
        out_rows.index_copy_(0, _row_index(packed, lens, g, out_u8.device), src_rows[take])
    return total


def scatter_torch(
    staging: torch.Tensor, buffer: torch.Tensor, buffer_addr: int, scatter_list: _U64Array
) -> int:
    """Copy packed fragments from ``staging`` into ``buffer`` with torch index ops.

    ``scatter_list`` rows are ``(packed_offset, dst_addr, len)``; ``buffer_addr`` is the
    address the ``dst_addr`` column is relative to. Returns the bytes written.
    """
    in_u8 = byte_view(staging)
    dst_u8 = byte_view(buffer)
    if scatter_list.shape[0] == 0:
        return 0
    packed = _as_i64(scatter_list[:, 0])
    dst = _as_i64(scatter_list[:, 1]) - buffer_addr
    lens = _as_i64(scatter_list[:, 2])
    _check_bounds("scatter packed", packed, lens, in_u8.numel())
    _check_bounds("scatter destination", dst, lens, dst_u8.numel())
    g = _row_bytes(packed, dst, lens)
    in_rows = _rows(in_u8, g)
    dst_rows = _rows(dst_u8, g)
    put = _row_index(dst, lens, g, dst_u8.device)
    total = int(lens.sum())
    if _is_dense(packed, lens):
        dst_rows.index_copy_(0, put, in_rows[: total // g])
    else:
        dst_rows.index_copy_(
            0, put, in_rows.index_select(0, _row_index(packed, lens, g, in_u8.device))
        )
    return total
