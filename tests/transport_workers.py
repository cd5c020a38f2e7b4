"""Spawned-process harness for the transport tests: workers, a reference compiler, oracles.

Every transport party runs in its own spawned process (loopback only): NIXL agents over UCX
on host memory, gloo process groups over a file store. The pytest process only orchestrates
through pipes and compares bytes against the global-tensor oracle.

``reference_compiler`` is an independent, numpy-built implementation of the
``TransferProgram`` interface from the Rust reshard plan (a test oracle may loop; this one
broadcasts). The tests use it to show that the backends accept any program through their
``compiler=`` hook; by default they run on the Rust descriptor compiler. Its packed offsets
follow plan order (transfer, kv, layer, token, head), independent of destination block ids.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# Reference transfer program (test oracle for the compiler interface)
# ---------------------------------------------------------------------------------------------


def _merge(a: np.ndarray, b: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge consecutive fragments contiguous on both sides; returns (a, b, lens)."""
    if a.size == 0:
        return a, b, lens
    brk = np.ones(a.size, dtype=bool)
    brk[1:] = (a[1:] != a[:-1] + lens[:-1]) | (b[1:] != b[:-1] + lens[:-1])
    starts = np.flatnonzero(brk)
    return a[starts], b[starts], np.add.reduceat(lens, starts)


def _rows(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.stack([a, b, c], axis=1).astype(np.uint64)


@dataclass
class ReferenceProgram:
    """Fragments per source rank: src addresses, dst addresses (or None), lengths."""

    frags: dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray]]
    src_dev: dict[int, int]
    dst_dev: int
    forced: str
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def src_ranks(self) -> list[int]:
        return sorted(r for r, f in self.frags.items() if f[0].size)

    def mode(self, src_rank: int) -> str:
        if self.forced in ("direct", "staged"):
            return self.forced
        return "staged" if self.frags[src_rank][0].size > 64 else "direct"

    def _packed(self, src_rank: int) -> np.ndarray:
        lens = self.frags[src_rank][2]
        return np.cumsum(lens) - lens

    def direct_descriptors(self, src_rank: int) -> tuple[np.ndarray, np.ndarray]:
        src, dst, lens = self.frags[src_rank]
        assert dst is not None, "descriptors need dst_block_ids"
        s, d, n = _merge(src, dst, lens)
        return (
            _rows(s, n, np.full_like(n, self.src_dev[src_rank])),
            _rows(d, n, np.full_like(n, self.dst_dev)),
        )

    def gather(self, src_rank: int) -> np.ndarray:
        src, _, lens = self.frags[src_rank]
        s, p, n = _merge(src, self._packed(src_rank), lens)
        return _rows(s, n, p)

    def scatter(self, src_rank: int) -> np.ndarray:
        _, dst, lens = self.frags[src_rank]
        assert dst is not None, "scatter needs dst_block_ids"
        p, d, n = _merge(self._packed(src_rank), dst, lens)
        return _rows(p, d, n)

    def packed_bytes(self, src_rank: int) -> int:
        return int(self.frags[src_rank][2].sum())


def _addr(meta: Mapping[str, Any], index: Mapping[str, np.ndarray]) -> np.ndarray:
    """Byte address of element ``index`` (axis name -> broadcastable int array) of a buffer."""
    buf = meta["buffer"]
    names = buf["axes"].split()
    off = np.zeros((), dtype=np.int64)
    for name, stride in zip(names, buf["strides"], strict=True):
        if name in index:
            off = off + index[name].astype(np.int64) * int(stride)
    return int(buf["addr"]) + off * int(buf["element_size"])


def _ids_for(ids: Any, rank: int) -> np.ndarray:
    if isinstance(ids, Mapping):
        return np.asarray(ids[rank], dtype=np.int64)
    return np.asarray(ids, dtype=np.int64)


def reference_compiler(
    srcs: Sequence[Mapping[str, Any]],
    dst: Mapping[str, Any],
    src_block_ids: Any,
    dst_block_ids: Any,
    num_tokens: int | None,
    mode: str,
) -> ReferenceProgram:
    import disagg_rs

    by_rank = {int(m["layout"]["global_rank"]): m for m in srcs}
    frags: dict[int, list[tuple[np.ndarray, np.ndarray | None, np.ndarray]]] = {}
    kind = dst["state_kind"]
    if kind == "kv":
        plan = disagg_rs.plan_kv_reshard(
            [disagg_rs.KVShardLayout.from_dict(m["layout"]) for m in srcs],
            [disagg_rs.KVShardLayout.from_dict(dst["layout"])],
        )
        assert num_tokens is not None
        tok = np.arange(num_tokens)
        d = int(dst["head_dim"])
        for t in plan.for_dst(int(dst["layout"]["global_rank"])):
            sm = by_rank[t.src_rank]
            ts, td = int(sm["tokens_per_block"]), int(dst["tokens_per_block"])
            sids = _ids_for(src_block_ids, t.src_rank)
            kv = np.arange(2)[:, None, None, None]
            sl = np.arange(*t.src_local_layers())[None, :, None, None]
            dl = np.arange(*t.dst_local_layers())[None, :, None, None]
            tk = tok[None, None, :, None]
            sh = np.arange(*t.src_local_heads())[None, None, None, :]
            dh = np.arange(*t.dst_local_heads())[None, None, None, :]
            shape = (2, t.num_layers, num_tokens, t.num_heads)
            src = _addr(
                sm, {"kv": kv, "layer": sl, "block": sids[tk // ts], "token": tk % ts, "head": sh}
            )
            dsta = None
            if dst_block_ids is not None:
                dids = np.asarray(dst_block_ids, dtype=np.int64)
                dsta = np.broadcast_to(
                    _addr(
                        dst,
                        {
                            "kv": kv,
                            "layer": dl,
                            "block": dids[tk // td],
                            "token": tk % td,
                            "head": dh,
                        },
                    ),
                    shape,
                ).reshape(-1)
            src = np.broadcast_to(src, shape).reshape(-1)
            lens = np.full(src.size, d * int(sm["buffer"]["element_size"]), dtype=np.int64)
            frags.setdefault(t.src_rank, []).append((src, dsta, lens))
    else:
        plan = disagg_rs.plan_ssm_reshard(
            [disagg_rs.SSMShardLayout.from_dict(m["layout"]) for m in srcs],
            [disagg_rs.SSMShardLayout.from_dict(dst["layout"])],
        )
        inner = "channel" if kind == "conv" else "head"
        for t in plan.for_dst(int(dst["layout"]["global_rank"])):
            if t.state_kind != kind:
                continue
            sm = by_rank[t.src_rank]
            sids = _ids_for(src_block_ids, t.src_rank)
            shape_inner = (
                np.prod(sm["buffer"]["shape"][3:])
                if kind == "recurrent"
                else (sm["buffer"]["shape"][3])
            )
            width = (t.src_local[1] - t.src_local[0]) * int(shape_inner)
            sl = np.arange(*t.src_local_layers())[:, None]
            dl = np.arange(*t.dst_local_layers())[:, None]
            src = _addr(
                sm, {"layer": sl, "slot": sids[None, :], inner: np.array(t.src_local[0])}
            ).reshape(-1)
            dsta = None
            if dst_block_ids is not None:
                dids = np.asarray(dst_block_ids, dtype=np.int64)
                dsta = _addr(
                    dst, {"layer": dl, "slot": dids[None, :], inner: np.array(t.dst_local[0])}
                ).reshape(-1)
            lens = np.full(src.size, width * int(sm["buffer"]["element_size"]), dtype=np.int64)
            frags.setdefault(t.src_rank, []).append((src, dsta, lens))
    joined = {
        r: (
            np.concatenate([f[0] for f in fs]),
            None if fs[0][1] is None else np.concatenate([f[1] for f in fs]),  # type: ignore[misc]
            np.concatenate([f[2] for f in fs]),
        )
        for r, fs in frags.items()
    }
    return ReferenceProgram(
        joined,
        {r: int(by_rank[r]["buffer"]["device_id"]) for r in joined},
        int(dst["buffer"]["device_id"]),
        mode,
    )


# ---------------------------------------------------------------------------------------------
# Global-tensor oracle
# ---------------------------------------------------------------------------------------------

SENTINEL = -7
DTYPE = "int32"


@dataclass(frozen=True)
class Side:
    """One rank's layout and buffer shape in a case."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    global_rank: int = 0
    tokens_per_block: int = 16
    num_blocks: int = 8
    axes: str = "kv layer block token head dim"
    #: Explicit block ids (benchmarks); ``None`` picks the scattered default below.
    block_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Case:
    """A transfer scenario: source ranks, destination ranks and the model facts."""

    name: str
    srcs: tuple[Side, ...]
    dsts: tuple[Side, ...]
    num_layers: int = 4
    num_kv_heads: int = 4
    head_dim: int = 8
    num_tokens: int = 40
    mode: str = "direct"
    kind: str = "kv"  # "kv", "conv" or "recurrent"
    ssm: tuple[int, int, int, int, int] = (
        4,
        2,
        3,
        2,
        4,
    )  # heads, head_dim, d_state, groups, d_conv


def kv_layout(case: Case, side: Side) -> Any:
    import disagg_rs

    return disagg_rs.KVShardLayout(
        case.num_layers,
        case.num_kv_heads,
        side.tp_size,
        side.tp_rank,
        side.pp_size,
        side.pp_rank,
        side.global_rank,
    )


def ssm_layout(case: Case, side: Side) -> Any:
    import disagg_rs

    return disagg_rs.SSMShardLayout(
        case.num_layers,
        disagg_rs.SSMStateDims(*case.ssm),
        side.tp_size,
        side.tp_rank,
        side.pp_size,
        side.pp_rank,
        side.global_rank,
        replicate_groups=True,
    )


def src_ids(case: Case, side: Side) -> list[int]:
    """Scattered, rank-independent source blocks: every other block from the end."""
    if side.block_ids is not None:
        return list(side.block_ids)
    if case.kind != "kv":
        return [side.num_blocks - 2]
    need = -(-case.num_tokens // side.tokens_per_block)
    return [side.num_blocks - 1 - 2 * i for i in range(need)]


def dst_ids(case: Case, side: Side) -> list[int]:
    if side.block_ids is not None:
        return list(side.block_ids)
    if case.kind != "kv":
        return [1]
    need = -(-case.num_tokens // side.tokens_per_block)
    return [1 + 2 * i for i in range(need)][::-1]


def _global_kv(case: Case) -> Any:
    import torch

    n = 2 * case.num_layers * case.num_tokens * case.num_kv_heads * case.head_dim
    return torch.arange(n, dtype=torch.int32).view(
        2, case.num_layers, case.num_tokens, case.num_kv_heads, case.head_dim
    )


def _global_ssm(case: Case) -> Any:
    import torch

    h, p, n, g, dc = case.ssm
    if case.kind == "conv":
        c = h * p + 2 * g * n
        return (
            torch.arange(case.num_layers * c * dc, dtype=torch.int32).view(case.num_layers, c, dc)
            + 1000
        )
    return (
        torch.arange(case.num_layers * h * p * n, dtype=torch.int32).view(case.num_layers, h, p, n)
        + 5000
    )


def make_buffer(case: Case, side: Side, *, fill: bool) -> Any:
    """A rank's buffer: the global tensor's slice at its blocks (fill) or all sentinel."""
    import torch

    if case.kind != "kv":
        lay = ssm_layout(case, side)
        _, p, n, _, dc = case.ssm
        l0, l1 = lay.layers
        if case.kind == "conv":
            buf = torch.full(
                (l1 - l0, side.num_blocks, lay.local_conv_channels, dc), SENTINEL, dtype=torch.int32
            )
            if fill:
                g = _global_ssm(case)
                slot = src_ids(case, side)[0]
                for band in ("x", "B", "C"):
                    (ga, gb), (la, lb) = lay.band_span(band)
                    buf[:, slot, la:lb] = g[l0:l1, ga:gb]
        else:
            h0, h1 = lay.heads
            buf = torch.full((l1 - l0, side.num_blocks, h1 - h0, p, n), SENTINEL, dtype=torch.int32)
            if fill:
                buf[:, src_ids(case, side)[0]] = _global_ssm(case)[l0:l1, h0:h1]
        return buf
    lay = kv_layout(case, side)
    (l0, l1), (h0, h1) = lay.layers, lay.heads
    canon = ["kv", "layer", "block", "token", "head", "dim"]
    sizes = {
        "kv": 2,
        "layer": l1 - l0,
        "block": side.num_blocks,
        "token": side.tokens_per_block,
        "head": h1 - h0,
        "dim": case.head_dim,
    }
    names = side.axes.split()
    buf = torch.full([sizes[a] for a in names], SENTINEL, dtype=torch.int32)
    view = buf.permute([names.index(a) for a in canon])  # canonical-order view of the bytes
    if fill:
        g = _global_kv(case)[:, l0:l1, :, h0:h1]
        tok = torch.arange(case.num_tokens)
        ids = torch.tensor(src_ids(case, side))
        view[:, :, ids[tok // side.tokens_per_block], tok % side.tokens_per_block] = g
    return buf


def expected_dst(case: Case, side: Side) -> Any:
    """What the destination buffer must hold after the transfer (sentinel elsewhere)."""
    import torch

    if case.kind != "kv":
        lay = ssm_layout(case, side)
        buf = make_buffer(case, side, fill=False)
        l0, l1 = lay.layers
        slot = dst_ids(case, side)[0]
        g = _global_ssm(case)
        if case.kind == "conv":
            for band in ("x", "B", "C"):
                (ga, gb), (la, lb) = lay.band_span(band)
                buf[:, slot, la:lb] = g[l0:l1, ga:gb]
        else:
            h0, h1 = lay.heads
            buf[:, slot] = g[l0:l1, h0:h1]
        return buf
    lay = kv_layout(case, side)
    (l0, l1), (h0, h1) = lay.layers, lay.heads
    buf = make_buffer(case, side, fill=False)
    names = side.axes.split()
    canon = ["kv", "layer", "block", "token", "head", "dim"]
    view = buf.permute([names.index(a) for a in canon])
    tok = torch.arange(case.num_tokens)
    ids = torch.tensor(dst_ids(case, side))
    view[:, :, ids[tok // side.tokens_per_block], tok % side.tokens_per_block] = _global_kv(case)[
        :, l0:l1, :, h0:h1
    ]
    return buf


# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------

#: Seconds a worker or the orchestrator waits for any one reply before giving up.
REPLY_TIMEOUT_S = 180.0


def _backend_kwargs(case: Case, side: Side) -> dict[str, Any]:
    if case.kind == "kv":
        lay = kv_layout(case, side)
        return {
            "tp_size": side.tp_size,
            "tp_rank": side.tp_rank,
            "pp_size": side.pp_size,
            "pp_rank": side.pp_rank,
            "global_rank": side.global_rank,
            "num_kv_heads_global": case.num_kv_heads,
            "num_layers_global": case.num_layers,
            "tokens_per_block": side.tokens_per_block,
            "head_dim": case.head_dim,
            "axes": side.axes,
            "heads_per_partition": lay.heads_per_partition,
        }
    return {"ssm_layout": ssm_layout(case, side), "ssm_state_kind": case.kind}


class WorkerState:
    """What one spawned worker keeps between commands."""

    def __init__(self, transport: str, name: str, rank: int, world: int, store: str) -> None:
        self.transport = transport
        self.name = name
        self.backends: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}
        self.root: Any = None
        # "nccl": NCCL over CUDA, one GPU per rank; buffers live on that GPU.
        # "nixl-cuda": NIXL over VRAM, every rank sharing GPU 0 (one-GPU machines).
        # "nixl-ipc": NIXL metadata, every rank on GPU 0, the CUDA IPC direct path on.
        # "nixl-2gpu" / "nixl-2gpu-ipc": the first half of the ranks on GPU 0, the rest on 1.
        self.device = {
            "nccl": f"cuda:{rank}",
            "nixl-cuda": "cuda:0",
            "nixl-ipc": "cuda:0",
            "nixl-2gpu": f"cuda:{int(rank >= world // 2)}",
            "nixl-2gpu-ipc": f"cuda:{int(rank >= world // 2)}",
            "nccl-2gpu-small": f"cuda:{int(rank >= world // 2)}",
        }.get(transport, "cpu")
        if transport.startswith("nixl"):
            import torch

            from disagg_rs.transfer_backends.nixl import NixlTransferBackend

            # A root registration keeps the shared agent alive across cases.
            self.root = NixlTransferBackend(
                name, torch.zeros(2, 1, 1, 1, 1, 1, dtype=torch.int32), 1, staging_bytes=1 << 20
            )
        else:
            import datetime

            import torch.distributed as dist

            if transport.startswith("nccl"):
                import torch

                torch.cuda.set_device(torch.device(self.device))
            dist.init_process_group(
                "nccl" if transport.startswith("nccl") else "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S),
            )

    def setup(self, key: str, case: Case, side: Side, role: str, **extra: Any) -> dict[str, Any]:
        """Create the backend for (case, side); fill it if it is a source; return its meta."""
        buf = make_buffer(case, side, fill=role == "src").to(self.device)
        kwargs = {**_backend_kwargs(case, side), **extra}
        if self.transport.startswith("nixl"):
            kwargs.setdefault("staging_bytes", 1 << 20)
            backend = self.root.new_registered_buffer(
                memory_buffer=buf, expected_num_blocks=side.num_blocks, **kwargs
            )
        else:
            from disagg_rs.transfer_backends import construct_kv_transfer_backend_class

            cls = construct_kv_transfer_backend_class("nccl")
            backend = cls(self.name, buf, side.num_blocks, **kwargs)
        self.backends[key] = backend
        meta: dict[str, Any] = backend.export_meta()
        return meta

    def setup_raw(
        self, key: str, shape: tuple[int, ...], num_blocks: int, fill: int | None, **extra: Any
    ) -> dict[str, Any]:
        """A backend over any int32 buffer of ``shape`` (e.g. the reference design's 3-D
        matched layout); ``fill`` offsets an ``arange`` fill, ``None`` fills the sentinel."""
        import torch

        n = int(np.prod(shape))
        if fill is None:
            buf = torch.full(shape, SENTINEL, dtype=torch.int32)
        else:
            buf = (torch.arange(n, dtype=torch.int32) + fill).reshape(shape)
        buf = buf.to(self.device)
        if self.transport in ("nixl", "nixl-cuda"):
            backend = self.root.new_registered_buffer(
                memory_buffer=buf, expected_num_blocks=num_blocks, **extra
            )
        else:
            from disagg_rs.transfer_backends import construct_kv_transfer_backend_class

            cls = construct_kv_transfer_backend_class("nccl")
            backend = cls(self.name, buf, num_blocks, **extra)
        self.backends[key] = backend
        meta: dict[str, Any] = backend.export_meta()
        return meta

    def call(self, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a backend method; keep a returned handle under ``key``."""
        out = getattr(self.backends[key], method)(*args, **kwargs)
        if hasattr(out, "poll"):
            self.handles[key] = out
            return None
        return out

    def call_as(self, key: str, handle_key: str, method: str, *args: Any, **kwargs: Any) -> None:
        """Call a backend method and keep its handle under ``handle_key`` (several handoffs
        of one backend in flight at once)."""
        self.handles[handle_key] = getattr(self.backends[key], method)(*args, **kwargs)

    def timed(self, key: str, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """Call a backend method, wait for its handle if it returns one; return (value, s)."""
        import time

        t0 = time.perf_counter()
        out = getattr(self.backends[key], method)(*args, **kwargs)
        if hasattr(out, "wait"):
            out.wait()
            out = None
        return out, time.perf_counter() - t0

    def per_message(
        self, key: str, send: bool, peer: int, rows: np.ndarray, tag: int
    ) -> tuple[int, float]:
        """The reference design's two-sided way: one message per (offset, len) row."""
        import time

        import torch.distributed as dist

        from disagg_rs.transfer_backends.staging import byte_view

        flat = byte_view(self.backends[key].memory_buffer)
        op = dist.isend if send else dist.irecv
        t0 = time.perf_counter()
        ops = [dist.P2POp(op, flat[o : o + n], peer, None, tag) for o, n in rows.tolist()]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return len(ops), time.perf_counter() - t0

    def wait(self, key: str) -> None:
        self.handles[key].wait()

    def attr(self, key: str, name: str) -> Any:
        """A backend attribute (e.g. ``out_of_step``)."""
        return getattr(self.backends[key], name)

    def stats(self, key: str) -> dict[str, Any]:
        """The last handle's ``stats`` (which path moved the bytes)."""
        return dict(self.handles[key].stats)

    def poll(self, key: str) -> bool:
        return bool(self.handles[key].poll())

    def cancel(self, key: str) -> None:
        """Cancel the handle under ``key`` (a decode giving a pull up)."""
        self.handles[key].cancel()

    def buffer(self, key: str) -> np.ndarray:
        return self.backends[key].memory_buffer.cpu().numpy().copy()

    def close(self, key: str) -> int:
        self.backends.pop(key).close()
        self.handles.pop(key, None)
        return int(self.root._ctx.refs) if self.root is not None else 0

    def peer_meta_parses(self) -> int:
        """How many peer metadata dicts this process has parsed."""
        from disagg_rs import _core

        return int(_core.peer_meta_parses())

    def agent_peers(self) -> dict[str, int]:
        return {k: v[0] for k, v in self.root._ctx.peers.items()}


def worker_main(
    conn: Connection, transport: str, name: str, rank: int, world: int, store: str
) -> None:
    """Serve commands ``(method, args, kwargs)`` until ``exit``; reply ``(ok, value)``."""
    if transport.endswith("-small"):
        # A staging pool far smaller than any prompt: every KV handoff moves in many chunks.
        os.environ["DISAGG_STAGING_POOL_BYTES"] = "8192"
        os.environ["DISAGG_CHUNK_BYTES"] = "4096"
    if transport.startswith("nixl-"):
        # GPU memory needs UCX's CUDA transports: let UCX pick rather than inherit a CPU list.
        os.environ.pop("UCX_TLS", None)
        # The plain GPU pools test NIXL itself; the "-ipc" pools the same-host direct path.
        os.environ["DISAGG_CUDA_IPC"] = "1" if transport.endswith("-ipc") else "0"
    else:
        _loopback_ucx()
    state: WorkerState | None = None
    try:
        state = WorkerState(transport, name, rank, world, store)
        conn.send((True, None))
    except BaseException as exc:  # report setup failure instead of hanging the parent
        conn.send((False, ("setup", repr(exc), traceback.format_exc())))
        os._exit(1)
    while True:
        if not conn.poll(REPLY_TIMEOUT_S * 5):
            os._exit(2)  # orchestrator gone: never linger
        method, args, kwargs = conn.recv()
        if method == "exit":
            conn.send((True, None))
            conn.close()
            # Skip interpreter teardown: a receive abandoned on purpose (deadline tests) must
            # not block process-group or UCX shutdown.
            os._exit(0)
        try:
            value = getattr(state, method)(*args, **kwargs)
            conn.send((True, value))
        except BaseException as exc:
            field_ = getattr(exc, "field", None)
            conn.send((False, (type(exc).__name__, str(exc), field_)))


class Worker:
    """Parent-side proxy of one spawned worker; every call has a deadline."""

    def __init__(
        self, transport: str, name: str, rank: int = 0, world: int = 1, store: str = ""
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main, args=(child, transport, name, rank, world, store), daemon=True
        )
        self.proc.start()
        child.close()
        self.name = name

    def ready(self) -> None:
        ok, value = self._recv()
        if not ok:
            raise RuntimeError(f"worker {self.name} failed to start: {value}")

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.conn.send((method, args, kwargs))

    def _recv(self) -> tuple[bool, Any]:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"worker {self.name} did not answer in {REPLY_TIMEOUT_S} s")
        result: tuple[bool, Any] = self.conn.recv()
        return result

    def result(self) -> Any:
        ok, value = self._recv()
        if not ok:
            raise WorkerError(*value)
        return value

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.send(method, *args, **kwargs)
        return self.result()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.send("exit")
                self.conn.poll(5)
        except (OSError, EOFError, BrokenPipeError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class WorkerError(Exception):
    """An exception raised inside a worker: its class name, message and ``field``."""

    def __init__(self, kind: str, message: str, field_: Any = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.field = field_


def start_workers(transport: str, names: Sequence[str], store: str) -> list[Worker]:
    """Spawn one worker per name (ranks in order) and wait until all are ready."""
    workers = [Worker(transport, n, i, len(names), store) for i, n in enumerate(names)]
    try:
        for w in workers:
            w.ready()
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def worker_pool(transport: str, names: Sequence[str], store: str = "") -> Iterator[list[Worker]]:
    """A fixture's body: the workers of :func:`start_workers` while it yields, stopped after."""
    workers = start_workers(transport, names, store)
    try:
        yield workers
    finally:
        stop_workers(workers)


def pull(
    call: Callable[..., Any], key: str, metas: Any, src: Any, dst: Any, how: str = "call", **kw: Any
) -> Any:
    """``begin_pull_blocks`` on a decode worker (``call``: the worker, or its ``send``;
    ``how="timed"`` returns the result and the seconds it took)."""
    return call(how, key, "begin_pull_blocks", metas, src, dst, **kw)


def stage(
    call: Callable[..., Any], key: str, dst_meta: Any, src: Any, how: str = "call", **kw: Any
) -> Any:
    """``stage_blocks`` on a prefill worker (``call`` and ``how``: as for :func:`pull`)."""
    return call(how, key, "stage_blocks", dst_meta, src, **kw)


#: Most rounds :func:`drive` runs; a round is one poll of every party.
DRIVE_ROUNDS = 20_000


def drive(decode: Worker, sources: Sequence[Worker], key: str) -> int:
    """Poll the decode's pull ``key`` and every source's streams (``poll_streams``, as a
    prefill's turn does) in rounds until the pull is terminal, then until no source has a
    stream left; returns the rounds. Raises ``AssertionError`` after ``DRIVE_ROUNDS``."""
    for rounds in range(1, DRIVE_ROUNDS + 1):
        done = bool(decode("poll", key))
        running = sum(int(w("call", key, "poll_streams")) for w in sources)
        if done and running == 0:
            return rounds
    raise AssertionError(f"transfer {key} did not finish in {DRIVE_ROUNDS} rounds")


def settle(parties: Sequence[Worker], key: str) -> None:
    """Collect the replies of calls already sent to ``parties``, then wait on each one's
    transfer ``key`` (two-sided transfers: every party posts before any waits)."""
    for w in parties:
        w.result()
    for w in parties:
        w.send("wait", key)
    for w in parties:
        w.result()


def _loopback_ucx() -> None:
    """Host-memory workers talk over shared memory and TCP only, on machines without GPUs: a
    CUDA build of NIXL refuses a UCX_TLS without CUDA transports (NIXL_ERR_BACKEND) even for
    host memory, so on a GPU machine UCX picks its transports itself."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")


def stop_workers(workers: Sequence[Worker]) -> None:
    for w in workers:
        w.stop()


def kill_after_meta(conn: Connection, case: Case, side: Side) -> None:
    """Source that exports its metadata and then waits to be killed (one-sided failure test)."""
    _loopback_ucx()
    state = WorkerState("nixl", "doomed", 0, 1, "")
    conn.send(state.setup("k", case, side, "src", mode="direct"))
    conn.poll(REPLY_TIMEOUT_S)
    os._exit(0)


Runner = Callable[..., Any]
