"""Two-sided transfers over torch.distributed: NCCL on GPU, gloo on CPU.

Both peers take part: the decode posts receives (``begin_pull_blocks``) when the handoff
arrives, the prefill posts the matching sends (``begin_push_blocks``) when the coordinator
names the decode. Both sides compile the same plan with the same inputs, so they agree on
the packed layout without exchanging it. Per handoff each (source, destination) pair moves
ONE message: the source packs its fragments (``staging.pack``), sends, and the destination
scatters the message into its paged buffer when the receive completes.

Messages of concurrent handoffs between the same pair are matched by post order (NCCL) or
by ``tag`` (gloo); the decode must post receives in the order the prefill posts sends.
``match_by_order`` (default: on when the group is NCCL) sends every message on one tag, so
gloo matches by post order too, as NCCL does.

Every message starts with a fixed-size header built in Rust (``_core.p2p_sends``: the
handoff's tag, the sender's incarnation, the chunk index and count, the payload size). The
receiver checks it before the bytes count (``_core.PeerSteps.check``): a message meant for
another receive (a receive that never got its send takes the next send on the pair) fails the
import with ``MessageOrderError``'s text and marks the peer as out of step (``steps``, a
``_core.PeerSteps``; later receives from it are refused). A sender that cannot send the real
bytes of a posted receive sends a filler of the posted sizes
(``begin_push_blocks(filler=True)``): the receive completes at once, its import fails as
aborted (``PushAbortedError``), and the pair stays in step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from disagg_rs import _core
from disagg_rs.exceptions import CapacityError, TransferError
from disagg_rs.transfer_backends import device_plan as dp
from disagg_rs.transfer_backends import pipeline
from disagg_rs.transfer_backends.base import (
    BlockIds,
    Clock,
    PeerMeta,
    ProgramCompiler,
    TransferBackendBase,
    TransferHandleBase,
    TransferProgramLike,
    kv_layout_from_meta,
    no_blocks,
    peer_set_key,
)

__all__ = ["NcclTransferBackend", "NcclTransferHandle"]

logger = logging.getLogger(__name__)


class NcclTransferHandle(TransferHandleBase):
    """Pollable handle for one batched send or receive of a handoff.

    Receives land in temporary packed buffers; on completion the handle scatters them into
    the paged buffer once. Send handles keep the packed source bytes alive until reaped.
    """

    def __init__(
        self,
        works: list[Any],
        keepalive: list[torch.Tensor],
        scatters: list[Callable[[], None]],
        timeout_s: float = 30.0,
        clock: Clock = time.monotonic,
        error: str | None = None,
        *,
        ready: Callable[[], bool] = lambda: True,
        errors: list[str] | None = None,
    ) -> None:
        super().__init__(timeout_s, clock)
        # Transfers run by a thread (gloo: ``pipeline.run_ops``, ``pipeline.post_chunks``) or
        # queued on a stream: settled once ``ready()`` says so; their failures land in
        # ``errors``.
        self._ready = ready
        self._errors = errors if errors is not None else []
        self.works = works
        self.keepalive = keepalive
        # Run in order once every part completed: header checks, then scatters (a failure
        # stops the rest).
        self.scatters = scatters
        self.error = error

    def _progress(self, now: float) -> bool:
        del now  # a posted receive may write until it completes: no quiet failure
        if not self._ready() or not all(w.is_completed() for w in self.works):
            return False
        self._finish()
        return True

    def _finish(self) -> None:
        # Every work is complete already: ``wait()`` returns at once, raising if it failed.
        failed = [_failure(work.wait, "torch.distributed reported") for work in self.works]
        self.error = _core.p2p_outcome(self.error, failed, self._errors)
        if self.error is None:
            self.error = _failure(self._land, "scatter failed:")
        self.works, self.scatters, self.keepalive = [], [], []

    def _land(self) -> None:
        """Run the header checks and scatters in order (the first failure stops the rest)."""
        for land in self.scatters:
            land()


def _failure(call: Callable[[], Any], what: str) -> str | None:
    """Run ``call``; its failure as ``what`` and the exception, or ``None``."""
    try:
        call()
    except Exception as exc:
        return f"{what} {exc!r}"
    return None


def _make_copy(view: torch.Tensor, buf: torch.Tensor) -> Callable[[], None]:
    """A closure that copies a received contiguous ``buf`` into the paged ``view``."""

    def copy() -> None:
        view.copy_(buf.view(view.shape))

    return copy


def _kv_layout_from_meta(meta: Mapping[str, Any]) -> _core.KVShardLayout:
    """Rebuild a peer's ``KVShardLayout`` from its exported (reference design's) fields."""
    return kv_layout_from_meta(meta)


class NcclTransferBackend(TransferBackendBase):
    """Per-buffer two-sided transport over a torch.distributed process group.

    Same constructor and metadata as ``NixlTransferBackend`` (plus ``dist_rank``, this
    process's rank in the default group), so the handoff layer treats both alike. Keyword
    extensions: ``axes``, ``timeout_s``, ``compiler``, ``incarnation``, ``clock``, ``group``,
    ``match_by_order`` (every message on one tag, so messages match by post order per peer
    pair whatever the group; default: on for NCCL, which ignores tags, off otherwise).
    """

    name = "nccl"
    #: Two-sided: the prefill pushes (``begin_push_blocks``) what the decode receives.
    is_push = True

    def __init__(
        self,
        agent_name: str,
        memory_buffer: torch.Tensor | Sequence[Any],
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
        *,
        axes: str | None = None,
        timeout_s: float = 30.0,
        compiler: ProgramCompiler | None = None,
        incarnation: int | None = None,
        clock: Clock = time.monotonic,
        group: Any = None,
        match_by_order: bool | None = None,
    ) -> None:
        super().__init__(**self._base_arguments(locals()))  # the reference signature, whole
        memory_buffer = self.memory_buffer  # the first tensor of a per-layer list
        if not dist.is_initialized():
            raise TransferError("NcclTransferBackend needs torch.distributed initialised first")
        self.group = group
        self.dist_rank = dist.get_rank()
        # NCCL posts from the serving thread; gloo's transfers run on threads (its works never
        # report completion to is_completed() and a timed wait() closes the connection):
        # one per transfer, or, matching by post order, one per group running them in order.
        self._nccl, self.match_by_order, ordered = _core.p2p_matching(
            dist.get_backend(group), match_by_order
        )
        self._lane = pipeline.lane_of(group, ordered)
        #: Which peers' messages still match this rank's receives (receives from one out of
        #: step are refused); shared with the backends of this rank's other buffers.
        self.steps = _core.PeerSteps()
        # Chunked transfers: a bounded staging pool, plans per peer set, ids to the device.
        self.staging_pool = pipeline.StagingPool(memory_buffer.device)
        self._plans = dp.PlanCache()
        self._ids = dp.IdUploader(memory_buffer.device)
        self._init_kwargs: dict[str, Any] = {
            "axes": axes,
            "timeout_s": timeout_s,
            "compiler": compiler,
            "clock": clock,
            "group": group,
            "incarnation": self.incarnation,
            "match_by_order": self.match_by_order,
        }

    @property
    def out_of_step(self) -> dict[int, str]:
        """Peers (process ranks) whose messages stopped matching this rank's receives, with
        the first mismatch."""
        return self.steps.out_of_step

    def new_registered_buffer(self, **kwargs: Any) -> NcclTransferBackend:
        """Another state buffer of this rank (SSM conv/recurrent) on the same process group."""
        other = NcclTransferBackend(
            **{"agent_name": self.agent_name, **self._init_kwargs, **kwargs}
        )
        other.steps = self.steps  # one rank's pairs: every buffer's messages share them
        return other

    def export_meta(self) -> dict[str, Any]:
        """Plain metadata for a peer; adds ``dist_rank`` (and the reference design's
        ``transport``/``nccl_rank``) to the shared schema."""
        meta = self._base_meta()
        meta["dist_rank"] = self.dist_rank
        meta["transport"] = self.name
        meta["nccl_rank"] = self.dist_rank
        return meta

    def _device(self) -> torch.device:
        return self.memory_buffer.device

    def _checker(
        self, buf: torch.Tensor, peer: int, tag: int, incarnation: int, nbytes: int
    ) -> Callable[[], None]:
        """A check of one received whole message's header, run before its scatter."""

        def check() -> None:
            got = buf[: pipeline.HEADER].cpu().numpy().tobytes()
            self.steps.check(peer, got, tag, incarnation, [nbytes])

        return check

    def begin_pull_blocks(
        self,
        peer_meta: Any,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        num_tokens: int | None = None,
        tag: int = 0,
        timeout_s: float | None = None,
    ) -> NcclTransferHandle:
        """Post this decode rank's receives for one handoff (one per source rank).

        ``peer_meta``: the source ranks' metadata (a dict, a list, ``{"tp_metas": [...]}`` or
        ``{"pp_metas": [...]}``). Without ``num_tokens`` whole blocks move (as many tokens as
        both block lists hold).
        """
        peers, src_ids = self._resolve_peers(peer_meta, src_block_ids)
        src_block_ids = cast(BlockIds, src_ids)  # given, so resolved to the ids or a rank map
        if no_blocks(src_block_ids, dst_block_ids):  # nothing to move: a settled handle
            return self._submit([], [], [], timeout_s)
        num_tokens = self._validate_peers(
            peers, src_block_ids, dst_block_ids, num_tokens, local_is_dst=True
        )
        metas = [p.meta for p in peers]
        self.steps.refuse([int(m["dist_rank"]) for m in metas])
        if num_tokens is not None and pipeline.chunkable([*peers, self._own_peer]):
            return self._pull_chunked(
                peers, src_block_ids, dst_block_ids, num_tokens, tag, timeout_s
            )
        program = self._compile(
            peers, self._own_peer, src_block_ids, dst_block_ids, num_tokens, "staged"
        )
        ops: list[dist.P2POp] = []
        keep: list[torch.Tensor] = []
        scatters: list[Callable[[], None]] = []
        checks: list[Callable[[], None]] = []
        head = pipeline.HEADER
        # One message from each source rank that sends bytes (Rust: ``MetadataError`` for a
        # source rank no metadata names), on the handoff's tag or, matching by post order, one
        # tag for all.
        wire_tag, receives = _core.p2p_receives(program, peers, tag, self.match_by_order)
        for peer, inc, nbytes, rank in receives:
            buf = torch.empty(head + nbytes, dtype=torch.uint8, device=self._device())
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, wire_tag))
            keep.append(buf)
            checks.append(self._checker(buf, peer, tag, inc, nbytes))
            scatters.append(self._lander(buf[head:], program.scatter(rank)))
        # Every header is checked before any scatter.
        handle = self._submit(ops, keep, checks + scatters, timeout_s)
        handle.stats = dict(program.stats)
        return handle

    def _pull_chunked(
        self,
        peers: Sequence[Any],
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        num_tokens: int,
        tag: int,
        timeout_s: float | None,
    ) -> NcclTransferHandle:
        """Receive every source's packed bytes in chunks through the staging pool and scatter
        each chunk from the cached device plan (see ``pipeline``)."""
        by_rank = {p.global_rank: p.meta for p in peers}

        def build() -> tuple[list[int], dict[int, dp.DevicePlan]]:
            program = self._compile(
                peers, self._own_peer, src_block_ids, dst_block_ids, num_tokens, "staged"
            )
            plans = {}
            for rank in program.src_ranks:
                plan = dp.DevicePlan.from_program(
                    program,
                    rank,
                    src_addr=int(by_rank[rank]["buffer"]["addr"]),
                    dst_addr=int(self.buffer_info["addr"]),
                )
                if plan is None:
                    raise TransferError(f"no device plan for source rank {rank}")
                plans[rank] = plan
            return list(program.src_ranks), plans

        ranks, plans = self._plans.get(("pull", peer_set_key(peers)), build)
        ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
        needs = [plans[r].num_blocks(num_tokens) for r in ranks]
        _core.check_chunk_blocks("dst_block_ids", ids.size, num_tokens, needs)
        (dev_ids,) = self._ids.upload(ids)
        pairs = [
            pipeline.ChunkPlan(
                plans[r],
                dev_ids,
                num_tokens,
                int(by_rank[r]["dist_rank"]),
                False,
                tag=tag,
                incarnation=int(by_rank[r]["incarnation"]),
            )
            for r in ranks
        ]
        handle = self._submit_chunks(pairs, timeout_s)
        chunks = sum(len(p.plan.chunks(num_tokens, self.staging_pool.slot_bytes)) for p in pairs)
        handle.stats = {
            "descriptors": chunks,
            "bytes": sum(plans[r].packed_bytes(num_tokens) for r in ranks),
            "chunks": chunks,
        }
        return handle

    def _submit_chunks(
        self, pairs: list[pipeline.ChunkPlan], timeout_s: float | None
    ) -> NcclTransferHandle:
        error: str | None = None
        works: list[Any] = []
        ready: Callable[[], bool] = lambda: True  # noqa: E731
        checks: list[Callable[[], None]] = []
        errors: list[str] = []
        try:
            works, ready, checks, errors = pipeline.post_chunks(
                pairs,
                self.memory_buffer,
                self.staging_pool,
                self.group,
                self.match_by_order,
                self.steps,
                self._lane,
            )
        except CapacityError:
            raise  # checked before anything is posted
        except Exception as exc:
            error = f"posting chunked point-to-point ops failed: {exc!r}"
        return NcclTransferHandle(
            works,
            [],
            checks,
            self._timeout(timeout_s),
            self.clock,
            error,
            ready=ready,
            errors=errors,
        )

    def _lander(self, buf: torch.Tensor, scatter_list: Any) -> Callable[[], None]:
        def land() -> None:
            self.scatter_rows(buf, scatter_list)

        return land

    def begin_push_blocks(
        self,
        peer_meta: Any,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds | None = None,
        *,
        src_metas: Sequence[PeerMeta] | None = None,
        num_tokens: int | None = None,
        tag: int = 0,
        timeout_s: float | None = None,
        filler: bool = False,
    ) -> NcclTransferHandle:
        """Pack and send this prefill rank's part of a handoff to each decode rank named.

        ``peer_meta``: the decode ranks' metadata (a dict, a list or ``{"tp_metas": [...]}``;
        one message per decode rank that reads from this rank). ``src_metas``: every source
        rank's metadata, so the plan picks the same representatives the decode does (default:
        this rank's model-parallel group inferred from its layout, see ``_group_metas``).
        Without ``num_tokens`` whole blocks move. ``filler``: send messages of the sizes the
        decode posted whose headers say ``aborted`` instead of the blocks' bytes (the handoff
        cannot be sent; ``src_block_ids`` then only size the plan, any valid ids do), so the
        decode's receives complete at once and the pair stays in step.
        """
        dsts = self._resolve_peers(peer_meta, None)[0]
        if no_blocks(src_block_ids):  # nothing to move: a settled handle
            return self._submit([], [], [], timeout_s)
        srcs = self._resolve_peers(src_metas, None)[0] if src_metas else self._group_peers
        num_tokens = self._validate_peers(srcs, src_block_ids, None, num_tokens, local_is_dst=False)
        me = self.layout.global_rank
        if num_tokens is not None and all(pipeline.chunkable([*srcs, d]) for d in dsts):
            return self._push_chunked(srcs, dsts, src_block_ids, num_tokens, tag, timeout_s, filler)
        programs: list[TransferProgramLike] = [
            self._compile(srcs, dst, src_block_ids, dst_block_ids, num_tokens, "staged")
            for dst in dsts
        ]
        ops: list[dist.P2POp] = []
        keep: list[torch.Tensor] = []
        head = pipeline.HEADER
        # One message to each decode rank that reads bytes from this rank, with its header
        # (Rust picks them, builds the headers and the tag they travel on).
        wire = (tag, self.incarnation, self.match_by_order)
        wire_tag, sends = _core.p2p_sends(me, programs, filler, wire)
        for i, nbytes, raw in sends:
            buf = torch.empty(head + nbytes, dtype=torch.uint8, device=self._device())
            buf[:head].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            if not filler:
                self.pack_rows(programs[i].gather(me), buf[head:])
            to = int(dsts[i].meta["dist_rank"])
            ops.append(dist.P2POp(dist.isend, buf, to, self.group, wire_tag))
            keep.append(buf)
        return self._submit(ops, keep, [], timeout_s)

    def _push_chunked(
        self,
        srcs: Sequence[Any],
        dsts: Sequence[Any],
        src_block_ids: BlockIds,
        num_tokens: int,
        tag: int,
        timeout_s: float | None,
        filler: bool = False,
    ) -> NcclTransferHandle:
        """Pack and send this rank's part in chunks through the staging pool (see
        ``pipeline``); the decode cuts the same chunks from the same plan."""
        me = self.layout.global_rank
        pairs: list[pipeline.ChunkPlan] = []
        ids = np.asarray(
            src_block_ids[me] if isinstance(src_block_ids, Mapping) else src_block_ids,
            dtype=np.int64,
        ).reshape(-1)
        (dev_ids,) = self._ids.upload(ids)
        for dst in dsts:

            def build(dst: Any = dst) -> dp.DevicePlan | None:
                program = self._compile(srcs, dst, src_block_ids, None, num_tokens, "staged")
                if me not in program.src_ranks:
                    return None
                addr = int(self.buffer_info["addr"])
                return dp.DevicePlan.from_program(program, me, src_addr=addr, dst_addr=0)

            plan = self._plans.get(("push", peer_set_key(srcs), peer_set_key([dst])), build)
            if plan is None:
                continue
            need = [plan.num_blocks(num_tokens)]
            _core.check_chunk_blocks("src_block_ids", ids.size, num_tokens, need)
            pairs.append(
                pipeline.ChunkPlan(
                    plan,
                    dev_ids,
                    num_tokens,
                    int(dst.meta["dist_rank"]),
                    True,
                    tag=tag,
                    incarnation=self.incarnation,
                    filler=filler,
                )
            )
        return self._submit_chunks(pairs, timeout_s)

    def _submit(
        self,
        ops: list[dist.P2POp],
        keep: list[torch.Tensor],
        scatters: list[Callable[[], None]],
        timeout_s: float | None,
    ) -> NcclTransferHandle:
        works: list[Any] = []
        error: str | None = None
        ready: Callable[[], bool] = lambda: True  # noqa: E731
        errors: list[str] = []
        if ops and not self._nccl:
            ready, errors = pipeline.run_ops(ops, self._lane)
        elif ops:
            # One op at a time, in order: a batched call must be the group's first call on
            # EVERY rank, which a handoff between some ranks never is. All or none are kept.
            error = _failure(
                lambda: works.extend([op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]),
                f"posting {len(ops)} point-to-point ops failed:",
            )
        timeout = self._timeout(timeout_s)
        return NcclTransferHandle(
            works, keep, scatters, timeout, self.clock, error, ready=ready, errors=errors
        )

    def close(self) -> None:
        """Nothing is registered for two-sided transfers; kept for interface parity."""
