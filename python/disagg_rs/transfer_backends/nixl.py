"""One-sided transfers over NIXL: the decode reads the prefill's blocks (``NixlTransferBackend``).

Each rank registers its state buffers once on ONE NIXL agent shared by them
(``_NixlAgentContext``, reference-counted; ``new_registered_buffer`` adds the SSM conv and
recurrent buffers). ``export_meta()`` ships the agent metadata with the buffer description;
a decode registers a peer lazily on its first pull and replaces it when the peer's
incarnation changes (a restarted prefill must never be read through a stale registration).

Two ways to move a source rank's bytes, chosen per source rank by the compiler:

- direct: the compiled ``(addr, len, device)`` descriptor lists go to NIXL as one READ;
- staged: the SOURCE packs its fragments into its registered staging region
  (``stage_blocks``, once per handoff, before the pull is announced), the decode reads the
  packed region with one descriptor and scatters it (``staging.scatter``) on completion.

The ticket ``stage_blocks`` returns travels with the handoff to the decode's
``begin_pull_blocks(..., staged=[ticket, ...])``. In ``"auto"`` mode the source packs (it
cannot know the decode's blocks) and the decode reads the packed copy only where the
compiler's cost model prefers staging; any source can always be read directly.

Prepared descriptor lists (``prep_xfer_dlist`` / ``make_prepped_xfer``) pay off when one list
is prepared once and indexed by many transfers, as in the reference design's fixed per-block
lists. Compiled programs are coalesced per handoff, so a list would be prepared and used once:
the backend posts them with ``initialize_xfer``, which does the same work in one call.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from disagg_rs import _core
from disagg_rs.exceptions import CapacityError, MetadataError, TransferError
from disagg_rs.transfer_backends import staging
from disagg_rs.transfer_backends.base import (
    BlockIds,
    Clock,
    PeerMeta,
    ProgramCompiler,
    TransferBackendBase,
    TransferHandleBase,
    check_meta_fields,
)

__all__ = ["NixlPullHandle", "NixlTransferBackend", "StagingArena"]

logger = logging.getLogger(__name__)

#: Poll interval of ``NixlPullHandle.wait`` (NIXL has no blocking wait).
_POLL_INTERVAL_S = 0.0005
#: Default deadline of a pull, from submission.
_POLL_TIMEOUT_S = 30.0
#: UCX transports that can move CUDA memory; ``UCX_TLS`` must allow one for VRAM buffers.
_UCX_CUDA_TLS = ("cuda", "cuda_copy", "cuda_ipc", "gdr_copy", "rc", "rc_x", "dc", "dc_x", "all")


def _detect_nixl_variant(api_module_name: str) -> str | None:
    """Distribution (``nixl-cu12``, ``nixl-cu13``, ...) that provides the active NIXL API."""
    module = sys.modules.get(api_module_name)
    top = (getattr(module, "__name__", "") or "").split(".")[0]
    if not top.startswith("nixl_"):
        return None
    dist = top.replace("_", "-")
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist


def ucx_tls_allows_cuda(tls: str | None) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX move CUDA memory (unset means UCX picks: yes).

    A ``^`` prefix is UCX's exclusion syntax: everything but the listed transports.
    """
    if not tls:
        return True
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if tls.startswith("^"):
        excluded = {t.lstrip("^") for t in names}
        return not {"cuda", "cuda_copy", "cuda_ipc"} <= excluded and "cuda" not in excluded
    return any(n in _UCX_CUDA_TLS or n.startswith("cuda") for n in names)


def nixl_cuda_major_mismatch(variant: str | None, torch_cuda: str | None) -> str | None:
    """Explain a nixl-cuXX vs torch CUDA major mismatch, or ``None`` when they agree."""
    if variant is None or torch_cuda is None or not variant.startswith("nixl-cu"):
        return None
    nixl_major = variant.removeprefix("nixl-cu")
    torch_major = torch_cuda.split(".")[0]
    if nixl_major != torch_major:
        return f"{variant} is built for CUDA {nixl_major} but torch uses CUDA {torch_cuda}"
    return None


def _validate_ucx_transport_config(memory_buffer: torch.Tensor) -> None:
    """Configure safe UCX memory detection and reject host-only transports for GPU buffers."""
    if not memory_buffer.is_cuda:
        return
    # The UCX memory-type cache misclassifies CUDA allocations reused by torch's caching
    # allocator; disabling it is the documented safe setting for registered VRAM.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    tls = os.environ.get("UCX_TLS")
    if not ucx_tls_allows_cuda(tls):
        raise TransferError(
            f"UCX_TLS={tls!r} has no CUDA transport, so UCX cannot read GPU buffers; add "
            "cuda_copy,cuda_ipc (or unset UCX_TLS)"
        )


def backend_supports_vram(mem_types: Any) -> bool:
    """Whether a NIXL backend's memory types include GPU memory. NIXL 1.5 names them
    ``"VRAM_SEG"`` (older builds ``"VRAM"``)."""
    return any(str(t).upper() in ("VRAM", "VRAM_SEG") for t in mem_types)


def _validate_nixl_cuda_support(agent: Any, memory_buffer: torch.Tensor) -> None:
    """Reject a NIXL/UCX runtime that cannot safely register CUDA memory."""
    if not memory_buffer.is_cuda:
        return
    mismatch = nixl_cuda_major_mismatch(_detect_nixl_variant("nixl._api"), torch.version.cuda)
    if mismatch is not None:
        raise TransferError(f"NIXL cannot register CUDA memory: {mismatch}")
    mem_types = agent.get_backend_mem_types("UCX")
    if not backend_supports_vram(mem_types):
        raise TransferError(
            f"the NIXL UCX backend supports {mem_types} but not VRAM (UCX built without CUDA)"
        )


class _NixlAgentContext:
    """NIXL resources shared by the state buffers on one rank: one agent, one peer table."""

    def __init__(
        self, agent_name: str, backends: Sequence[str] = ("UCX",), incarnation: int | None = None
    ) -> None:
        self.agent_name = agent_name
        self.backends = list(backends)
        self.incarnation = int(incarnation if incarnation is not None else time.time_ns())
        self._agent: Any = None
        self._refs = 0
        # Peer agent name -> (incarnation, digest of the metadata it was loaded from).
        self.peers: dict[str, tuple[int, str]] = {}

    @property
    def agent(self) -> Any:
        """The live agent; raises if every registration has been released."""
        if self._agent is None:
            raise TransferError(f"NIXL agent {self.agent_name!r} is closed")
        return self._agent

    def acquire(self) -> Any:
        """Retain the shared agent for one buffer registration (created on first use)."""
        if self._agent is None:
            if self._refs:
                raise TransferError(f"NIXL agent {self.agent_name!r} is closed")
            from nixl._api import nixl_agent, nixl_agent_config

            self._agent = nixl_agent(self.agent_name, nixl_agent_config(backends=self.backends))
        self._refs += 1
        return self._agent

    def release(self) -> None:
        """Release one registration; drop the agent after the last user closes."""
        if self._refs <= 0:
            return
        self._refs -= 1
        if self._refs == 0:
            for name in list(self.peers):
                self._forget(name)
            self._agent = None

    @property
    def refs(self) -> int:
        """Registrations still holding the agent."""
        return self._refs

    def _forget(self, name: str) -> None:
        self.peers.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # a peer that is gone cannot be disconnected cleanly
            logger.debug("removing NIXL peer %s: %s", name, exc)

    def ensure_peer(self, meta: PeerMeta) -> str:
        """Register the peer on first use, replacing a stale incarnation; return its name."""
        name = str(meta["agent_name"])
        blob = base64.b64decode(meta["agent_metadata"])
        key = (int(meta["incarnation"]), hashlib.sha256(blob).hexdigest())
        known = self.peers.get(name)
        if known == key:
            return name
        if known is not None:
            logger.info("NIXL peer %s changed incarnation %s -> %s", name, known[0], key[0])
            self._forget(name)
        try:
            raw = self.agent.add_remote_agent(blob)
            loaded = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception as exc:
            raise TransferError(f"cannot register NIXL peer {name!r}: {exc!r}") from exc
        if loaded != name:
            raise MetadataError(
                f"agent_metadata describes agent {loaded!r} but agent_name is {name!r}",
                field="agent_name",
            )
        self.peers[name] = key
        return name


class StagingArena:
    """First-fit allocator of byte ranges ``[offset, offset + size)`` in a staging region.

    One range per staged handoff part, so it tracks as many ranges as transfers in flight,
    never one per block.
    """

    #: Ranges start on this many bytes, so packed rows can use wide element views.
    alignment = 256

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._used: dict[int, int] = {}

    def alloc(self, size: int) -> int:
        """Reserve ``size`` bytes; return the offset. Raises ``CapacityError`` when full."""
        size = -(-int(size) // self.alignment) * self.alignment
        cursor = 0
        for off, length in sorted(self._used.items()):
            if off - cursor >= size:
                break
            cursor = off + length
        if cursor + size > self.capacity:
            raise CapacityError(
                f"staging needs {size} bytes but only {self.capacity - self.in_use} of "
                f"staging_bytes={self.capacity} are free (or fragmented)",
                field="staging_bytes",
            )
        self._used[cursor] = size
        return cursor

    def free(self, offset: int) -> None:
        """Return a range; freeing an unknown offset is a no-op (idempotent release)."""
        self._used.pop(int(offset), None)

    @property
    def in_use(self) -> int:
        """Bytes reserved now."""
        return sum(self._used.values())


@dataclass
class _PullPart:
    """One NIXL READ of a pull and what to do when it lands."""

    src_rank: int
    xfer: Any
    on_done: Callable[[], None] | None = None
    cleanup: Callable[[], None] | None = None
    state: str = "PROC"
    context: str = ""
    descriptors: int = 0
    """Descriptors this read posted (1 for a staged read)."""

    def finish(self) -> None:
        if self.cleanup is not None:
            self.cleanup()
            self.cleanup = None


class NixlPullHandle(TransferHandleBase):
    """Pollable handle for one logical pull made of one or more NIXL transfers."""

    def __init__(
        self, agent: Any, parts: list[_PullPart], timeout_s: float, clock: Clock, error: str | None
    ) -> None:
        super().__init__(timeout_s, clock)
        self.poll_interval_s = _POLL_INTERVAL_S
        self.agent = agent
        self.parts = parts
        self.error = error

    @property
    def xfers(self) -> list[Any]:
        """The NIXL transfer handles of the parts still held."""
        return [p.xfer for p in self.parts if p.xfer is not None]

    @property
    def contexts(self) -> list[str]:
        """One label per part, for logs."""
        return [p.context for p in self.parts]

    def _fail(self, part: _PullPart, message: str) -> None:
        part.state = "ERR"
        if self.error is None:
            self.error = message

    def _progress(self) -> bool:
        for part in self.parts:
            if part.state != "PROC":
                continue
            try:
                state = self.agent.check_xfer_state(part.xfer)
            except Exception as exc:
                state = "ERR"
                logger.debug("check_xfer_state failed: %r", exc)
            if state == "PROC":
                continue
            if state == "DONE":
                part.state = "DONE"
                if part.on_done is not None:
                    try:
                        part.on_done()
                    except Exception as exc:
                        self._fail(part, f"scatter of {part.context} failed: {exc!r}")
            else:
                self._fail(part, f"NIXL reported {state} for {part.context}")
            self._release(part)
        return all(p.state != "PROC" for p in self.parts)

    def cancel(self) -> None:
        """Stop the parts still running: NIXL releases (aborts) each posted read, so nothing
        writes the destinations afterwards. The handle then counts as failed."""
        for part in self.parts:
            if part.state == "PROC":
                self._fail(part, f"cancelled {part.context} at the quarantine drain horizon")
                self._release(part)
        self.done = True

    def _release(self, part: _PullPart) -> None:
        try:
            if part.xfer is not None:
                self.agent.release_xfer_handle(part.xfer)
        except Exception as exc:
            logger.debug("release_xfer_handle: %r", exc)
        part.xfer = None
        part.finish()


def _np_u64(rows: Sequence[Sequence[int]]) -> npt.NDArray[np.uint64]:
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 3)


class NixlTransferBackend(TransferBackendBase):
    """Per-buffer registration on a rank's NIXL agent; the decode pulls with one-sided reads.

    Constructor parameters are the reference design's; keyword extensions: ``axes`` (cache
    layout), ``staging_bytes`` (registered staging region for staged pulls, 0 = none),
    ``mode`` (``"auto"``/``"direct"``/``"staged"``, passed to the compiler), ``timeout_s``,
    ``compiler``, ``incarnation``, ``clock``.
    """

    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        memory_buffer: torch.Tensor,
        expected_num_blocks: int,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        num_kv_heads_global: int | None = None,
        heads_per_partition: int | None = None,
        head_dim: int | None = None,
        tokens_per_block: int | None = None,
        global_rank: int | None = None,
        pp_size: int | None = None,
        pp_rank: int | None = None,
        num_layers_global: int | None = None,
        layer_start: int | None = None,
        layer_end: int | None = None,
        ssm_layout: _core.SSMShardLayout | None = None,
        ssm_state_kind: str | None = None,
        _shared_context: _NixlAgentContext | None = None,
        *,
        axes: str | None = None,
        staging_bytes: int = 0,
        mode: str = "auto",
        timeout_s: float = _POLL_TIMEOUT_S,
        compiler: ProgramCompiler | None = None,
        incarnation: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        context = _shared_context or _NixlAgentContext(agent_name, incarnation=incarnation)
        super().__init__(
            agent_name,
            memory_buffer,
            expected_num_blocks,
            tp_size,
            tp_rank,
            num_kv_heads_global,
            heads_per_partition,
            head_dim,
            tokens_per_block,
            global_rank,
            pp_size,
            pp_rank,
            num_layers_global,
            layer_start,
            layer_end,
            ssm_layout,
            ssm_state_kind,
            axes=axes,
            compiler=compiler,
            timeout_s=timeout_s,
            incarnation=context.incarnation,
            clock=clock,
        )
        if mode not in ("auto", "direct", "staged"):
            raise ValueError(f"mode must be 'auto', 'direct' or 'staged', got {mode!r}")
        self.mode = mode
        _validate_ucx_transport_config(memory_buffer)
        self._ctx = context
        agent = context.acquire()
        self._closed = False
        self._regs: list[Any] = []
        try:
            _validate_nixl_cuda_support(agent, memory_buffer)
            self._regs.append(agent.register_memory(memory_buffer))
            self.staging_buffer: torch.Tensor | None = None
            if staging_bytes > 0:
                self.staging_buffer = torch.zeros(
                    int(staging_bytes), dtype=torch.uint8, device=memory_buffer.device
                )
                self._regs.append(agent.register_memory(self.staging_buffer))
        except Exception:
            self.close()
            raise
        self.arena = StagingArena(int(staging_bytes))
        self._init_kwargs: dict[str, Any] = {
            "axes": axes,
            "mode": mode,
            "timeout_s": timeout_s,
            "compiler": compiler,
            "clock": clock,
        }

    # -- registration ----------------------------------------------------------------------

    @property
    def agent(self) -> Any:
        """The rank's shared NIXL agent."""
        return self._ctx.agent

    def new_registered_buffer(self, **kwargs: Any) -> NixlTransferBackend:
        """Register another state buffer (e.g. SSM conv/recurrent) on this backend's agent.

        ``kwargs`` are constructor arguments; ``agent_name`` defaults to this backend's and the
        keyword extensions default to this backend's values.
        """
        kwargs.setdefault("agent_name", self.agent_name)
        for key, value in self._init_kwargs.items():
            kwargs.setdefault(key, value)
        return NixlTransferBackend(_shared_context=self._ctx, **kwargs)

    def close(self) -> None:
        """Deregister this buffer and release its reference to the shared agent (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        agent = self._ctx.agent
        for reg in self._regs:
            try:
                agent.deregister_memory(reg)
            except Exception as exc:
                logger.warning("deregister_memory failed: %r", exc)
        self._regs.clear()
        self._ctx.release()

    # -- metadata ------------------------------------------------------------------------

    def export_meta(self) -> dict[str, Any]:
        """Plain metadata for a peer: agent name and metadata, buffer, layout, version, hash.

        The agent metadata is taken now, so export after registering all buffers of the rank.
        """
        meta = self._base_meta()
        meta["agent_metadata"] = base64.b64encode(self.agent.get_agent_metadata()).decode()
        meta["staging"] = (
            None
            if self.staging_buffer is None
            else {
                "addr": int(self.staging_buffer.data_ptr()),
                "nbytes": int(self.staging_buffer.numel()),
            }
        )
        return meta

    def _ensure_peer_registered(self, peer_meta: PeerMeta) -> str:
        """Register the peer with NIXL on first use; return its agent name."""
        return self._ctx.ensure_peer(peer_meta)

    def _peer_list(self, peer_meta: Any) -> list[PeerMeta]:
        metas = super()._peer_list(peer_meta)
        for meta in metas:
            for key in ("agent_metadata", "staging"):
                if key not in meta:
                    raise MetadataError(f"peer metadata lacks required field {key!r}", field=key)
        return metas

    # -- source side of a staged pull ----------------------------------------------------

    def stage_blocks(
        self,
        peer_meta: PeerMeta,
        src_block_ids: BlockIds,
        *,
        src_metas: Sequence[PeerMeta] | None = None,
        num_tokens: int | None = None,
    ) -> dict[str, Any]:
        """Pack this rank's fragments for the decode rank ``peer_meta`` (source side).

        ``src_metas`` are all source ranks' metadata (default: this rank alone) so the plan
        picks the same representatives the decode will. Returns the ticket to send with the
        handoff; ``{"staged": False}`` in it means the compiler chose direct for this rank.
        The pack finishes before this returns. Release the region with ``release_staged``.
        """
        dst = check_meta_fields(peer_meta, self.name)
        srcs = list(src_metas) if src_metas is not None else [self._base_meta()]
        srcs = [check_meta_fields(m, self.name) for m in srcs]
        num_tokens = self._validate_peers(srcs, src_block_ids, None, num_tokens, local_is_dst=False)
        self._check_compat([dst])
        me = self.layout.global_rank
        ticket: dict[str, Any] = {
            "src_rank": me,
            "agent_name": self.agent_name,
            "incarnation": self.incarnation,
            "staged": False,
            "offset": 0,
            "nbytes": 0,
        }
        if self.mode == "direct":
            return ticket
        # Without destination blocks only the gather side compiles (mode "staged"); in
        # "auto" the decode may still read this rank directly and ignore the packed copy.
        program = self.compiler(srcs, dst, src_block_ids, None, num_tokens, "staged")
        if me not in program.src_ranks:
            return ticket
        if self.staging_buffer is None:
            raise CapacityError("staged pull needs staging_bytes > 0", field="staging_bytes")
        nbytes = int(program.packed_bytes(me))
        offset = self.arena.alloc(nbytes)
        try:
            region = self.staging_buffer[offset : offset + nbytes]
            staging.pack(self.memory_buffer, self.buffer_info["addr"], program.gather(me), region)
            if region.is_cuda:
                torch.cuda.current_stream(region.device).synchronize()
        except Exception:
            self.arena.free(offset)
            raise
        ticket.update(staged=True, offset=offset, nbytes=nbytes)
        return ticket

    def release_staged(self, ticket: Mapping[str, Any]) -> None:
        """Free the staging region of a ticket (after RELEASE_KV); idempotent."""
        if ticket.get("staged"):
            self.arena.free(int(ticket["offset"]))

    # -- decode side -----------------------------------------------------------------------

    def begin_pull_blocks(
        self,
        peer_meta: Any,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        num_tokens: int | None = None,
        staged: Sequence[Mapping[str, Any]] | None = None,
        timeout_s: float | None = None,
    ) -> NixlPullHandle:
        """Validate, compile and post the reads of one handoff; return a pollable handle.

        ``peer_meta`` is one source rank's metadata or a list of them (every source rank this
        rank reads from). ``staged`` holds the tickets of ``stage_blocks`` (one per source
        rank that packed). Everything is validated and every peer registered before the
        first read is posted.
        """
        metas = self._peer_list(peer_meta)
        num_tokens = self._validate_peers(
            metas, src_block_ids, dst_block_ids, num_tokens, local_is_dst=True
        )
        by_rank = {int(m["layout"]["global_rank"]): m for m in metas}
        tickets = self._check_tickets(staged or (), by_rank)
        program = self.compiler(
            metas, self._base_meta(), src_block_ids, dst_block_ids, num_tokens, self.mode
        )
        plan: list[tuple[int, str]] = []
        for rank in program.src_ranks:
            if rank not in by_rank:
                raise MetadataError(
                    f"the plan reads source rank {rank} but no metadata names it",
                    field="peer_meta",
                )
            ticket = tickets.get(rank)
            # Read the packed copy when the source made one and the compiler prefers staging
            # for this rank; otherwise read the blocks directly (always possible).
            if ticket is not None and ticket["staged"] and program.mode(rank) == "staged":
                if int(ticket["nbytes"]) != int(program.packed_bytes(rank)):
                    raise MetadataError(
                        f"ticket of rank {rank} packs {ticket['nbytes']} bytes, the plan "
                        f"{program.packed_bytes(rank)}",
                        field="staged",
                    )
                plan.append((rank, "staged"))
            else:
                plan.append((rank, "direct"))
        if any(kind == "staged" for _, kind in plan) and self.staging_buffer is None:
            raise CapacityError("staged pull needs staging_bytes > 0", field="staging_bytes")
        peers = {rank: self._ensure_peer_registered(by_rank[rank]) for rank, _ in plan}
        parts: list[_PullPart] = []
        error: str | None = None
        for rank, kind in plan:
            try:
                part = (
                    self._post_staged(program, rank, by_rank[rank], tickets[rank], peers[rank])
                    if kind == "staged"
                    else self._post_direct(program, rank, by_rank[rank], peers[rank])
                )
            except Exception as exc:
                # Parts already posted keep running; the handle raises once they settle.
                error = f"posting the read from rank {rank} failed: {exc!r}"
                break
            if part is not None:
                parts.append(part)
        handle = NixlPullHandle(
            self.agent,
            parts,
            self.timeout_s if timeout_s is None else timeout_s,
            self.clock,
            error,
        )
        # What was actually posted (a source without a staged ticket is read directly).
        handle.stats = {
            "bytes": int(program.stats.get("bytes", 0)),
            "descriptors": sum(p.descriptors for p in parts),
            "modes": {p.src_rank: p.context.split(":", 1)[0] for p in parts},
        }
        return handle

    def _check_tickets(
        self, tickets: Sequence[Mapping[str, Any]], by_rank: Mapping[int, PeerMeta]
    ) -> dict[int, Mapping[str, Any]]:
        out: dict[int, Mapping[str, Any]] = {}
        for ticket in tickets:
            for key in ("src_rank", "incarnation", "staged", "offset", "nbytes"):
                if key not in ticket:
                    raise MetadataError(f"staging ticket lacks field {key!r}", field="staged")
            rank = int(ticket["src_rank"])
            meta = by_rank.get(rank)
            if meta is None:
                raise MetadataError(f"ticket names unknown source rank {rank}", field="staged")
            if int(ticket["incarnation"]) != int(meta["incarnation"]):
                raise MetadataError(
                    f"ticket of rank {rank} is from incarnation {ticket['incarnation']}, the "
                    f"peer is at {meta['incarnation']}",
                    field="staged",
                )
            if rank in out:
                raise MetadataError(f"two tickets for source rank {rank}", field="staged")
            stage = meta["staging"]
            if ticket["staged"] and (
                stage is None or int(ticket["offset"]) + int(ticket["nbytes"]) > stage["nbytes"]
            ):
                raise MetadataError(
                    f"ticket of rank {rank} names bytes outside the peer's staging region",
                    field="staged",
                )
            out[rank] = ticket
        return out

    def _mem(self, meta: PeerMeta) -> str:
        return str(meta["buffer"]["mem_type"])

    def _post(
        self,
        local: npt.NDArray[np.uint64],
        remote: npt.NDArray[np.uint64],
        meta: PeerMeta,
        peer: str,
        label: str,
    ) -> Any:
        agent = self.agent
        xfer = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, self.buffer_info["mem_type"]),
            agent.get_xfer_descs(remote, self._mem(meta)),
            peer,
            label.encode(),
        )
        state = agent.transfer(xfer)
        if state == "ERR":
            agent.release_xfer_handle(xfer)
            raise TransferError(f"NIXL refused to post {label}")
        return xfer

    def _post_direct(self, program: Any, rank: int, meta: PeerMeta, peer: str) -> _PullPart | None:
        src, dst = program.direct_descriptors(rank)
        if len(src) == 0:
            return None
        label = f"direct:{meta['agent_name']}:{rank}"
        part = _PullPart(rank, self._post(dst, src, meta, peer, label), context=label)
        part.descriptors = len(src)
        return part

    def _post_staged(
        self, program: Any, rank: int, meta: PeerMeta, ticket: Mapping[str, Any], peer: str
    ) -> _PullPart | None:
        nbytes = int(ticket["nbytes"])
        if nbytes == 0:
            return None
        assert self.staging_buffer is not None  # checked before posting
        offset = self.arena.alloc(nbytes)
        region = self.staging_buffer[offset : offset + nbytes]
        scatter_list = program.scatter(rank)
        remote = _np_u64(
            [
                [
                    int(meta["staging"]["addr"]) + int(ticket["offset"]),
                    nbytes,
                    int(meta["buffer"]["device_id"]),
                ]
            ]
        )
        local = _np_u64([[int(region.data_ptr()), nbytes, int(self.buffer_info["device_id"])]])
        label = f"staged:{meta['agent_name']}:{rank}"

        def land() -> None:
            staging.scatter(region, self.memory_buffer, self.buffer_info["addr"], scatter_list)
            if region.is_cuda:
                torch.cuda.current_stream(region.device).synchronize()

        try:
            xfer = self._post(local, remote, meta, peer, label)
        except Exception:
            self.arena.free(offset)
            raise
        part = _PullPart(
            rank, xfer, on_done=land, cleanup=lambda: self.arena.free(offset), context=label
        )
        part.descriptors = 1
        return part
