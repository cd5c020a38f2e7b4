"""The reference engine across processes: TP, uneven PP and GQA/group replication agree with
the one-process run token for token, and a prefill on one layout hands its state to a decode on
another layout (copied by hand with torch indexing) that continues exactly like the colocated
run. One spawned 2-rank gloo world runs every case (spawning is the slow part)."""

from __future__ import annotations

from typing import Any

import pytest

from _reference_worker import GenerateCase, HandoffCase, SplitHandoffCase, run_world
from disagg_rs import reference as ref

pytestmark = pytest.mark.slow

PROMPTS = {
    0: ref.encode_text("Prefill on two ranks, decode on one: the state must survive the trip. "),
    1: ref.encode_text("Short prompt."),
    2: ref.encode_text("Hybrid models carry conv and recurrent SSM state per request slot. " * 2),
}
MAX_NEW = 10
SHARED = ref.encode_text("A shared prefix of several full blocks, reused by the second round. " * 2)
PREFIX_PROMPTS = {0: SHARED + ref.encode_text("one?"), 1: SHARED + ref.encode_text("two!")}
# tp=2 > 1 KV head and > 1 SSM group: GQA and group replication.
REPLICATED = ref.hybrid_model(num_kv_heads=1, ssm_n_groups=1, seed=3)
# pp=2 splits it into an attention-only stage and an SSM-only stage (no KV cache at all).
SSM_TAIL = ref.hybrid_model(layer_kinds=("attention", "attention", "ssm", "ssm"), seed=5)

CASES: dict[str, Any] = {
    "tp2": GenerateCase(ref.hybrid_model(), ref.EngineConfig(tp=2), PROMPTS, MAX_NEW),
    "tp1pp2_uneven": GenerateCase(
        ref.hybrid_model(),
        ref.EngineConfig(pp=2, stage_layers=(1, 5), cache_layout="hnd"),
        PROMPTS,
        MAX_NEW,
    ),
    "tp2_replicated": GenerateCase(
        REPLICATED, ref.EngineConfig(tp=2, cache_layout="nhd"), PROMPTS, MAX_NEW
    ),
    "pp2_stage_without_attention": GenerateCase(
        SSM_TAIL, ref.EngineConfig(pp=2, cache_layout="nhd"), PROMPTS, MAX_NEW
    ),
    "tp2_prefix": GenerateCase(
        ref.attention_model(),
        ref.EngineConfig(tp=2, block_size_tokens=16),
        PREFIX_PROMPTS,
        MAX_NEW,
        2,
    ),
    "handoff_tp2_to_pp2": HandoffCase(
        ref.hybrid_model(),
        ref.EngineConfig(tp=2, role="prefill", cache_layout="megatron", block_size_tokens=16),
        ref.EngineConfig(
            pp=2,
            stage_layers=(1, 5),
            role="decode",
            cache_layout="hnd",
            block_size_tokens=64,
            max_batch=2,
        ),
        PROMPTS,
        MAX_NEW,
    ),
    "handoff_pp2_to_tp2": HandoffCase(
        ref.hybrid_model(),
        ref.EngineConfig(
            pp=2, stage_layers=(4, 2), role="prefill", cache_layout="nhd", block_size_tokens=64
        ),
        ref.EngineConfig(tp=2, role="decode", cache_layout="megatron", block_size_tokens=16),
        PROMPTS,
        MAX_NEW,
    ),
}


@pytest.fixture(scope="module")
def world_results() -> dict[str, list[dict[str, Any]]]:
    names = list(CASES)
    per_rank = run_world(2, [CASES[n] for n in names])
    return {n: [per_rank[r][i] for r in range(2)] for i, n in enumerate(names)}


def single_process(model: ref.ModelConfig, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    e = ref.ReferenceEngine(model, ref.EngineConfig())
    return e.generate(dict(prompts), MAX_NEW)  # type: ignore[arg-type]


def assert_all_pools_free(results: list[dict[str, Any]]) -> None:
    for rank_result in results:
        for pool in rank_result["pools"]:
            assert pool["free_blocks"] == pool["num_blocks"], pool
            assert pool["free_slots"] == pool["num_slots"], pool


def assert_first_round_matches(results: list[dict[str, Any]], expected: Any) -> None:
    """Every rank's first round equals ``expected`` and every pool ended free."""
    for rank_result in results:
        assert rank_result["rounds"][0] == expected
    assert_all_pools_free(results)


@pytest.mark.parametrize("case", ["tp2", "tp1pp2_uneven"])
def test_tp2_and_uneven_pp2_generate_the_same_tokens_as_tp1(
    world_results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    assert_first_round_matches(world_results[case], single_process(ref.hybrid_model(), PROMPTS))


def test_gqa_and_ssm_group_replication_generate_the_same_tokens_as_tp1(
    world_results: dict[str, list[dict[str, Any]]],
) -> None:
    assert_first_round_matches(world_results["tp2_replicated"], single_process(REPLICATED, PROMPTS))


def test_a_pipeline_stage_without_attention_layers_holds_no_kv_and_agrees_with_tp1(
    world_results: dict[str, list[dict[str, Any]]],
) -> None:
    results = world_results["pp2_stage_without_attention"]
    assert_first_round_matches(results, single_process(SSM_TAIL, PROMPTS))
    assert [r["layouts"] for r in results] == [(True, False), (False, True)]


def test_prefix_cache_reuse_under_tp2_gives_identical_tokens(
    world_results: dict[str, list[dict[str, Any]]],
) -> None:
    expected = single_process(ref.attention_model(), PREFIX_PROMPTS)
    for rank_result in world_results["tp2_prefix"]:
        first, second = rank_result["rounds"]
        assert first == expected and second == expected
    assert_all_pools_free(world_results["tp2_prefix"])


@pytest.mark.parametrize("case", ["handoff_tp2_to_pp2", "handoff_pp2_to_tp2"])
def test_manual_handoff_across_layouts_decodes_exactly_like_the_colocated_run(
    world_results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    expected = single_process(ref.hybrid_model(), PROMPTS)
    for rank_result in world_results[case]:
        assert rank_result["tokens"] == expected
    assert_all_pools_free(world_results[case])


def test_prefill_tp2_and_decode_tp1_on_disjoint_ranks_match_the_colocated_run() -> None:
    """Three processes: a TP2 prefill engine on ranks 0-1 (its own subgroup) and a TP1 decode
    engine on rank 2, as the disaggregated demo runs them."""
    case = SplitHandoffCase(
        ref.hybrid_model(),
        ref.EngineConfig(tp=2, ranks=(0, 1), role="prefill", cache_layout="nhd"),
        ref.EngineConfig(ranks=(2,), role="decode", cache_layout="megatron", block_size_tokens=64),
        PROMPTS,
        MAX_NEW,
    )
    (rank0, rank1, rank2) = [r[0] for r in run_world(3, [case])]
    assert rank2["role"] == "decode" and rank0["role"] == rank1["role"] == "prefill"
    assert rank2["tokens"] == single_process(ref.hybrid_model(), PROMPTS)
    assert_all_pools_free([rank0, rank1, rank2])
