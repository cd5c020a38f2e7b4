"""Optional integrity check of a transferred handoff state (``verify_integrity=True``).

A digest of the state that depends only on **logical position and values**, never on the
physical layout: the same KV state held by a TP2 prefill with 16-token blocks in the Megatron
layout and by a TP1 decode with 64-token blocks in the NHD layout gives the same digest.

Cells and entries
-----------------
- KV: a cell is one head row (``head_dim`` elements) at ``(kv, layer, global head, token)``;
  the table entry of ``(kv, layer, global head)`` is the sum over the prompt's tokens
  ``[0, num_tokens)`` of the cell hashes. Table shape ``[2, num_layers, num_kv_heads]``.
- SSM conv state ``[x | B | C]``: units that no TP split cuts — one per SSM head in the x band
  (``head_dim`` channels), one per group in the B band and in the C band (``d_state``
  channels each); a cell is the unit's channels x ``d_conv``. Unit index: x head ``h`` is
  ``h``, B group ``g`` is ``num_heads + g``, C group ``g`` is ``num_heads + n_groups + g``.
  Table shape ``[num_layers, num_heads + 2 * n_groups]``.
- SSM recurrent state: a cell is one head's ``[p, n]`` state. Table ``[num_layers, num_heads]``.

Layers are the layout's global layer indices (attention layers for KV, SSM layers for SSM).

Hash
----
A cell's bytes are read as 64-bit words (32, 16 or 8-bit words when the row size is not a
multiple of 8, widened to 64 bits). Word ``j`` of the cell at position key ``k`` hashes to
``fmix64(w_j XOR (fmix64(k) + j * golden))`` (``fmix64``: MurmurHash3's 64-bit finalizer, a
bijection); the cell hash is the sum of its words' hashes and every sum is mod 2^64. Because
the word hash is a bijection of the word for a fixed position, changing any byte of a cell
changes that cell's hash and therefore exactly its entry. Because entries are sums, any rank
holding a cell can contribute it (a PP stage owns its layers, GQA and group replicas hold
identical values) and any rank holding it after a reshard can check it.

Everything is integer torch ops on the buffer's device (CPU or CUDA, identical results; int64
wrap-around is two's complement on both): the rank's registered byte buffer is viewed through
its geometry with ``torch.as_strided``, the request's blocks are picked with ``index_select``,
one (kv, layer) plane at a time. Only the small table of entries ever leaves the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs._core import (
    KVShardLayout,
    SSMShardLayout,
    check_integrity_wire,
    digest_plan,
    integrity_conv_bands,
    integrity_first_mismatch,
    integrity_merge,
    integrity_mismatch_text,
    integrity_shapes,
)
from disagg_rs.exceptions import ArgumentError, IntegrityError

__all__ = [
    "MAX_CHUNKS",
    "MIN_CHUNK_TOKENS",
    "IntegrityError",
    "IntegrityMismatch",
    "IntegrityPiece",
    "IntegrityTable",
    "TableName",
    "cell_hashes",
    "chunk_tokens_for",
    "conv_pieces",
    "kv_entries",
    "kv_pieces",
    "recurrent_pieces",
]

TableName = Literal["kv", "conv", "recurrent"]

#: Position-key kind codes (key bits 58-59).
_KIND_KEY, _KIND_VALUE, _KIND_CONV, _KIND_RECURRENT = 0, 1, 2, 3
#: Position key = kind << 58 | layer << 42 | unit << 26 | token.
_LAYER_BITS, _UNIT_BITS, _TOKEN_BITS = 16, 16, 26

#: Cell bytes digested per batch of kernels, by device type (the int64 temporaries are a few
#: times this): large on GPUs, where one plane is too little work per launch; on CPUs one
#: cache-friendly plane at a time is fastest.
_CHUNK_BYTES = {"cuda": 64 << 20}
_CHUNK_BYTES_DEFAULT = 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    return int.from_bytes(c.to_bytes(8, "little"), "little", signed=True)


_FMIX_M1 = _signed(0xFF51AFD7ED558CCD)
_FMIX_M2 = _signed(0xC4CEB9FE1A85EC53)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_LOW31 = (1 << 31) - 1  # mask after a logical right shift by 33


def _fmix64_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer on an int64 tensor, in place (logical shifts)."""
    x.bitwise_xor_((x >> 33) & _LOW31)
    x.mul_(_FMIX_M1)
    x.bitwise_xor_((x >> 33) & _LOW31)
    x.mul_(_FMIX_M2)
    x.bitwise_xor_((x >> 33) & _LOW31)
    return x


def _keys(
    kind: int | torch.Tensor, layers: torch.Tensor, units: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Hashed position keys ``[planes, tokens, units]`` (int64) of the cells at
    ``(kind[p], layers[p], unit, token)`` (``kind`` per plane, or one for all)."""
    base = (kind << (_LAYER_BITS + _UNIT_BITS + _TOKEN_BITS)) | (
        layers << (_UNIT_BITS + _TOKEN_BITS)
    )
    keys = base.view(-1, 1, 1) + tokens.view(1, -1, 1) + (units << _TOKEN_BITS).view(1, 1, -1)
    return _fmix64_(keys)


#: Word types by size in bytes.
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_dtype(row_bytes: int) -> torch.dtype:
    """The widest word that tiles a cell row: depends on the row size only (same both sides).
    ``row_bytes & -row_bytes`` is the largest power of two dividing it."""
    return _WORDS[min(row_bytes & -row_bytes, 8)]


def cell_hashes(cells: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Hash of every cell: ``cells`` is ``[..., row_bytes]`` uint8 (contiguous), ``keys`` the
    hashed position keys ``[...]`` (int64); returns ``[...]`` int64 (bits of a uint64)."""
    row_bytes = int(cells.shape[-1])
    words = cells.view(_word_dtype(row_bytes)).to(torch.int64)  # may alias the state buffer
    offsets = torch.arange(words.shape[-1], dtype=torch.int64, device=words.device) * _GOLDEN
    # Out of place first: ``words`` may be the caller's memory (int64 rows need no widening).
    mixed = torch.bitwise_xor(words, keys.unsqueeze(-1) + offsets)
    return _fmix64_(mixed).sum(dim=-1)


def _byte_view(buffer: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The registered buffer as flat bytes, and its base address."""
    if not buffer.is_contiguous():
        raise ArgumentError("integrity digest: the state buffer must be contiguous", "buffer")
    return buffer.reshape(-1).view(torch.uint8), int(buffer.data_ptr())


def _geometry_dict(geometry: Any) -> Mapping[str, Any]:
    return geometry if isinstance(geometry, Mapping) else dict(geometry.to_dict())


def _u64(t: torch.Tensor) -> npt.NDArray[np.uint64]:
    """Copy a small int64 entry tensor to host as uint64 (same bits)."""
    return t.cpu().numpy().astype(np.int64, copy=False).view(np.uint64)


# -- KV -----------------------------------------------------------------------------------------


def kv_entries(
    buffer: torch.Tensor,
    geometry: Any,
    layout: KVShardLayout,
    block_ids: Sequence[int] | npt.NDArray[Any] | torch.Tensor,
    num_tokens: int,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Entries ``[2, local layers, local heads]`` (int64, on the buffer's device) of one
    request's KV state on one rank; with ``chunk_tokens`` ``C``, entries
    ``[chunks, 2, local layers, local heads]``, chunk ``c`` summing tokens ``[c*C, (c+1)*C)``.

    ``buffer`` is the rank's registered KV buffer, ``geometry`` its :class:`KVGeometry` (or its
    ``to_dict()``), ``layout`` its :class:`KVShardLayout` (global layer and head ranges,
    half-open), ``block_ids`` the request's blocks in token order (covering ``[0,
    num_tokens)``).
    """
    g = _geometry_dict(geometry)
    flat, base = _byte_view(buffer)
    t_per_b, n_heads = int(g["tokens_per_block"]), int(g["num_heads"])
    row_bytes = int(g["head_dim"]) * int(g["element_size"])
    num_layers = int(g["num_layers"])
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=buffer.device)
    dev = buffer.device
    bases = [int(b) - base for b in g["plane_bases"]]  # plane p = kv * num_layers + local layer
    # Checks (geometry against layout, block coverage, key ranges) and the plan, in Rust:
    # planes equally spaced in memory (one [2, L, ...] tensor) are digested a batch of planes
    # per batch of kernels (bounded temporaries); other geometries one plane at a time.
    plan = digest_plan(
        "kv",
        {
            "num_kv": int(g["num_kv"]),
            "geometry_heads": n_heads,
            "geometry_layers": num_layers,
            "layout_heads": layout.heads_per_partition,
            "layout_layers": layout.num_local_layers,
            "block_ids": int(ids.numel()),
            "tokens_per_block": t_per_b,
            "num_tokens": num_tokens,
            "layer_end": layout.layer_end,
            "head_end": layout.head_end,
            "chunk_tokens": chunk_tokens,
            "plane_offsets": bases,
            "row_bytes": row_bytes,
            "batch_bytes": _CHUNK_BYTES.get(dev.type, _CHUNK_BYTES_DEFAULT),
        },
    )
    ids = ids[: plan["blocks"]]
    heads = torch.arange(layout.head_start, layout.head_end, dtype=torch.int64, device=dev)
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=dev)
    strides = (int(g["block_stride"]), int(g["token_stride"]), int(g["head_stride"]), 1)
    size = (int(g["num_blocks"]), t_per_b, n_heads, row_bytes)
    per_chunk, n_chunks, step = plan["per_chunk"], plan["chunks"], plan["step"]
    out = torch.empty((2 * num_layers, n_chunks, n_heads), dtype=torch.int64, device=dev)
    chunk = plan["planes_per_batch"]
    for p0 in range(0, 2 * num_layers, chunk):
        n = min(chunk, 2 * num_layers - p0)
        planes = torch.as_strided(flat, (n, *size), (step, *strides), bases[p0])
        cells = planes.index_select(1, ids).reshape(n, -1, n_heads, row_bytes)[:, :num_tokens]
        p = torch.arange(p0, p0 + n, dtype=torch.int64, device=dev)
        kind = _KIND_KEY + p // num_layers  # planes [0, L) keys, [L, 2L) values (_KIND_VALUE)
        layer = layout.layer_start + p % num_layers
        keys = _keys(kind, layer, heads, tokens)
        hashes = cell_hashes(cells, keys)  # [planes, tokens, heads]
        if n_chunks == 1:
            out[p0 : p0 + n, 0] = hashes.sum(dim=1)
        else:  # zero-padded to whole chunks (a zero adds nothing to a sum)
            padded = torch.zeros((n, n_chunks * per_chunk, n_heads), dtype=torch.int64, device=dev)
            padded[:, :num_tokens] = hashes
            out[p0 : p0 + n] = padded.view(n, n_chunks, per_chunk, n_heads).sum(dim=2)
    entries = out.view(2, num_layers, n_chunks, n_heads).permute(2, 0, 1, 3).contiguous()
    return entries if chunk_tokens is not None else entries[0]


# -- SSM ----------------------------------------------------------------------------------------


def _ssm_cells(
    flat: torch.Tensor, offsets: list[int], part: Mapping[str, Any], step: int | None
) -> torch.Tensor:
    """Units ``[layers, num_units, unit_bytes]`` of one slot in every local SSM layer (at
    ``offsets``), as bytes: one strided view when the layers are equally spaced (``step``: one
    ``[L, slots, ...]`` tensor, one batch of kernels after), else the layers stacked."""
    size = (int(part["num_units"]), int(part["unit_bytes"]))
    strides = (int(part["unit_stride"]), 1)
    num_layers = len(offsets)
    if step is not None:
        return torch.as_strided(flat, (num_layers, *size), (step, *strides), offsets[0])
    return torch.stack([torch.as_strided(flat, size, strides, o) for o in offsets[:num_layers]])


def _slot_cells(
    buffer: torch.Tensor,
    geometry: Any,
    layout: SSMShardLayout,
    slot: int,
    part_name: str,
    units: tuple[str, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SSM slot's ``part_name`` state on one rank: its cells (see :func:`_ssm_cells`), the
    global layer numbers and the zero token key (SSM state has no token axis). ``units``: the
    unit axis's name and end, checked against the position key."""
    part = _geometry_dict(geometry)[part_name]
    flat, base = _byte_view(buffer)
    offsets = [int(b) - base + slot * int(part["slot_stride"]) for b in part["layer_bases"]]
    offsets = offsets[: layout.num_local_layers]
    # The slot and key ranges checked, and the layers' spacing found, in Rust.
    facts = {"slot": slot, "num_slots": int(part["num_slots"]), "layer_end": layout.layer_end}
    plan = digest_plan(
        "ssm", {**facts, "unit_name": units[0], "unit_end": units[1], "layer_offsets": offsets}
    )
    dev = buffer.device
    layers = torch.arange(layout.layer_start, layout.layer_end, dtype=torch.int64, device=dev)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    return _ssm_cells(flat, offsets, part, plan["step"]), layers, zero


def conv_pieces(
    buffer: torch.Tensor, geometry: Any, layout: SSMShardLayout, slot: int
) -> list[IntegrityPiece]:
    """Entries of one SSM slot's conv state on one rank, one piece per band (x, B, C)."""
    dims = layout.dims
    unit_end = ("unit", dims.num_heads + 2 * dims.n_groups)
    all_layers, layers, zero = _slot_cells(buffer, geometry, layout, slot, "conv", unit_end)
    dev = buffer.device
    pieces = []
    for band, (u_lo, u_hi), (c_lo, c_hi) in integrity_conv_bands(layout):
        units = torch.arange(u_lo, u_hi, dtype=torch.int64, device=dev)
        cells = all_layers[:, c_lo:c_hi].reshape(layers.numel(), u_hi - u_lo, -1)
        entries = cell_hashes(cells, _keys(_KIND_CONV, layers, units, zero)[:, 0])
        pieces.append(IntegrityPiece("conv", layout.layer_start, u_lo, _u64(entries), band=band))
    return pieces


def recurrent_pieces(
    buffer: torch.Tensor, geometry: Any, layout: SSMShardLayout, slot: int
) -> list[IntegrityPiece]:
    """Entries of one SSM slot's recurrent state on one rank (one piece)."""
    h_lo, h_hi = layout.heads
    cells, layers, zero = _slot_cells(buffer, geometry, layout, slot, "recurrent", ("head", h_hi))
    heads = torch.arange(h_lo, h_hi, dtype=torch.int64, device=buffer.device)
    keys = _keys(_KIND_RECURRENT, layers, heads, zero)[:, 0]
    entries = cell_hashes(cells.contiguous(), keys)
    return [IntegrityPiece("recurrent", layout.layer_start, h_lo, _u64(entries))]


def kv_pieces(
    buffer: torch.Tensor,
    geometry: Any,
    layout: KVShardLayout,
    block_ids: Sequence[int] | npt.NDArray[Any] | torch.Tensor,
    num_tokens: int,
    chunk_tokens: int | None = None,
) -> list[IntegrityPiece]:
    """:func:`kv_entries` as a table piece ``[chunks, 2, layers, heads]`` (one chunk without
    ``chunk_tokens``), copied to host: a few bytes per chunk, layer and head."""
    table = kv_entries(buffer, geometry, layout, block_ids, num_tokens, chunk_tokens or None)
    entries = _u64(table).reshape(-1, *table.shape[-3:])  # one chunk: [1, 2, layers, heads]
    return [IntegrityPiece("kv", layout.layer_start, layout.head_start, entries)]


# -- tables ---------------------------------------------------------------------------------

#: At most this many KV chunks per ticket (8 bytes per chunk, layer and KV head).
MAX_CHUNKS = 8
#: Smallest KV chunk: a decode reuses its prefix cache in whole chunks only.
MIN_CHUNK_TOKENS = 64


def chunk_tokens_for(num_tokens: int) -> int:
    """The KV chunk size for a prompt: a power of two, at least :data:`MIN_CHUNK_TOKENS`,
    so that at most :data:`MAX_CHUNKS` chunks cover it (powers of two align with the usual
    block sizes, so a decode's prefix reuse loses at most one chunk)."""
    need = max(1, -(-num_tokens // MAX_CHUNKS))
    return max(MIN_CHUNK_TOKENS, 1 << (need - 1).bit_length())


@dataclass(frozen=True)
class IntegrityPiece:
    """Entries one rank computed: a dense block of a table starting at global ``(layer,
    unit)``; ``entries`` is ``[chunks, 2, layers, units]`` for ``kv`` and ``[layers, units]``
    for ``conv``/``recurrent`` (``unit`` = KV head, conv band unit or SSM head)."""

    table: TableName
    layer_start: int
    unit_start: int
    entries: npt.NDArray[np.uint64]
    band: str | None = None
    """Conv band (``x``, ``B`` or ``C``) the units belong to (for messages only)."""

    def index(self) -> tuple[slice, ...]:
        """Where the piece sits in its full table."""
        n_layers, n_units = self.entries.shape[-2:]
        cells = (
            slice(self.layer_start, self.layer_start + n_layers),
            slice(self.unit_start, self.unit_start + n_units),
        )
        return (slice(None), slice(None), *cells) if self.table == "kv" else cells


@dataclass(frozen=True)
class IntegrityMismatch:
    """The first cell whose entry differs (``kv`` is ``"K"``/``"V"`` for KV cells)."""

    table: TableName
    layer: int
    unit: int
    expected: int
    got: int
    kv: str | None = None
    band: str | None = None
    tokens: tuple[int, int] | None = None
    """The KV chunk's token range ``[lo, hi)``."""

    def describe(self) -> str:
        """A one-line description naming the cell and both values."""
        return integrity_mismatch_text(**asdict(self))  # the fields are its parameters


@dataclass
class IntegrityTable:
    """The full digest of one handoff: per table, a ``uint64`` array of entries.

    Wire form (the ticket's ``"integrity"`` key): ``{name: {"shape": [...], "data": bytes}}``
    with little-endian ``uint64`` data, msgpack- and pickle-safe.
    """

    tables: dict[str, npt.NDArray[np.uint64]]
    chunk_tokens: int | None = None
    """Tokens per KV chunk (the last may be shorter); None: one chunk of the whole prompt."""

    @staticmethod
    def shapes(
        kv_layout: KVShardLayout | None, ssm_layout: SSMShardLayout | None, num_chunks: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """Table shapes of a model given any rank's layouts (and the KV chunk count)."""
        # In Rust (LayoutError naming total_layers when an SSM layout lacks it).
        return {n: tuple(s) for n, s in integrity_shapes(kv_layout, ssm_layout, num_chunks)}

    @classmethod
    def merge(
        cls, shapes: Mapping[str, tuple[int, ...]], pieces: Sequence[IntegrityPiece]
    ) -> IntegrityTable:
        """Assemble the full tables from every rank's pieces (the first holder of a cell
        wins: replicas hold identical values). Raises if a cell has no holder."""
        # Placement, first-holder-wins and the every-cell-held check, in Rust (ArgumentError).
        flat = integrity_merge([(n, list(s)) for n, s in shapes.items()], _piece_args(pieces))
        return cls({n: t.reshape(s) for (n, s), t in zip(shapes.items(), flat, strict=True)})

    def to_wire(self) -> dict[str, Any]:
        """The compact, msgpack-able form carried in the ticket."""
        wire: dict[str, Any] = {
            n: {"shape": list(t.shape), "data": t.astype("<u8").tobytes()}
            for n, t in self.tables.items()
        }
        if self.chunk_tokens is not None:
            wire["chunk_tokens"] = self.chunk_tokens
        return wire

    @staticmethod
    def wire_chunk_tokens(wire: Any) -> int | None:
        """The ``chunk_tokens`` of a ticket's table (None when absent); MetadataError if bad."""
        return check_integrity_wire(wire)

    @classmethod
    def from_wire(cls, wire: Any, shapes: Mapping[str, tuple[int, ...]]) -> IntegrityTable:
        """Decode and check a ticket's ``"integrity"`` value against this model's ``shapes``;
        raises :class:`~disagg_rs.exceptions.MetadataError` naming the bad field."""
        # Every table's presence, shape and byte length, and chunk_tokens, in Rust.
        chunk = check_integrity_wire(wire, [(n, list(s)) for n, s in shapes.items()])
        tables = {
            name: np.frombuffer(bytes(wire[name]["data"]), dtype="<u8")
            .astype(np.uint64)
            .reshape(shape)
            for name, shape in shapes.items()
        }
        return cls(tables, chunk)

    def first_mismatch(
        self, pieces: Sequence[IntegrityPiece], first_chunk: int = 0
    ) -> IntegrityMismatch | None:
        """The first cell of ``pieces`` (this rank's entries) whose entry differs; KV chunks
        before ``first_chunk`` (a prefix the decode reused from its own cache, not moved) are
        not compared."""
        names = list(self.tables)
        found = integrity_first_mismatch(
            [(n, list(t.shape)) for n, t in self.tables.items()],
            [self.tables[n] for n in names],
            _piece_args(pieces),
            first_chunk,
            self.chunk_tokens,
        )
        if found is None:
            return None
        i, _, layer, unit, expected, got, kv, tokens = found
        piece = pieces[i]
        return IntegrityMismatch(
            piece.table, layer, unit, expected, got, kv=kv, band=piece.band, tokens=tokens
        )


def _piece_args(pieces: Sequence[IntegrityPiece]) -> list[tuple[str, int, int, Any]]:
    """The pieces as the core reads them: table, first layer, first unit, ``uint64`` entries."""
    return [
        (p.table, p.layer_start, p.unit_start, np.ascontiguousarray(p.entries, dtype=np.uint64))
        for p in pieces
    ]
