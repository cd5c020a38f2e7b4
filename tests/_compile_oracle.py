"""Byte-level oracle for the descriptor compiler (shared by the compile tests).

Real numpy buffers in each cache geometry are filled from one global tensor of unique values
(split by the layouts); a program is applied with ``ctypes.memmove`` (direct: descriptor pairs;
staged: gather into a staging buffer, then scatter); the destination must equal a direct split
of the global tensor, with every cell outside the moved region still holding the sentinel.
Every address is checked against the known buffers before any byte moves, so a compiler bug
fails the test instead of corrupting the interpreter.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg_rs import KVGeometry, KVShardLayout, TransferProgram

KINDS = ("megatron", "nhd", "hnd", "kv_lists")
Array = npt.NDArray[Any]


def kv_layouts(tp: int, pp: int, layers: int, heads: int, rank0: int = 0) -> list[KVShardLayout]:
    """All ranks of one engine, global ranks ``rank0 + pp_rank * tp + tp_rank``."""
    return [
        KVShardLayout(layers, heads, tp, t, pp, p, global_rank=rank0 + p * tp + t)
        for p in range(pp)
        for t in range(tp)
    ]


@dataclass
class KvRank:
    """One rank's cache: numpy buffers in ``kind`` layout plus its geometry."""

    layout: KVShardLayout
    kind: str
    num_blocks: int
    tokens_per_block: int
    head_dim: int
    dtype: npt.DTypeLike
    fill: int
    buffers: list[Array] = field(default_factory=list)
    geometry: KVGeometry | None = None
    _planes: Callable[[int, int], Array] | None = None

    def __post_init__(self) -> None:
        n_l, n_h = self.layout.num_local_layers, self.layout.heads_per_partition
        b, t, d = self.num_blocks, self.tokens_per_block, self.head_dim

        def full(shape: Sequence[int]) -> Array:
            return np.full(shape, self.fill, dtype=self.dtype)

        if self.kind == "megatron":
            a = full((2, n_l, b, t, n_h, d))
            self.buffers = [a]
            self.geometry = KVGeometry.from_tensor(a)
            self._planes = lambda kv, layer: a[kv, layer]
        elif self.kind == "nhd":
            ls = [full((2, b, t, n_h, d)) for _ in range(n_l)]
            self.buffers = ls
            self.geometry = KVGeometry.from_layer_tensors(ls)
            self._planes = lambda kv, layer: ls[layer][kv]
        elif self.kind == "hnd":
            ls = [full((2, b, n_h, t, d)) for _ in range(n_l)]
            self.buffers = ls
            self.geometry = KVGeometry.from_layer_tensors(ls, axes="kv block head token dim")
            self._planes = lambda kv, layer: ls[layer][kv].transpose(0, 2, 1, 3)
        elif self.kind == "kv_lists":
            # Separate K and V tensors per layer, described with explicit fields.
            ks = [full((b, t, n_h, d)) for _ in range(n_l)]
            vs = [full((b, t, n_h, d)) for _ in range(n_l)]
            self.buffers = ks + vs
            item = np.dtype(self.dtype).itemsize
            self.geometry = KVGeometry(
                num_layers=n_l,
                num_blocks=b,
                tokens_per_block=t,
                num_heads=n_h,
                head_dim=d,
                element_size=item,
                block_stride=t * n_h * d * item,
                token_stride=n_h * d * item,
                head_stride=d * item,
                plane_bases=[x.ctypes.data for x in ks + vs],
                dtype=np.dtype(self.dtype).name,
            )
            self._planes = lambda kv, layer: (ks if kv == 0 else vs)[layer]
        elif self.kind == "mla":
            a = full((n_l, b, t, d))
            self.buffers = [a]
            self.geometry = KVGeometry.from_mla_tensor(a)
            self._planes = lambda kv, layer: a[layer][:, :, None, :]
        else:
            raise AssertionError(self.kind)

    @property
    def num_kv(self) -> int:
        return 1 if self.kind == "mla" else 2

    def plane(self, kv: int, layer: int) -> Array:
        """Logical ``[block, token, head, dim]`` view of local plane ``(kv, layer)``."""
        assert self._planes is not None
        return self._planes(kv, layer)

    def write(self, g: Array, block_ids: Sequence[int], lo: int, hi: int) -> None:
        """Store token positions ``[lo, hi)`` of the global tensor ``g[kv, L, N, H, d]``."""
        if hi <= lo:
            return
        pos = np.arange(lo, hi)
        blocks = np.asarray(block_ids)[pos // self.tokens_per_block]
        offs = pos % self.tokens_per_block
        l0, h0, h1 = self.layout.layer_start, self.layout.head_start, self.layout.head_end
        for kv in range(self.num_kv):
            for layer in range(self.layout.num_local_layers):
                self.plane(kv, layer)[blocks, offs] = g[kv, l0 + layer, lo:hi, h0:h1]

    def ranges(self) -> list[tuple[int, int]]:
        return [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in self.buffers]

    def snapshot(self) -> list[Array]:
        return [b.copy() for b in self.buffers]


def megatron_geometry(
    layers: int, blocks: int, tpb: int, heads: int, d: int, base: int, item: int = 2
) -> KVGeometry:
    """A Megatron ``[2, L, B, T, H, d]`` geometry by explicit fields (no memory needed)."""
    row = d * item
    plane = blocks * tpb * heads * row
    return KVGeometry(
        num_layers=layers,
        num_blocks=blocks,
        tokens_per_block=tpb,
        num_heads=heads,
        head_dim=d,
        element_size=item,
        block_stride=tpb * heads * row,
        token_stride=heads * row,
        head_stride=row,
        plane_bases=[base + i * plane for i in range(2 * layers)],
        dtype="bfloat16",
    )


def global_tensor(num_kv: int, layers: int, tokens: int, heads: int, d: int, dtype: Any) -> Array:
    """Unique values 1..n (never the sentinel nor the source filler)."""
    n = num_kv * layers * tokens * heads * d
    assert n + 2 < np.iinfo(dtype).max
    return (
        (np.arange(n, dtype=np.int64) + 1).astype(dtype).reshape(num_kv, layers, tokens, heads, d)
    )


def _inside(addr: int, n: int, ranges: Sequence[tuple[int, int]], what: str) -> None:
    assert any(lo <= addr and addr + n <= hi for lo, hi in ranges), (
        f"{what} range [{addr:#x}, {addr + n:#x}) lies outside every buffer"
    )


def apply_program(
    program: TransferProgram,
    src_ranges: dict[int, list[tuple[int, int]]],
    dst_ranges: list[tuple[int, int]],
) -> None:
    """Move the bytes the way a transport would: direct pairs, or gather -> one move -> scatter."""
    for r in program.src_ranks:
        if program.mode(r) == "direct":
            s, d = program.descriptors(r)
            assert s.dtype == np.uint64 and s.shape[1] == 3 and s.shape == d.shape
            for (sa, n, _), (da, n2, _) in zip(s.tolist(), d.tolist(), strict=True):
                assert n == n2 and n > 0
                _inside(sa, n, src_ranges[r], "source")
                _inside(da, n, dst_ranges, "destination")
                ctypes.memmove(da, sa, n)
        else:
            size = program.packed_bytes(r)
            s, d = program.descriptors(r)
            assert s.tolist() == [[0, size, s[0, 2]]] and d.shape == (1, 3)
            src_stage = np.zeros(max(size, 1), dtype=np.uint8)
            dst_stage = np.zeros(max(size, 1), dtype=np.uint8)
            sb, db = src_stage.ctypes.data, dst_stage.ctypes.data
            for sa, n, off in program.gather(r).tolist():
                assert off + n <= size
                _inside(sa, n, src_ranges[r], "gather source")
                ctypes.memmove(sb + off, sa, n)
            ctypes.memmove(db, sb, size)  # the one large descriptor
            for off, da, n in program.scatter(r).tolist():
                assert off + n <= size
                _inside(da, n, dst_ranges, "scatter destination")
                ctypes.memmove(da, db + off, n)
