"""The reference engine: continuous batching, greedy sampling, roles, and the handoff entry
points.

Every rank of an engine runs the same :class:`ReferenceEngine` code on the same inputs (the
requests are given to every rank): scheduling decisions and pool operations are mirrored on all
ranks, only the model compute is split. The last stage samples and broadcasts the tokens.

Roles:

- ``colocated``: a request runs its prompt, then decodes until done.
- ``prefill``: a request runs its prompt and samples its first token; its KV blocks and SSM
  slot stay pinned and a :class:`PrefillHandoff` is returned by :meth:`ReferenceEngine.step`
  for the handoff layer to ship. :meth:`ReferenceEngine.release_pinned` unpins.
- ``decode``: prompts are refused; :meth:`ReferenceEngine.admit` takes a request whose prompt
  KV and SSM state were written into this engine's cache from outside, and decoding continues
  from its resume token(s) without running the prompt.

Handoff surface (what the mixin and the transports read): :attr:`~ReferenceEngine.kv_cache`
(tensor or per-layer list) and :attr:`~ReferenceEngine.kv_cache_layout`,
:attr:`~ReferenceEngine.block_size_tokens`, :attr:`~ReferenceEngine.kv_layout` and
:attr:`~ReferenceEngine.ssm_layout` of this rank, :attr:`~ReferenceEngine.ssm_conv_state` and
:attr:`~ReferenceEngine.ssm_recurrent_state`, :attr:`~ReferenceEngine.block_pool` and
:attr:`~ReferenceEngine.ssm_slot_pool`, :meth:`~ReferenceEngine.admit`, and the
``disagg_rs.engine_protocol.HandoffEngine`` surface (:attr:`~ReferenceEngine.decode_batch`,
:meth:`~ReferenceEngine.expect_import`,
:meth:`~ReferenceEngine.complete_request_without_forward`, :attr:`~ReferenceEngine.event_loop`).

:meth:`~ReferenceEngine.abort` drops one request and :meth:`~ReferenceEngine.reset` every
request, returning their blocks and slots (pinned prefill handoffs stay with their owner).

Prompts reserve their whole life's blocks at admission (prompt plus every continuation block),
so they never wait for a block and nothing is ever preempted. Imported requests reserve the rest
of their generation when the pool has it, else grow one block at a time as they decode (a step
leaves out a request whose next block is not free; if that is every request, it raises
``CapacityError``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_rs._core import BlockPool, KVShardLayout, SlotPool, SSMShardLayout
from disagg_rs.engine_protocol import BlockAllocator, SlotAllocator
from disagg_rs.exceptions import (
    ArgumentError,
    BlockIdError,
    CapacityError,
    DuplicateRequestError,
    GeometryMismatchError,
    HandoffStateError,
    UnknownRequestError,
)
from disagg_rs.reference.cache import PagedKVCache, SsmStateCache
from disagg_rs.reference.config import (
    CacheLayoutName,
    EngineConfig,
    ModelConfig,
    Role,
    kv_layout_for,
    ssm_layout_for,
)
from disagg_rs.reference.model import BatchInput, StageModel
from disagg_rs.reference.parallel import EngineComm

#: Token ids of a prompt or of handed-off resume tokens.
_Tokens = Sequence[int]

__all__ = [
    "EngineStats",
    "FinishedRequest",
    "PrefillHandoff",
    "ReferenceDecodeBatch",
    "ReferenceEngine",
    "StepOutput",
    "decode_text",
    "encode_text",
]


def _token_list(request_id: int, prompt: Any) -> list[int]:
    """``prompt`` as a list of ints; anything else (a non-sequence, floats, bools, strings
    among the ids) raises :class:`ArgumentError` naming ``prompt``."""
    try:
        tokens = list(prompt)
    except TypeError:
        tokens = None
    if tokens is None or not all(type(t) is int for t in tokens):
        raise ArgumentError(
            f"request {request_id}: prompt must be a sequence of int token ids, got {prompt!r:.60}",
            "prompt",
        )
    return tokens


def encode_text(text: str) -> list[int]:
    """Byte-level tokens of ``text`` (its UTF-8 bytes)."""
    return list(text.encode())


def decode_text(tokens: Sequence[int]) -> str:
    """Text of byte tokens (invalid UTF-8 shown as U+FFFD)."""
    return bytes(tokens).decode(errors="replace")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FinishedRequest:
    """A request that ended on this engine (colocated or decode role)."""

    request_id: int
    """The caller's id."""
    prompt: list[int]
    """Prompt tokens."""
    tokens: list[int]
    """Every generated token, the resume token(s) of an imported request included."""


@dataclass(frozen=True)
class PrefillHandoff:
    """A prompt finished on a prefill-role engine, with its state pinned for the handoff.

    ``block_ids[i]`` holds prompt positions ``[i * block_size, (i + 1) * block_size)``; the SSM
    slot holds the state after the whole prompt. The handoff owns one reference on each block
    and the slot until :meth:`ReferenceEngine.release_pinned`. A ``PinLedger`` that shares the
    engine's pools can take them over instead: ``pins.pin(id, block_ids, ssm_slot, ...)``
    (which retains the blocks and takes the slot), then ``engine.block_pool.release(block_ids)``.
    """

    request_id: int
    """The caller's id."""
    prompt: list[int]
    """Prompt tokens (their KV is in ``block_ids``)."""
    block_ids: list[int]
    """Pinned KV blocks covering the prompt, in position order."""
    ssm_slot: int | None
    """Pinned SSM slot (None for attention-only models)."""
    first_token: int
    """The token sampled after the prompt: the decode engine's resume token."""
    max_new_tokens: int
    """The request's generation budget, the first token included."""


@dataclass
class StepOutput:
    """What one :meth:`ReferenceEngine.step` produced."""

    new_tokens: dict[int, int] = field(default_factory=dict)
    """Token sampled this step per request id (for streaming)."""
    finished: list[FinishedRequest] = field(default_factory=list)
    """Requests that ended (their blocks and slot are back in the pools)."""
    handoffs: list[PrefillHandoff] = field(default_factory=list)
    """Prompts finished on a prefill engine (state pinned)."""


@dataclass
class EngineStats:
    """Counters of one engine rank (identical on every rank of the engine)."""

    steps: int = 0
    """Forward passes run."""
    prompt_tokens_computed: int = 0
    """Prompt tokens that went through the model."""
    prefix_hit_tokens: int = 0
    """Prompt tokens skipped because their KV blocks came from the prefix cache."""
    decode_tokens: int = 0
    """Tokens sampled after the first (continuation tokens)."""
    imported_requests: int = 0
    """Requests admitted with state written from outside."""


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    ssm_slot: int | None = None
    num_computed: int = 0
    """Tokens whose KV and SSM state are in the cache; the next forward starts here."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class ReferenceEngine:
    """One rank of a small, real engine for the byte-level hybrid model.

    Build it on every rank of the engine (``config.engine_ranks()``), after
    ``torch.distributed`` is initialized when ``tp * pp > 1``. ``block_pool`` and
    ``ssm_slot_pool`` default to a new ``disagg_rs.BlockPool`` / ``disagg_rs.SlotPool`` of the
    configured size; pass a ledger's pools (``ImportLedger.block_pool``, ...) so that the engine
    and the ledger draw from, and account, the same blocks.
    """

    num_speculative_tokens = 0
    """Draft tokens per step (the reference engine does not speculate)."""

    def __init__(
        self,
        model: ModelConfig,
        config: EngineConfig,
        *,
        block_pool: BlockAllocator | None = None,
        ssm_slot_pool: SlotAllocator | None = None,
        event_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.model = model
        """Global model shape."""
        self.config = config
        """Layout, capacity and role."""
        self.comm = EngineComm(config)
        """This rank's place in the engine and its collectives."""
        tp_rank, pp_rank = self.comm.tp_rank, self.comm.pp_rank
        self._kv_layout = kv_layout_for(model, config, tp_rank, pp_rank)
        self._ssm_layout = ssm_layout_for(model, config, tp_rank, pp_rank)
        window = config.windows(model)[pp_rank]
        kv = self._kv_layout
        self._kv = PagedKVCache(
            config.cache_layout,
            kv.num_local_layers if kv is not None else 0,
            config.num_blocks,
            config.block_size_tokens,
            kv.heads_per_partition if kv is not None else model.num_kv_heads,
            model.head_dim,
            config.device,
        )
        ssm = self._ssm_layout
        self._ssm: SsmStateCache | None = None
        if ssm is not None:
            h_lo, h_hi = ssm.heads
            self._ssm = SsmStateCache(
                ssm.num_local_layers,
                config.num_ssm_slots,
                ssm.local_conv_channels,
                model.ssm_d_conv,
                h_hi - h_lo,
                model.ssm_head_dim,
                model.ssm_d_state,
                config.device,
            )
        self._stage = StageModel(
            model, window, self.comm, kv, ssm, self._kv, self._ssm, config.device
        )
        pool = (
            block_pool
            if block_pool is not None
            else BlockPool(config.num_blocks, config.block_size_tokens)
        )
        if (pool.num_blocks, pool.block_size_tokens) != (
            config.num_blocks,
            config.block_size_tokens,
        ):
            raise GeometryMismatchError(
                f"block_pool has num_blocks={pool.num_blocks}, block_size_tokens="
                f"{pool.block_size_tokens}; the KV cache has num_blocks={config.num_blocks}, "
                f"block_size_tokens={config.block_size_tokens}",
                "block_pool",
            )
        self.block_pool: BlockAllocator = pool
        """KV blocks of this engine (mirrored on every rank)."""
        self.ssm_slot_pool: SlotAllocator | None = None
        """SSM slots of this engine (None for attention-only models)."""
        if model.num_ssm_layers:
            slots = ssm_slot_pool if ssm_slot_pool is not None else SlotPool(config.num_ssm_slots)
            if slots.num_slots != config.num_ssm_slots:
                raise GeometryMismatchError(
                    f"ssm_slot_pool has num_slots={slots.num_slots}; the SSM state has "
                    f"num_ssm_slots={config.num_ssm_slots}",
                    "ssm_slot_pool",
                )
            self.ssm_slot_pool = slots
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._done_without_forward: list[FinishedRequest] = []
        self._expected: dict[int, tuple[list[int], list[int], int]] = {}
        self._event_loop = event_loop
        self.stats = EngineStats()
        """Counters (steps, prompt tokens run, prefix-cache hits, decode tokens, imports)."""

    # -- what the handoff layer reads -------------------------------------------------------

    @property
    def role(self) -> Role:
        """``colocated``, ``prefill`` or ``decode``."""
        return self.config.role

    @property
    def block_size_tokens(self) -> int:
        """Tokens per KV block."""
        return self.config.block_size_tokens

    @property
    def kv_cache(self) -> torch.Tensor | list[torch.Tensor]:
        """This rank's KV cache memory (see :attr:`kv_cache_layout` for its axes)."""
        return self._kv.tensors

    @property
    def kv_cache_layout(self) -> CacheLayoutName:
        """``megatron`` ``[2, L, B, T, H, d]``, or per layer ``nhd`` ``[2, B, T, H, d]`` /
        ``hnd`` ``[2, B, H, T, d]``."""
        return self._kv.layout

    @property
    def kv_layout(self) -> KVShardLayout | None:
        """Which KV layers and heads this rank holds (None: its stage has no attention)."""
        return self._kv_layout

    @property
    def ssm_layout(self) -> SSMShardLayout | None:
        """Which SSM layers, heads and groups this rank holds (None: no SSM layer here)."""
        return self._ssm_layout

    @property
    def ssm_conv_state(self) -> torch.Tensor | None:
        """Conv state ``[L, slots, C, d_conv]`` (C packed ``[x | B | C]``), if any."""
        return self._ssm.conv if self._ssm is not None else None

    @property
    def ssm_recurrent_state(self) -> torch.Tensor | None:
        """Recurrent state ``[L, slots, H, p, n]``, if any."""
        return self._ssm.recurrent if self._ssm is not None else None

    @property
    def has_ssm(self) -> bool:
        """Whether requests need an SSM slot."""
        return self.ssm_slot_pool is not None

    # -- requests ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Prompts queued for capacity."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything."""
        return bool(self._waiting or self._running or self._done_without_forward)

    def add_request(
        self, request_id: int, prompt: Sequence[int] | str, max_new_tokens: int
    ) -> None:
        """Queue a prompt (FIFO). Refused on a decode-role engine, which never runs prompts."""
        if self.role == "decode":
            raise HandoffStateError(
                f"role='decode' engine got prompt request {request_id}; decode engines only "
                "admit handed-off requests (admit)",
                "role",
            )
        tokens = encode_text(prompt) if isinstance(prompt, str) else _token_list(request_id, prompt)
        self._validate_new(request_id, len(tokens), max_new_tokens)
        self._validate_tokens(request_id, tokens)
        total = self._blocks_for(len(tokens), max_new_tokens)
        if total > self.config.num_blocks:
            raise CapacityError(
                f"request {request_id} needs {total} blocks > num_blocks={self.config.num_blocks}",
                "max_new_tokens",
            )
        self._waiting.append(_Request(request_id, tokens, max_new_tokens))

    def batch_room(self, num_requests: int) -> int:
        """How many of ``num_requests`` more requests the running batch can take now."""
        return max(0, min(num_requests, self.config.max_batch - len(self._running)))

    def blocks_needed(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        """KV blocks a request holds on this engine for its whole life."""
        return self._blocks_for(num_prompt_tokens, max_new_tokens)

    def can_admit(self, num_prompt_tokens: int, max_new_tokens: int, num_blocks_given: int) -> bool:
        """Whether the batch has room and the pool holds the rest of such a request's
        generation (:meth:`admit` also accepts one it cannot reserve fully; it then grows)."""
        extra = self._blocks_for(num_prompt_tokens, max_new_tokens) - num_blocks_given
        return len(self._running) < self.config.max_batch and self.block_pool.can_allocate(
            max(extra, 0)
        )

    def admit(
        self,
        request_id: int,
        prompt: Sequence[int],
        resume_tokens: Sequence[int],
        block_ids: Sequence[int],
        ssm_slot: int | None,
        max_new_tokens: int,
    ) -> FinishedRequest | None:
        """Admit a request whose prompt state was written into this engine from outside.

        ``block_ids`` (at least ``ceil(len(prompt) / block_size)``, position order) hold the
        prompt's KV for positions ``[0, len(prompt))``; ``ssm_slot`` holds the SSM state after
        the prompt. ``resume_tokens`` are the tokens the prefill already sampled. The engine
        takes over one reference on each block and the slot, allocates any continuation blocks,
        and frees them all when the request ends. A request that the resume tokens already
        finish ends here without a forward pass and is returned (and reported by the next
        :meth:`step`). Validates everything before changing anything.
        """
        if self.role == "prefill":
            raise HandoffStateError(
                "role='prefill' engine cannot admit handed-off requests", "role"
            )
        prompt_l, resume, blocks = list(prompt), list(resume_tokens), list(block_ids)
        self._validate_new(request_id, len(prompt_l), max_new_tokens)
        self._validate_tokens(request_id, prompt_l + resume)
        if not resume:
            raise BlockIdError(
                f"request {request_id}: resume_tokens=[] must hold the prefill's token", "resume"
            )
        needed = _ceil_div(len(prompt_l), self.block_size_tokens)
        if len(blocks) < needed:
            raise BlockIdError(
                f"request {request_id}: len(block_ids)={len(blocks)} < {needed} blocks for "
                f"{len(prompt_l)} prompt tokens at block_size={self.block_size_tokens}",
                "block_ids",
            )
        if (ssm_slot is None) == self.has_ssm:
            raise BlockIdError(
                f"request {request_id}: ssm_slot={ssm_slot} but model has "
                f"{self.model.num_ssm_layers} SSM layers",
                "ssm_slot",
            )
        finishes = len(resume) >= max_new_tokens or self._is_eos(resume[-1])
        if not finishes and len(self._running) >= self.config.max_batch:
            raise CapacityError(
                f"running batch is full: {len(self._running)} >= max_batch={self.config.max_batch}",
                "max_batch",
            )
        req = _Request(request_id, prompt_l, max_new_tokens, resume, blocks, ssm_slot)
        req.num_computed = len(prompt_l)
        self.stats.imported_requests += 1
        if finishes:
            done = self._finish(req)
            self._done_without_forward.append(done)
            return done
        # Reserve the rest of the generation now when the pool has it; otherwise the request
        # grows block by block as it decodes (see step).
        extra = self._blocks_for(len(prompt_l), max_new_tokens) - len(blocks)
        if extra > 0 and self.block_pool.can_allocate(extra):
            req.block_ids += self.block_pool.allocate(extra)
        self._running.append(req)
        return None

    def expect_import(
        self, request_id: int, prompt: _Tokens, resume_tokens: _Tokens, max_new_tokens: int
    ) -> None:
        """Announce a handed-off request before its state arrives, for :attr:`decode_batch`.

        The handoff layer calls this when SUBMIT_REQUEST_WITH_KV arrives; the later
        ``decode_batch.admit(request_id, block_ids, ssm_slot)`` (or
        :meth:`complete_request_without_forward`) then finds the prompt, resume tokens and
        budget here.
        """
        if self.role == "prefill":
            raise HandoffStateError(
                "role='prefill' engine cannot admit handed-off requests", "role"
            )
        if request_id in self._expected:
            raise DuplicateRequestError(f"request_id={request_id} is already expected")
        self._validate_new(request_id, len(prompt), max_new_tokens)
        self._expected[request_id] = (list(prompt), list(resume_tokens), max_new_tokens)

    def complete_request_without_forward(self, request_id: int, result: object = None) -> None:
        """Finish an expected request whose resume tokens already satisfy it (the ledger
        released its state); it is reported by the next :meth:`step`. ``result`` is unused."""
        del result
        prompt, resume, _ = self._take_expected(request_id)
        self._done_without_forward.append(FinishedRequest(request_id, prompt, resume))

    @property
    def decode_batch(self) -> ReferenceDecodeBatch:
        """The admission surface of ``disagg_rs.engine_protocol.DecodeBatch``."""
        return ReferenceDecodeBatch(self)

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop on which the handoff layer resolves futures (given at construction)."""
        if self._event_loop is None:
            raise AttributeError("no event loop: construct ReferenceEngine(..., event_loop=loop)")
        return self._event_loop

    def abort(self, request_id: int) -> bool:
        """Drop a waiting, running or announced request, returning its blocks and slot to the
        pools (nothing is published: its KV may be partial). False if the id is unknown."""
        if self._expected.pop(request_id, None) is not None:
            return True
        for req in self._waiting:
            if req.request_id == request_id:
                self._waiting.remove(req)
                return True
        for req in self._running:
            if req.request_id == request_id:
                self._running.remove(req)
                self._drop(req)
                return True
        return False

    def reset(self) -> int:
        """Abort every request (waiting, running and announced); return how many. Pinned
        prefill handoffs are not touched: their owner releases them."""
        dropped = len(self._waiting) + len(self._running) + len(self._expected)
        for req in self._running:
            self._drop(req)
        self._waiting.clear()
        self._running = []
        self._expected.clear()
        self._done_without_forward = []
        return dropped

    def release_pinned(self, handoff: PrefillHandoff) -> None:
        """Unpin a prefill handoff's blocks and SSM slot (after the decode has the state)."""
        self.block_pool.release(handoff.block_ids)
        if handoff.ssm_slot is not None and self.ssm_slot_pool is not None:
            self.ssm_slot_pool.free(handoff.ssm_slot)

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Admit waiting prompts (FIFO, whole reservation or wait), run one forward over the
        running batch, sample greedily, and retire what finished."""
        out = StepOutput(finished=self._done_without_forward)
        self._done_without_forward = []
        self._admit_waiting()
        batch_reqs = [r for r in self._running if self._grow(r)]
        if not batch_reqs:
            if self._running:
                raise CapacityError(
                    f"every running request needs a block and none is free "
                    f"(num_free={self.block_pool.num_free}, running={len(self._running)})",
                    "num_blocks",
                )
            return out
        batch = BatchInput.build(
            [r.tokens[r.num_computed :] for r in batch_reqs],
            [r.num_computed for r in batch_reqs],
            [r.block_ids for r in batch_reqs],
            [r.ssm_slot or 0 for r in batch_reqs],
            self.config.device,
        )
        logits = self._stage.forward(batch)
        if logits is not None:
            sampled = torch.argmax(logits, dim=-1)
        else:
            sampled = torch.empty(len(batch_reqs), dtype=torch.int64, device=self.config.device)
        sampled = self.comm.broadcast_tokens(sampled)
        self.stats.steps += 1
        ended: set[int] = set()
        for req, tok in zip(batch_reqs, sampled.tolist(), strict=True):
            if req.num_computed < len(req.prompt):
                self.stats.prompt_tokens_computed += len(req.prompt) - req.num_computed
            if req.generated:
                self.stats.decode_tokens += 1
            req.num_computed = len(req.tokens)
            req.generated.append(int(tok))
            out.new_tokens[req.request_id] = int(tok)
            if self.role == "prefill":
                out.handoffs.append(self._pin(req))
                ended.add(req.request_id)
            elif len(req.generated) >= req.max_new_tokens or self._is_eos(int(tok)):
                out.finished.append(self._finish(req))
                ended.add(req.request_id)
        self._running = [r for r in self._running if r.request_id not in ended]
        return out

    def generate(
        self, prompts: dict[int, Sequence[int] | str], max_new_tokens: int
    ) -> dict[int, list[int]]:
        """Colocated convenience: queue every prompt and step until idle; tokens per id."""
        for rid, prompt in prompts.items():
            self.add_request(rid, prompt, max_new_tokens)
        result: dict[int, list[int]] = {}
        while self.has_work:
            for done in self.step().finished:
                result[done.request_id] = done.tokens
        return result

    def check_pools(self) -> None:
        """Run the pools' own consistency checks."""
        self.block_pool.check()
        if self.ssm_slot_pool is not None:
            self.ssm_slot_pool.check()

    # -- internals --------------------------------------------------------------------------

    def _is_eos(self, token: int) -> bool:
        return self.config.eos_token is not None and token == self.config.eos_token

    def _blocks_for(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        # The last generated token is never fed back, so its KV is never stored.
        kv_tokens = num_prompt_tokens
        if self.role != "prefill":
            kv_tokens += max_new_tokens - 1
        return _ceil_div(kv_tokens, self.block_size_tokens)

    def _validate_new(self, request_id: int, num_prompt: int, max_new_tokens: int) -> None:
        known = any(r.request_id == request_id for r in self._running) or any(
            r.request_id == request_id for r in self._waiting
        )
        if known:
            raise DuplicateRequestError(f"request_id={request_id} is already queued or running")
        if num_prompt < 1:
            raise ArgumentError(f"request {request_id}: prompt is empty (0 tokens)", "prompt")
        if max_new_tokens < 1:
            raise CapacityError(
                f"request {request_id}: max_new_tokens={max_new_tokens} must be >= 1",
                "max_new_tokens",
            )

    def _grow(self, req: _Request) -> bool:
        """Give ``req`` the blocks its next forward writes; False when the pool is short."""
        short = _ceil_div(len(req.tokens), self.block_size_tokens) - len(req.block_ids)
        if short <= 0:
            return True
        if not self.block_pool.can_allocate(short):
            return False
        req.block_ids += self.block_pool.allocate(short)
        return True

    def _take_expected(self, request_id: int) -> tuple[list[int], list[int], int]:
        meta = self._expected.pop(request_id, None)
        if meta is None:
            raise UnknownRequestError(
                f"request_id={request_id} was never announced (expect_import)"
            )
        return meta

    def _validate_tokens(self, request_id: int, tokens: list[int]) -> None:
        lo, hi = min(tokens, default=0), max(tokens, default=0)
        if lo < 0 or hi >= self.model.vocab_size:
            raise ArgumentError(
                f"request {request_id}: token ids span [{lo}, {hi}], outside the vocabulary "
                f"[0, {self.model.vocab_size})",
                "prompt",
            )

    def _prefix_reusable(self) -> bool:
        # A cached KV prefix only skips compute when no SSM state must be rebuilt over it.
        return self.config.enable_prefix_caching and not self.has_ssm

    def _admit_waiting(self) -> None:
        pool = self.block_pool
        while self._waiting and len(self._running) < self.config.max_batch:
            req = self._waiting[0]
            if self.ssm_slot_pool is not None and self.ssm_slot_pool.num_free < 1:
                return
            total = self._blocks_for(len(req.prompt), req.max_new_tokens)
            matched: list[int] = []
            if self._prefix_reusable():
                hashes = pool.block_hashes(req.prompt)
                # Keep at least one prompt token to run: its logits give the first token.
                usable = (len(req.prompt) - 1) // self.block_size_tokens
                matched = pool.match_prefix(hashes[:usable])
                pool.retain(matched)
            if not pool.can_allocate(total - len(matched)):
                pool.release(matched)
                return
            self._waiting.popleft()
            req.block_ids = matched + pool.allocate(total - len(matched))
            req.num_computed = len(matched) * self.block_size_tokens
            self.stats.prefix_hit_tokens += req.num_computed
            if self.ssm_slot_pool is not None:
                req.ssm_slot = self.ssm_slot_pool.allocate()
            self._running.append(req)

    def _publish(self, req: _Request, num_tokens: int) -> None:
        if not self.config.enable_prefix_caching:
            return
        hashes = self.block_pool.block_hashes(req.tokens[:num_tokens])
        self.block_pool.register_cached(req.block_ids[: len(hashes)], hashes)

    def _pin(self, req: _Request) -> PrefillHandoff:
        self._publish(req, len(req.prompt))
        return PrefillHandoff(
            request_id=req.request_id,
            prompt=req.prompt,
            block_ids=req.block_ids,
            ssm_slot=req.ssm_slot,
            first_token=req.generated[0],
            max_new_tokens=req.max_new_tokens,
        )

    def _finish(self, req: _Request) -> FinishedRequest:
        self._publish(req, req.num_computed)
        self._drop(req)
        return FinishedRequest(req.request_id, req.prompt, req.generated)

    def _drop(self, req: _Request) -> None:
        self.block_pool.release(req.block_ids)
        if req.ssm_slot is not None and self.ssm_slot_pool is not None:
            self.ssm_slot_pool.free(req.ssm_slot)


class ReferenceDecodeBatch:
    """``disagg_rs.engine_protocol.DecodeBatch`` over a :class:`ReferenceEngine`: admits
    requests announced with :meth:`ReferenceEngine.expect_import`."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self._engine = engine

    def can_admit(self, num_requests: int) -> int:
        """How many of ``num_requests`` ready imports fit in the running batch now."""
        return self._engine.batch_room(num_requests)

    def admit(self, request_id: int, block_ids: Sequence[int], ssm_slot: int | None) -> None:
        """Admit an announced request; it takes over one reference on each block and the
        slot (a slot detached from a ledger's pool is freed by the engine when it ends)."""
        engine = self._engine
        prompt, resume, max_new = engine._take_expected(request_id)
        try:
            engine.admit(request_id, prompt, resume, block_ids, ssm_slot, max_new)
        except Exception:
            engine._expected[request_id] = (prompt, resume, max_new)
            raise
