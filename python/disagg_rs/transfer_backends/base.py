"""What the NIXL and torch.distributed backends share: metadata, validation, handles.

A backend wraps ONE state buffer of one rank: the paged KV cache, or an SSM conv or recurrent
state buffer. ``export_meta()`` describes it in a plain dict (msgpack- and JSON-safe) that the
control plane ships to peers once; a pull or push names the peer metadata and the block ids,
the Rust descriptor compiler turns them into a transfer program, and the backend posts it.

Metadata schema (``FORMAT_VERSION`` 1), every field required:

==================  =========================================================================
``version``         wire format version; a peer with another version is rejected
``backend``         ``"nixl"`` or ``"nccl"``
``agent_name``      the rank's transport agent name (NIXL agent; informative for NCCL)
``incarnation``     epoch of the exporting process; a new value means the peer restarted
``compat_hash``     hash of the model-level facts both sides must share (dtype, head_dim, ...)
``state_kind``      ``"kv"``, ``"conv"`` or ``"recurrent"``
``layout``          ``KVShardLayout.to_dict()`` or ``SSMShardLayout.to_dict()``
``num_blocks``      blocks (KV) or slots (SSM) in the buffer; ids are in ``[0, num_blocks)``
``tokens_per_block`` tokens per KV block (``None`` for SSM state)
``head_dim``        KV head dim (SSM: the state's head dim)
``dtype``           torch dtype name of the buffer
``buffer``          the buffer's memory: ``addr``, ``nbytes``, ``device_id``, ``mem_type``,
                    ``shape``, ``strides`` (elements), ``element_size``, ``axes``
``geometry``        the descriptor compiler's geometry dict (``None`` when not available)
==================  =========================================================================

Backends add their own fields (NIXL: ``agent_metadata``, ``staging``; NCCL: ``dist_rank``).
Beside them every export carries the reference design's fields (Megatron-LM's
disaggregation package: ``base_addr``, ``outer_stride_bytes``, ``num_outer``,
``bytes_per_slice``, ``blocks_axis``, ``element_size``, ``heads_per_partition``, the KV layout
fields ``global_rank`` ... ``layer_end``, ``ssm_layout``; NIXL ``agent_metadata_b64``; NCCL
``transport``, ``nccl_rank``), and a peer dict without ``version`` is read from those alone.
All ranges are half-open ``[lo, hi)``.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs import _core
from disagg_rs.exceptions import (
    TransferStartError,
)
from disagg_rs.transfer_backends import staging

__all__ = [
    "BACKENDS",
    "FORMAT_VERSION",
    "KV_AXES",
    "SSM_AXES",
    "BlockIds",
    "BufferGeometry",
    "Clock",
    "KVTransportBackend",
    "PeerMeta",
    "ProgramCompiler",
    "StateKind",
    "TransferBackendBase",
    "TransferHandleBase",
    "TransferProgramLike",
    "TransferStartError",
    "compute_buffer_geometry",
    "construct_kv_transfer_backend_class",
    "export_geometry_meta",
    "reference_layout_fields",
    "rust_program_compiler",
    "transfer_peer_records",
]

#: Version of the metadata schema above; bump on any incompatible change.
FORMAT_VERSION = 1

#: Default axis order of a KV buffer: Megatron's ``[2, L, B, T, H, d]``.
KV_AXES = "kv layer block token head dim"

#: Axis order of the SSM buffers: conv ``[L, slots, C, d_conv]``, recurrent ``[L, slots, H, p, n]``.
SSM_AXES: dict[str, str] = {"conv": "layer slot channel conv", "recurrent": "layer slot head p n"}

#: Peer metadata as produced by ``export_meta()``.
PeerMeta: TypeAlias = Mapping[str, Any]
#: An integer array of block ids.
_IdArray: TypeAlias = "npt.NDArray[np.integer[Any]]"
#: Block ids: one list (or array) for every source rank, or ``{source global_rank: list}``.
BlockIds: TypeAlias = "Sequence[int] | _IdArray | Mapping[int, Sequence[int] | _IdArray]"
#: Which state a buffer holds.
StateKind: TypeAlias = Literal["kv", "conv", "recurrent"]
#: Monotonic seconds; injected so tests drive deadlines with a virtual clock.
Clock: TypeAlias = Callable[[], float]

_U64 = npt.NDArray[np.uint64]


class TransferProgramLike(Protocol):
    """The compiler's ``TransferProgram`` as the backends use it (one destination rank)."""

    @property
    def stats(self) -> dict[str, Any]:
        """Totals of the program (bytes, descriptors, fragments, per-source modes)."""
        ...

    @property
    def src_ranks(self) -> list[int]:
        """Source global ranks this destination reads from, in plan order."""

    def mode(self, src_rank: int) -> Literal["direct", "staged"]:
        """How the bytes from ``src_rank`` move."""

    def direct_descriptors(self, src_rank: int) -> tuple[_U64, _U64]:
        """``N x 3`` ``(addr, len, device_id)`` rows for source and destination, whatever the
        source's mode (a staged source can always be read directly instead)."""

    def gather(self, src_rank: int) -> _U64:
        """``M x 3`` ``(src_addr, len, packed_offset)`` rows (canonical packed order)."""

    def scatter(self, src_rank: int) -> _U64:
        """``M x 3`` ``(packed_offset, dst_addr, len)`` rows."""

    def packed_bytes(self, src_rank: int) -> int:
        """Size of the packed region from ``src_rank``."""


#: Turns peer metadata and block ids into a transfer program for one destination rank:
#: ``(srcs, dst, src_block_ids, dst_block_ids, num_tokens, mode)``, as
#: ``rust_program_compiler``. ``dst_block_ids`` is ``None`` on the source side of a staged or
#: two-sided transfer: the gather list and packed offsets must not depend on it.
ProgramCompiler: TypeAlias = Callable[
    [Sequence[PeerMeta], PeerMeta, BlockIds, "BlockIds | None", "int | None", str],
    TransferProgramLike,
]


def rust_program_compiler(
    srcs: Sequence[PeerMeta],
    dst: PeerMeta,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds | None,
    num_tokens: int | None,
    mode: str,
) -> TransferProgramLike:
    """The default compiler: the Rust descriptor compiler over the peers' layouts and
    geometries, each metadata dict parsed in Rust (a backend plans from its ``PeerTable``
    instead, parsing each peer once). SSM handoffs move one slot."""
    extras = {"agent_metadata": "", "staging": None, "dist_rank": 0}
    backend = str(dst.get("backend", "nixl"))
    peers = [_core.parse_peer_meta({**extras, **m}, backend) for m in (*srcs, dst)]
    program: TransferProgramLike = _core.compile_peer_transfer(
        peers[:-1], peers[-1], src_block_ids, dst_block_ids, num_tokens, mode
    )
    return program


def incarnation_of(incarnation: int | None) -> int:
    """A buffer's incarnation: the one given, else now in nanoseconds (a restarted process
    registers under a new one)."""
    return int(incarnation if incarnation is not None else time.time_ns())


def no_blocks(*block_ids: Any) -> bool:
    """Whether every given block id list is empty (a handoff with nothing left to move, e.g.
    a prompt whole in the decode's prefix cache): the reference design's no-op transfer.
    ``None`` is skipped; a ``{rank: ids}`` map counts each list. Decided in Rust."""
    empty: bool = _core.no_blocks(*block_ids)
    return empty


def _mem_type(tensor: torch.Tensor) -> Literal["DRAM", "VRAM"]:
    return "VRAM" if tensor.is_cuda else "DRAM"


def _buffer_info(
    tensor: torch.Tensor, axes: str, tensors: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """Plain description of a registered buffer (the part of the metadata every peer reads):
    ``tensor``'s fields plus ``regions``, ``[addr, nbytes]`` of every registered tensor
    (``tensors``, one per layer or per K/V plane, or ``tensor`` alone)."""
    regions = [[int(t.data_ptr()), int(t.numel() * t.element_size())] for t in tensors]
    return {
        "regions": regions,
        "addr": int(tensor.data_ptr()),
        "nbytes": int(tensor.numel() * tensor.element_size()),
        "device_id": int(tensor.device.index or 0) if tensor.is_cuda else 0,
        "mem_type": _mem_type(tensor),
        "shape": [int(s) for s in tensor.shape],
        "strides": [int(s) for s in tensor.stride()],
        "element_size": int(tensor.element_size()),
        "axes": axes,
    }


def check_meta_fields(meta: Any, backend: str) -> PeerMeta:
    """Reject metadata that is not a dict of this schema (missing or mistyped field, version,
    backend, size caps): ``MetadataError`` naming the field. Parsed in Rust."""
    _core.parse_peer_meta(meta, backend)
    return meta  # type: ignore[no-any-return]


# -- the reference design's registry, geometry and peer wrappers ------------------------------

#: The reference design's name for "a transfer backend class" (its registry's return type).
KVTransportBackend: TypeAlias = "type[TransferBackendBase]"

#: Backend name -> (module, class) of the explicit registry.
BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("disagg_rs.transfer_backends.nixl", "NixlTransferBackend"),
    "nccl": ("disagg_rs.transfer_backends.nccl", "NcclTransferBackend"),
}


def construct_kv_transfer_backend_class(name: str) -> type[TransferBackendBase]:
    """Return the backend class registered as ``name`` (``"nixl"`` or ``"nccl"``, any case).

    Selection is explicit (the launcher names the backend); modules import lazily, so
    ``import disagg_rs`` never imports NIXL or touches a process group.
    """
    key = str(name).lower().replace("_", "-")
    if key not in BACKENDS:
        raise ValueError(
            f"unknown transfer backend {name!r}; expected 'nixl' or 'nccl' (known: "
            f"{sorted(BACKENDS)})"
        )
    module_name, class_name = BACKENDS[key]
    cls: type[TransferBackendBase] = getattr(importlib.import_module(module_name), class_name)
    return cls


@dataclass
class BufferGeometry:
    """A registered buffer as the reference design describes it: ``[outer..., B, inner...]``.

    Each ``(outer, block)`` pair is one contiguous slice of ``bytes_per_slice`` bytes; the
    outer stride skips the whole block pool. ``layout`` is the KV layout when the buffer is
    a KV cache with a full layout (``None`` otherwise). The descriptor compiler's geometry
    (``KVGeometry`` / ``SSMGeometry``) is the richer description the transfers use; this one
    is exported alongside it so reference-design peers can read our metadata.
    """

    buf_ptr: int
    element_size: int
    device_id: int
    blocks_axis: int
    num_blocks: int
    num_outer: int
    bytes_per_slice: int
    outer_stride_bytes: int
    heads_per_partition: int | None
    head_dim: int | None
    tokens_per_block: int | None
    layout: _core.KVShardLayout | None


def compute_buffer_geometry(
    memory_buffer: torch.Tensor,
    expected_num_blocks: int,
    *,
    backend_name: str,
    ssm_layout: _core.SSMShardLayout | None = None,
    ssm_state_kind: str | None = None,
    blocks_axis: int | None = None,
    **layout: int | None,
) -> BufferGeometry:
    """Locate the blocks axis of ``memory_buffer`` and derive its slice strides.

    ``layout``: the reference design's layout keywords (``tp_size``,
    ``tp_rank``, ``num_kv_heads_global``, ``heads_per_partition``, ``head_dim``,
    ``tokens_per_block``, ``global_rank``, ``pp_size``, ``pp_rank``, ``num_layers_global``,
    ``layer_start``, ``layer_end``; ``ArgumentError`` names any other). ``blocks_axis`` (an
    extension) names the axis; without it the one axis whose size is ``expected_num_blocks``
    is the blocks axis (SSM state: axis 1, the slot axis), as in the reference design. With
    every KV layout field given, the KV layout is built and checked against the buffer
    (``[2, L, B, T, H, d]``). Raises ``LayoutError`` / ``GeometryMismatchError`` (both
    ``ValueError``) naming the field.
    """
    fields = _core.plan_buffer(
        memory_buffer,
        None,
        ssm_layout,
        backend=backend_name,
        contiguous=True,
        expected_num_blocks=expected_num_blocks,
        ssm_state_kind=ssm_state_kind,
        axes=None,
        blocks_axis=blocks_axis,
        reference_only=True,
        **layout,
    )
    return BufferGeometry(**fields)


#: ``TransferBackendBase.__init__``'s keywords among a backend constructor's arguments: its
#: own and the reference design's layout keywords (alphabetical).
_BASE_ARGUMENTS = frozenset(
    {
        "agent_name",
        "axes",
        "clock",
        "compiler",
        "expected_num_blocks",
        "global_rank",
        "head_dim",
        "heads_per_partition",
        "incarnation",
        "layer_end",
        "layer_start",
        "memory_buffer",
        "num_kv_heads_global",
        "num_layers_global",
        "pp_rank",
        "pp_size",
        "ssm_layout",
        "ssm_state_kind",
        "timeout_s",
        "tokens_per_block",
        "tp_rank",
        "tp_size",
    }
)


#: The reference design's KV layout fields in peer metadata.
REFERENCE_LAYOUT_FIELDS = tuple(_core.REFERENCE_LAYOUT_FIELDS)

#: The reference design's address fields every exported buffer carries.
REFERENCE_ADDRESS_FIELDS = tuple(_core.REFERENCE_ADDRESS_FIELDS)


def reference_layout_fields(layout: _core.KVShardLayout) -> dict[str, Any]:
    """``layout`` in the reference design's KV layout fields (``REFERENCE_LAYOUT_FIELDS``), as
    its metadata carries them and its backend constructors take them."""
    return {
        "global_rank": layout.global_rank,
        "tp_size": layout.tp_size,
        "tp_rank": layout.tp_rank,
        "pp_size": layout.pp_size,
        "pp_rank": layout.pp_rank,
        "num_layers_global": layout.num_layers,
        "num_kv_heads_global": layout.num_kv_heads,
        "layer_start": layout.layer_start,
        "layer_end": layout.layer_end,
    }


def kv_layout_from_meta(meta: Mapping[str, Any]) -> _core.KVShardLayout:
    """Rebuild a peer's ``KVShardLayout`` from the reference design's metadata fields.

    Raises ``MetadataError`` naming the missing fields, ``LayoutError`` on invalid values.
    """
    layout: _core.KVShardLayout = _core.kv_layout_from_reference(meta)
    return layout


def _ssm_reference_dict(layout: _core.SSMShardLayout) -> dict[str, Any]:
    """An SSM layout in the reference design's field names (``num_layers`` = local layers)."""
    dims = layout.dims
    return {
        "global_rank": layout.global_rank,
        "tp_size": layout.tp_size,
        "tp_rank": layout.tp_rank,
        "layer_start": layout.layer_start,
        "num_layers": layout.num_local_layers,
        "dims": {
            "nheads": dims.num_heads,
            "headdim": dims.head_dim,
            "d_state": dims.d_state,
            "ngroups": dims.n_groups,
            "d_conv": dims.d_conv,
        },
    }


def export_geometry_meta(
    geometry: BufferGeometry, ssm_layout: _core.SSMShardLayout | None = None
) -> dict[str, Any]:
    """The reference design's metadata fields of one buffer (plain ints, msgpack-safe).

    Every backend's ``export_meta()`` carries them beside its own schema.
    """
    meta: dict[str, Any] = {
        "base_addr": geometry.buf_ptr,
        "outer_stride_bytes": geometry.outer_stride_bytes,
        "device_id": geometry.device_id,
        "num_outer": geometry.num_outer,
        "bytes_per_slice": geometry.bytes_per_slice,
        "blocks_axis": geometry.blocks_axis,
        "num_blocks": geometry.num_blocks,
        "heads_per_partition": geometry.heads_per_partition,
        "head_dim": geometry.head_dim,
        "tokens_per_block": geometry.tokens_per_block,
        "element_size": geometry.element_size,
    }
    if geometry.layout is not None:
        meta.update(reference_layout_fields(geometry.layout))
    if ssm_layout is not None:
        meta["ssm_layout"] = _ssm_reference_dict(ssm_layout)
    return meta


def transfer_peer_records(
    peer_meta: Any, src_block_ids: Any
) -> list[tuple[Mapping[str, Any], Any]]:
    """Unwrap peer metadata into ``(meta, source block ids)`` records, one per source rank.

    Accepts what the reference design's hand-off carries: one metadata dict, a list of them,
    ``{"tp_metas": [...]}`` and ``{"pp_metas": [{"tp_metas": [...], "block_ids": [...]},
    ...]}`` (each pipeline stage with its own block ids). A metadata dict with its own
    ``block_ids`` uses those; the others use ``src_block_ids`` (as given). Unwrapped in Rust;
    ``MetadataError`` names ``peer_meta`` or ``pp_metas`` for an entry that is not a dict.
    """
    records: list[tuple[Mapping[str, Any], Any]] = _core.backend_peer_records(
        peer_meta, src_block_ids
    )
    return records


def _sibling_meta(me: PeerMeta, layout: _core.KVShardLayout | _core.SSMShardLayout) -> PeerMeta:
    """A model-parallel sibling's metadata derived from this rank's ``me``: its layout, and
    an agent name of its own."""
    name = f"{me['agent_name']}/{layout.pp_rank}.{layout.tp_rank}"
    return {**me, "layout": dict(layout.to_dict()), "agent_name": name}


class TransferBackendBase:
    """State shared by both backends: the rank's buffer, its layout and its metadata.

    Constructor parameters are the reference design's, the KV layout fields (``tp_size``,
    ``tp_rank``, ... ``layer_end``) by name in ``layout``: each backend's constructor lists
    them in the reference order. Omitted layout fields are derived from the buffer's shape
    (TP1, PP1 defaults).
    """

    #: Backend name used in metadata and by ``construct_kv_transfer_backend_class``.
    name: str = "base"
    # The reference design's address fields under its private names (set from ``_geometry``).
    _buf_ptr: int
    _device_id: int
    _bytes_per_slice: int
    _outer_stride_bytes: int

    def __init__(
        self,
        agent_name: str,
        memory_buffer: torch.Tensor | Sequence[Any],
        expected_num_blocks: int,
        ssm_layout: _core.SSMShardLayout | None = None,
        ssm_state_kind: str | None = None,
        *,
        axes: str | None = None,
        compiler: ProgramCompiler | None = None,
        timeout_s: float = 30.0,
        incarnation: int | None = None,
        clock: Clock = time.monotonic,
        **layout: int | None,
    ) -> None:
        #: Every registered tensor: the buffer, or the per-layer tensors (K and V of a layer
        #: as given), each one region of the exported ``buffer.regions``. ``layers``: the
        #: per-layer items of a list argument (``None`` for one tensor); checked in Rust.
        self.region_tensors: list[torch.Tensor]
        self.region_tensors, layers = _core.buffer_tensors(memory_buffer)
        memory_buffer = self.region_tensors[0]
        self.agent_name = agent_name
        self.memory_buffer = memory_buffer
        self.expected_num_blocks = int(expected_num_blocks)
        self.timeout_s = float(timeout_s)
        self.compiler: ProgramCompiler = compiler or rust_program_compiler
        self.clock = clock
        self.incarnation = incarnation_of(incarnation)
        # Kind, axes, layout and both geometries, inferred and checked in Rust.
        plan = _core.plan_buffer(
            memory_buffer,
            layers,
            ssm_layout,
            backend=type(self).__name__,
            contiguous=all(t.is_contiguous() for t in self.region_tensors),
            expected_num_blocks=self.expected_num_blocks,
            ssm_state_kind=ssm_state_kind,
            axes=axes,
            reference_only=False,
            **layout,
        )
        self.state_kind: StateKind = plan["state_kind"]
        self.axes: str = plan["axes"]
        self.layout: _core.KVShardLayout | _core.SSMShardLayout = plan["layout"]
        self.head_dim: int = plan["head_dim"]
        self.tokens_per_block: int | None = plan["tokens_per_block"]
        self.buffer_info = _buffer_info(memory_buffer, self.axes, self.region_tensors)
        #: The reference design's description of the same buffer (exported beside ours).
        self._geometry = BufferGeometry(**plan["reference"])
        #: The descriptor compiler's geometry dict.
        self.geometry: dict[str, Any] | None = plan["geometry"]
        # The reference design's private attribute names, for code written against it: each
        # ``BufferGeometry`` field as ``_<field>`` (``_buf_ptr`` ... ``_layout``).
        vars(self).update({f"_{name}": value for name, value in vars(self._geometry).items()})
        self._memory_buffer = memory_buffer
        self._ssm_layout = ssm_layout
        self._ssm_state_kind = ssm_state_kind

    # -- construction helpers ------------------------------------------------------------

    @staticmethod
    def _base_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
        """This class's constructor keywords picked from a backend constructor's arguments
        (its ``locals()``): each backend's constructor keeps the reference design's signature
        and forwards it whole, in one place."""
        return {key: arguments[key] for key in _BASE_ARGUMENTS}

    def _reference_fields(self) -> dict[str, Any]:
        """The reference design's metadata fields of this buffer (plus ``dtype``)."""
        meta = export_geometry_meta(
            self._geometry, self.layout if isinstance(self.layout, _core.SSMShardLayout) else None
        )
        meta["dtype"] = str(self.memory_buffer.dtype)
        return meta

    # -- pack and scatter over the registered tensors -----------------------------------

    def pack_rows(self, rows: _U64, out: torch.Tensor) -> None:
        """Gather rows ``(src_addr, len, packed_offset)`` of this rank's registered tensors
        into ``out`` (packed offset 0 at its byte 0). The rows are grouped by the region
        they lie in, in Rust, which checks every byte; one pack per region that has rows."""
        for i, part in _core.rows_by_region(rows, "gather", self.buffer_info["regions"]):
            t = self.region_tensors[i]
            staging.pack(t, int(t.data_ptr()), part, out)

    def scatter_rows(self, packed: torch.Tensor, rows: _U64) -> None:
        """Scatter ``packed`` into this rank's registered tensors as rows ``(packed_offset,
        dst_addr, len)`` say (grouped by region as in ``pack_rows``)."""
        for i, part in _core.rows_by_region(rows, "scatter", self.buffer_info["regions"]):
            t = self.region_tensors[i]
            staging.scatter(packed, t, int(t.data_ptr()), part)

    # -- metadata ------------------------------------------------------------------------

    def _compat_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "version": FORMAT_VERSION,
            "state_kind": self.state_kind,
            "dtype": str(self.memory_buffer.dtype),
            "head_dim": self.head_dim,
            "num_layers": self.layout.num_layers,
        }
        if isinstance(self.layout, _core.SSMShardLayout):
            # An SSM layout's num_layers counts its stage's layers; the model's is total_layers.
            facts["num_layers"] = self.layout.total_layers
            facts["dims"] = self.layout.dims.to_dict()
        else:
            facts["num_kv_heads"] = self.layout.num_kv_heads
        return facts

    def _base_meta(self) -> dict[str, Any]:
        # The reference design's fields first; ours (same meaning where names coincide) win.
        return self._reference_fields() | {
            "version": FORMAT_VERSION,
            "backend": self.name,
            "agent_name": self.agent_name,
            "incarnation": self.incarnation,
            "compat_hash": _core.compat_hash(self._compat_facts()),
            "state_kind": self.state_kind,
            "layout": dict(self.layout.to_dict()),
            "num_blocks": self.expected_num_blocks,
            "tokens_per_block": self.tokens_per_block,
            "head_dim": self.head_dim,
            "dtype": str(self.memory_buffer.dtype),
            "buffer": dict(self.buffer_info),
            "geometry": self.geometry,
        }

    def export_meta(self) -> dict[str, Any]:
        """Plain metadata for peers (see the module docstring for the schema)."""
        return self._base_meta()

    # -- validation ----------------------------------------------------------------------

    def _group_metas(self) -> list[PeerMeta]:
        """This rank's metadata and its model-parallel siblings' (every TP rank of every PP
        stage), for a source that must plan without the other sources' metadata.

        The reference design's push names only the decode ranks; the plan still needs every
        source so that each destination cell has exactly one sender. Siblings are numbered
        the Megatron way (TP fastest, then PP, from this group's first global rank) and share
        this rank's geometry; where that cannot hold (an explicit, uneven layer window or
        unequal shards), ``MetadataError`` asks for ``src_metas``.
        """
        me = self._base_meta()
        # The siblings' layouts (``None``: this rank), inferred and checked in Rust.
        siblings = _core.group_layouts(self.layout)
        return [me if sib is None else _sibling_meta(me, sib) for sib in siblings]

    @functools.cached_property
    def _group_peers(self) -> list[Any]:
        """The parsed peers of ``_group_metas``, once (this rank's layout does not change)."""
        return [self._as_peer(m) for m in self._group_metas()]

    def _timeout(self, timeout_s: float | None) -> float:
        """A call's time limit: ``timeout_s``, else the backend's ``timeout_s``."""
        return self.timeout_s if timeout_s is None else timeout_s

    def _resolve_peers(
        self, peer_meta: Any, src_block_ids: BlockIds | None
    ) -> tuple[list[Any], BlockIds | None]:
        """Unwrap the peers' metadata into parsed ``Peer`` objects (``_adopt_peer``); return
        them with the source block ids.

        ``peer_meta``: one metadata dict, a list, ``{"tp_metas": [...]}`` or
        ``{"pp_metas": [...]}`` (``transfer_peer_records``); each dict in this library's
        schema or in the reference design's fields only. Where a wrapper or a dict carries
        its own ``block_ids``, the returned ids are ``{global_rank: ids}``.
        """
        resolved: tuple[list[Any], BlockIds | None] = self._peers.resolve(peer_meta, src_block_ids)
        return resolved

    @functools.cached_property
    def _peers(self) -> Any:
        """This backend's ``PeerResolver`` over its ``PeerTable``: every peer parsed once,
        checked against this rank's model-level facts, found again by content;
        reference-only dicts translated first."""
        facts = self._compat_facts()
        table = _core.PeerTable(
            self.name,
            state_kind=self.state_kind,
            dtype=facts["dtype"],
            head_dim=self.head_dim,
            num_layers=dict(self.layout.to_dict()).get("num_layers"),
            compat_hash=_core.compat_hash(facts),
        )
        size = int(self.memory_buffer.element_size())
        return _core.PeerResolver(table, self.name, self.state_kind, size, facts["dtype"])

    def _peer_table(self) -> Any:
        """This backend's ``PeerTable``."""
        return self._peers.table

    def _adopt_peer(self, meta: Any) -> Any:
        """The parsed ``Peer`` of one metadata dict: a table lookup when seen before, else
        parsed once (the reference design's fields translated first). A dict's own
        ``block_ids`` (per handoff) are not part of the peer."""
        return self._peers.adopt(meta)

    def register_peers(self, peer_meta: Any) -> int:
        """Parse and check peers' metadata now (when the control plane announces them:
        REGISTER/PEERS), so handoffs naming them only look them up. ``peer_meta`` as for a
        pull (this rank's own metadata, which plans read too, is parsed with them); returns
        how many peer buffers were named."""
        _ = self._own_peer  # this rank's own peer, parsed here once: handoffs pass it on
        return len(self._resolve_peers(peer_meta, None)[0])

    def retain_peers(self, peer_meta: Sequence[Mapping[str, Any]]) -> list[str]:
        """Forget the transport's registrations of peers that ``peer_meta`` (every peer
        buffer the control plane's peer table names now) no longer names, or names with
        another incarnation; return their names. This backend keeps none: nothing."""
        del peer_meta
        return []

    def _adopt_peer_meta(self, meta: Mapping[str, Any]) -> PeerMeta:
        """One peer's metadata, checked, in this library's schema."""
        return self._adopt_peer(meta).meta  # type: ignore[no-any-return]

    @functools.cached_property
    def _own_peer(self) -> Any:
        """This rank's own parsed ``Peer``, once (its metadata does not change while it
        lives): the destination side of ``Peer.split_descriptors``."""
        return self._as_peer(self._base_meta())

    def _as_peer(self, meta: Any) -> Any:
        """A ``Peer`` as is; a dict adopted before, found by content; else this rank's own
        metadata or a sibling's derived from it (the backend's own transport fields are not
        needed to plan)."""
        return self._peers.peer(meta)

    def _compile(
        self,
        srcs: Sequence[Any],
        dst: Any,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds | None,
        num_tokens: int | None,
        mode: str,
    ) -> TransferProgramLike:
        """The transfer program of checked peers (``_validate_peers``): from the layouts and
        geometries parsed with the peers, or through a caller-supplied compiler."""
        peers = [self._as_peer(m) for m in srcs]
        to = self._as_peer(dst)
        if self.compiler is not rust_program_compiler:
            metas = [p.meta for p in peers]
            return self.compiler(metas, to.meta, src_block_ids, dst_block_ids, num_tokens, mode)
        program: TransferProgramLike = _core.compile_peer_transfer(
            peers, to, src_block_ids, dst_block_ids, num_tokens, mode, checked=True
        )
        return program

    def _meta_from_reference(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """This library's schema for a peer that exports the reference design's fields only.

        The reference exports no dtype, version, incarnation or memory type: the dtype is
        this rank's when the element sizes agree; the memory type is VRAM (the reference
        registers GPU memory only). A peer with the KV layout fields is a ``[2, L, B, T, H,
        d]`` cache; without them it is a matched-layout buffer moved in whole slices.
        """
        converted: dict[str, Any] = _core.meta_from_reference(
            meta,
            self.name,
            self.state_kind,
            int(self.memory_buffer.element_size()),
            str(self.memory_buffer.dtype),
        )
        return converted

    def _validate_peers(
        self,
        peers: Sequence[Any],
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds | None,
        num_tokens: int | None,
        *,
        local_is_dst: bool,
    ) -> int | None:
        """Check parsed peers (two claiming one rank) and the block ids against both
        buffers, once, in Rust; return the token count to move (``None`` for SSM state).

        ``peers`` are the source ranks; this rank is the destination when ``local_is_dst``
        (pull, receive) and one of the sources otherwise (push, stage). Raises before
        anything is posted: ``MetadataError``, ``BlockIdError``.
        """
        n: int | None = _core.check_peer_transfer(
            [self._as_peer(m) for m in peers],
            src_block_ids,
            dst_block_ids,
            num_tokens,
            local_is_dst=local_is_dst,
            local_num_blocks=self.expected_num_blocks,
            local_tokens_per_block=self.tokens_per_block,
        )
        return n

    def close(self) -> None:
        """Release this buffer's transport resources (idempotent)."""


def peer_set_key(peers: Sequence[Any]) -> tuple[tuple[str, int, int], ...]:
    """What identifies a set of parsed peers' buffers (device plans are cached by it): names,
    incarnations and global ranks."""
    return tuple((p.agent_name, p.incarnation, p.global_rank) for p in peers)


class TransferHandleBase:
    """A pollable transfer made of parts that each settle on their own.

    ``poll()`` never blocks: it advances every part once and returns whether all parts are
    terminal. ``wait()`` polls until then or until the deadline. Errors raise only once every
    part is terminal (``TransferError``), so a failed handle never leaves a part that may still
    write; past the deadline with parts still running, ``TransferTimeout`` is raised and its
    ``destinations_may_be_written`` says the destinations must stay quarantined.
    """

    #: Seconds ``wait()`` sleeps between polls: short, so completion is seen promptly,
    #: non-zero, so a waiting rank does not monopolise a core.
    poll_interval_s: float = 0.0005

    def __init__(self, timeout_s: float, clock: Clock) -> None:
        self.clock = clock
        self.submitted_at = clock()
        self.timeout_s = float(timeout_s)
        self.done = False
        self.error: str | None = None
        #: The compiler's ``TransferProgram.stats`` of what this handle moves (receive side):
        #: ``bytes``, ``descriptors``, ``fragments``, per-source modes. Empty when unknown.
        self.stats: dict[str, Any] = {}

    @property
    def storage_safe(self) -> bool:
        """Whether every part has stopped reading and writing its buffers (all terminal)."""
        return bool(self.done)

    @property
    def deadline(self) -> float:
        """Clock value after which an unfinished transfer is timed out."""
        return self.submitted_at + self.timeout_s

    def _progress(self, now: float) -> bool:
        """Advance every non-terminal part once at clock value ``now``; True when all parts
        are terminal (past the deadline, a part that posted nothing may fail quietly)."""
        raise NotImplementedError

    def poll(self) -> bool:
        """Return True once every part is terminal; never blocks.

        Raises ``TransferError`` (all parts terminal, one failed: also a part that had posted
        nothing when the deadline passed) or ``TransferTimeout`` (deadline passed, some part
        may still write).
        """
        now = self.clock()
        if not self.done:
            self.done = self._progress(now)
        # Settled, failed or timed out: decided (and raised) in Rust.
        settled: bool = _core.poll_verdict(
            self.done, self.error, now, self.deadline, self.timeout_s
        )
        return settled

    def wait(self) -> None:
        """Block until ``poll()`` returns True or raises (deadline ``submitted_at + timeout_s``)."""
        while not self.poll():
            time.sleep(self.poll_interval_s)
