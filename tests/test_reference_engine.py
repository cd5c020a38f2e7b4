"""The reference engine in one process: model math against a naive oracle, cache layouts,
block sizes, continuous batching, prefix caching, roles and a manual in-process handoff."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from _reference_state import Piece, assemble, manual_handoff, read_piece, write_state
from disagg_rs import KVShardLayout, SSMShardLayout
from disagg_rs.engine_protocol import HandoffEngine
from disagg_rs.exceptions import (
    BlockIdError,
    CapacityError,
    DuplicateRequestError,
    HandoffStateError,
    UnknownRequestError,
)
from disagg_rs.ledger import ImportLedger, PinLedger
from disagg_rs.reference import (
    EngineConfig,
    ModelConfig,
    ReferenceEngine,
    attention_model,
    encode_text,
    hybrid_model,
)
from disagg_rs.reference.weights import AttentionWeights, MlpWeights, SsmWeights, global_tensor

PROMPTS = {
    0: encode_text("Disaggregated serving moves the prompt's state to the decoder. " * 2),
    1: encode_text("The quick brown fox jumps over the lazy dog."),
    2: encode_text("abc"),
    3: encode_text("Mamba layers carry a recurrent state; attention layers carry KV blocks!"),
}
MAX_NEW = 12


def engine(model: ModelConfig, **cfg: object) -> ReferenceEngine:
    return ReferenceEngine(model, EngineConfig(**cfg))  # type: ignore[arg-type]


def assert_pools_free(e: ReferenceEngine) -> None:
    e.check_pools()
    assert e.block_pool.num_free == e.config.num_blocks
    if e.ssm_slot_pool is not None:
        assert e.ssm_slot_pool.num_free == e.config.num_ssm_slots


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos.double()[:, None] * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    return torch.cat(
        [x[..., :half] * cos - x[..., half:] * sin, x[..., :half] * sin + x[..., half:] * cos], -1
    )


def oracle_generate(m: ModelConfig, prompt: list[int], n: int) -> list[int]:
    """Recompute the whole sequence for every token: dense causal attention, the SSM as a
    token-by-token recurrence with an explicit conv window. No cache, no padding, no TP."""
    kv = KVShardLayout(max(m.num_attention_layers, 1), m.num_kv_heads)
    ssm = SSMShardLayout(m.num_ssm_layers, m.ssm_dims) if m.num_ssm_layers else None
    h = m.hidden
    emb = global_tensor(m, -1, "embedding", (m.vocab_size, h)) * h**0.5
    final_norm = 1.0 + 0.1 * global_tensor(m, -1, "final_norm", (h,))
    head = global_tensor(m, -1, "lm_head", (m.vocab_size, h))
    toks = list(prompt)
    for _ in range(n):
        x = emb[torch.tensor(toks)]
        t_len = x.shape[0]
        pos = torch.arange(t_len)
        for layer, kind in enumerate(m.layer_kinds):
            mlp = MlpWeights.build(m, layer, 1, 0)
            a = _rms(x, mlp.norm_mix, m.rms_eps)
            if kind == "attention":
                w = AttentionWeights.build(m, layer, kv)
                q = _rope((a @ w.wq.T).view(t_len, -1, m.head_dim), pos, m.rope_base)
                k = _rope((a @ w.wk.T).view(t_len, -1, m.head_dim), pos, m.rope_base)
                v = (a @ w.wv.T).view(t_len, -1, m.head_dim)
                g = m.num_q_heads // m.num_kv_heads
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
                s = torch.einsum("qhd,khd->hqk", q, k) / m.head_dim**0.5
                s = s.masked_fill(~torch.ones(t_len, t_len, dtype=torch.bool).tril(), float("-inf"))
                o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t_len, -1)
                x = x + o @ w.wo.T
            else:
                assert ssm is not None
                w2 = SsmWeights.build(m, layer, ssm)
                p, ds, kw = m.ssm_head_dim, m.ssm_d_state, m.ssm_d_conv
                hh, gg = m.ssm_num_heads, m.ssm_n_groups
                z = (a @ w2.wz.T).view(t_len, hh, p)
                xbc = a @ w2.wxbc.T
                dt = F.softplus(a @ w2.wdt.T + w2.dt_bias)
                u = torch.cat([torch.zeros(kw - 1, xbc.shape[1], dtype=torch.float64), xbc])
                state = torch.zeros(hh, p, ds, dtype=torch.float64)
                ys = []
                for t in range(t_len):
                    c = F.silu((u[t : t + kw].T * w2.conv_w).sum(-1) + w2.conv_b)
                    xs = c[: hh * p].view(hh, p)
                    bb = c[hh * p : hh * p + gg * ds].view(gg, ds)[w2.head_to_group]
                    cc = c[hh * p + gg * ds :].view(gg, ds)[w2.head_to_group]
                    decay = torch.exp(dt[t] * -torch.exp(w2.a_log))
                    state = (
                        decay[:, None, None] * state
                        + (dt[t][:, None] * xs)[..., None] * bb[:, None, :]
                    )
                    y = (state * cc[:, None, :]).sum(-1) + xs * w2.d_skip[:, None]
                    ys.append(y)
                y = torch.stack(ys) * F.silu(z)
                y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m.rms_eps)
                x = x + (y.reshape(t_len, -1) * w2.norm_w) @ w2.wout.T
            b = _rms(x, mlp.norm_mlp, m.rms_eps)
            x = x + (F.silu(b @ mlp.w_gate.T) * (b @ mlp.w_up.T)) @ mlp.w_down.T
        logits = _rms(x[-1], final_norm, m.rms_eps) @ head.T
        toks.append(int(logits.argmax()))
    return toks[len(prompt) :]


@pytest.mark.parametrize("model", [hybrid_model(), attention_model()], ids=["hybrid", "attention"])
def test_engine_tokens_equal_a_naive_full_recompute_oracle(model: ModelConfig) -> None:
    e = engine(model)
    got = e.generate(dict(PROMPTS), 6)
    for rid, prompt in PROMPTS.items():
        assert got[rid] == oracle_generate(model, prompt, 6), rid
    assert_pools_free(e)


@pytest.mark.parametrize("layout", ["megatron", "nhd", "hnd"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_every_cache_layout_and_block_size_gives_identical_tokens(
    layout: str, block_size: int
) -> None:
    base = engine(hybrid_model()).generate(dict(PROMPTS), MAX_NEW)
    e = engine(hybrid_model(), cache_layout=layout, block_size_tokens=block_size)
    assert e.generate(dict(PROMPTS), MAX_NEW) == base
    assert e.kv_cache_layout == layout
    assert_pools_free(e)


def test_cache_tensors_have_the_documented_shapes() -> None:
    m = hybrid_model()
    e = engine(m, cache_layout="megatron", num_blocks=10, block_size_tokens=16)
    assert isinstance(e.kv_cache, torch.Tensor)
    assert tuple(e.kv_cache.shape) == (2, 3, 10, 16, 2, 16)
    nhd = engine(m, cache_layout="nhd", num_blocks=10).kv_cache
    hnd = engine(m, cache_layout="hnd", num_blocks=10).kv_cache
    assert isinstance(nhd, list) and isinstance(hnd, list) and len(nhd) == len(hnd) == 3
    assert tuple(nhd[0].shape) == (2, 10, 16, 2, 16)
    assert tuple(hnd[0].shape) == (2, 10, 2, 16, 16)
    assert e.ssm_conv_state is not None and e.ssm_recurrent_state is not None
    assert tuple(e.ssm_conv_state.shape) == (3, 8, m.ssm_dims.conv_channels, 4)
    assert tuple(e.ssm_recurrent_state.shape) == (3, 8, 4, 8, 8)


def test_continuous_batching_with_staggered_arrivals_matches_one_request_at_a_time() -> None:
    m = hybrid_model()
    alone = {rid: engine(m).generate({rid: p}, MAX_NEW)[rid] for rid, p in PROMPTS.items()}
    e = engine(m, max_batch=3)
    got: dict[int, list[int]] = {}
    for rid, prompt in PROMPTS.items():
        e.add_request(rid, prompt, MAX_NEW)
        for f in e.step().finished:  # each arrival joins a batch that is already decoding
            got[f.request_id] = f.tokens
    while e.has_work:
        for f in e.step().finished:
            got[f.request_id] = f.tokens
    assert got == alone
    assert_pools_free(e)


def test_waiting_prompts_start_in_fifo_order_when_blocks_run_short() -> None:
    m = attention_model()
    e = engine(m, num_blocks=6, block_size_tokens=16, enable_prefix_caching=False)
    e.add_request(0, [1] * 60, 20)  # 79 KV tokens: 5 blocks
    e.add_request(1, [2] * 40, 8)  # 3 blocks: must wait behind request 0's reservation
    e.add_request(2, [3] * 3, 2)  # 1 block: fits, but never overtakes request 1
    e.step()
    assert (e.num_running, e.num_waiting) == (1, 2)
    while e.has_work:
        e.step()
    assert_pools_free(e)


@pytest.mark.parametrize("model", [attention_model(), hybrid_model()], ids=["attention", "hybrid"])
def test_prefix_cache_reuse_gives_identical_tokens(model: ModelConfig) -> None:
    shared = encode_text("A long shared system prompt that many requests begin with. " * 2)
    first = {0: shared + encode_text("First question?")}
    second = {1: shared + encode_text("Second, different question?"), 2: shared}
    cold = engine(model).generate(dict(second), MAX_NEW)
    e = engine(model, block_size_tokens=16)
    e.generate(dict(first), MAX_NEW)
    assert e.block_pool.num_evictable > 0  # published blocks stay cached after release
    assert e.generate(dict(second), MAX_NEW) == cold
    if model.num_ssm_layers:
        # Hybrid: the SSM state over the prefix is not cached, so the prefix is recomputed.
        assert e.stats.prefix_hit_tokens == 0
    else:
        # Both second-round prompts reuse the whole-block part of the shared prefix.
        full = (len(shared) - 1) // 16 * 16
        assert e.stats.prefix_hit_tokens >= full + (len(shared) // 16 * 16)
    assert_pools_free(e)


def test_eos_token_ends_a_request_early() -> None:
    m = hybrid_model()
    free_run = engine(m).generate({0: PROMPTS[1]}, MAX_NEW)[0]
    eos = free_run[3]
    got = engine(m, eos_token=eos).generate({0: PROMPTS[1]}, MAX_NEW)[0]
    assert got == free_run[: free_run.index(eos) + 1]


def test_prefill_role_pins_blocks_and_slot_until_released() -> None:
    m = hybrid_model()
    e = engine(m, role="prefill", block_size_tokens=16)
    e.add_request(7, PROMPTS[0], MAX_NEW)
    out = e.step()
    assert not e.has_work and not out.finished
    (h,) = out.handoffs
    colocated = engine(m).generate({7: PROMPTS[0]}, MAX_NEW)[7]
    assert h.first_token == colocated[0] == out.new_tokens[7]
    assert len(h.block_ids) == -(-len(PROMPTS[0]) // 16)
    assert e.block_pool.num_free == e.config.num_blocks - len(h.block_ids)
    assert h.ssm_slot is not None and e.ssm_slot_pool is not None
    assert e.ssm_slot_pool.num_free == e.config.num_ssm_slots - 1
    e.release_pinned(h)
    assert_pools_free(e)


def test_a_pin_ledger_sharing_the_engine_pools_can_take_over_a_prefill_handoff() -> None:
    pins = PinLedger(64, 16, 8)
    e = ReferenceEngine(
        hybrid_model(),
        EngineConfig(role="prefill", block_size_tokens=16),
        block_pool=pins.block_pool,
        ssm_slot_pool=pins.slot_pool,
    )
    e.add_request(1, PROMPTS[0], MAX_NEW)
    (h,) = e.step().handoffs
    pins.pin(1, h.block_ids, h.ssm_slot, lease_until=100, now=0)
    e.block_pool.release(h.block_ids)  # the engine's reference ends; the pin's remains
    assert e.block_pool.num_free == 64 - len(h.block_ids)
    (released,) = pins.release(1)  # RELEASE_KV
    assert released.kind == "release"
    pins.check()
    assert_pools_free(e)


def test_bad_prompts_and_configs_are_rejected_naming_the_value() -> None:
    e = engine(hybrid_model())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.add_request(0, [1, 256], 4)
    with pytest.raises(ValueError, match="prompt is empty"):
        e.add_request(0, [], 4)
    with pytest.raises(CapacityError, match="max_new_tokens=0"):
        e.add_request(0, [1], 0)
    with pytest.raises(CapacityError, match="num_blocks=64"):
        e.add_request(0, [1] * 2000, 4)
    assert not e.has_work
    with pytest.raises(ValueError, match="block_size_tokens=0"):
        EngineConfig(block_size_tokens=0)
    with pytest.raises(ValueError, match="stage_layers"):
        EngineConfig(pp=2, stage_layers=(6, 0)).windows(hybrid_model())


def test_abort_and_reset_return_every_block_and_slot() -> None:
    m = hybrid_model()
    e = engine(m, max_batch=2)
    for rid, prompt in PROMPTS.items():
        e.add_request(rid, prompt, MAX_NEW)
    e.step()  # two running, two waiting
    assert (e.num_running, e.num_waiting) == (2, 2)
    assert e.abort(0) and e.abort(3) and not e.abort(99)
    assert (e.num_running, e.num_waiting) == (1, 1)
    e.step()
    assert e.reset() == 2 and not e.has_work
    assert_pools_free(e)
    # The engine keeps working after a reset, with the same answers.
    assert e.generate({1: PROMPTS[1]}, MAX_NEW) == engine(m).generate({1: PROMPTS[1]}, MAX_NEW)
    assert_pools_free(e)


def test_decode_role_refuses_prompts() -> None:
    e = engine(hybrid_model(), role="decode")
    with pytest.raises(HandoffStateError, match="role='decode'"):
        e.add_request(0, PROMPTS[0], 4)
    assert not e.has_work


def _local_gather(piece: Piece) -> list[Piece]:
    return [piece]


@pytest.mark.parametrize(
    ("model", "src", "dst"),
    [
        (
            hybrid_model(),
            {"cache_layout": "nhd", "block_size_tokens": 16},
            {"cache_layout": "megatron", "block_size_tokens": 64},
        ),
        (
            hybrid_model(),
            {"cache_layout": "megatron", "block_size_tokens": 64},
            {"cache_layout": "hnd", "block_size_tokens": 16},
        ),
        (
            attention_model(),
            {"cache_layout": "hnd", "block_size_tokens": 16},
            {"cache_layout": "nhd", "block_size_tokens": 64},
        ),
    ],
    ids=["hybrid-nhd16-to-megatron64", "hybrid-megatron64-to-hnd16", "attention-hnd16-to-nhd64"],
)
def test_manual_handoff_in_one_process_decodes_exactly_like_the_colocated_run(
    model: ModelConfig, src: dict[str, object], dst: dict[str, object]
) -> None:
    colocated = engine(model).generate(dict(PROMPTS), MAX_NEW)
    pre = engine(model, role="prefill", **src)
    dec = engine(model, role="decode", max_batch=3, **dst)
    got = manual_handoff(pre, dec, dict(PROMPTS), MAX_NEW, _local_gather)
    assert got == colocated
    assert dec.stats.prompt_tokens_computed == 0 and dec.stats.imported_requests == len(PROMPTS)
    assert_pools_free(pre)
    assert_pools_free(dec)


def test_resume_token_that_finishes_the_request_completes_without_a_forward() -> None:
    m = hybrid_model()
    dec = engine(m, role="decode")
    assert dec.ssm_slot_pool is not None
    blocks, slot = dec.block_pool.allocate(1), dec.ssm_slot_pool.allocate()
    done = dec.admit(5, [1, 2, 3], [42], blocks, slot, max_new_tokens=1)
    assert done is not None and done.tokens == [42]
    out = dec.step()
    assert [f.request_id for f in out.finished] == [5] and dec.stats.steps == 0
    assert_pools_free(dec)


def test_admit_rejects_bad_input_and_changes_nothing() -> None:
    dec = engine(hybrid_model(), role="decode", num_blocks=4, block_size_tokens=16, max_batch=1)
    assert dec.ssm_slot_pool is not None
    blocks, slot = dec.block_pool.allocate(2), dec.ssm_slot_pool.allocate()
    prompt = list(range(20))
    with pytest.raises(BlockIdError, match="len\\(block_ids\\)=1 < 2"):
        dec.admit(1, prompt, [9], blocks[:1], slot, 4)
    with pytest.raises(BlockIdError, match="ssm_slot=None"):
        dec.admit(1, prompt, [9], blocks, None, 4)
    with pytest.raises(BlockIdError, match="resume_tokens"):
        dec.admit(1, prompt, [], blocks, slot, 4)
    assert dec.block_pool.num_free == 2 and not dec.has_work
    assert dec.can_admit(20, 4, 2)
    assert dec.admit(1, prompt, [9], blocks, slot, 4) is None
    with pytest.raises(DuplicateRequestError):
        dec.admit(1, prompt, [9], blocks, slot, 4)
    assert not dec.can_admit(20, 4, 2)  # max_batch=1 is full
    with pytest.raises(CapacityError, match="max_batch=1"):
        dec.admit(2, prompt, [9], blocks, slot, 4)
    while dec.has_work:
        dec.step()
    assert_pools_free(dec)


def test_an_import_the_pool_cannot_fully_reserve_grows_block_by_block() -> None:
    m = attention_model()
    colocated = engine(m).generate({0: PROMPTS[1], 1: PROMPTS[2]}, 30)
    dec = engine(m, role="decode", num_blocks=11, block_size_tokens=8)
    pre = engine(m, role="prefill", block_size_tokens=8)
    # Request 0 (44 + 29 KV tokens) reserves all its 10 blocks; request 1 (3 + 29) gets only
    # its prompt block, waits out the steps where no block is free, and finishes after 0.
    got = manual_handoff(pre, dec, {0: PROMPTS[1], 1: PROMPTS[2]}, 30, _local_gather)
    assert got == colocated
    assert_pools_free(dec)


def test_a_batch_where_every_request_waits_for_a_block_raises_capacity_error() -> None:
    dec = engine(attention_model(), role="decode", num_blocks=2, block_size_tokens=4)
    dec.admit(1, [5, 6, 7, 8], [1], dec.block_pool.allocate(1), None, 40)
    dec.admit(2, [5, 6, 7, 8], [1], dec.block_pool.allocate(1), None, 40)
    with pytest.raises(CapacityError, match="none is free"):
        dec.step()


@pytest.mark.parametrize("model", [attention_model(), hybrid_model()], ids=["attention", "hybrid"])
def test_ledger_driven_imports_reuse_the_decode_prefix_cache_and_match_the_colocated_run(
    model: ModelConfig,
) -> None:
    m = model
    slots = 4 if m.num_ssm_layers else 0
    shared = encode_text("The shared preamble that a second request repeats word for word. ")
    prompts = {0: shared + encode_text("first"), 1: shared + encode_text("second one")}
    colocated = engine(m).generate(dict(prompts), MAX_NEW)
    pre = engine(m, role="prefill", block_size_tokens=16)
    ledger = ImportLedger(32, 16, slots, pull=True)
    loop = asyncio.new_event_loop()
    try:
        dec = ReferenceEngine(
            m,
            EngineConfig(role="decode", num_blocks=32, block_size_tokens=16, num_ssm_slots=slots),
            block_pool=ledger.block_pool,
            ssm_slot_pool=ledger.slot_pool,
            event_loop=loop,
        )
        assert isinstance(dec, HandoffEngine)
        results: dict[int, list[int]] = {}
        for rid, prompt in prompts.items():  # one after the other: the second hits the cache
            pre.add_request(rid, prompt, MAX_NEW)
            (h,) = pre.step().handoffs
            n = len(h.prompt)
            state = assemble(pre, [read_piece(pre, h.block_ids, n, h.ssm_slot)], n)
            dec.expect_import(rid, h.prompt, [h.first_token], h.max_new_tokens)
            (start,) = ledger.submit(
                rid,
                h.prompt,
                src_block_ids=h.block_ids,
                src_block_size_tokens=16,
                resume_tokens=1,
                has_ssm=bool(slots),
                deadline=10**6,
                now=0,
            )
            assert start.kind == "start"
            prompt_blocks = start.cached_block_ids + start.dst_block_ids
            write_state(dec, state, prompt_blocks, start.ssm_slot, token_start=start.token_start)
            pre.release_pinned(h)
            ledger.report(rid, start.epoch, rank=0, outcome="ok", now=1)
            for action in ledger.admit(dec.decode_batch.can_admit(1)):
                assert action.kind == "admit"
                dec.decode_batch.admit(action.request_id, action.block_ids, action.ssm_slot)
            while dec.has_work:
                for f in dec.step().finished:
                    results[f.request_id] = f.tokens
            if rid == 1:
                assert start.token_start == len(shared) // 16 * 16 > 0
        assert results == colocated
        ledger.check()
        assert_pools_free(dec)
        assert_pools_free(pre)
    finally:
        loop.close()


def test_complete_without_forward_reports_the_announced_request() -> None:
    dec = engine(attention_model(), role="decode")
    dec.expect_import(3, [1, 2], [7], 1)
    with pytest.raises(UnknownRequestError):
        dec.complete_request_without_forward(4)
    dec.complete_request_without_forward(3)
    (done,) = dec.step().finished
    assert (done.request_id, done.tokens) == (3, [7])
    assert_pools_free(dec)


def test_an_engine_without_an_event_loop_is_not_yet_a_handoff_engine() -> None:
    assert not isinstance(engine(attention_model()), HandoffEngine)


_BASELINE = ReferenceEngine(hybrid_model(), EngineConfig())


@given(
    prompts=st.lists(st.binary(min_size=1, max_size=24), min_size=1, max_size=3),
    max_new=st.integers(1, 4),
    layout=st.sampled_from(["megatron", "nhd", "hnd"]),
    block_size=st.sampled_from([1, 3, 16]),
    max_batch=st.integers(1, 3),
)
def test_tokens_do_not_depend_on_layout_block_size_or_batching(
    prompts: list[bytes], max_new: int, layout: str, block_size: int, max_batch: int
) -> None:
    m = hybrid_model()
    reqs = {i: list(p) for i, p in enumerate(prompts)}
    # One request at a time on a reused default engine (it ends every example with all pools
    # free, so earlier examples cannot influence later ones).
    alone = {i: _BASELINE.generate({i: p}, max_new)[i] for i, p in reqs.items()}
    e = engine(
        m, cache_layout=layout, block_size_tokens=block_size, max_batch=max_batch, num_blocks=64
    )
    assert e.generate(dict(reqs), max_new) == alone  # type: ignore[arg-type]
    assert_pools_free(e)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["megatron", "nhd", "hnd"])
def test_a_cuda_engine_generates_the_same_tokens_as_the_cpu_engine(layout: str) -> None:
    expected = engine(hybrid_model()).generate(dict(PROMPTS), MAX_NEW)
    e = engine(hybrid_model(), cache_layout=layout, device="cuda")
    assert e.generate(dict(PROMPTS), MAX_NEW) == expected
    kv = e.kv_cache
    assert (kv if isinstance(kv, torch.Tensor) else kv[0]).is_cuda
    assert_pools_free(e)


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_prefill_hands_off_to_a_cpu_decode_that_matches_the_colocated_run() -> None:
    colocated = engine(hybrid_model()).generate(dict(PROMPTS), MAX_NEW)
    pre = engine(hybrid_model(), role="prefill", device="cuda", cache_layout="hnd")
    dec = engine(hybrid_model(), role="decode", block_size_tokens=64)
    assert manual_handoff(pre, dec, dict(PROMPTS), MAX_NEW, _local_gather) == colocated
    assert_pools_free(pre)
    assert_pools_free(dec)
