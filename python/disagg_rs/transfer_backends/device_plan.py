"""Device-resident transfer plans: the GPU looks the blocks up, the host uploads only ids.

The descriptor compiler describes a KV transfer of one (source rank, destination rank) pair
as a block-id-free table (``TransferProgram.device_plan``): one row per plane (transfer, kv,
layer) with the plane's address on each side, its packed offset per token and its row size;
plus both sides' block and token strides. :class:`DevicePlan` keeps that table on the device
(once per device and unit size) and :func:`copy` launches ONE kernel that reads each item's
block id from a device array. So per handoff the host validates the ids, writes them into a
pinned buffer, queues one small host-to-device copy and one launch: no fragment list, no run
table, no synchronisation.

A plan depends only on the two geometries and the reshard plan, so transports cache it per
peer pair (:class:`PlanCache`, keyed by the peers' names and incarnations). The same plan
serves all three copies a transport needs:

- pack: source cache -> packed region (``a="src"``, ``b="packed"``);
- scatter: packed region -> destination cache (``a="packed"``, ``b="dst"``);
- direct: source cache -> destination cache, e.g. through a CUDA IPC mapping of the peer's
  cache (``a="src"``, ``b="dst"``), no staging at all.

Work is split into *items*: item ``k`` is plane row ``k // n_blk`` and block index
``k % n_blk``. Items are in packed order, so a range of items is a contiguous range of the
packed region (:meth:`DevicePlan.chunks`): a pipelined or bounded transfer runs the same
kernel over item ranges. Ranges are half-open ``[lo, hi)``.

Host tensors run the same kernel under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how the CPU tests check it; without it :func:`copy` falls back to torch index ops built
from the same plan (vectorised, no Python loop over blocks).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs import _core
from disagg_rs.transfer_backends import torch_copy
from disagg_rs.transfer_backends.kernels import _UNIT_LANES, launchable

__all__ = [
    "DevicePlan",
    "IdUploader",
    "PlanCache",
    "PreparedCopy",
    "PullRoute",
    "Side",
    "copy",
    "copy_torch",
]

SideKind = Literal["src", "dst", "packed"]
_I64 = npt.NDArray[np.int64]

#: Lanes per inner step of one program (each lane one unit).
BLOCK = 1024


@dataclass
class DevicePlan:
    """One source rank's transfer as plane rows; see the module docstring.

    ``planes`` is ``[p, 4]`` int64 bytes ``(src_off, dst_off, packed_coef, row_bytes)`` with
    the plane offsets relative to the two buffers' bases (so a peer's buffer mapped at another
    address works unchanged). ``sets`` (all 0 for one rank) is each row's id set: a paged side
    reads row ``p``'s block ids at ``sets[p] * set_stride`` of its id array, which lets one
    plan (:meth:`merge`) read several source ranks, each with its own ids, in one launch.
    A merged plan copies between paged sides only (its packed coefficients overlap).
    """

    planes: _I64
    tokens_per_block: int
    src_block_stride: int
    src_token_stride: int
    dst_block_stride: int
    dst_token_stride: int
    sets: _I64
    paged_only: bool = False
    _dev: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def from_program(
        cls, program: Any, src_rank: int, *, src_addr: int, dst_addr: int
    ) -> DevicePlan | None:
        """The plan of ``src_rank`` in ``program``, or ``None`` when it has none.

        ``src_addr`` / ``dst_addr`` are the buffer bases the geometries' plane addresses
        are relative to (the two ranks' ``buffer.addr``; ``dst_addr`` is ignored for a
        program compiled without destination).
        """
        raw = program.device_plan(src_rank) if hasattr(program, "device_plan") else None
        if raw is None:
            return None
        planes = np.asarray(raw["planes"]).astype(np.int64)
        planes[:, 0] -= int(src_addr)
        if int(raw["dst_block_stride"]):
            planes[:, 1] -= int(dst_addr)
        return cls(
            planes=planes,
            tokens_per_block=int(raw["tokens_per_block"]),
            src_block_stride=int(raw["src_block_stride"]),
            src_token_stride=int(raw["src_token_stride"]),
            dst_block_stride=int(raw["dst_block_stride"]),
            dst_token_stride=int(raw["dst_token_stride"]),
            sets=np.zeros(planes.shape[0], dtype=np.int64),
        )

    @classmethod
    def merge(cls, plans: list[DevicePlan], src_shifts: list[int]) -> DevicePlan | None:
        """One plan reading every plan of ``plans`` (one source rank each), ``None`` when
        they do not share block size and strides. Plan ``j``'s rows read id set ``j`` and its
        source offsets move by ``src_shifts[j]`` bytes (its buffer's address minus the base
        address the merged plan is launched with)."""
        if len({plan.strides for plan in plans}) != 1:
            return None
        counts = [plan.num_planes for plan in plans]
        planes = np.concatenate([plan.planes for plan in plans])
        planes[:, 0] += np.repeat(np.asarray(src_shifts, dtype=np.int64), counts)
        sets = np.repeat(np.arange(len(plans), dtype=np.int64), counts)
        return cls(planes, *plans[0].strides, sets=sets, paged_only=True)

    @property
    def strides(self) -> tuple[int, int, int, int, int]:
        """Block size and both sides' block and token strides (what :meth:`merge` needs
        to agree)."""
        return (
            self.tokens_per_block,
            self.src_block_stride,
            self.src_token_stride,
            self.dst_block_stride,
            self.dst_token_stride,
        )

    @property
    def num_sets(self) -> int:
        """Id sets the rows read (1 for one rank's plan)."""
        return int(self.sets.max(initial=0)) + 1

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_planes(self) -> int:
        """Plane rows."""
        return int(self.planes.shape[0])

    def num_blocks(self, n_tok: int) -> int:
        """Block indices ``n_tok`` tokens span."""
        return -(-int(n_tok) // self.tokens_per_block)

    def num_items(self, n_tok: int) -> int:
        """Items (plane row x block index) of a handoff of ``n_tok`` tokens."""
        return self.num_planes * self.num_blocks(n_tok)

    def packed_bytes(self, n_tok: int) -> int:
        """Size of the packed region of ``n_tok`` tokens."""
        return self._token_bytes * int(n_tok)

    @functools.cached_property
    def _token_bytes(self) -> int:
        return int(self.planes[:, 3].sum())

    def item_offsets(self, items: _I64, n_tok: int) -> _I64:
        """Packed byte offset where each item of ``items`` starts (``num_items`` -> the end)."""
        n_blk = self.num_blocks(n_tok)
        k = np.asarray(items, dtype=np.int64)
        p = np.minimum(k // n_blk, self.num_planes - 1)
        i = k - p * n_blk
        start = (
            self.planes[p, 2] * n_tok
            + np.minimum(i * self.tokens_per_block, n_tok) * (self.planes[p, 3])
        )
        return np.where(k >= self.num_items(n_tok), self.packed_bytes(n_tok), start)

    def item_offset(self, k: int, n_tok: int) -> int:
        """:meth:`item_offsets` of one item, in plain integers (the per-launch path)."""
        return self.packed.offset(int(k), int(n_tok))

    @functools.cached_property
    def packed(self) -> _core.PackedRows:
        """The plan's table in Rust: item offsets, copy checks, the kernel's unit and side
        arguments, launch placement."""
        strides = self.strides[1:]
        return _core.PackedRows(self.planes.tolist(), self.tokens_per_block, strides)

    @property
    def item_bytes(self) -> int:
        """Bytes of the largest item (one block of one plane row)."""
        return int(self.planes[:, 3].max()) * self.tokens_per_block

    @functools.cached_property
    def rows(self) -> list[tuple[int, int]]:
        """``(packed coefficient, row bytes per token)`` of every plane row."""
        return [(int(c), int(r)) for c, r in self.planes[:, 2:4].tolist()]

    def chunks(self, n_tok: int, max_bytes: int) -> list[tuple[int, int, int, int]]:
        """Item ranges of at most ``max_bytes`` packed bytes (one item at least):
        ``(k_lo, k_hi, byte_lo, byte_hi)`` in packed order, covering every item once
        (the last few cuts are kept: handoffs of one size repeat)."""
        return list(_chunks(self.packed, int(n_tok), max(int(max_bytes), 0)))

    # -- device tables -------------------------------------------------------------------

    def paged_end(self, kind: Literal["src", "dst"], num_blocks: int) -> int:
        """One past the last byte a paged side can touch with block ids < ``num_blocks``."""
        return self.packed.paged_end(kind, int(num_blocks))

    def unit(self, *addresses: int) -> int:
        """Largest power of two <= 16 dividing every offset, stride, row and address."""
        return self.packed.unit([int(a) for a in addresses])

    def table(self, device: torch.device, unit: int) -> torch.Tensor:
        """The plane table in ``unit``-byte units on ``device`` (copied once, then cached).

        Column 2 (packed coefficient) stays a multiple of the row, so it divides too.
        """
        key = (str(device), unit)
        dev = self._dev.get(key)
        if dev is None:
            rows = np.concatenate([self.planes // unit, self.sets[:, None]], axis=1)
            dev = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(device)
            self._dev[key] = dev
        return dev


@functools.lru_cache(maxsize=64)
def _chunks(
    packed: _core.PackedRows, n_tok: int, max_bytes: int
) -> tuple[tuple[int, int, int, int], ...]:
    """:meth:`DevicePlan.chunks`, cached by the plan's rows object (found by identity).
    Decided in Rust: the source and the decode of a streamed copy cut it alike."""
    return tuple(packed.chunks(n_tok, max_bytes))


@dataclass(frozen=True)
class Side:
    """One side of a copy: a buffer (whole cache or packed window) and how it is addressed.

    ``kind`` "src" / "dst": a paged cache addressed through ``ids`` (device int tensor of
    block ids, one per block index; id set ``j`` of a merged plan at ``j * set_stride``,
    the same ids for every set when 0).
    "packed": the packed region, of which ``buffer`` holds bytes ``[bias, bias + buffer
    bytes)``.
    """

    kind: SideKind
    buffer: torch.Tensor
    ids: torch.Tensor | None = None
    bias: int = 0
    set_stride: int = 0


#: How the kernel addresses one side (Rust decides it): ``(plane column, block stride, token
#: stride, packed)``, strides in bytes.
_SideArgs = tuple[int, int, int, bool]
#: A launch's ``(unit, a side, b side)``.
_Sides = tuple[int, _SideArgs, _SideArgs]


_ELEMENT_BYTES = {torch.int32: 4, torch.int16: 2, torch.uint8: 1}


def _lanes(tensor: torch.Tensor, unit: int) -> torch.Tensor:
    dtype, _ = _UNIT_LANES[unit]
    flat = torch_copy.byte_view(tensor)
    size = _ELEMENT_BYTES[dtype]
    return flat[: (flat.numel() // size) * size].view(dtype)


def _kernel() -> Any:
    """The block-copy kernel, or its interpreted twin under ``TRITON_INTERPRET=1`` (CPU tests)."""
    from disagg_rs.transfer_backends._triton_blocks import copy_blocks_kernel

    return launchable(copy_blocks_kernel)


def _spec(side: Side) -> tuple[str, int | None, int, int, int, int]:
    """``side`` as the copy's checks take it (Rust): kind, its block ids (``None``: none),
    buffer bytes (a packed side's window), bias, id set stride, buffer address."""
    ids = None if side.ids is None else side.ids.numel()
    buf = side.buffer
    return side.kind, ids, buf.nbytes, side.bias, side.set_stride, buf.data_ptr()


def _check(
    plan: DevicePlan, a: Side, b: Side, n_tok: int, items: tuple[int, int] | None
) -> tuple[list[int], _Sides]:
    """Rust's checks of a copy by ``plan``: ``([k_lo, k_hi, byte_lo, byte_hi], sides)``."""
    return plan.packed.check_copy(
        int(n_tok), items, _spec(a), _spec(b), plan.num_sets, plan.paged_only
    )


def _home(a: Side, b: Side) -> torch.Tensor:
    """The buffer whose device runs the kernel: the local cache, i.e. the destination of a
    pull (its source may be a peer's buffer mapped from another GPU), else the source."""
    return (b if b.kind == "dst" else a).buffer


def _kernel_runs(device: torch.device) -> bool:
    """Whether the kernel runs for buffers on ``device``: CUDA, or host memory under Triton's
    interpreter (``TRITON_INTERPRET=1``, the CPU tests); else the torch twin copies."""
    return (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and _triton()


def copy(
    plan: DevicePlan,
    a: Side,
    b: Side,
    n_tok: int,
    *,
    items: tuple[int, int] | None = None,
    path: Literal["auto", "triton", "torch"] = "auto",
) -> int:
    """Copy items ``items`` (default: all) of a handoff of ``n_tok`` tokens from ``a`` to
    ``b``; return the bytes copied. Queued on the current stream (one launch)."""
    (k_lo, k_hi, lo, hi), sides = _check(plan, a, b, n_tok, items)
    if k_hi == k_lo:
        return 0
    if path == "torch" or (path == "auto" and not _kernel_runs(a.buffer.device)):
        copy_torch(plan, a, b, n_tok, k_lo, k_hi)
        return int(hi - lo)
    home = _home(a, b)
    table = plan.table(home.device, sides[0])
    with torch.cuda.device(home.get_device()):  # index -1 (host memory): does nothing
        _launch(table, a, b, n_tok, k_lo, k_hi, plan, sides)
    return int(hi - lo)


#: Compiled block-copy kernels by (device, packed sides, lanes, pointer alignments).
_COMPILED: dict[tuple[Any, ...], Any] = {}


def _launch(
    table: torch.Tensor,
    a: Side,
    b: Side,
    n_tok: int,
    k_lo: int,
    k_hi: int,
    plan: DevicePlan,
    sides: _Sides,
) -> None:
    """Queue the kernel on the current stream. The first launch of each class (device,
    packed sides, lanes, every pointer's element type and 16-byte alignment: what Triton
    specialises on; the integers are never specialised) goes through Triton's JIT; the
    later ones straight to the compiled kernel's launcher with raw addresses (no argument
    binding, no specialisation: several times cheaper on the host)."""
    unit, (a_col, a_bs, a_ts, a_packed), (b_col, b_bs, b_ts, b_packed) = sides
    _, vec = _UNIT_LANES[unit]
    a_ids, b_ids = (table if s.ids is None else s.ids for s in (a, b))  # packed: no ids read
    ptrs = (_lanes(a.buffer, unit), _lanes(b.buffer, unit), table, a_ids, b_ids)
    ints = (plan.num_blocks(n_tok), int(n_tok), plan.tokens_per_block, k_lo, a_col, a_bs // unit,
            a_ts // unit, a.bias // unit, b_col, b_bs // unit, b_ts // unit, b.bias // unit,
            a.set_stride, b.set_stride, k_hi, 0, k_hi, 0)  # fmt: skip
    flags = (a_packed, b_packed, vec, BLOCK)
    addrs = tuple(p.data_ptr() for p in ptrs)
    key = (table.device, *flags, *(p.dtype for p in ptrs), *(x % 16 == 0 for x in addrs))
    compiled = _COMPILED.get(key)
    if compiled is None or not hasattr(compiled, "run"):
        _COMPILED[key] = _kernel()[(k_hi - k_lo,)](
            *ptrs, *ints, A_PACKED=flags[0], B_PACKED=flags[1], VEC=vec, BLOCK=BLOCK
        )
        return
    stream = torch._C._cuda_getCurrentRawStream(table.device.index)
    _run_compiled(compiled, k_hi - k_lo, stream, (*addrs, *ints, *flags))


def _run_compiled(compiled: Any, grid: int, stream: int, args: tuple[Any, ...]) -> None:
    """Launch a compiled Triton kernel on ``grid`` programs of the raw stream ``stream``
    with its full argument list (constexprs included, pointers as raw addresses)."""
    enter, leave = _launch_hooks()
    meta = None if enter is None else compiled.launch_metadata((grid, 1, 1), stream, *args)
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, enter,
                 leave, *args)  # fmt: skip


class PreparedCopy:
    """:func:`copy` from a fixed paged buffer ``a`` to a fixed paged buffer or packed staging
    buffer ``b``, prepared once (a route's per-peer-pair state): bounds, unit, lane views and
    the device table are settled at construction, so a handoff costs the id checks of its
    caller and one launch. A packed ``b`` takes each handoff's copy at a byte offset that
    keeps the unit's alignment (a staging region: 256-byte aligned starts).

    After the first launch of each pointer-alignment class the compiled kernel is launched
    directly (Triton's own launcher, without re-binding and re-hashing the arguments); the
    alignment of every pointer is part of the key because Triton specialises on it.
    """

    def __init__(self, plan: DevicePlan, a: Side, b: Side) -> None:
        self.plan = plan
        self.device = _home(a, b).device
        self.a, self.b = a.buffer, b.buffer
        self.b_bytes = torch_copy.byte_view(b.buffer).numel()
        # Rust refuses a packed ``a`` (ArgumentError) and gives the packed window of ``b``
        # (``None``: a paged ``b``, read through its ids).
        sides, self._window = plan.packed.prepare(
            (a.kind, a.buffer.data_ptr()), (b.kind, b.buffer.data_ptr(), self.b_bytes)
        )
        u, (a_col, a_bs, a_ts, _), (b_col, b_bs, b_ts, self.packed) = sides
        #: ``self.packed``: whether ``b`` is a packed staging buffer (no ids; a byte offset
        #: per handoff).
        self.unit = u
        self.a_lanes = _lanes(a.buffer, u)
        self.b_lanes = _lanes(b.buffer, u)
        self.table = plan.table(self.device, u)
        self._consts = (a_col, a_bs // u, a_ts // u, 0, b_col, b_bs // u, b_ts // u, 0)
        self._vec = _UNIT_LANES[u][1]
        self._sets = plan.num_sets
        self._compiled: dict[tuple[bool, ...], Any] = {}
        self._ptrs = (self.a_lanes.data_ptr(), self.b_lanes.data_ptr(), self.table.data_ptr())
        #: The kernel itself (CUDA, or Triton's interpreter on the host), else ``copy``.
        self._fast = _kernel_runs(self.device)

    def __call__(
        self,
        n_tok: int,
        a_ids: torch.Tensor,
        b_ids: torch.Tensor | None,
        stream: int | None = None,
        a_set: int = 0,
        b_offset: int = 0,
        items: tuple[int, int] | None = None,
    ) -> int:
        """Queue the copy of items ``items`` (default: every item) of an ``n_tok``-token
        handoff on the current stream of the device (block ids on it or in pinned host
        memory, which the kernel reads in place, one per block index; id set ``j`` of a
        merged plan at ``j * a_set`` of ``a_ids``; a packed ``b`` needs no ids and takes the
        packed bytes of the items at byte ``b_offset``, a multiple of 16); return the bytes.
        ``stream``: that stream's raw handle when the caller has it (CUDA, device current)."""
        k_lo, k_hi = (0, self.plan.num_items(n_tok)) if items is None else items
        return self._queue(n_tok, a_ids, b_ids, stream, a_set, [(b_offset, k_lo, k_hi)])

    def pack(
        self,
        n_tok: int,
        a_ids: torch.Tensor,
        parts: Sequence[tuple[int, int, int]],
        stream: int | None = None,
    ) -> int:
        """Queue the packs of ``parts`` into the packed ``b``: ``(byte offset, first item,
        end item)`` each, consecutive item ranges of an ``n_tok``-token handoff, each at its
        own offset (a multiple of 16): up to three in one launch. Returns the bytes."""
        return sum(
            self._queue(n_tok, a_ids, None, stream, 0, parts[j : j + _PARTS])
            for j in range(0, len(parts), _PARTS)
        )

    def _queue(
        self,
        n_tok: int,
        a_ids: torch.Tensor,
        b_ids: torch.Tensor | None,
        stream: int | None,
        a_set: int,
        parts: Sequence[tuple[int, int, int]],
    ) -> int:
        """One launch copying ``parts`` (three at most; a paged ``b``: one, at offset 0)."""
        plan = self.plan
        n_blk = plan.num_blocks(n_tok)
        b_ids = self.table if b_ids is None else b_ids  # a packed side reads no ids
        ids = (a_ids.numel(), a_set, self._sets, b_ids.numel())
        k_lo, k_hi, nbytes, biases = plan.packed.launch(
            int(n_tok), parts, self._window, self.unit, ids
        )
        if not self._fast:
            a = Side("src", self.a, a_ids, set_stride=a_set)
            return sum(
                copy(plan, a, self._b_side(b_ids, offset, lo, n_tok), n_tok, items=(lo, hi))
                for offset, lo, hi in parts
            )
        tpb, grid, b_offset = plan.tokens_per_block, k_hi - k_lo, parts[0][0]
        consts = (*self._consts[:7], biases[0])
        a_ptr, b_ptr = a_ids.data_ptr(), b_ids.data_ptr()
        key = (a_ptr % 16 == 0, b_ptr % 16 == 0)
        compiled = self._compiled.get(key)
        if compiled is None or not hasattr(compiled, "run"):
            # Triton's JIT takes device tensors only: ids in pinned host memory go up once,
            # for the launch that compiles (same alignment class, so the same kernel).
            a_ids, b_ids = (x.to(self.device) for x in (a_ids, b_ids))
            self._compiled[key] = _kernel()[(grid,)](
                self.a_lanes, self.b_lanes[b_offset // self.b_lanes.element_size() :],
                self.table, a_ids, b_ids,
                n_blk, int(n_tok), tpb, k_lo, *consts, a_set, 0, *biases[1:],
                A_PACKED=False, B_PACKED=self.packed, VEC=self._vec, BLOCK=BLOCK,
            )  # fmt: skip
            return nbytes
        # Raw addresses: Triton's launcher then skips a data_ptr() call and a pointer query
        # per tensor (the buffers are held by this object, the ids by the caller). The
        # buffers' alignment is fixed (a packed side's offset keeps it); the ids' is the key.
        a_lanes, b_lanes, table = self._ptrs
        args = (a_lanes, b_lanes + b_offset, table, a_ptr, b_ptr, n_blk, int(n_tok), tpb, k_lo,
                *consts, a_set, 0, *biases[1:], False, self.packed, self._vec, BLOCK)  # fmt: skip
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        _run_compiled(compiled, grid, stream, args)
        return nbytes

    def _b_side(self, b_ids: torch.Tensor, offset: int, lo: int, n_tok: int) -> Side:
        """``b`` as :func:`copy` takes it for the item range from ``lo`` on placed at byte
        ``offset`` (a paged ``b``: the whole cache, its ids)."""
        if not self.packed:
            return Side("dst", self.b, b_ids)
        region = torch_copy.byte_view(self.b)[offset:]
        return Side("packed", region, bias=self.plan.item_offset(lo, n_tok))


#: Item ranges one launch packs at their own offsets (the kernel's two cuts; the core's rule).
_PARTS = _core.PACK_PARTS


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch hooks, or ``(None, None)`` when none is registered.

    Triton 3.4 and later keep an empty hook chain rather than ``None``; passed on, an empty
    chain makes every launch build its launch metadata and call two Python hooks that do
    nothing (several times the launch itself on the host)."""
    from triton import knobs

    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
        return enter, leave
    return None, None


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _side_rows(
    plan: DevicePlan, side: Side, args: _SideArgs, n_tok: int, k_lo: int, k_hi: int
) -> _I64:
    """Byte offset of every (item, token) row of items ``[k_lo, k_hi)``, numpy, vectorised
    (``args``: how the kernel addresses ``side``)."""
    n_blk = plan.num_blocks(n_tok)
    tpb = plan.tokens_per_block
    k = np.arange(k_lo, k_hi, dtype=np.int64)
    p, i = k // n_blk, k % n_blk
    ntok = np.minimum(tpb, n_tok - i * tpb)
    item = np.repeat(np.arange(k.size), ntok)
    t = np.arange(int(ntok.sum()), dtype=np.int64) - np.repeat(np.cumsum(ntok) - ntok, ntok)
    pp, ii = p[item], i[item]
    row = plan.planes[pp, 3]
    col, bs, ts, packed = args
    if packed:
        out: _I64 = plan.planes[pp, 2] * n_tok + (ii * tpb + t) * row - side.bias
        return out
    # A paged side has ids: Rust's copy check refused one without.
    ids = cast(torch.Tensor, side.ids).cpu().numpy().astype(np.int64)
    at = plan.sets[pp] * side.set_stride + ii
    out = plan.planes[pp, col] + ids[at] * bs + t * ts
    return out


def copy_torch(plan: DevicePlan, a: Side, b: Side, n_tok: int, k_lo: int, k_hi: int) -> None:
    """The torch twin of the kernel (host tensors without the interpreter): row offsets by
    numpy, one ``torch_copy`` gather/scatter pass through a dense temporary. Checked by Rust
    like :func:`copy`."""
    _, (_, a_args, b_args) = _check(plan, a, b, n_tok, (k_lo, k_hi))
    src_rows = _side_rows(plan, a, a_args, n_tok, k_lo, k_hi)
    dst_rows = _side_rows(plan, b, b_args, n_tok, k_lo, k_hi)
    n_blk = plan.num_blocks(n_tok)
    k = np.arange(k_lo, k_hi, dtype=np.int64)
    p, i = k // n_blk, k % n_blk
    ntok = np.minimum(plan.tokens_per_block, n_tok - i * plan.tokens_per_block)
    lens = np.repeat(plan.planes[p, 3], ntok)
    packed = np.cumsum(lens) - lens
    total = int(lens.sum())
    tmp = torch.empty(total, dtype=torch.uint8, device=a.buffer.device)
    gather = np.stack([src_rows, lens, packed], axis=1).astype(np.uint64)
    torch_copy.pack_torch(a.buffer, 0, gather, tmp)
    scatter = np.stack([packed, dst_rows, lens], axis=1).astype(np.uint64)
    torch_copy.scatter_torch(tmp, b.buffer, 0, scatter)


def pinned_in_place() -> bool:
    """Whether kernels may read torch's pinned host memory in place. Torch pins with
    ``cudaHostAlloc`` by default, memory CUDA maps at the same address for every device; its
    ``pinned_use_cuda_host_register`` allocator option registers ordinary memory instead,
    whose device address may differ, and then the ids are copied up."""
    conf = ",".join(
        os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "pinned_use_cuda_host_register:true" not in conf.replace(" ", "").lower()


class _Done:
    """The event of a slot settled without one (or of work on host memory): finished."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


_DONE = _Done()


class IdUploader:
    """Block ids for the device through a ring of pinned buffers: one async copy per handoff
    (:meth:`upload`, :meth:`begin`), or none (:meth:`take` + :meth:`view`: kernels read the
    pinned slot in place, host memory that CUDA maps for every device at the same address).

    A slot is reused only once the work that last read it has finished (its event says so);
    a busy ring grows instead of waiting, so the host never blocks on the GPU. Settled slots
    wait in settle order and only the oldest one's event is asked, so taking a slot costs
    the same however many handoffs are still queued on the GPU.
    """

    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.device = device
        self.capacity = int(capacity)
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Slots free now (their readers finished), and slots settled with an event not yet
        #: seen complete, oldest first.
        self._free: list[int] = []
        self._pending: deque[tuple[int, Any]] = deque()
        self._views: list[npt.NDArray[np.int64]] = []
        self._cuts: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor, list[Any]]] = {}
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: Whether :meth:`view` hands out the pinned slot itself (see :func:`pinned_in_place`).
        self.in_place = pinned_in_place()
        #: One CUDA event per slot for readers that record their own (``PullRoute``).
        self.events: list[Any] = []
        self._lock = threading.Lock()

    def upload(self, *arrays: npt.ArrayLike) -> list[torch.Tensor]:
        """Copy the int arrays to the device in one transfer; return device views of each."""
        views, slot = self.begin(*arrays, fresh=True)
        if slot >= 0:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
            self.settle(slot, ev)
        return views

    def begin(self, *arrays: npt.ArrayLike, fresh: bool = False) -> tuple[list[torch.Tensor], int]:
        """Like :meth:`upload`, but the slot stays taken until :meth:`settle` names the event
        recorded after the last kernel that reads the ids (one event per handoff, not two),
        and the ids land in the slot's own device buffer (``fresh``: a new device tensor, for
        readers that the slot's event does not cover). Returns the device views and the slot
        (-1: host memory, nothing to settle)."""
        parts = [np.asarray(x, dtype=np.int64).reshape(-1) for x in arrays]
        if self.device.type != "cuda":
            flat = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
            return list(torch.split(flat, [p.size for p in parts])), -1
        # Every part starts 16-byte aligned (an even element offset), so the kernels that read
        # them see the same pointer alignment from one handoff to the next.
        starts = [0, *itertools.accumulate(p.size + (p.size & 1) for p in parts)]
        n = starts[-1]
        with self._lock:
            slot = self._slot(n)
        host, dev = self._slots[slot]
        view = self._views[slot]
        for p, at in zip(parts, starts, strict=False):
            view[at : at + p.size] = p
        if fresh:
            dev = host[:n].to(self.device, non_blocking=True)
            return [dev[at : at + p.size] for p, at in zip(parts, starts, strict=False)], slot
        # The slot's device views of the last cut, reused while the part sizes repeat.
        sizes = tuple(p.size for p in parts)
        cut = self._cuts.get(slot)
        if cut is None or cut[0] != sizes:
            views = [dev[at : at + p.size] for p, at in zip(parts, starts, strict=False)]
            cut = self._cuts[slot] = (sizes, host[:n], dev[:n], views)
        cut[2].copy_(cut[1], non_blocking=True)
        return list(cut[3]), slot

    def take(self, n: int) -> tuple[int, npt.NDArray[np.int64]]:
        """A slot of at least ``n`` ids, taken until :meth:`settle`, and its pinned host
        memory as a numpy array for the caller to fill (then :meth:`push`). Host devices:
        slot -1 and a fresh array (nothing to settle)."""
        if self.device.type != "cuda":
            return -1, np.zeros(n, dtype=np.int64)
        with self._lock:
            slot = self._slot(n)
        return slot, self._views[slot]

    def view(self, slot: int, host: npt.NDArray[np.int64], n: int) -> torch.Tensor:
        """The first ``n`` ids of a taken slot (``host``: what :meth:`take` returned) as a
        tensor the kernels read in place: the pinned slot itself (its address is valid on
        every device: CUDA maps pinned allocations into the unified address space), no copy;
        a copy on the device (queued on the current stream) when :attr:`in_place` is false.
        The slot stays taken until :meth:`settle` names an event recorded after its readers."""
        if slot < 0:
            return torch.from_numpy(host[:n])
        pair = self._pairs.get(slot)
        if pair is None or pair[0].numel() != n:  # the slot's views of the last size
            h, d = self._slots[slot]
            pair = self._pairs[slot] = (h[:n], d[:n])
        if self.in_place:
            return pair[0]
        pair[1].copy_(pair[0], non_blocking=True)
        return pair[1]

    def settle(self, slot: int, event: Any) -> None:
        """Slot ``slot`` is free once ``event`` (recorded after its readers) has completed."""
        if slot >= 0:
            with self._lock:
                self._pending.append((slot, event if event is not None else _DONE))

    def _slot(self, n: int) -> int:
        """A free slot of at least ``n`` ids (the lock held): the last slot whose readers
        finished (settled slots are asked oldest first, one event query while the oldest is
        still running), else a new slot (also when that one is too small: slots hold
        ``capacity`` ids, more only for the rare larger handoff)."""
        while self._pending and self._pending[0][1].query():
            self._free.append(self._pending.popleft()[0])
        if self._free and self._views[self._free[-1]].size >= n:
            return self._free.pop()
        size = max(n, self.capacity)
        host = torch.empty(size, dtype=torch.int64).pin_memory()
        dev = torch.empty(size, dtype=torch.int64, device=self.device)
        self._slots.append((host, dev))
        self._views.append(host.numpy())
        self.events.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
        return len(self._slots) - 1


class _SlotRoute:
    """A route whose kernels read block ids in place from pinned slots of ``uploader``, on
    ``buffer``'s device (index -1: host memory, where ``torch.cuda.device`` does nothing)."""

    def __init__(self, uploader: IdUploader, buffer: torch.Tensor) -> None:
        self.uploader = uploader
        self.device = buffer.device
        self.index = buffer.get_device()
        self._cuda = buffer.is_cuda
        self._streams: dict[int, Any] = {}

    def _write(
        self, n: int, *args: Any, **kw: Any
    ) -> tuple[int, npt.NDArray[np.int64], tuple[int, int, int, int]] | None:
        """Take an id slot of at least ``n`` ids and have Rust check the peers and ids and
        write them into it (``_core.write_pull_ids`` with ``args`` and ``kw``): ``(slot, its
        memory, what Rust returned)``, or ``None`` when the ids do not fit this route."""
        slot, host = self.uploader.take(n)
        got = None
        try:
            got = _core.write_pull_ids(host, *args, **kw)
        finally:
            if got is None:  # raised, or not this route's ids: the slot is free again
                self.uploader.settle(slot, None)
        return None if got is None else (slot, host, got)

    def _raw(self) -> int | None:
        """The raw handle of the device's current stream (``None``: host memory)."""
        return torch._C._cuda_getCurrentRawStream(self.index) if self._cuda else None

    def _record(self, slot: int, raw: Any) -> Any:
        """Record the event of id slot ``slot`` on the stream ``raw`` and settle the slot
        (host memory: a completed event, nothing to settle).

        One event per slot, recorded again when the slot is reused: the slot is free only
        once that event's last record completed, so a handle still holding it can only see
        it complete later, never early."""
        if not self._cuda:
            return _DONE
        done = self.uploader.events[slot]
        done.record(self._stream(raw))
        self.uploader.settle(slot, done)
        return done

    def _stream(self, raw: Any) -> Any:
        """The device's current stream, whose raw handle is ``raw``: stream objects are kept
        by raw handle (building one costs more than the launch's other calls together)."""
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream


class PullRoute(_SlotRoute):
    """Every source rank of one peer set copied into this rank's blocks by one launch.

    ``plans`` are the source ranks' plans (by global rank) and ``buffers`` their buffers as
    this rank's kernels see them (e.g. CUDA IPC mappings); ``dst`` is this rank's buffer.
    The plans are merged into one (:meth:`DevicePlan.merge`, source offsets relative to the
    lowest buffer address) when they share block size and strides, else each keeps its own
    launch. The merged kernel reads across buffers by address: host tensors need Triton's
    interpreter (the torch twin reads one buffer). Per handoff (:meth:`run`) Rust checks
    the block ids and writes them straight into a pinned slot of ``uploader``; the launch
    follows, its kernel reading the ids from that slot in place.
    """

    def __init__(
        self,
        plans: dict[int, DevicePlan],
        buffers: dict[int, torch.Tensor],
        dst: torch.Tensor,
        uploader: IdUploader,
    ) -> None:
        super().__init__(uploader, dst)
        self.ranks = sorted(plans)
        self.tokens_per_block = plans[self.ranks[0]].tokens_per_block
        base = min(self.ranks, key=lambda r: buffers[r].data_ptr())
        shifts = [buffers[r].data_ptr() - buffers[base].data_ptr() for r in self.ranks]
        merged = DevicePlan.merge([plans[r] for r in self.ranks], shifts)
        solo = [(plans[r], r, j) for j, r in enumerate(self.ranks)]
        groups = solo if merged is None else [(merged, base, 0)]
        #: ``(prepared copy, first id set)``: one entry when merged, else one per rank.
        self.copies = [
            (PreparedCopy(plan, Side("src", buffers[r]), Side("dst", dst)), j)
            for plan, r, j in groups
        ]

    def run(
        self,
        peers: list[Any],
        src_block_ids: Any,
        dst_block_ids: Any,
        num_tokens: int | None,
        *,
        local_num_blocks: int,
        local_tokens_per_block: int | None,
    ) -> tuple[Any, int] | None:
        """Check the ids (``check_peer_transfer``'s errors), upload them and queue the copy
        on the device's current stream; return ``(event recorded after it, bytes)``, or
        ``None`` (nothing queued) when the ids do not fit this route (block counts other
        than the plan's)."""
        got = self._write(
            _core.pull_ids_len(dst_block_ids, len(self.ranks)),
            peers, self.ranks, src_block_ids, dst_block_ids, num_tokens,
            local_num_blocks=local_num_blocks, local_tokens_per_block=local_tokens_per_block,
            tokens_per_block=self.tokens_per_block,
        )  # fmt: skip
        if got is None:
            return None
        slot, host, (n_tok, _, stride, n) = got
        with torch.cuda.device(self.index):
            ids = self.uploader.view(slot, host, n)
            raw = self._raw()
            try:
                nbytes = sum(
                    launch(n_tok, ids[(first + 1) * stride :], ids, raw, a_set=stride)
                    for launch, first in self.copies
                )
            finally:
                done = self._record(slot, raw)
        return done, nbytes


@dataclass(frozen=True)
class PackIds:
    """One handoff's block ids of a :class:`PackRoute`, checked: the first ``n`` ids of id
    slot ``slot`` (taken until the route records or releases it; ``host``: its memory)."""

    slot: int
    host: npt.NDArray[np.int64]
    n: int
    num_tokens: int


class PackRoute(_SlotRoute):
    """This rank's blocks packed for one decode (the source side of a staged pull), prepared
    once per (sources, decode) pair: ``plan`` (this rank's device plan) from ``src`` (this
    rank's cache) into the packed staging buffer ``staging``.

    Per handoff :meth:`begin` has Rust check the peers and ids (``check_peer_transfer``'s
    errors) and write this rank's ids into a pinned slot of ``uploader``; :meth:`pack_whole`
    queues one launch that reads them in place and packs the whole copy into a staging
    region, and settles the slot; a streamed copy packs chunks with :meth:`pack_items` and
    gives the slot back with :meth:`release` once its last pack has completed.
    """

    def __init__(
        self,
        plan: DevicePlan,
        rank: int,
        src: torch.Tensor,
        staging: torch.Tensor,
        uploader: IdUploader,
    ) -> None:
        super().__init__(uploader, src)
        self.plan, self.rank = plan, rank
        self.copy = PreparedCopy(plan, Side("src", src), Side("packed", staging))

    def begin(
        self,
        peers: list[Any],
        src_block_ids: Any,
        num_tokens: int | None,
        *,
        local_num_blocks: int,
        local_tokens_per_block: int | None,
        checked: bool = False,
    ) -> PackIds | None:
        """Check and lay out this rank's ids of one handoff; ``None`` (nothing taken) when
        they do not fit this route (SSM state, a block count other than the plan's).
        ``checked``: the caller has checked them (``num_tokens`` is what the check returned)."""
        args = (peers, [self.rank], src_block_ids, None, num_tokens)
        kw = {"local_num_blocks": local_num_blocks, "checked": checked,
              "local_tokens_per_block": local_tokens_per_block,
              "tokens_per_block": self.plan.tokens_per_block}  # fmt: skip
        # A slot of the ring's usual size first (one Rust call); one of the size these ids
        # need when they did not fit it (a handoff of more blocks than the ring's slots
        # hold: its ids are then checked twice).
        got = self._write(self.uploader.capacity, *args, **kw)
        if got is None:
            got = self._write(_core.pull_ids_len(src_block_ids, 0, rank=self.rank), *args, **kw)
        return None if got is None else PackIds(got[0], got[1], got[2][3], int(got[2][0]))

    def pack_whole(self, got: PackIds, offset: int) -> Any:
        """Queue the pack of the whole copy into the staging buffer at byte ``offset`` and
        settle the slot; the event recorded after it (host memory: one that has completed)."""
        with torch.cuda.device(self.index):
            raw = self._raw()
            try:
                ids = self.uploader.view(got.slot, got.host, got.n)
                self.copy(got.num_tokens, ids, None, raw, b_offset=offset)
            finally:
                done = self._record(got.slot, raw)
        return done

    def pack_items(self, got: PackIds, parts: list[tuple[int, int, int]]) -> list[Any]:
        """Queue the packs of ``parts`` (``(byte offset in the staging buffer, first item,
        end item)`` each, consecutive item ranges) on the device's current stream, up to
        three in one launch; return each one's completion (one event recorded after them
        all; host memory: completed ones)."""
        if not parts:
            return []
        with torch.cuda.device(self.index):
            ids = self.uploader.view(got.slot, got.host, got.n)
            raw = self._raw()
            self.copy.pack(got.num_tokens, ids, parts, raw)
            done = self._event(raw)
        return [done] * len(parts)

    def _event(self, raw: Any) -> Any:
        """A new event recorded on the stream ``raw`` (host memory: a completed one)."""
        if not self._cuda:
            return _DONE
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream(raw))
        return event

    def release(self, got: PackIds) -> None:
        """Give the slot of a handoff whose packs have all completed back."""
        self.uploader.settle(got.slot, None)


class PlanCache:
    """Plans (or anything derived from a compiled program) by key (peer names and
    incarnations), built once by ``build``; thread-safe; the oldest key goes past ``limit``."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = int(limit)
        self._plans: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The cached value of ``key``, built on first use (``None`` is cached too)."""
        with self._lock:
            if key in self._plans:
                self.hits += 1
                return self._plans[key]
        plan = build()
        with self._lock:
            self.misses += 1
            if len(self._plans) >= self.limit:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def peek(self, key: Hashable) -> Any:
        """The cached value of ``key`` or ``None`` (no build)."""
        with self._lock:
            return self._plans.get(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._plans

    def __len__(self) -> int:
        return len(self._plans)
