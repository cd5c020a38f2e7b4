"""Pack and scatter on the GPU: one Triton launch per handoff (or per pipeline chunk).

The staged path (``staging.pack`` / ``staging.scatter`` are this module's) takes the kernel for
CUDA buffers; host buffers keep the vectorised torch path of ``torch_copy.py``. What the kernel
consumes is a :class:`RunTable`: the compiler's fragment list (``TransferProgram.gather`` /
``scatter``, ``[m, 3]``) or its strided runs (``gather_runs`` / ``scatter_runs``, ``[n, 6]``),
turned into four ``int64`` columns by a handful of numpy ops (no Python loop over fragments)
and moved to the device in ONE copy. Build the table once per handoff; every chunk of a
pipelined transfer launches against the same table with a different packed range.

Units: every offset, length and stride of a table, and both buffers' addresses, are divided
by the largest power of two up to 16 bytes that divides them all; at 16 bytes each kernel
lane is one 128-bit load and one 128-bit store. 256-byte head slices and whole blocks both
get 16-byte units; odd sizes fall back to 8, 4, 2 or 1 bytes (slower, still one launch).

Ranges are half-open ``[lo, hi)``. The packed side must be canonical (fragments back to back
from 0 in packed order, what the compiler emits); a list that is not takes the torch path.

Dispatch (``path_for``): CUDA tensors use Triton when it imports; everything else uses torch.
``DISAGG_STAGING_KERNEL=torch`` forces torch everywhere (A/B runs); ``=triton`` forces the
kernel, which on host tensors only works under ``TRITON_INTERPRET=1`` (how the CPU tests run
the kernel itself).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs import _core
from disagg_rs.transfer_backends import torch_copy

__all__ = [
    "KernelConfig",
    "RunTable",
    "build_run_table",
    "copy_runs",
    "launchable",
    "pack",
    "path_for",
    "pipelined_handoff",
    "scatter",
    "triton_available",
]

_U64Array = npt.NDArray[np.uint64]
_I64Array = npt.NDArray[np.int64]
ListForm = Literal["gather", "scatter", "gather_runs", "scatter_runs"]
Path = Literal["triton", "torch"]

# Element type and lane width (elements) per unit size in bytes: 16-byte units are four
# int32 per lane, which Triton turns into one 128-bit access.
_UNIT_LANES: dict[int, tuple[torch.dtype, int]] = {
    16: (torch.int32, 4),
    8: (torch.int32, 2),
    4: (torch.int32, 1),
    2: (torch.int16, 1),
    1: (torch.uint8, 1),
}


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: each program copies ``block * sub`` units of the packed range.

    ``block`` lanes per inner step (a power of two), ``sub`` steps per program, ``num_warps``
    per program. The default (1024 x 16 lanes, 256 KiB per program at 16-byte units) keeps
    the per-program run search small next to the bytes moved; the GPU bench sweeps others.
    """

    block: int = 1024
    sub: int = 16
    num_warps: int = 4

    @property
    def chunk_units(self) -> int:
        """Units of packed space one program owns."""
        return self.block * self.sub


DEFAULT_CONFIG = KernelConfig()


@dataclass(frozen=True)
class RunTable:
    """A fragment list on the device, sorted by packed offset, in units of ``unit`` bytes.

    ``packed_start`` has ``n_runs + 1`` entries (the last is the packed total); run ``r``
    covers packed units ``[packed_start[r], packed_start[r + 1])`` and its fragment ``k``
    starts at ``other_start[r] + k * other_stride[r]`` units on the scattered side, each
    ``frag_len[r]`` units long. ``other_end_bytes`` is one past the last scattered byte.
    """

    packed_start: torch.Tensor
    other_start: torch.Tensor
    frag_len: torch.Tensor
    other_stride: torch.Tensor
    n_runs: int
    unit: int
    total_bytes: int
    other_end_bytes: int
    min_run_units: int
    #: Fragment-index arithmetic the kernel needs: 0 (one fragment per run), 32 or 64 bits.
    div_bits: int = 64

    @property
    def outer_steps(self) -> int:
        """Binary-search steps over all runs: ceil(log2(n_runs))."""
        return max(self.n_runs - 1, 0).bit_length()

    def inner_steps(self, config: KernelConfig) -> int:
        """Search steps within one program's chunk: ceil(log2(runs a chunk can touch))."""
        touch = min(self.n_runs, config.chunk_units // max(self.min_run_units, 1) + 2)
        return max(touch - 1, 0).bit_length()


def triton_available() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def path_for(tensor: torch.Tensor) -> Path:
    """Which implementation copies fragments of ``tensor``: "triton" or "torch"."""
    forced = os.environ.get("DISAGG_STAGING_KERNEL", "auto")
    return _core.staging_path(forced, tensor.is_cuda and triton_available())


def build_run_table(
    rows: _U64Array,
    form: ListForm,
    other_base: int,
    *,
    device: torch.device | str,
    other_limit: int,
    packed_limit: int,
    align: tuple[int, ...] = (),
) -> RunTable | None:
    """Turn a compiler list into a device :class:`RunTable`, or None when not canonical.

    ``rows`` is one of the compiler's forms (``form`` says which); ``other_base`` is the
    address its scattered-side column is relative to. The scattered side must fit
    ``[0, other_limit)`` and the packed side ``[0, packed_limit)`` bytes (``ValueError``
    otherwise, before anything is copied). ``align`` are the buffers' addresses, folded into
    the unit so that vector accesses stay aligned. The table is computed by the core
    (``disagg_core::runs``); this uploads it.
    """
    rows = np.ascontiguousarray(rows, dtype=np.uint64)
    limits = (int(other_limit), int(packed_limit))
    got = _core.run_table((rows, form, int(other_base), limits), [int(a) for a in align])
    if got is None:
        return None
    host, n, unit, total, other_end, min_run_units, div_bits = got
    dev = torch.from_numpy(host).to(device, non_blocking=False)
    return RunTable(
        packed_start=dev[: n + 1],
        other_start=dev[n + 1 : 2 * n + 1],
        frag_len=dev[2 * n + 1 : 3 * n + 1],
        other_stride=dev[3 * n + 1 :],
        n_runs=n,
        unit=unit,
        total_bytes=total,
        other_end_bytes=other_end,
        min_run_units=min_run_units,
        div_bits=div_bits,
    )


def _lanes(tensor: torch.Tensor, unit: int) -> torch.Tensor:
    """``tensor``'s bytes viewed as the element type of ``unit``-byte lanes (tail trimmed)."""
    dtype, _ = _UNIT_LANES[unit]
    flat = torch_copy.byte_view(tensor)
    size = torch.tensor([], dtype=dtype).element_size()
    return flat[: (flat.numel() // size) * size].view(dtype)


_interpreted: dict[int, Any] = {}


def launchable(kernel: Any) -> Any:
    """``kernel``, or its interpreted twin when ``TRITON_INTERPRET=1`` is set now.

    ``triton.jit`` picks interpreter or compiler when the module is imported; looking at the
    flag per call lets the CPU tests run the real kernel body on host tensors in-process.
    """
    from triton import knobs

    if not knobs.runtime.interpret or not hasattr(kernel, "fn"):
        return kernel
    if id(kernel) not in _interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted[id(kernel)] = InterpretedFunction(kernel.fn)
    return _interpreted[id(kernel)]


def _kernel() -> Any:
    """The run-copy kernel, as ``launchable`` gives it."""
    from disagg_rs.transfer_backends._triton_copy import copy_runs_kernel

    return launchable(copy_runs_kernel)


def copy_runs(
    table: RunTable,
    scattered: torch.Tensor,
    packed: torch.Tensor,
    *,
    gather: bool,
    packed_lo: int = 0,
    packed_hi: int | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
) -> int:
    """Launch the kernel once for packed bytes ``[packed_lo, packed_hi)``; return the bytes.

    ``gather``: ``scattered`` -> ``packed``; else ``packed`` -> ``scattered``. Bounds must be
    multiples of ``table.unit`` (``ValueError`` otherwise). Queued on the current stream.
    """
    window = _core.packed_window(
        (packed_lo, packed_hi), (table.total_bytes, table.unit), config.chunk_units
    )
    return _launch(table, scattered, packed, gather, window, config)


def _launch(
    table: RunTable,
    scattered: torch.Tensor,
    packed: torch.Tensor,
    gather: bool,
    window: tuple[int, int, int],
    config: KernelConfig,
) -> int:
    """Launch the kernel over ``window`` (``_core.packed_window``: units ``[lo, hi)`` and the
    programs); return the bytes."""
    lo_u, hi_u, programs = window
    if hi_u == lo_u:
        return 0
    _, vec = _UNIT_LANES[table.unit]
    src, dst = (scattered, packed) if gather else (packed, scattered)
    grid = (programs,)
    # Launch on the scattered buffer's GPU (the current device may be another one).
    guard = torch.cuda.device(scattered.device) if scattered.is_cuda else contextlib.nullcontext()
    with guard:
        _kernel()[grid](
            _lanes(src, table.unit),
            _lanes(dst, table.unit),
            table.packed_start,
            table.other_start,
            table.frag_len,
            table.other_stride,
            table.n_runs,
            lo_u,
            hi_u,
            table.outer_steps,
            table.inner_steps(config),
            GATHER=gather,
            VEC=vec,
            BLOCK=config.block,
            SUB=config.sub,
            DIV=table.div_bits,
            num_warps=config.num_warps,
        )
    return (hi_u - lo_u) * table.unit


def expand_runs(runs: _U64Array) -> _U64Array:
    """Strided runs ``[n, 6]`` -> flat ``[m, 3]`` ``(a, len, b)``-ordered as the run form says.

    Returns rows ``(a + k * a_stride, b + k * b_stride, len)`` for every run and ``k <
    count``, run by run (numpy ``repeat``; no Python loop).
    """
    r = np.ascontiguousarray(runs).astype(np.int64, copy=False)
    count = r[:, 3]
    k = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    a = np.repeat(r[:, 0], count) + k * np.repeat(r[:, 4], count)
    b = np.repeat(r[:, 1], count) + k * np.repeat(r[:, 5], count)
    return np.stack([a, b, np.repeat(r[:, 2], count)], axis=1).astype(np.uint64)


def _flat(rows: _U64Array, form: ListForm) -> _U64Array:
    """The ``torch_copy`` list form of ``rows``: gather ``(src, len, packed)``, scatter
    ``(packed, dst, len)``."""
    if form == "gather_runs":
        a_b_len = expand_runs(rows)
        return np.ascontiguousarray(a_b_len[:, [0, 2, 1]])
    if form == "scatter_runs":
        return expand_runs(rows)
    return rows


def _triton_table(
    buffer: torch.Tensor,
    buffer_addr: int,
    rows: _U64Array,
    region: torch.Tensor,
    form: ListForm,
    table: RunTable | None,
) -> RunTable | None:
    """On the Triton path, the prepared ``table`` or one built for ``rows`` between ``buffer``
    and ``region``; ``None`` where the torch path copies (another device, or no table)."""
    if path_for(buffer) != "triton":
        return None
    if table is not None:
        return table
    return build_run_table(
        rows,
        form,
        buffer_addr,
        device=buffer.device,
        other_limit=torch_copy.byte_view(buffer).numel(),
        packed_limit=torch_copy.byte_view(region).numel(),
        align=(buffer.data_ptr(), region.data_ptr()),
    )


def pack(
    buffer: torch.Tensor,
    buffer_addr: int,
    rows: _U64Array,
    region: torch.Tensor,
    *,
    form: ListForm = "gather",
    config: KernelConfig = DEFAULT_CONFIG,
    table: RunTable | None = None,
) -> int:
    """Gather the fragments ``rows`` names from ``buffer`` into ``region``; return bytes.

    ``form`` is "gather" (``[m, 3]`` ``(src_addr, len, packed_offset)``) or "gather_runs"
    (``[n, 6]``); ``buffer_addr`` is the address the source column is relative to. On the
    Triton path a prepared ``table`` skips the host work. Queued on the current stream.
    """
    table = _triton_table(buffer, buffer_addr, rows, region, form, table)
    if table is not None:
        return copy_runs(table, buffer, region, gather=True, config=config)
    return torch_copy.pack_torch(buffer, buffer_addr, _flat(rows, form), region)


def scatter(
    region: torch.Tensor,
    buffer: torch.Tensor,
    buffer_addr: int,
    rows: _U64Array,
    *,
    form: ListForm = "scatter",
    config: KernelConfig = DEFAULT_CONFIG,
    table: RunTable | None = None,
) -> int:
    """Scatter ``region`` into ``buffer`` as ``rows`` says; return bytes written.

    ``form`` is "scatter" (``[m, 3]`` ``(packed_offset, dst_addr, len)``) or "scatter_runs"
    (``[n, 6]``); ``buffer_addr`` is the address the destination column is relative to.
    """
    table = _triton_table(buffer, buffer_addr, rows, region, form, table)
    if table is not None:
        return copy_runs(table, buffer, region, gather=False, config=config)
    return torch_copy.scatter_torch(region, buffer, buffer_addr, _flat(rows, form))


def pipelined_handoff(
    gather_table: RunTable,
    src: torch.Tensor,
    src_region: torch.Tensor,
    scatter_table: RunTable,
    dst: torch.Tensor,
    dst_region: torch.Tensor,
    *,
    chunk_bytes: int = 64 << 20,
    config: KernelConfig = DEFAULT_CONFIG,
    streams: tuple[Any, Any, Any] | None = None,
) -> Any:
    """Pack, move and scatter in chunks on three CUDA streams, chained by events.

    Chunk ``i`` is packed on stream 0, copied ``src_region -> dst_region`` on stream 1 once
    its pack event fires, and scattered on stream 2 once its copy event fires; so chunk
    ``i + 1`` packs while chunk ``i`` moves and chunk ``i - 1`` scatters, with no host sync.
    The copy stands in for the transport's read of one chunk (same-device or peer
    ``copy_``). Returns the event recorded after the last scatter; the caller waits on it.
    Both tables must describe the same packed total (one source, one destination).
    """
    # Both tables must pack the same total (``ArgumentError`` otherwise); chunks are
    # ``chunk_bytes`` rounded to both tables' units.
    # Rust cuts the windows and each table's launch over them.
    windows = _core.pipeline_launches(
        (gather_table.total_bytes, gather_table.unit),
        (scatter_table.total_bytes, scatter_table.unit),
        int(chunk_bytes),
        config.chunk_units,
    )
    s_pack, s_move, s_land = streams or tuple(
        torch.cuda.Stream(src.device)  # type: ignore[no-untyped-call]
        for _ in range(3)
    )
    src_u8, dst_u8 = torch_copy.byte_view(src_region), torch_copy.byte_view(dst_region)
    # The regions and buffers must be ready before the first chunk starts.
    start = torch.cuda.Event()  # type: ignore[no-untyped-call]
    start.record()
    for s in (s_pack, s_move, s_land):
        s.wait_event(start)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    for (lo, hi), packs, lands in windows:  # chunks, not fragments: a handful per handoff
        packed_ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        moved_ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(s_pack):
            _launch(gather_table, src, src_region, True, packs, config)
            packed_ev.record(s_pack)
        with torch.cuda.stream(s_move):
            s_move.wait_event(packed_ev)
            dst_u8[lo:hi].copy_(src_u8[lo:hi], non_blocking=True)
            moved_ev.record(s_move)
        with torch.cuda.stream(s_land):
            s_land.wait_event(moved_ev)
            _launch(scatter_table, dst, dst_region, False, lands, config)
    done.record(s_land)
    return done
