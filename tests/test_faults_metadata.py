"""Named fault scenarios (issue 9, item 1) for bad peer metadata and block ids: real NIXL
backends in this process (a TP2 and a PP2 prefill, a TP1 decode). Every bad input raises its
typed error naming the field before anything is posted, and the destination is untouched.
(The same checks across processes, for NIXL and gloo: tests/test_transport_multiprocess.py.)"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import disagg_rs
from disagg_rs import exceptions
from disagg_rs.transfer_backends.nixl import NixlTransferBackend

os.environ.setdefault("UCX_LOG_LEVEL", "error")

L, B, T, H, D = 4, 8, 16, 2, 8
DIMS = disagg_rs.SSMStateDims(num_heads=4, head_dim=2, d_state=3, n_groups=2, d_conv=4)


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Any]]:
    made: list[NixlTransferBackend] = []

    def kv(name: str, layers: int, heads: int, **kw: Any) -> NixlTransferBackend:
        buf = torch.randn(2, layers, B, T, heads, D)
        made.append(NixlTransferBackend(name, buf, B, num_kv_heads_global=H, **kw))
        return made[-1]

    def ssm(name: str, layout: disagg_rs.SSMShardLayout) -> NixlTransferBackend:
        conv = torch.randn(layout.num_local_layers, 2, layout.local_conv_channels, DIMS.d_conv)
        made.append(
            NixlTransferBackend(
                name,
                conv,
                2,
                ssm_layout=layout,
                ssm_state_kind="conv",
                global_rank=layout.global_rank,
            )
        )
        return made[-1]

    out = {
        "tp": [kv(f"tp{r}", L, 1, tp_size=2, tp_rank=r, global_rank=r) for r in range(2)],
        "pp": [
            kv(f"pp{p}", L // 2, H, pp_size=2, pp_rank=p, num_layers_global=L, global_rank=20 + p)
            for p in range(2)
        ],
        "dst": kv("dst", L, H, global_rank=10),
        "ssm": [
            ssm(
                f"ssm{r}",
                disagg_rs.SSMShardLayout(2, DIMS, tp_size=2, tp_rank=r, global_rank=30 + r),
            )
            for r in range(2)
        ],
        "ssm_dst": ssm("ssm-dst", disagg_rs.SSMShardLayout(2, DIMS, global_rank=40)),
    }
    out["dst"].memory_buffer.zero_()
    out["ssm_dst"].memory_buffer.zero_()
    yield out
    for b in made:
        b.close()


def _metas(peers: dict[str, Any], which: str = "tp") -> list[dict[str, Any]]:
    return [copy.deepcopy(b.export_meta()) for b in peers[which]]


def _rejected(
    peers: dict[str, Any],
    error: type[exceptions.DisaggError],
    field: str | None,
    metas: list[dict[str, Any]],
    src: Any = (0, 1),
    dst: Any = (2, 3),
    num_tokens: int | None = 20,
    target: str = "dst",
) -> None:
    backend = peers[target]
    before = backend.memory_buffer.clone()
    with pytest.raises(error) as info:
        backend.begin_pull_blocks(metas, list(src), list(dst), num_tokens=num_tokens)
    assert info.value.field == field, info.value
    if error is exceptions.PlanCoverageError:  # the message names the uncovered cell
        assert "no source holds layer 0" in str(info.value)
    assert torch.equal(backend.memory_buffer, before)


def _edit(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def go(m: dict[str, Any]) -> None:
        if value is _DELETE:
            del m[key]
        else:
            m[key] = value

    return go


_DELETE = object()


@pytest.mark.parametrize(
    ("edit", "error", "field"),
    [
        (_edit("incarnation", _DELETE), exceptions.MetadataError, "incarnation"),
        (_edit("layout", "tp=2,pp=1"), exceptions.MetadataError, "layout"),
        (_edit("num_blocks", "8"), exceptions.MetadataError, "num_blocks"),
        (_edit("num_blocks", True), exceptions.MetadataError, "num_blocks"),
        (_edit("version", 2), exceptions.MetadataError, "version"),
        (_edit("compat_hash", "0" * 16), exceptions.GeometryMismatchError, "compat_hash"),
        (_edit("head_dim", 4), exceptions.GeometryMismatchError, "head_dim"),
        (_edit("dtype", "torch.bfloat16"), exceptions.GeometryMismatchError, "dtype"),
    ],
    ids=[
        "missing-field",
        "layout-wrong-type",
        "num-blocks-a-string",
        "num-blocks-a-bool",
        "unknown-version",
        "compat-hash-mismatch",
        "head-dim-mismatch",
        "dtype-mismatch",
    ],
)
def test_bad_peer_metadata_is_a_typed_error_before_anything_is_posted(
    peers: dict[str, Any], edit: Callable[[dict[str, Any]], None], error: Any, field: str
) -> None:
    metas = _metas(peers)
    edit(metas[1])
    _rejected(peers, error, field, metas)


def test_two_peers_claiming_one_global_rank_are_refused(peers: dict[str, Any]) -> None:
    m = _metas(peers)
    _rejected(peers, exceptions.MetadataError, "global_rank", [m[0], m[0]])


def test_sources_missing_a_tp_rank_leave_heads_uncovered_and_are_refused(
    peers: dict[str, Any],
) -> None:
    _rejected(peers, exceptions.PlanCoverageError, "dsts", _metas(peers)[:1])


def test_sources_missing_a_pipeline_stage_leave_layers_uncovered_and_are_refused(
    peers: dict[str, Any],
) -> None:
    _rejected(peers, exceptions.PlanCoverageError, "dsts", _metas(peers, "pp")[1:])


def test_ssm_sources_missing_a_tp_rank_leave_bands_uncovered_and_are_refused(
    peers: dict[str, Any],
) -> None:
    metas = _metas(peers, "ssm")[:1]
    _rejected(
        peers, exceptions.PlanCoverageError, "dsts", metas, (0,), (1,), None, target="ssm_dst"
    )


@pytest.mark.parametrize(
    ("src", "dst", "num_tokens", "field"),
    [
        ((0, -1), (2, 3), 20, "src_block_ids"),
        ((0, 8), (2, 3), 20, "src_block_ids"),
        ((0, 1), (-1, 3), 20, "dst_block_ids"),
        ((0, 1), (2, 99), 20, "dst_block_ids"),
        ((0, 1), (2, 2), 20, "dst_block_ids"),
        ((0, 1), (2,), 20, "dst_block_ids"),
        ((0,), (2, 3), 20, "num_tokens"),
        ((0, 1), (2, 3), 0, "num_tokens"),
    ],
    ids=[
        "negative-source",
        "source-out-of-range",
        "negative-destination",
        "destination-out-of-range",
        "duplicate-destination",
        "fewer-destination-than-source-tokens",
        "fewer-source-blocks-than-tokens",
        "zero-tokens",
    ],
)
def test_bad_block_ids_are_a_typed_error_before_anything_is_posted(
    peers: dict[str, Any], src: Any, dst: Any, num_tokens: int, field: str
) -> None:
    _rejected(peers, exceptions.BlockIdError, field, _metas(peers), src, dst, num_tokens)
