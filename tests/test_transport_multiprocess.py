"""Real transports across spawned processes, byte-exact against the global-tensor oracle.

NIXL: one-sided READs over UCX (loopback, host memory) between agents in separate processes.
gloo: two-sided ``batch_isend_irecv`` in a 4-process group (ranks 0-1 prefill, 2-3 decode).
Every wait has a deadline and every process is joined with a timeout and killed on failure.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import transport_workers as tw
from transport_workers import Case, Side, Worker, WorkerError

pytestmark = pytest.mark.slow

NHD = "kv layer block token head dim"
HND = "kv layer block head token dim"

CASES = [
    Case("tp1_to_tp1", (Side(),), (Side(),)),
    Case("tp2_to_tp1", (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)), (Side(),)),
    Case("tp1_to_tp2", (Side(),), (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1))),
    Case(
        "pp2_to_pp1",
        (Side(pp_size=2, pp_rank=0, global_rank=0), Side(pp_size=2, pp_rank=1, global_rank=1)),
        (Side(),),
    ),
    Case(
        "gqa_replicated_tp2_to_tp2",
        (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)),
        (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)),
        num_kv_heads=1,
    ),
    Case(
        "block16_to_block64",
        (Side(tokens_per_block=16, num_blocks=16),),
        (Side(tokens_per_block=64, num_blocks=4),),
        num_tokens=100,
    ),
    Case(
        "block64_to_block16",
        (Side(tokens_per_block=64, num_blocks=4),),
        (Side(tokens_per_block=16, num_blocks=16),),
        num_tokens=100,
    ),
    Case("nhd_to_hnd_cache_layout", (Side(axes=NHD),), (Side(axes=HND),)),
    Case(
        "ssm_conv_tp2_to_tp1",
        (Side(2, 0, global_rank=0, num_blocks=4), Side(2, 1, global_rank=1, num_blocks=4)),
        (Side(num_blocks=4),),
        kind="conv",
    ),
    Case(
        "ssm_recurrent_tp2_to_tp1",
        (Side(2, 0, global_rank=0, num_blocks=4), Side(2, 1, global_rank=1, num_blocks=4)),
        (Side(num_blocks=4),),
        kind="recurrent",
    ),
]

_tags = itertools.count(1)


def _pool(transport: str, store: str = "") -> Iterator[dict[str, list[Worker]]]:
    for workers in tw.worker_pool(transport, ["pre0", "pre1", "dec0", "dec1"], store):
        yield {"pre": workers[:2], "dec": workers[2:]}


@pytest.fixture(scope="module")
def nixl_pool() -> Iterator[dict[str, list[Worker]]]:
    yield from _pool("nixl")


@pytest.fixture(scope="module")
def nixl_cuda_pool() -> Iterator[dict[str, list[Worker]]]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    yield from _pool("nixl-cuda")


@pytest.fixture(scope="module")
def gloo_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Worker]]]:
    yield from _pool("gloo", str(tmp_path_factory.mktemp("gloo") / "store"))


def _src_ids(case: Case) -> dict[int, list[int]]:
    return {s.global_rank: tw.src_ids(case, s) for s in case.srcs}


def _setup(pool: dict[str, list[Worker]], case: Case, key: str, **extra: Any) -> tuple[Any, Any]:
    src_metas = [
        pool["pre"][i]("setup", key, case, s, "src", **extra) for i, s in enumerate(case.srcs)
    ]
    dst_metas = [
        pool["dec"][j]("setup", key, case, s, "dst", **extra) for j, s in enumerate(case.dsts)
    ]
    return src_metas, dst_metas


def _close(pool: dict[str, list[Worker]], case: Case, key: str) -> None:
    for i in range(len(case.srcs)):
        pool["pre"][i]("close", key)
    for j in range(len(case.dsts)):
        pool["dec"][j]("close", key)


def _num_tokens(case: Case) -> int | None:
    return case.num_tokens if case.kind == "kv" else None


def _assert_landed(pool: dict[str, list[Worker]], case: Case, key: str) -> None:
    for j, side in enumerate(case.dsts):
        got = pool["dec"][j]("buffer", key)
        want = tw.expected_dst(case, side).numpy()
        assert np.array_equal(got, want), f"{case.name}: decode rank {j} bytes differ"


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "pool_name",
    ["nixl_pool", pytest.param("nixl_cuda_pool", marks=pytest.mark.gpu, id="one-shared-gpu")],
)
def test_nixl_pull_lands_every_byte_where_the_oracle_says(
    request: pytest.FixtureRequest, pool_name: str, case: Case, mode: str
) -> None:
    """Host memory, and (marker ``gpu``) processes sharing one GPU."""
    _nixl_pull_case(request.getfixturevalue(pool_name), case, mode)


def _nixl_pull_case(
    nixl_pool: dict[str, list[Worker]], case: Case, mode: str
) -> list[dict[str, Any]]:
    """Stage (staged mode), pull, wait; check the bytes; return each decode's handle stats."""
    key = f"{case.name}-{mode}"
    src_metas, dst_metas = _setup(nixl_pool, case, key, mode=mode)
    stats = []
    try:
        for j, dst_meta in enumerate(dst_metas):
            tickets = []
            if mode == "staged":
                # The prefill packs before the pull is announced; the ticket travels with it.
                tickets = [
                    tw.stage(
                        nixl_pool["pre"][i],
                        key,
                        dst_meta,
                        tw.src_ids(case, s),
                        src_metas=src_metas,
                        num_tokens=_num_tokens(case),
                    )
                    for i, s in enumerate(case.srcs)
                ]
            dec = nixl_pool["dec"][j]
            tw.pull(
                dec,
                key,
                src_metas,
                _src_ids(case),
                tw.dst_ids(case, case.dsts[j]),
                num_tokens=_num_tokens(case),
                staged=tickets,
            )
            dec("wait", key)
            stats.append(dec("stats", key))
        _assert_landed(nixl_pool, case, key)
    finally:
        _close(nixl_pool, case, key)
    return stats


def _push_pull(pool: dict[str, list[Worker]], case: Case, tag: int) -> list[dict[str, Any]]:
    """Every decode posts its receives, every prefill its sends; wait; check the bytes; return
    the decodes' handle stats."""
    key = case.name
    src_metas, dst_metas = _setup(pool, case, key)
    try:
        for j, side in enumerate(case.dsts):
            tw.pull(
                pool["dec"][j].send,
                key,
                src_metas,
                _src_ids(case),
                tw.dst_ids(case, side),
                num_tokens=_num_tokens(case),
                tag=tag,
            )
        for i, side in enumerate(case.srcs):
            pool["pre"][i].send(
                "call",
                key,
                "begin_push_blocks",
                dst_metas,
                tw.src_ids(case, side),
                src_metas=src_metas,
                num_tokens=_num_tokens(case),
                tag=tag,
            )
        tw.settle(pool["dec"][: len(case.dsts)] + pool["pre"][: len(case.srcs)], key)
        _assert_landed(pool, case, key)
        return [pool["dec"][j]("stats", key) for j in range(len(case.dsts))]
    finally:
        _close(pool, case, key)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gloo_push_and_pull_land_every_byte_where_the_oracle_says(
    gloo_pool: dict[str, list[Worker]], case: Case
) -> None:
    _push_pull(gloo_pool, case, next(_tags))


TP2 = CASES[1]


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_nixl_pull_accepts_any_program_through_the_compiler_hook(
    nixl_pool: dict[str, list[Worker]], mode: str
) -> None:
    case, key = TP2, f"hook-{mode}"
    src_metas, dst_metas = _setup(nixl_pool, case, key, mode=mode, compiler=tw.reference_compiler)
    try:
        tickets = [
            tw.stage(
                nixl_pool["pre"][i],
                key,
                dst_metas[0],
                tw.src_ids(case, s),
                src_metas=src_metas,
                num_tokens=case.num_tokens,
            )
            for i, s in enumerate(case.srcs)
        ]
        dec = nixl_pool["dec"][0]
        dst = tw.dst_ids(case, case.dsts[0])
        tw.pull(
            dec, key, src_metas, _src_ids(case), dst, num_tokens=case.num_tokens, staged=tickets
        )
        dec("wait", key)
        _assert_landed(nixl_pool, case, key)
    finally:
        _close(nixl_pool, case, key)


def _bad(meta: dict[str, Any], change: str) -> Any:
    meta = dict(meta)
    if change == "missing_field":
        del meta["incarnation"]
    elif change == "wrong_version":
        meta["version"] = 99
    elif change == "geometry_mismatch":
        meta["head_dim"] = meta["head_dim"] * 2
    return meta


@pytest.mark.parametrize(
    ("change", "kind", "field"),
    [
        ("missing_field", "MetadataError", "incarnation"),
        ("wrong_version", "MetadataError", "version"),
        ("geometry_mismatch", "GeometryMismatchError", "head_dim"),
        ("duplicate_rank", "MetadataError", "global_rank"),
        ("src_block_out_of_range", "BlockIdError", "src_block_ids"),
        ("dst_block_out_of_range", "BlockIdError", "dst_block_ids"),
    ],
)
@pytest.mark.parametrize("transport", ["nixl", "gloo"])
def test_bad_peer_metadata_is_rejected_before_anything_is_posted(
    request: pytest.FixtureRequest, transport: str, change: str, kind: str, field: str
) -> None:
    pool = request.getfixturevalue(f"{transport}_pool")
    case = TP2
    key = f"bad-{change}"
    src_metas, _ = _setup(pool, case, key)
    src = _src_ids(case)
    dst = tw.dst_ids(case, case.dsts[0])
    metas: list[Any] = [_bad(m, change) for m in src_metas]
    if change == "duplicate_rank":
        metas = [src_metas[0], src_metas[0]]
    elif change == "src_block_out_of_range":
        src = {r: [*ids[:-1], 99] for r, ids in src.items()}
    elif change == "dst_block_out_of_range":
        dst = [*dst[:-1], -1]
    try:
        with pytest.raises(WorkerError) as info:
            tw.pull(
                pool["dec"][0],
                key,
                metas,
                src,
                dst,
                num_tokens=case.num_tokens,
                **({"tag": next(_tags)} if transport == "gloo" else {}),
            )
        assert (info.value.kind, info.value.field) == (kind, field)
        untouched = tw.make_buffer(case, case.dsts[0], fill=False).numpy()
        assert np.array_equal(pool["dec"][0]("buffer", key), untouched)
    finally:
        _close(pool, case, key)


def test_nixl_pull_from_a_killed_source_fails_typed_and_a_restarted_source_replaces_it(
    nixl_pool: dict[str, list[Worker]],
) -> None:
    case, side = CASES[0], CASES[0].srcs[0]
    dec = nixl_pool["dec"][1]
    ctx = mp.get_context("spawn")
    key = "killed"
    procs = []

    def pull_from(meta: dict[str, Any]) -> None:
        dst = tw.dst_ids(case, case.dsts[0])
        tw.pull(dec, key, meta, tw.src_ids(case, side), dst, num_tokens=case.num_tokens)
        dec("wait", key)

    try:
        dec("setup", key, case, case.dsts[0], "dst", timeout_s=5.0, mode="direct")
        metas = []
        for _ in range(2):  # the second incarnation reuses the dead one's agent name
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=tw.kill_after_meta, args=(child, case, side), daemon=True)
            proc.start()
            procs.append(proc)
            assert parent.poll(tw.REPLY_TIMEOUT_S)
            metas.append(parent.recv())
            if len(metas) == 1:
                pull_from(metas[0])
                proc.kill()
                proc.join(10)
                with pytest.raises(WorkerError) as info:
                    pull_from(metas[0])
                assert info.value.kind in ("TransferError", "TransferTimeout")
        assert metas[0]["incarnation"] != metas[1]["incarnation"]
        pull_from(metas[1])
        assert dec("agent_peers")["doomed"] == metas[1]["incarnation"]
        assert np.array_equal(dec("buffer", key), tw.expected_dst(case, case.dsts[0]).numpy())
    finally:
        dec("close", key)
        for proc in procs:
            proc.kill()
            proc.join(10)


def test_gloo_pull_whose_peer_never_posts_times_out_typed(
    gloo_pool: dict[str, list[Worker]],
) -> None:
    case = CASES[0]
    key = "never"
    src_metas, _ = _setup(gloo_pool, case, key, timeout_s=0.5)
    dec = gloo_pool["dec"][0]
    try:
        # A tag nobody will ever send on: this receive stays posted until the worker exits.
        dst = tw.dst_ids(case, case.dsts[0])
        tw.pull(dec, key, src_metas, _src_ids(case), dst, num_tokens=case.num_tokens, tag=10**6)
        with pytest.raises(WorkerError) as info:
            dec("wait", key)
        assert info.value.kind == "TransferTimeout"
    finally:
        _close(gloo_pool, case, key)
