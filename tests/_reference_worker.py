"""Multi-process harness for the reference-engine tests: spawned processes, loopback gloo.

``run_world(world_size, cases)`` starts ``world_size`` spawned processes that join one gloo
group on 127.0.0.1 and run every case in order (each case builds its engines on all ranks);
rank 0's result per case comes back through a queue. Every wait has a timeout, and a worker
that raises sends its traceback instead of hanging its peers silently.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from _reference_state import Piece, assemble, manual_handoff, read_piece, write_state
from disagg_rs.reference import EngineConfig, ModelConfig, ReferenceEngine

TIMEOUT_S = 120.0


@dataclass(frozen=True)
class GenerateCase:
    """Colocated generation on one engine layout (optionally twice, to hit the prefix cache)."""

    model: ModelConfig
    config: EngineConfig
    prompts: dict[int, list[int]]
    max_new_tokens: int
    rounds: int = 1


@dataclass(frozen=True)
class HandoffCase:
    """Prefill on layout A, copy the state by hand, decode on layout B."""

    model: ModelConfig
    prefill: EngineConfig
    decode: EngineConfig
    prompts: dict[int, list[int]]
    max_new_tokens: int


@dataclass(frozen=True)
class SplitHandoffCase(HandoffCase):
    """Prefill and decode engines on disjoint ranks of one world (the disaggregated setup)."""


def _run_split(case: SplitHandoffCase) -> dict[str, Any]:
    me = dist.get_rank()
    pre = dec = None
    if me in case.prefill.engine_ranks():
        pre = ReferenceEngine(case.model, case.prefill)
    if me in case.decode.engine_ranks():
        dec = ReferenceEngine(case.model, case.decode)
    handoffs = {}
    if pre is not None:
        for rid, prompt in case.prompts.items():
            pre.add_request(rid, prompt, case.max_new_tokens)
        while pre.has_work:
            handoffs.update({h.request_id: h for h in pre.step().handoffs})
    tokens: dict[int, list[int]] = {}
    for rid in sorted(case.prompts):
        n = len(case.prompts[rid])
        piece = None
        if pre is not None:
            h = handoffs[rid]
            piece = read_piece(pre, h.block_ids, n, h.ssm_slot)
            piece.first_token = h.first_token
        pieces: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, piece)
        if pre is not None:
            pre.release_pinned(handoffs[rid])
        if dec is not None:
            state = assemble(dec, [p for p in pieces if p is not None], n)
            blocks = dec.block_pool.allocate(-(-n // dec.block_size_tokens))
            slot = dec.ssm_slot_pool.allocate() if dec.ssm_slot_pool is not None else None
            write_state(dec, state, blocks, slot)
            first = pieces_first_token(pieces, rid)
            dec.admit(rid, case.prompts[rid], [first], blocks, slot, case.max_new_tokens)
            for f in dec.step().finished:
                tokens[f.request_id] = f.tokens
    if dec is not None:
        while dec.has_work:
            for f in dec.step().finished:
                tokens[f.request_id] = f.tokens
    pools = [_pool_report(e) for e in (pre, dec) if e is not None]
    return {"tokens": tokens, "pools": pools, "role": "prefill" if pre is not None else "decode"}


def pieces_first_token(pieces: list[Any], rid: int) -> int:
    """The prefill's first token travels with the pieces (every prefill rank sends it)."""
    firsts = {p.first_token for p in pieces if p is not None}
    assert len(firsts) == 1, f"request {rid}: prefill ranks disagree on the first token {firsts}"
    return int(firsts.pop())


def _pool_report(engine: ReferenceEngine) -> dict[str, int]:
    engine.check_pools()
    slots = engine.ssm_slot_pool
    return {
        "free_blocks": engine.block_pool.num_free,
        "num_blocks": engine.config.num_blocks,
        "free_slots": slots.num_free if slots is not None else 0,
        "num_slots": engine.config.num_ssm_slots if slots is not None else 0,
    }


def _run_case(case: GenerateCase | HandoffCase | SplitHandoffCase) -> dict[str, Any]:
    if isinstance(case, SplitHandoffCase):
        return _run_split(case)
    if isinstance(case, GenerateCase):
        eng = ReferenceEngine(case.model, case.config)
        rounds = []
        for r in range(case.rounds):
            prompts = {rid + 1000 * r: p for rid, p in case.prompts.items()}
            out = eng.generate(prompts, case.max_new_tokens)  # type: ignore[arg-type]
            rounds.append({rid - 1000 * r: t for rid, t in out.items()})
        layouts = (eng.kv_layout is not None, eng.ssm_layout is not None)
        return {"rounds": rounds, "pools": [_pool_report(eng)], "layouts": layouts}
    pre = ReferenceEngine(case.model, case.prefill)
    dec = ReferenceEngine(case.model, case.decode)

    def gather(piece: Piece) -> list[Piece]:
        pieces: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, piece)
        return pieces

    tokens = manual_handoff(pre, dec, case.prompts, case.max_new_tokens, gather)
    return {"tokens": tokens, "pools": [_pool_report(pre), _pool_report(dec)]}


def _run_cases(rank: int, cases: list[Any]) -> list[dict[str, Any]]:
    del rank
    return [_run_case(c) for c in cases]


def _rank_main(
    rank: int, world: int, port: int, timeout_s: float, fn: Any, args: tuple[Any, ...], out: Any
) -> None:
    # Ranks share two (busy) cores: intra-op threads would only oversubscribe them.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        out.put((rank, "ok", fn(rank, *args)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_gloo_world(world: int, fn: Any, *args: Any, timeout_s: float = TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, *args)`` (a module-level function) on ``world`` spawned ranks of one
    gloo world; returns each rank's result, in rank order. A rank's error fails the call."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, timeout_s, fn, args, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, payload = out.get(timeout=timeout_s * 2)
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout_s * 2} s waiting for the ranks")
    finally:
        for p in procs:
            p.join(timeout=30)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    if errors:
        raise AssertionError("\n".join(errors))
    return [got[r] for r in range(world)]


def run_world(world: int, cases: list[Any]) -> list[list[dict[str, Any]]]:
    """Run ``cases`` on ``world`` spawned ranks; results per rank, per case."""
    return spawn_gloo_world(world, _run_cases, cases)
