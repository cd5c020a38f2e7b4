"""A second engine, written only against ``disagg_rs.engine_protocol`` (not the reference
engine), hands prompts off from a prefill process to a decode process: real NIXL (UCX over
loopback) or the two-sided transport on real gloo moves the KV cache, gloo carries the control
messages, and the decode reserves speculative lookahead blocks with every import.

The engine's "model" is deterministic arithmetic: a prompt token's KV depends on the token and
its position, and each decoded token on every KV value the request holds, so a decode that
continues from one wrong byte answers differently. Every answer must equal a colocated run,
the imported cache must equal the prefill's byte for byte, and every pool must be free at the
end."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _reference_worker import spawn_gloo_world
from disagg_rs import KVShardLayout
from disagg_rs.engine_protocol import HandoffEngine, HandoffHost
from disagg_rs.inference_state_handoff import InferenceStateHandoffMixin, with_push_destination
from toy_engine import ExpectingEngine

os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

TIMEOUT_S = 300.0
LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 2, 4, 251
BLOCK = 4
SPECULATIVE = 2
NUM_BLOCKS = 48

# (request id, prompt, tokens to generate, stop words); request 3's first token is a stop word.
PROMPTS: list[tuple[int, list[int], int, list[list[int]]]] = [
    (0, [5, 9, 200, 3, 17, 42, 8], 6, []),
    (1, list(range(30, 52)), 5, []),
    (2, [11, 12, 13, 14, 15, 16, 17, 18], 1, []),
]


def first_token(prompt: list[int]) -> int:
    """The prefill's sampled token."""
    return (sum(prompt) * 13 + len(prompt)) % VOCAB


PROMPTS.append((3, [1, 2, 3], 4, [[first_token([1, 2, 3])]]))


def kv_values(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """KV of tokens at positions: ``[2, L, n, H, d]`` float32 (vectorised)."""
    kv = torch.arange(2).view(2, 1, 1, 1, 1)
    layer = torch.arange(LAYERS).view(1, LAYERS, 1, 1, 1)
    head = torch.arange(HEADS).view(1, 1, 1, HEADS, 1)
    dim = torch.arange(HEAD_DIM).view(1, 1, 1, 1, HEAD_DIM)
    t = tokens.view(1, 1, -1, 1, 1)
    p = positions.view(1, 1, -1, 1, 1)
    return ((t * 31 + p * 7 + layer * 3 + head * 5 + dim + kv * 11) % 97).float() / 97.0


def next_token(kv: torch.Tensor, last: int) -> int:
    """A decoded token from every KV value of the request (``[2, L, n, H, d]``) and the last
    token."""
    return (int(kv.double().sum().item() * 1000) + last * 17) % VOCAB


def colocated(prompt: list[int], max_new: int, stop_words: list[list[int]]) -> list[int]:
    """The answer of one engine that runs prefill and decode itself: each step feeds the last
    token back (writing its KV) and reads the KV of every position so far."""
    out = [first_token(prompt)]
    while len(out) < max_new and not any(out[-len(w) :] == w for w in stop_words):
        seq = prompt + out
        out.append(next_token(kv_values(torch.tensor(seq), torch.arange(len(seq))), out[-1]))
    return out


@dataclass
class Settings:
    eos_token: int | None = None


@dataclass
class Shape:
    head_dim: int = HEAD_DIM


@dataclass
class Sampling:
    """The reference design's sampling parameters, as the mixin reads them."""

    num_tokens_to_generate: int
    termination_id: int | None = None
    stop_word_ids: list[list[int]] = field(default_factory=list)


@dataclass
class Finished:
    request_id: int
    block_ids: list[int]
    ssm_slot: int | None
    first_token: int
    prompt: list[int]


class Batch:
    """The engine's decode batch (``engine_protocol.DecodeBatch``)."""

    def __init__(self, engine: ContractEngine, max_batch: int) -> None:
        self.engine, self.max_batch = engine, max_batch

    def can_admit(self, num_requests: int) -> int:
        return max(0, min(num_requests, self.max_batch - len(self.engine.running)))

    def admit(self, request_id: int, block_ids: Any, ssm_slot: int | None) -> None:
        prompt, resume, max_new = self.engine.expected.pop(request_id)
        self.engine.admitted_blocks[request_id] = len(block_ids)
        self.engine.running[request_id] = (prompt, list(resume), max_new, list(block_ids))


class ContractEngine(ExpectingEngine, InferenceStateHandoffMixin):
    """Attention-only toy engine providing exactly ``engine_protocol.HandoffHost``."""

    def __init__(self, role: str, backend: str, rank: int, loop: asyncio.AbstractEventLoop):
        self.init_handoff_state()
        self.handoff_mp_rank = 0
        self.config = Settings()
        self.model = Shape()
        self.block_size_tokens = BLOCK
        self.num_speculative_tokens = SPECULATIVE
        ledger = self.make_handoff_ledger(
            role,
            NUM_BLOCKS,
            BLOCK,
            0,
            pull=backend != "nccl",
            num_speculative_tokens=SPECULATIVE,
        )
        self.attach_handoff_ledger(ledger)
        self.block_pool = ledger.block_pool
        self.ssm_slot_pool = None
        self.kv_cache = torch.zeros(2, LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
        self.kv_cache_layout = "megatron"
        self.kv_layout = KVShardLayout(LAYERS, HEADS, global_rank=rank)
        self.ssm_layout = None
        self.ssm_conv_state = None
        self.ssm_recurrent_state = None
        self.num_waiting = 0
        self._loop = loop
        self.decode_batch = Batch(self, max_batch=2)
        self.expected: dict[int, tuple[list[int], list[int], int]] = {}
        self.running: dict[int, tuple[list[int], list[int], int, list[int]]] = {}
        self.answers: dict[int, list[int]] = {}
        self.admitted_blocks: dict[int, int] = {}
        self.stop_words: dict[int, list[list[int]]] = {}

    def finish_without_forward(self, request_id: int, tokens: list[int]) -> None:
        self.answers[request_id] = tokens

    # -- the toy model -----------------------------------------------------------------------------
    def _slots(self, blocks: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n)
        return torch.tensor(blocks)[pos // BLOCK], pos % BLOCK

    def prefill(self, rid: int, prompt: list[int]) -> Finished:
        blocks = self.block_pool.allocate(-(-len(prompt) // BLOCK))
        blk, off = self._slots(blocks, len(prompt))
        self.kv_cache[:, :, blk, off] = kv_values(torch.tensor(prompt), torch.arange(len(prompt)))
        return Finished(rid, blocks, None, first_token(prompt), prompt)

    def prompt_kv(self, blocks: list[int], n: int) -> torch.Tensor:
        blk, off = self._slots(blocks, n)
        return self.kv_cache[:, :, blk, off].clone()

    def step(self) -> None:
        """One decode step of every running request."""
        for rid, (prompt, out, max_new, blocks) in list(self.running.items()):
            if len(out) >= max_new or any(out[-len(w) :] == w for w in self.stop_words[rid]):
                self.block_pool.release(blocks)
                del self.running[rid]
                self.answers[rid] = out
                continue
            n = len(prompt) + len(out) - 1  # position of the token fed back now
            if n + 1 > len(blocks) * BLOCK:
                blocks += self.block_pool.allocate(1)
            blk, off = self._slots(blocks, n + 1)
            self.kv_cache[:, :, blk[n:], off[n:]] = kv_values(
                torch.tensor([out[-1]]), torch.tensor([n])
            )
            out.append(next_token(self.kv_cache[:, :, blk, off], out[-1]))


def _exchange(obj: Any, src: int) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _prefill_and_share(
    engine: ContractEngine, rank: int, rid: int, prompt: list[int], prefill_meta: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """Rank 0 prefills ``prompt`` and shares its ticket and prompt KV; every rank returns them."""
    payload = None
    if rank == 0:
        finished = engine.prefill(rid, prompt)
        ticket = engine.capture_handoff_ticket(finished)
        ticket["prefill_meta"] = prefill_meta
        payload = (ticket, engine.prompt_kv(finished.block_ids, len(prompt)))
    shared: tuple[dict[str, Any], torch.Tensor] = _exchange(payload, 0)
    return shared


def _run(rank: int, backend: str) -> dict[str, Any]:
    role = "prefill" if rank == 0 else "decode"
    loop = asyncio.new_event_loop()
    engine = ContractEngine(role, backend, rank, loop)
    assert isinstance(engine, HandoffEngine) and isinstance(engine, HandoffHost)
    engine.setup_kv_transfer(role, backend)
    prefill_meta = _exchange(engine.handoff_static_meta if rank == 0 else None, 0)
    decode_meta = _exchange(engine.handoff_static_meta if rank == 1 else None, 1)
    now = 1_000
    report: dict[str, Any] = {"role": role}
    futures: dict[int, asyncio.Future[Any]] = {}
    for rid, prompt, max_new, stops in PROMPTS:
        now += 1_000_000
        engine.handoff_now_ns = now
        ticket, prefill_kv = _prefill_and_share(engine, rank, rid, prompt, prefill_meta)
        if rank == 1:
            engine.stop_words[rid] = stops
            sampling = Sampling(max_new, stop_word_ids=stops)
            futures[rid] = engine.add_request_with_kv_handoff(
                rid, prompt, sampling, ticket, ticket["src_block_ids"]
            )
        started = engine.kv_import_destination(rid) if rank == 1 else None
        destination = _exchange(started, 1)
        if rank == 0 and destination is not None and backend == "nccl":
            engine.push_handoff_kv(rid, with_push_destination(decode_meta["ranks"], destination))
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            now += 1_000
            engine.handoff_now_ns = now
            if rank == 0:
                engine.poll_kv_pushes()
                if not engine.pending_kv_push_count:
                    break
            else:
                engine.poll_kv_imports()
                engine.schedule_waiting_requests()
                if futures[rid].done():
                    break
        if rank == 1:
            assert futures[rid].result() == rid
            if rid in engine.running:
                blocks = engine.running[rid][3]
                got = engine.prompt_kv(blocks, len(prompt))
                assert torch.equal(got, prefill_kv), f"request {rid}: imported KV differs"
        _exchange(None, 1)  # the decode has admitted: RELEASE_KV
        if rank == 0:
            engine.release_handoff_blocks(rid)
    if rank == 1:
        while engine.running:
            engine.step()
        report["answers"] = engine.answers
        report["admitted_blocks"] = engine.admitted_blocks
        report["completed_without_forward"] = engine.handoff_stats[
            "imports_completed_without_forward"
        ]
    report["free"] = engine.block_pool.num_free
    loop.close()
    engine.close_kv_transfer()
    return report


@pytest.mark.parametrize("backend", ["nixl", "nccl"], ids=["nixl", "two-sided-on-gloo"])
def test_an_engine_written_against_the_protocol_hands_off_byte_exact_with_lookahead(
    backend: str,
) -> None:
    got = dict(enumerate(spawn_gloo_world(2, _run, backend, timeout_s=TIMEOUT_S)))
    decode = got[1]
    expected = {rid: colocated(p, n, s) for rid, p, n, s in PROMPTS}
    assert decode["answers"] == expected
    # Request 2 (one token) and request 3 (its first token is a stop word) end at admission.
    assert decode["completed_without_forward"] == 2
    for rid, prompt, _, _ in PROMPTS:
        if rid in decode["admitted_blocks"]:
            # The ledger reserved the resume token and the speculative lookahead with the prompt.
            need = -(-(len(prompt) + 1 + SPECULATIVE) // BLOCK)
            assert decode["admitted_blocks"][rid] == need, (rid, decode["admitted_blocks"])
    assert set(decode["admitted_blocks"]) == {0, 1}
    assert got[0]["free"] == NUM_BLOCKS
    assert decode["free"] == NUM_BLOCKS
