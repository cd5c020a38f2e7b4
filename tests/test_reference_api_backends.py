"""The reference design's transfer-backend surface (Megatron-LM's disaggregation package).

An engine written against ``megatron.core.inference.disaggregation.transfer_backends`` must
run on ``disagg_rs.transfer_backends`` with only its import paths changed: the names, the
constructor signatures, the reference metadata fields (produced and accepted), the
``{"tp_metas": [...]}`` peer wrapper, ``begin_pull_blocks(peer_meta, src, dst)`` without
``num_tokens`` (whole blocks), the UCX checks and buffers registered on a shared agent.
Transfers are real: NIXL between spawned processes and torch.distributed gloo.
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import disagg_rs
import transport_workers as tw
from disagg_rs import _core, exceptions
from disagg_rs.transfer_backends import base, nccl, nixl
from transport_workers import Case, Side, Worker

SEED_PARAMS = [
    "agent_name",
    "memory_buffer",
    "expected_num_blocks",
    "tp_size",
    "tp_rank",
    "num_kv_heads_global",
    "heads_per_partition",
    "head_dim",
    "tokens_per_block",
    "global_rank",
    "pp_size",
    "pp_rank",
    "num_layers_global",
    "layer_start",
    "layer_end",
    "ssm_layout",
    "ssm_state_kind",
]

#: This library's own top-level metadata keys (what a reference-only peer lacks).
OWN_KEYS = (
    "version",
    "backend",
    "incarnation",
    "compat_hash",
    "state_kind",
    "layout",
    "dtype",
    "buffer",
    "geometry",
    "agent_metadata",
    "staging",
    "dist_rank",
    "buffer_name",
)


def reference_only(meta: dict[str, Any]) -> dict[str, Any]:
    """What a reference-design peer exports: our metadata without our own fields."""
    return {k: v for k, v in meta.items() if k not in OWN_KEYS}


class _CudaLike:
    """Stands in for a CUDA tensor where only ``is_cuda`` is read (the UCX_TLS check)."""

    is_cuda = True


# -- names and signatures ------------------------------------------------------------------


def test_every_reference_name_exists_in_its_module() -> None:
    for name in (
        "construct_kv_transfer_backend_class",
        "compute_buffer_geometry",
        "export_geometry_meta",
        "BufferGeometry",
        "TransferStartError",
        "KVTransportBackend",
    ):
        assert hasattr(base, name), name
    for name in (
        "NixlTransferBackend",
        "NixlPullHandle",
        "_NixlAgentContext",
        "_validate_ucx_transport_config",
        "_validate_nixl_cuda_support",
        "_detect_nixl_variant",
        "logger",
        "_HAVE_NIXL",
        "_NIXL_VARIANT",
        "nixl_agent",
        "nixl_agent_config",
        "importlib_metadata",
    ):
        assert hasattr(nixl, name), name
    for name in ("NcclTransferBackend", "NcclTransferHandle", "_make_copy", "_kv_layout_from_meta"):
        assert hasattr(nccl, name), name
    assert nixl._POLL_INTERVAL_S == 0.0005
    assert nixl._POLL_TIMEOUT_S == 30.0
    assert base.TransferStartError is exceptions.TransferStartError
    assert issubclass(exceptions.TransferStartError, RuntimeError)


@pytest.mark.parametrize("cls", [nixl.NixlTransferBackend, nccl.NcclTransferBackend])
def test_constructors_take_the_reference_parameters_in_the_reference_order(cls: type) -> None:
    params = list(inspect.signature(cls).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional[: len(SEED_PARAMS)] == SEED_PARAMS
    for p in params[3 : len(SEED_PARAMS)]:
        assert p.default is None, p.name
    if cls is nixl.NixlTransferBackend:
        assert positional[len(SEED_PARAMS)] == "_shared_context"


def test_reference_methods_exist_on_both_backends() -> None:
    for name in ("export_meta", "new_registered_buffer", "begin_pull_blocks", "close"):
        assert callable(getattr(nixl.NixlTransferBackend, name))
        assert callable(getattr(nccl.NcclTransferBackend, name))
    for name in ("_ensure_peer_registered", "_validate_peer", "_begin_transfer"):
        assert callable(getattr(nixl.NixlTransferBackend, name))
    assert callable(nccl.NcclTransferBackend.begin_push_blocks)
    assert nixl.NixlTransferBackend._kv_layout_from_meta is not None
    assert nccl.NcclTransferBackend.is_push is True
    for name in ("poll", "wait", "storage_safe"):
        assert hasattr(nixl.NixlPullHandle, name)
        assert hasattr(nccl.NcclTransferHandle, name)
    for name in ("acquire", "release", "ref_count", "agent"):
        assert hasattr(nixl._NixlAgentContext("names-only"), name)


@pytest.mark.parametrize("name", ["nixl", "NIXL", "nccl", "Nccl"])
def test_the_registry_selects_a_backend_by_name_in_any_case(name: str) -> None:
    cls = base.construct_kv_transfer_backend_class(name)
    assert cls.name == name.lower()
    assert disagg_rs.transfer_backends.construct_kv_transfer_backend_class is (
        base.construct_kv_transfer_backend_class
    )


def test_the_registry_refuses_an_unknown_backend_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="expected 'nixl' or 'nccl'"):
        base.construct_kv_transfer_backend_class("carrier-pigeon")


# -- UCX and NIXL runtime checks ---------------------------------------------------------------


@pytest.mark.parametrize(
    "tls",
    ["tcp", "rc", "tcp,self,sm", "rc,ud,sm", "^cuda", "^cuda_copy,cuda_ipc,gdr_copy", "^ib,cuda"],
)
def test_a_ucx_tls_without_a_cuda_transport_is_refused_for_gpu_buffers(
    monkeypatch: pytest.MonkeyPatch, tls: str
) -> None:
    monkeypatch.setenv("UCX_TLS", tls)
    with pytest.raises(exceptions.TransferError, match="does not enable a CUDA transport") as info:
        nixl._validate_ucx_transport_config(_CudaLike())  # type: ignore[arg-type]
    assert isinstance(info.value, RuntimeError)
    assert info.value.field == "UCX_TLS"


@pytest.mark.parametrize(
    "tls",
    [None, "", "all", "cuda", "cuda_copy", "rc,cuda_ipc", "tcp,gdr_copy", "^tcp", "^cuda_ipc"],
)
def test_a_ucx_tls_with_a_cuda_transport_is_accepted_and_the_memtype_cache_turned_off(
    monkeypatch: pytest.MonkeyPatch, tls: str | None
) -> None:
    monkeypatch.delenv("UCX_MEMTYPE_CACHE", raising=False)
    if tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    nixl._validate_ucx_transport_config(_CudaLike())  # type: ignore[arg-type]
    assert os.environ["UCX_MEMTYPE_CACHE"] == "n"


def test_host_memory_may_use_a_host_only_ucx_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm")  # what the tests and CPU demos set
    nixl._validate_ucx_transport_config(torch.zeros(4))
    backend = nixl.NixlTransferBackend("host-only", torch.zeros(2, 1, 2, 4, 1, 2), 2)
    try:
        assert backend.export_meta()["buffer"]["mem_type"] == "DRAM"
    finally:
        backend.close()


def test_a_nixl_build_for_another_cuda_major_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl, "_NIXL_VARIANT", "nixl_cu12")
    monkeypatch.setattr(nixl.torch.version, "cuda", "13.0")
    with pytest.raises(exceptions.TransferError, match="NIXL selected nixl_cu12"):
        nixl._validate_nixl_cuda_support(object(), _CudaLike())  # type: ignore[arg-type]


def test_the_active_nixl_build_is_named_by_its_package() -> None:
    api = __import__("nixl._api", fromlist=["_api"])
    variant = nixl._detect_nixl_variant(api.__name__)
    assert variant == api.__name__.split(".")[0]
    assert variant == nixl._NIXL_VARIANT
    assert nixl._detect_nixl_variant("no_such_package._api") is None


# -- metadata: the reference fields, produced and accepted ----------------------------------------


@pytest.fixture(scope="module")
def root() -> Iterator[nixl.NixlTransferBackend]:
    backend = nixl.NixlTransferBackend("refapi-root", torch.zeros(2, 1, 1, 1, 1, 1), 1)
    yield backend
    backend.close()


@contextmanager
def _closing(*backends: Any) -> Iterator[tuple[Any, ...]]:
    """The backends, closed on the way out whatever happens inside."""
    try:
        yield backends
    finally:
        for b in backends:
            b.close()


def _kv_backend(
    root: nixl.NixlTransferBackend, tp: int, rank: int, pp: int, stage: int, blocks: int, t: int
) -> Any:
    layers, heads, dim = 4, 4, 8
    buf = torch.zeros(2, layers // pp, blocks, t, heads // tp, dim, dtype=torch.bfloat16)
    return root.new_registered_buffer(
        memory_buffer=buf,
        expected_num_blocks=blocks,
        tp_size=tp,
        tp_rank=rank,
        num_kv_heads_global=heads,
        heads_per_partition=heads // tp,
        head_dim=dim,
        tokens_per_block=t,
        global_rank=stage * tp + rank,
        pp_size=pp,
        pp_rank=stage,
        num_layers_global=layers,
        layer_start=stage * layers // pp,
        layer_end=(stage + 1) * layers // pp,
    )


def test_export_meta_carries_the_reference_fields_beside_ours(
    root: nixl.NixlTransferBackend,
) -> None:
    b = _kv_backend(root, 2, 1, 2, 1, blocks=5, t=16)
    try:
        meta = b.export_meta()
        buf = b.memory_buffer
        assert meta["base_addr"] == buf.data_ptr() == meta["buffer"]["addr"]
        assert meta["blocks_axis"] == 2
        assert meta["num_outer"] == 2 * 2
        assert meta["bytes_per_slice"] == 16 * 2 * 8 * 2
        assert meta["outer_stride_bytes"] == 5 * meta["bytes_per_slice"]
        assert meta["element_size"] == 2
        assert meta["num_blocks"] == 5
        assert (meta["heads_per_partition"], meta["head_dim"], meta["tokens_per_block"]) == (
            2,
            8,
            16,
        )
        assert meta["agent_metadata_b64"] == meta["agent_metadata"]
        assert {k: meta[k] for k in base.REFERENCE_LAYOUT_FIELDS} == {
            "global_rank": 3,
            "tp_size": 2,
            "tp_rank": 1,
            "pp_size": 2,
            "pp_rank": 1,
            "num_layers_global": 4,
            "num_kv_heads_global": 4,
            "layer_start": 2,
            "layer_end": 4,
        }
        assert meta["version"] == base.FORMAT_VERSION  # our schema is still there
    finally:
        b.close()


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    blocks=st.integers(1, 6),
    t=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_reference_only_metadata_reads_back_as_the_same_layout_and_geometry(
    root: nixl.NixlTransferBackend, tp: int, pp: int, blocks: int, t: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, tp - 1))
    stage = data.draw(st.integers(0, pp - 1))
    with _closing(
        _kv_backend(root, tp, rank, pp, stage, blocks, t), _kv_backend(root, 1, 0, 1, 0, blocks, t)
    ) as (src, dst):
        ours = src.export_meta()
        theirs = dst._adopt_peer_meta(reference_only(ours))
        assert theirs["reference_only"] is True
        for attr in ("layers", "heads", "num_layers", "num_kv_heads", "global_rank", "tp_size"):
            assert getattr(disagg_rs.KVShardLayout.from_dict(theirs["layout"]), attr) == getattr(
                src.layout, attr
            )
        assert disagg_rs.KVGeometry.from_dict(theirs["geometry"]) == disagg_rs.KVGeometry.from_dict(
            ours["geometry"]
        )
        assert theirs["compat_hash"] == ours["compat_hash"]
        assert theirs["buffer"]["mem_type"] == "VRAM"  # the reference registers GPU memory


def test_a_reference_peer_is_translated_once_and_read_the_same_every_time(
    root: nixl.NixlTransferBackend,
) -> None:
    with _closing(_kv_backend(root, 2, 1, 1, 0, 4, 16), _kv_backend(root, 1, 0, 1, 0, 4, 16)) as (
        src,
        dst,
    ):
        ref = reference_only(src.export_meta())
        parses = _core.peer_meta_parses()
        first = dst._adopt_peer_meta(dict(ref))
        assert dst._adopt_peer_meta(dict(ref)) == first == dst._meta_from_reference(ref)
        assert len(dst._peer_table()) == 1
        assert _core.peer_meta_parses() == parses + 1
        moved = dst._adopt_peer_meta({**ref, "base_addr": ref["base_addr"] + 4096})
        assert moved["buffer"]["addr"] == first["buffer"]["addr"] + 4096


def test_reference_metadata_with_a_wrong_field_is_refused_naming_it(
    root: nixl.NixlTransferBackend,
) -> None:
    dst = _kv_backend(root, 1, 0, 1, 0, 4, 16)
    try:
        meta = reference_only(dst.export_meta())
        for key, value, field, error in (
            ("bytes_per_slice", None, "bytes_per_slice", exceptions.MetadataError),
            ("num_outer", -2, "num_outer", exceptions.MetadataError),
            ("agent_metadata_b64", None, "agent_metadata_b64", exceptions.MetadataError),
            ("transport", "nccl", "transport", exceptions.MetadataError),
            ("num_outer", 6, "num_outer", exceptions.GeometryMismatchError),
            ("head_dim", 4, "bytes_per_slice", exceptions.GeometryMismatchError),
            ("tp_size", 0, "tp_size", exceptions.LayoutError),
        ):
            bad = {**meta, key: value}
            if value is None:
                del bad[key]
            with pytest.raises(error) as info:
                dst._adopt_peer_meta(bad)
            assert info.value.field == field, (key, info.value)
    finally:
        dst.close()


def test_a_pull_of_no_blocks_is_a_settled_handle_and_half_empty_lists_are_refused(
    root: nixl.NixlTransferBackend,
) -> None:
    with _closing(_kv_backend(root, 2, 0, 1, 0, 4, 16), _kv_backend(root, 1, 0, 1, 0, 4, 16)) as (
        src,
        dst,
    ):
        meta = {"tp_metas": [src.export_meta()]}
        before = dst.memory_buffer.clone()
        handle = dst.begin_pull_blocks(meta, [], [])
        assert handle.poll() is True
        assert handle.storage_safe
        assert torch.equal(dst.memory_buffer, before)
        with pytest.raises(exceptions.BlockIdError) as info:
            dst.begin_pull_blocks(meta, [], [1])
        assert info.value.field == "src_block_ids"


def test_a_buffer_registered_the_reference_way_exports_its_slices(
    root: nixl.NixlTransferBackend,
) -> None:
    b = root.new_registered_buffer(
        memory_buffer=torch.zeros(2, 3, 5, dtype=torch.float32), expected_num_blocks=3
    )
    try:
        meta = b.export_meta()
        assert (meta["bytes_per_slice"], meta["num_outer"], meta["blocks_axis"]) == (20, 2, 1)
        assert meta["outer_stride_bytes"] == 60
        assert meta["heads_per_partition"] is None
        assert b._geometry == base.compute_buffer_geometry(
            b.memory_buffer, 3, backend_name="NixlTransferBackend"
        )
        # The reference design's private names of the same fields (``_buf_ptr``, ...).
        assert {f: getattr(b, f"_{f}") for f in vars(b._geometry)} == vars(b._geometry)
        assert (b._bytes_per_slice, b._outer_stride_bytes, b._device_id) == (20, 60, 0)
    finally:
        b.close()


def test_an_ambiguous_blocks_axis_is_refused() -> None:
    with pytest.raises(exceptions.GeometryMismatchError) as info:
        base.compute_buffer_geometry(torch.zeros(3, 3, 5), 3, backend_name="t")
    assert info.value.field == "expected_num_blocks"


def test_the_buffer_planner_reads_layout_arguments_by_name_and_refuses_other_names() -> None:
    kw: dict[str, Any] = dict(backend="t", contiguous=True, expected_num_blocks=3)
    tensor = torch.zeros(2, 3, 5)
    plan = _core.plan_buffer(tensor, None, None, head_dim=5, tokens_per_block=1, **kw)
    assert (plan["head_dim"], plan["tokens_per_block"]) == (5, 1)
    with pytest.raises(exceptions.ArgumentTypeError) as info:
        _core.plan_buffer(tensor, None, None, tp_sizes=2, **kw)
    assert info.value.field == "tp_sizes"
    with pytest.raises(exceptions.ArgumentTypeError) as bad:
        _core.plan_buffer(tensor, None, None, layer_end="2", **kw)
    assert bad.value.field == "layer_end"


def test_peer_wrappers_unwrap_into_one_record_per_source_rank() -> None:
    a, b = {"agent_name": "a"}, {"agent_name": "b", "block_ids": [7]}
    assert base.transfer_peer_records({"tp_metas": [a, b]}, [1, 2]) == [(a, [1, 2]), (b, [7])]
    assert base.transfer_peer_records([a], [3]) == [(a, [3])]
    assert base.transfer_peer_records(a, [3]) == [(a, [3])]
    pp = {"pp_metas": [{"tp_metas": [a], "block_ids": [4]}, {"tp_metas": [b]}]}
    assert base.transfer_peer_records(pp, [9]) == [(a, [4]), (b, [7])]
    with pytest.raises(exceptions.MetadataError):
        base.transfer_peer_records({"tp_metas": ["not a dict"]}, [1])


# -- the reference design's NIXL primitives ---------------------------------------------------


def test_a_read_that_fails_to_post_hands_back_a_handle_that_proves_it_settled() -> None:
    class Agent:  # the NIXL calls a failing post makes, recorded
        def __init__(self) -> None:
            self.released: list[Any] = []

        def get_xfer_descs(self, rows: Any, mem_type: str) -> Any:
            return rows

        def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> Any:
            self.rows = (local, remote)
            return "xfer"

        def transfer(self, xfer: Any) -> str:
            raise RuntimeError("fabric down")

        def check_xfer_state(self, xfer: Any) -> str:
            return "ERR"

        def release_xfer_handle(self, xfer: Any) -> None:
            self.released.append(xfer)

    backend = object.__new__(nixl.NixlTransferBackend)
    backend._agent = agent = Agent()
    backend._ensure_peer_registered = lambda _meta: "peer"  # type: ignore[method-assign]
    backend._bytes_per_slice, backend._outer_stride_bytes = 16, 64
    backend._buf_ptr, backend._device_id = 1024, 0
    peer = {"base_addr": 2048, "device_id": 0, "bytes_per_slice": 16, "outer_stride_bytes": 64}
    with pytest.raises(exceptions.TransferStartError) as info:
        backend._begin_transfer(peer, [1, 3], [2, 0], 0, 1, 2)
    local, remote = agent.rows
    # (block, outer) slices in block-major order; local outer starts at 1.
    assert local[:, 0].tolist() == [1024 + 64 + 32, 1024 + 128 + 32, 1024 + 64, 1024 + 128]
    assert remote[:, 0].tolist() == [2048 + 16, 2048 + 64 + 16, 2048 + 48, 2048 + 64 + 48]
    assert not info.value.storage_safe
    assert info.value.destinations_may_be_written
    with pytest.raises(exceptions.TransferError):
        info.value.cleanup_handles[0].poll()
    assert info.value.storage_safe
    assert agent.released == ["xfer"]


# -- real transfers between processes ---------------------------------------------------------


#: TP2 -> TP1, whole blocks: every token of the 3 source blocks (the seed-style call).
TP2_WHOLE = Case(
    "tp2_to_tp1_whole_blocks",
    (Side(2, 0, global_rank=0), Side(2, 1, global_rank=1)),
    (Side(global_rank=2),),
    num_tokens=48,
)


@pytest.fixture(scope="module")
def nixl_pool() -> Iterator[list[Worker]]:
    yield from tw.worker_pool("nixl", ["ref-pre0", "ref-pre1", "ref-dec0"])


@pytest.fixture(scope="module")
def gloo_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    store = str(tmp_path_factory.mktemp("gloo-ref") / "store")
    yield from tw.worker_pool("gloo", ["ref-pre0", "ref-pre1", "ref-dec0"], store)


def _landed(worker: Worker, key: str, case: Case) -> None:
    got = worker("buffer", key)
    assert np.array_equal(got, tw.expected_dst(case, case.dsts[0]).numpy())


def _close(workers: list[Worker], key: str) -> None:
    for w in workers:
        w("close", key)


# gloo first: its workers meet at a rendezvous, which a loaded machine running the NIXL
# workers beside it can push past the reply deadline.
@pytest.mark.slow
@pytest.mark.parametrize("reference_fields_only", [False, True], ids=["ours", "reference"])
def test_a_seed_style_tp2_to_tp1_gloo_push_and_pull_without_num_tokens_move_whole_blocks(
    gloo_pool: list[Worker], reference_fields_only: bool
) -> None:
    case, key = TP2_WHOLE, f"seed-gloo-{reference_fields_only}"
    src_metas = [gloo_pool[i]("setup", key, case, s, "src") for i, s in enumerate(case.srcs)]
    dst_meta = gloo_pool[2]("setup", key, case, case.dsts[0], "dst")
    if reference_fields_only:  # what the reference design's hand-off carries
        src_metas = [reference_only(m) for m in src_metas]
        dst_meta = reference_only(dst_meta)
        assert dst_meta["transport"] == "nccl" and "nccl_rank" in dst_meta
    try:
        src, dst = tw.src_ids(case, case.srcs[0]), tw.dst_ids(case, case.dsts[0])
        gloo_pool[2].send("call", key, "begin_pull_blocks", {"tp_metas": src_metas}, src, dst)
        for i in range(2):
            gloo_pool[i].send("call", key, "begin_push_blocks", {"tp_metas": [dst_meta]}, src)
        tw.settle(gloo_pool, key)
        _landed(gloo_pool[2], key, case)
    finally:
        _close(gloo_pool, key)


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", [True, False], ids=["tp_metas", "list"])
def test_a_seed_style_tp2_to_tp1_nixl_pull_without_num_tokens_moves_whole_blocks(
    nixl_pool: list[Worker], wrapped: bool
) -> None:
    key = f"seed-nixl-{wrapped}"
    case = TP2_WHOLE
    metas = [nixl_pool[i]("setup", key, case, s, "src") for i, s in enumerate(case.srcs)]
    nixl_pool[2]("setup", key, case, case.dsts[0], "dst")
    try:
        peer = {"tp_metas": metas} if wrapped else metas
        src, dst = tw.src_ids(case, case.srcs[0]), tw.dst_ids(case, case.dsts[0])
        nixl_pool[2]("call", key, "begin_pull_blocks", peer, src, dst)
        nixl_pool[2]("wait", key)
        _landed(nixl_pool[2], key, case)
    finally:
        _close(nixl_pool, key)


@pytest.mark.slow
def test_a_buffer_with_its_own_agent_name_on_a_shared_agent_can_be_pulled_from(
    nixl_pool: list[Worker],
) -> None:
    case, key = Case("tp1_own_name", (Side(),), (Side(global_rank=1),)), "own-name"
    meta = nixl_pool[0]("setup", key, case, case.srcs[0], "src", agent_name="ref-pre0-kv")
    nixl_pool[2]("setup", key, case, case.dsts[0], "dst")
    try:
        assert meta["agent_name"] == "ref-pre0"  # peers address the rank's agent
        assert meta["buffer_name"] == "ref-pre0-kv"
        src, dst = tw.src_ids(case, case.srcs[0]), tw.dst_ids(case, case.dsts[0])
        nixl_pool[2]("call", key, "begin_pull_blocks", [meta], src, dst, num_tokens=40)
        nixl_pool[2]("wait", key)
        _landed(nixl_pool[2], key, case)
    finally:
        nixl_pool[0]("close", key)
        nixl_pool[2]("close", key)


@pytest.mark.slow
def test_a_three_axis_buffer_registered_the_reference_way_is_pulled_in_whole_slices(
    nixl_pool: list[Worker],
) -> None:
    shape, key = (2, 3, 5), "three-axis"
    meta = nixl_pool[0]("setup_raw", key, shape, 3, 100)
    nixl_pool[2]("setup_raw", key, shape, 3, None)
    try:
        nixl_pool[2]("call", key, "begin_pull_blocks", meta, [1, 0], [2, 1])
        nixl_pool[2]("wait", key)
        got = nixl_pool[2]("buffer", key)
        src = (np.arange(30, dtype=np.int32) + 100).reshape(shape)
        want = np.full(shape, tw.SENTINEL, dtype=np.int32)
        want[:, 2], want[:, 1] = src[:, 1], src[:, 0]
        assert np.array_equal(got, want)
    finally:
        _close([nixl_pool[0], nixl_pool[2]], key)


def test_nccl_metadata_carries_the_reference_transport_fields(tmp_path: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        b = nccl.NcclTransferBackend("solo", torch.zeros(2, 2, 3, 4, 1, 2), 3)
        meta = b.export_meta()
        assert (meta["transport"], meta["nccl_rank"], meta["dist_rank"]) == ("nccl", 0, 0)
        assert b._adopt_peer_meta(reference_only(meta))["dist_rank"] == 0
        with pytest.raises(exceptions.MetadataError) as info:
            b._adopt_peer_meta({k: v for k, v in reference_only(meta).items() if k != "nccl_rank"})
        assert info.value.field == "nccl_rank"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_pp2_to_pp1_nixl_pull_takes_each_stage_s_block_ids_from_the_pp_metas_wrapper(
    nixl_pool: list[Worker],
) -> None:
    case = Case(
        "pp2_to_pp1_whole_blocks",
        (Side(pp_size=2, pp_rank=0, global_rank=0), Side(pp_size=2, pp_rank=1, global_rank=1)),
        (Side(global_rank=2),),
        num_tokens=48,
    )
    key = "pp-metas"
    metas = [nixl_pool[i]("setup", key, case, s, "src") for i, s in enumerate(case.srcs)]
    nixl_pool[2]("setup", key, case, case.dsts[0], "dst")
    try:
        stages = [
            {"tp_metas": [m], "block_ids": tw.src_ids(case, s)}
            for m, s in zip(metas, case.srcs, strict=True)
        ]
        dst = tw.dst_ids(case, case.dsts[0])
        # The stage lists carry the block ids; the top-level list is not consulted.
        nixl_pool[2]("call", key, "begin_pull_blocks", {"pp_metas": stages}, [], dst)
        nixl_pool[2]("wait", key)
        _landed(nixl_pool[2], key, case)
    finally:
        _close(nixl_pool, key)


@pytest.fixture(scope="module")
def nccl_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    store = str(tmp_path_factory.mktemp("nccl-ref") / "store")
    yield from tw.worker_pool("nccl", ["ref-pre0", "ref-dec0"], store)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("reference_fields_only", [False, True], ids=["ours", "reference"])
def test_an_nccl_push_and_pull_between_gpus_in_the_reference_form_move_whole_blocks(
    nccl_pool: list[Worker], reference_fields_only: bool
) -> None:
    case = Case("tp1_whole_blocks", (Side(),), (Side(global_rank=1),), num_tokens=48)
    key = f"seed-nccl-{reference_fields_only}"
    pre, dec = nccl_pool
    ms = pre("setup", key, case, case.srcs[0], "src")
    md = dec("setup", key, case, case.dsts[0], "dst")
    if reference_fields_only:
        ms, md = reference_only(ms), reference_only(md)
    try:
        src, dst = tw.src_ids(case, case.srcs[0]), tw.dst_ids(case, case.dsts[0])
        dec.send("call", key, "begin_pull_blocks", {"tp_metas": [ms]}, src, dst)
        pre.send("call", key, "begin_push_blocks", {"tp_metas": [md]}, src)
        tw.settle([dec, pre], key)
        _landed(dec, key, case)
    finally:
        pre("close", key)
        dec("close", key)
