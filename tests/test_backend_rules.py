"""The transfer backends' host-side rules as the backends call them (``_core`` functions of
``disagg_core::backend_rules``): sibling layouts of a model-parallel group, staging slots,
launch windows, row units, and the CUDA IPC host and reader choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import disagg_rs
from disagg_rs import _core
from disagg_rs.exceptions import ArgumentError, MetadataError
from disagg_rs.transfer_backends import ipc, pipeline


def test_siblings_are_this_rank_s_layout_at_every_other_place_of_its_group() -> None:
    me = disagg_rs.KVShardLayout(8, 4, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1, global_rank=7)
    sibs = _core.group_layouts(me)
    assert sibs[3] is None  # this rank: TP fastest, then PP
    mine = dict(me.to_dict())
    for (stage, rank), sib in zip([(0, 0), (0, 1), (1, 0)], sibs, strict=False):
        assert sib is not None
        want = {**mine, "tp_rank": rank, "pp_rank": stage, "global_rank": 4 + 2 * stage + rank}
        assert dict(sib.to_dict()) == want


def test_a_group_that_would_start_below_rank_zero_is_refused_naming_src_metas() -> None:
    me = disagg_rs.KVShardLayout(8, 4, tp_size=2, tp_rank=1, global_rank=0)
    with pytest.raises(MetadataError, match=r"tp_rank=0, pp_rank=0") as info:
        _core.group_layouts(me)
    assert info.value.field == "src_metas"


def test_an_ssm_group_is_inferred_too() -> None:
    dims = disagg_rs.SSMStateDims(4, 2, 3, 2, 4)
    me = disagg_rs.SSMShardLayout(2, dims, tp_size=2, tp_rank=0, global_rank=0)
    sibs = _core.group_layouts(me)
    assert sibs[0] is None
    assert sibs[1] is not None and (sibs[1].tp_rank, sibs[1].global_rank) == (1, 1)


def test_a_staging_pool_refuses_a_chunk_that_is_not_a_multiple_of_256() -> None:
    pool = pipeline.StagingPool(torch.device("cpu"), 1000, 512)
    assert (pool.slots, pool.slot_bytes) == (1, 512)
    with pytest.raises(ArgumentError, match="chunk_bytes=300") as info:
        pipeline.StagingPool(torch.device("cpu"), 1024, 300)
    assert info.value.field == "chunk_bytes"
    assert isinstance(info.value, ValueError)


def test_rows_are_viewed_in_the_widest_unit_dividing_row_and_offset() -> None:
    def units(row: int, offsets: tuple[int, int]) -> tuple[int, int]:
        rows = np.array([[0, row, 0]], dtype=np.uint64)  # one fragment of one row
        got = _core.row_copy((rows, "gather", 0, (row, row)), offsets)
        assert got[0] == row
        return tuple(got[1])

    assert units(16, (0, 4)) == (8, 4)
    assert units(6, (0, 0)) == (2, 2)
    assert units(16, (3, 8)) == (1, 8)


def test_a_mapped_buffer_is_read_from_the_local_gpu_when_one_is_given() -> None:
    assert _core.ipc_reader_gpu(2, None, 0) == 2
    assert _core.ipc_reader_gpu(2, torch.device("cpu"), 0) == 2
    assert _core.ipc_reader_gpu(2, torch.device("cuda", 5), 0) == 5
    assert _core.ipc_reader_gpu(2, torch.device("cuda"), 7) == 7


def test_exports_without_a_host_name_or_empty_share_no_host() -> None:
    assert not ipc.same_host({}, {"hostname": "h", "boot_id": "b"})
    assert ipc.same_host({"hostname": "h"}, {"hostname": "h"})  # both lack a boot id


def test_pipeline_windows_round_chunks_to_both_units() -> None:
    windows = _core.pipeline_launches((48, 4), (48, 6), 25, 2)
    assert windows == [((0, 24), (0, 6, 3), (0, 4, 2)), ((24, 48), (6, 12, 3), (4, 8, 2))]
    assert _core.pipeline_launches((48, 4), (48, 6), -1, 2)[0][0] == (0, 12)
    with pytest.raises(ValueError, match="gather packs 30 bytes but scatter expects 24"):
        _core.pipeline_launches((30, 4), (24, 4), 16, 2)


def test_a_peer_dict_is_found_again_by_identity_and_reparsed_when_changed_in_place() -> None:
    from disagg_rs.transfer_backends.nixl import NixlTransferBackend

    src = NixlTransferBackend("memo-src", torch.zeros(2, 2, 4, 16, 2, 8), 4)
    dst = NixlTransferBackend("memo-dst", torch.zeros(2, 2, 4, 16, 2, 8), 4)
    try:
        meta = src.export_meta()
        first = dst._resolve_peers(meta, [0])[0][0]
        assert dst._resolve_peers(meta, [0])[0][0] is first
        assert dst._resolve_peers(dict(meta), [0])[0][0] is first  # equal content
        meta["num_blocks"] = 3  # the same dict, changed: parsed again, not the stale peer
        changed = dst._resolve_peers(meta, [0])[0][0]
        assert changed is not first and (changed.num_blocks, first.num_blocks) == (3, 4)
    finally:
        src.close()
        dst.close()
