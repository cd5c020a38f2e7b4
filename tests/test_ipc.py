"""The same-host direct path's decisions on the CPU: who may map whom, and when the
transport must fall back to its network path (the mapping itself runs in the GPU tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disagg_rs.tools import demo
from disagg_rs.transfer_backends import ipc


def _meta(**ipc_fields: Any) -> dict[str, Any]:
    base = {"hostname": "h", "boot_id": "b", "pid": 1, "device_uuid": "GPU-x", "nbytes": 8}
    return {"agent_name": "pre", "incarnation": 1, "ipc": {**base, **ipc_fields}}


def test_host_memory_exports_no_ipc_handle() -> None:
    assert ipc.export(torch.zeros(4)) is None


def test_two_exports_share_a_host_only_when_host_name_and_boot_id_agree() -> None:
    mine = _meta()["ipc"]
    assert ipc.same_host(mine, _meta()["ipc"])
    assert not ipc.same_host(mine, _meta(hostname="other")["ipc"])
    assert not ipc.same_host(mine, _meta(boot_id="rebooted")["ipc"])
    assert not ipc.same_host(mine, None)
    assert not ipc.same_host(None, mine)


def test_a_peer_on_another_host_or_without_ipc_is_not_mapped() -> None:
    mapper = ipc.IpcMapper()
    mine = _meta()["ipc"]
    assert mapper.open(_meta(hostname="far"), mine) is None
    assert mapper.open({"agent_name": "pre", "incarnation": 1, "ipc": None}, mine) is None
    assert mapper.open(_meta(), None) is None


def test_a_peer_whose_gpu_is_not_visible_here_falls_back_and_the_answer_is_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    mapper = ipc.IpcMapper()
    mine = _meta()["ipc"]
    assert mapper.open(_meta(pid=-5), mine) is None
    calls: list[int] = []
    monkeypatch.setattr(ipc, "_local_index", lambda uuid: calls.append(1))
    assert mapper.open(_meta(pid=-5), mine) is None
    assert calls == []  # same incarnation: no second attempt
    assert mapper.open({**_meta(pid=-5), "incarnation": 2}, mine) is None
    assert calls == [1]  # a restarted peer is looked at again


def test_the_direct_path_can_be_turned_off_by_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISAGG_CUDA_IPC", "0")
    assert ipc.export(torch.zeros(4)) is None


@pytest.mark.parametrize(("gpus", "want"), [(0, "cuda"), (1, "cuda"), (2, ("cuda:0", "cuda:1"))])
def test_the_demo_puts_prefill_on_gpu0_and_decode_on_gpu1_when_two_are_visible(
    monkeypatch: pytest.MonkeyPatch, gpus: int, want: Any
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    got = (demo.engine_device("cuda", "prefill"), demo.engine_device("cuda", "decode"))
    assert got == (want if isinstance(want, tuple) else (want, want))
    assert demo.engine_device("cpu", "decode") == "cpu"
