"""``disagg-rs demo``: a real disaggregated prefill -> decode run of the reference engine.

Starts a coordinator (in this process), a prefill engine and a decode engine as spawned
processes (one per rank, one torch.distributed world over loopback), sends built-in prompts,
streams the answers with a progress bar, and checks every answer token for token against a
colocated run of the same model. Exits non-zero if any answer differs or anything leaked.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROMPTS", "DemoOptions", "DemoResult", "add_demo_arguments", "run_demo"]

PROMPTS = [
    "Disaggregated serving splits prefill and decode.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged KV caches hold attention keys and values in blocks.",
    "Mamba layers carry a convolution state and a recurrent state.",
    "Tensor parallelism shards heads across ranks.",
    "Pipeline stages own contiguous windows of layers.",
    "A handoff must never leak or corrupt a block.",
    "NIXL reads remote memory with one-sided transfers.",
]


@dataclass(frozen=True)
class DemoOptions:
    """What to run."""

    backend: str = "nixl"
    prefill_tp: int = 2
    prefill_pp: int = 1
    decode_tp: int = 1
    decode_pp: int = 1
    prefill_block_size: int = 16
    decode_block_size: int = 16
    model: str = "hybrid"
    requests: int = 8
    max_new_tokens: int = 12
    device: str = "cpu"
    cache_layout: str = "megatron"
    decode_cache_layout: str | None = None
    num_blocks: int = 96
    decode_num_blocks: int | None = None
    """KV blocks per decode rank (default ``num_blocks``). A small pool makes the decode defer
    imports until running requests finish and free their blocks."""
    timeout_s: float = 90.0
    quiet: bool = False
    nixl_mode: str = "auto"
    """NIXL descriptor mode: "direct" reads, "staged" packed reads, "auto" by cost model."""
    staging_mib: int = 64
    """Registered staging region per NIXL KV buffer (staged pulls)."""
    metrics_port: int | None = None
    """Serve each rank's Prometheus metrics on ``metrics_port + n`` (loopback), ``n`` the
    process's position: prefill ranks first, then decode ranks."""
    control_faults: float = 0.0
    """Share of coordinator -> engine messages dropped, duplicated or delayed (fault test);
    requests may then fail, but every one must end once and nothing may leak."""
    lease_s: float = 120.0
    """Prefill pin lease (a dropped RELEASE_KV is recovered by lease expiry)."""
    kill_engine: str | None = None
    """Fault test: ``"prefill"`` or ``"decode"``. Once the first token has streamed, one rank
    of that engine is killed with SIGKILL; the supervisor kills the engine's other ranks and
    starts it again as a new incarnation (new processes, torch.distributed world and NIXL
    agents), then the second half of the requests is sent. Requests that lost state fail
    once; every other one must answer like the colocated run and nothing may leak."""
    kill_rank: int = -1
    """Which rank of the killed engine gets SIGKILL (index into its ranks; -1: the last)."""
    restart: bool = True
    """With ``kill_engine``: start the killed engine again. If False it stays dead; the second
    half is sent once the coordinator has declared it lost and must fail at once."""
    engine_timeout_s: float = 10.0
    """Coordinator liveness: an engine silent this long is declared lost and the requests that
    depended on it fail (engines send a heartbeat every ``engine_timeout_s / 10``)."""
    prompts: tuple[str, ...] | None = None
    """Prompts to send (default: the built-in ones, cycled to ``requests``)."""
    sequential: bool = False
    """Submit each request only after the previous one finished (prefix-cache reuse)."""
    verify_integrity: bool = False
    """Digest the state on prefill and check it on decode before admission."""
    stall_engine: str | None = None
    """Fault test: ``"decode"``. The decode's processes are stopped (SIGSTOP) before the
    first half of the requests is sent, so their tickets wait unread while the coordinator
    declares the decode lost; once the prefill's leases ended, requests with other prompts
    make the prefill reuse its blocks, then the decode continues (SIGCONT), registers again
    and the second half is sent. The stalled requests may fail, never answer wrongly, and are
    never admitted; the second half must answer like the colocated run."""
    corrupt: tuple[int, int] | None = None
    """Fault test ``(decode rank index, request id)``: on that decode rank, flip a bit of that
    request's KV as its read completes (needs ``verify_integrity`` and NIXL). The request must
    fail on every decode rank together; nothing may leak."""
    insecure_plaintext: bool = False
    """Run the control plane as plain TCP without CURVE keys (one warning). By default every
    run generates fresh keys: the coordinator admits only its own engines and client."""
    bind_host: str = "127.0.0.1"
    """Address every socket the demo opens binds to: the coordinator (ZeroMQ), the engines'
    rendezvous store and collectives (torch.distributed, gloo) and NIXL's UCX transports.
    Loopback by default; any other address exposes them to that network (see the README's
    trust boundary)."""


@dataclass
class DemoResult:
    """What a demo run produced."""

    exit_code: int
    failures: list[str]
    answers: dict[int, list[int]]
    expected: dict[int, list[int]]
    workers: list[dict[str, Any]]
    failed_requests: dict[int, str] = field(default_factory=dict)
    faults_injected: int = 0
    restarts: int = 0
    """Engines restarted by the supervisor (``kill_engine``)."""
    after_restart: tuple[int, ...] = ()
    """Requests sent after the restarted engine registered again."""


@dataclass
class _RequestTrace:
    submitted: float
    first_token: float | None = None
    done: float | None = None
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


def _free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host`` (all held open while choosing: a port closed and
    asked for again may come back, and two worlds on one port would cross their rendezvous)."""
    socks = [socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _model_config(name: str) -> Any:
    from disagg_rs.reference import attention_model, hybrid_model

    if name == "hybrid":
        return hybrid_model()
    if name == "attention":
        return attention_model()
    raise ValueError(f"--model {name!r}: expected 'hybrid' or 'attention'")


def _engine_config(opts: DemoOptions, role: str, ranks: tuple[int, ...]) -> Any:
    from disagg_rs.reference import EngineConfig

    prefill = role == "prefill"
    layout = opts.cache_layout if prefill else (opts.decode_cache_layout or opts.cache_layout)
    return EngineConfig(
        tp=opts.prefill_tp if prefill else opts.decode_tp,
        pp=opts.prefill_pp if prefill else opts.decode_pp,
        ranks=ranks,
        cache_layout=layout,  # type: ignore[arg-type]
        block_size_tokens=opts.prefill_block_size if prefill else opts.decode_block_size,
        num_blocks=opts.num_blocks if prefill else (opts.decode_num_blocks or opts.num_blocks),
        num_ssm_slots=max(8, opts.requests),
        max_batch=8,
        role=role,  # type: ignore[arg-type]
        device=engine_device(opts.device, role),
    )


def engine_device(device: str, role: str) -> str:
    """Where an engine runs: with ``--device cuda`` and two or more GPUs visible, the
    prefill on GPU 0 and the decode on GPU 1 (their handoffs cross NVLink); else ``device``."""
    if device != "cuda" or _gpu_count() < 2:
        return device
    return "cuda:0" if role == "prefill" else "cuda:1"


def _gpu_count() -> int:
    """CUDA GPUs visible to this process."""
    import torch

    return int(torch.cuda.device_count())


@dataclass(frozen=True)
class _Placement:
    """Where one engine process sits."""

    role: str
    global_rank: int
    """Rank in its torch.distributed world (and in the engine's layouts)."""
    ranks: tuple[int, ...]
    """The engine's ranks."""
    world: int
    dist_port: int
    slot: int
    """Position among all engine processes (prefill ranks first): the metrics port offset."""
    generation: int
    """How many times this engine was started before (0: the first incarnation)."""


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _bind_ucx(host: str) -> None:
    """Keep UCX's and gloo's sockets on the loopback interface when the demo binds there (an
    operator's explicit setting wins)."""
    if _loopback(host):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _store(host: str, port: int, world: int, rank: int, timeout: datetime.timedelta) -> Any:
    """The world's rendezvous store. torch's TCPStore server listens on every interface when
    it opens its own socket, so the first rank hands it one bound to ``host`` only."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    if rank != 0:
        return TCPStore(host, port, world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    store = TCPStore(
        host, port, world, True, timeout=timeout, master_listen_fd=sock.detach(), use_libuv=True
    )
    return store


def serve_engine(engine: Any, link: Any, heartbeat_s: float, grace_s: float) -> dict[str, Any]:
    """Serve one engine rank until SHUTDOWN, drain, and return the driver's report."""
    from disagg_rs.driver import HandoffDriver

    driver = HandoffDriver(engine, link, heartbeat_s=heartbeat_s, shutdown_grace_s=grace_s)
    while driver.running:
        msgs = driver.receive()  # only the engine's first rank holds a link
        # Every rank of the engine acts on the same messages at the same clock.
        clocks = (time.monotonic_ns(), time.time_ns(), msgs)
        now, wall, msgs = engine.handoff_broadcast(clocks)
        for msg in msgs:
            driver.on_message(msg)
        driver.tick(now, wall)
    return driver.drain()


def _worker(opts: DemoOptions, where: _Placement, control: Any, results: Any) -> None:
    """One engine rank: build, register, serve control messages until SHUTDOWN, then drain
    (quarantined imports and unreleased pins, within their deadlines) and report."""
    role, global_rank, ranks = where.role, where.global_rank, where.ranks
    tag = {"role": role, "rank": global_rank, "generation": where.generation}
    # NIXL's INFO lines would drown the progress bar.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        import torch
        import torch.distributed as dist

        # UCX stays on loopback transports on a machine without GPUs; where GPUs are present
        # the CUDA build of NIXL needs UCX's CUDA transports even for host memory (an
        # H200 refused a CPU demo with NIXL_ERR_BACKEND under UCX_TLS=tcp,self,sm).
        if not torch.cuda.is_available():
            os.environ.setdefault("UCX_TLS", "tcp,self,sm")
        _bind_ucx(opts.bind_host)

        from disagg_rs.control import EngineLink
        from disagg_rs.control.keys import INSECURE
        from disagg_rs.reference.handoff import HandoffReferenceEngine

        torch.set_num_threads(1)
        placed = engine_device(opts.device, role)
        if placed.startswith("cuda:"):
            # Launches, NCCL and the CUDA IPC mapping follow the engine's GPU.
            torch.cuda.set_device(int(placed.split(":")[1]))
        timeout = datetime.timedelta(seconds=opts.timeout_s)
        store = _store(opts.bind_host, where.dist_port, where.world, global_rank, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=global_rank, world_size=where.world, timeout=timeout
        )
        engine = HandoffReferenceEngine(
            _model_config(opts.model), _engine_config(opts, role, ranks), backend=opts.backend
        )
        engine.handoff_now_ns = time.monotonic_ns()
        engine.handoff_lease_ns = int(opts.lease_s * 1e9)
        engine.verify_integrity = opts.verify_integrity
        if opts.metrics_port is not None:
            from disagg_rs.metrics import HandoffMetrics

            engine.handoff_metrics = HandoffMetrics(role, global_rank)
            engine.handoff_metrics.serve(opts.metrics_port + where.slot, opts.bind_host)
        nixl_kwargs = (
            {"mode": opts.nixl_mode, "staging_bytes": opts.staging_mib << 20}
            if opts.backend == "nixl"
            else {}
        )
        engine.setup_kv_transfer(role, opts.backend, **nixl_kwargs)
        if (
            role == "decode"
            and opts.corrupt is not None
            and opts.corrupt[0] == ranks.index(global_rank)
        ):
            _corrupt_reads(engine, opts.corrupt[1])
        endpoint, keys = control  # keys: this run's ControlPlaneKeys, or None (plain TCP)
        access = INSECURE if keys is None else keys.engine_args(role)
        link = EngineLink(endpoint, role, role, **access) if global_rank == ranks[0] else None
        report = serve_engine(engine, link, opts.engine_timeout_s / 10, opts.lease_s + 2.0)
        results.put({**tag, **report, "error": None})
        engine.close_kv_transfer()
        if link is not None:
            link.close()
        dist.destroy_process_group()
    except BaseException:
        results.put({**tag, "error": traceback.format_exc()})


def _corrupt_reads(engine: Any, request_id: int) -> None:
    """Fault test: wrap this decode rank's KV backend so that ``request_id``'s read lands with
    one bit flipped (the soak's ``corrupt_transfer``)."""
    from disagg_rs.tools.soak import FaultInjectingBackend, track_posting_request

    kv = FaultInjectingBackend(engine.kv_transfer_backend, "kv")
    kv.faults[request_id] = "corrupt_transfer"
    engine.kv_transfer_backend = kv
    track_posting_request(engine, [kv])


class _Supervisor:
    """Starts the engines' processes; kills one engine and starts it again (``kill_engine``).

    With a one-sided backend (NIXL) every engine has its own torch.distributed world, as
    separate deployments do, so one engine can be replaced while the other keeps running. The
    two-sided backend moves state through a world that spans both engines, whose members
    cannot be replaced one at a time.
    """

    def __init__(self, opts: DemoOptions, control: Any, results: Any) -> None:
        self.opts = opts
        self.control = control  # (endpoint, keys)
        self.results = results
        self.ctx = mp.get_context("spawn")
        self.sizes = {
            "prefill": opts.prefill_tp * opts.prefill_pp,
            "decode": opts.decode_tp * opts.decode_pp,
        }
        self.shared_world = opts.backend == "nccl"
        self.generation = {"prefill": 0, "decode": 0}
        self.down: set[str] = set()
        """Engines killed and not restarted."""
        self.procs: dict[str, list[Any]] = {"prefill": [], "decode": []}
        self.retired: list[Any] = []
        self._placements: list[_Placement] = []
        self.restarts = 0

    @property
    def world(self) -> int:
        """How many engine processes run now."""
        return sum(n for role, n in self.sizes.items() if role not in self.down)

    def _spawn(self, role: str, port: int) -> None:
        n_prefill = self.sizes["prefill"]
        if self.shared_world:
            first, world = (0 if role == "prefill" else n_prefill), self.world
        else:
            first, world = 0, self.sizes[role]
        ranks = tuple(range(first, first + self.sizes[role]))
        slot0 = 0 if role == "prefill" else n_prefill
        for i, r in enumerate(ranks):
            where = _Placement(role, r, ranks, world, port, slot0 + i, self.generation[role])
            self._placements.append(where)
            p = self.ctx.Process(
                target=_worker, args=(self.opts, where, self.control, self.results), daemon=True
            )
            p.start()
            self.procs[role].append(p)

    def start(self) -> None:
        """Start both engines."""
        prefill_port, decode_port = _free_ports(2, self.opts.bind_host)
        self._spawn("prefill", prefill_port)
        self._spawn("decode", prefill_port if self.shared_world else decode_port)

    def kill(self, role: str, rank_index: int, restart: bool) -> int:
        """SIGKILL one rank of ``role``; as a supervisor would, kill the rest of that engine
        (ranks of a dead engine hang in its collectives) and, if ``restart``, start a new
        incarnation. Returns the pid that was killed first."""
        procs = self.procs[role]
        victim = procs[rank_index]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        self.retired += procs
        self.procs[role] = []
        self.generation[role] += 1
        if restart:
            self.restarts += 1
            # Not the port the other engine's world uses, nor the dead incarnation's.
            taken = {w.dist_port for w in self._placements}
            self._spawn(
                role, next(p for p in _free_ports(3, self.opts.bind_host) if p not in taken)
            )
        else:
            self.down.add(role)
        return int(victim.pid)

    def signal(self, role: str, sig: int) -> None:
        """Send ``sig`` to every process of ``role`` (SIGSTOP / SIGCONT: a stalled engine)."""
        for p in self.procs[role]:
            os.kill(p.pid, sig)

    def current(self, report: dict[str, Any]) -> bool:
        """Whether a worker report comes from an engine's current incarnation."""
        return report.get("generation") == self.generation.get(str(report.get("role")))

    def all(self) -> list[Any]:
        """Every process started, current and retired."""
        return [*self.retired, *self.procs["prefill"], *self.procs["decode"]]


def _colocated_reference(opts: DemoOptions, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    """The same model and prompts on one colocated TP1 engine in this process."""
    from disagg_rs.reference import EngineConfig, ReferenceEngine

    cfg = EngineConfig(
        num_blocks=opts.num_blocks,
        num_ssm_slots=max(8, opts.requests),
        block_size_tokens=opts.decode_block_size,
        device=opts.device,
    )
    engine = ReferenceEngine(_model_config(opts.model), cfg)
    return engine.generate(dict(prompts), opts.max_new_tokens)


def run_demo(opts: DemoOptions) -> DemoResult:
    """Run the demo; ``result.exit_code`` is non-zero if an answer differs or anything
    leaked."""
    from disagg_rs.control import ControlClient, ControlPlaneKeys, CoordinatorServer, Msg
    from disagg_rs.control.keys import INSECURE

    say = (lambda *a: None) if opts.quiet else print
    check_options(opts)
    if not _loopback(opts.bind_host):
        print(
            f"disagg-rs demo: warning: binding to {opts.bind_host}: the coordinator, the "
            "rendezvous store and the transfer agents accept anyone on that network",
            file=sys.stderr,
        )
    # Fresh CURVE keys per run: only this run's engines and client pass the allow-list.
    keys = None if opts.insecure_plaintext else ControlPlaneKeys.generate(("prefill", "decode"))
    # Requests fail at 75 % of the run's budget, so the client still hears every FAILED.
    server = CoordinatorServer(
        endpoint=f"tcp://{opts.bind_host}:0",
        request_timeout_s=0.75 * opts.timeout_s,
        push_transport=opts.backend == "nccl",
        engine_timeout_s=opts.engine_timeout_s,
        **(INSECURE if keys is None else keys.server_args()),
    )
    if opts.control_faults > 0:
        server.inject_faults(opts.control_faults, seed=0)
    serve = threading.Thread(target=server.serve, daemon=True)
    serve.start()
    results = mp.get_context("spawn").Queue()
    sup = _Supervisor(opts, (server.endpoint, keys), results)
    sup.start()
    if opts.metrics_port is not None:
        last = opts.metrics_port + sup.world - 1
        say(f"metrics: http://{opts.bind_host}:{opts.metrics_port}..{last}/")
    say(
        f"disagg-rs demo: {opts.model} model, prefill TP{opts.prefill_tp}xPP{opts.prefill_pp} "
        f"(block {opts.prefill_block_size}) -> decode TP{opts.decode_tp}xPP{opts.decode_pp} "
        f"(block {opts.decode_block_size}) over {opts.backend}, {opts.requests} requests"
    )
    texts = opts.prompts or PROMPTS
    prompts = {i: list(texts[i % len(texts)].encode()) for i in range(opts.requests)}
    # stall_engine: other prompts (the same texts reversed) that reuse the prefill's blocks.
    fillers = (
        {opts.requests + i: list(reversed(prompts[i])) for i in range(opts.requests)}
        if opts.stall_engine
        else {}
    )
    t_ref = time.perf_counter()
    expected = _colocated_reference(opts, {**prompts, **fillers})
    t_ref = time.perf_counter() - t_ref
    client = ControlClient(
        server.endpoint,
        default_timeout_s=opts.timeout_s,  # the coordinator's FAILED comes first
        **(INSECURE if keys is None else keys.client_args()),
    )
    deadline = time.monotonic() + opts.timeout_s
    failures: list[str] = []
    worker_reports: list[dict[str, Any]] = []
    traces: dict[int, _RequestTrace] = {}
    elapsed = 0.0
    open_ids = set(prompts)
    ended_twice: list[int] = []
    # With kill_engine: the second half is sent once the restarted engine has registered.
    # With stall_engine: once the stalled engine continued and registered again.
    two_waves = bool(opts.kill_engine or opts.stall_engine)
    wave2 = sorted(prompts)[(opts.requests + 1) // 2 :] if two_waves else []
    stall = _Stall(opts, sup, server, fillers) if opts.stall_engine else None
    after_restart: tuple[int, ...] = ()
    restart_from: int | None = None  # incarnation that was killed, until its successor registers
    killed = False

    def crashed() -> bool:
        # Reports of a killed incarnation (ranks failing in collectives) are expected.
        return any(r.get("error") and sup.current(r) for r in worker_reports)

    try:
        while len(server.state.engines) < 2 and time.monotonic() < deadline and not crashed():
            worker_reports += _drain(results, timeout=0.1)
        if len(server.state.engines) < 2 and not crashed():
            failures.append(f"engines did not register within {opts.timeout_s} s")
        t0 = time.perf_counter()
        to_send = list(prompts.items()) if not failures and not crashed() else []
        held = [(rid, p) for rid, p in to_send if rid in wave2]
        to_send = [(rid, p) for rid, p in to_send if rid not in wave2]

        # The coordinator fails a request timeout_s after its SUBMIT; wait that long after the
        # last submit, plus a margin for the FAILED to arrive, before calling a request hung.
        ends = [deadline]

        def submit_next() -> None:
            rid, prompt = to_send.pop(0)
            traces[rid] = _RequestTrace(time.perf_counter())
            client.submit(rid, prompt, opts.max_new_tokens)
            ends.append(time.monotonic() + opts.timeout_s + 5.0)

        if stall is not None and to_send:
            stall.stop()
            say(f"stopped {opts.stall_engine} with SIGSTOP before sending {len(to_send)} requests")
        while to_send and not opts.sequential:
            submit_next()
        if to_send:
            submit_next()
        bar = _progress(opts.requests * opts.max_new_tokens, opts.quiet)
        while traces and (open_ids or held) and time.monotonic() < max(ends) and not crashed():
            if opts.sequential and to_send and len(open_ids) == len(to_send):
                submit_next()
            streamed = any(t.first_token is not None for t in traces.values())
            if opts.kill_engine and not killed and streamed:
                role = opts.kill_engine
                restart_from = server.state.engines[role].incarnation
                pid = sup.kill(role, opts.kill_rank, opts.restart)
                killed = True
                say(
                    f"killed {role} rank {opts.kill_rank % sup.sizes[role]} (pid {pid}) "
                    f"with SIGKILL; {'restarting the engine' if opts.restart else 'not restarted'}"
                )
            if stall is not None:
                for line in stall.step(open_ids, to_send):
                    say(line)
                for rid in stall.submitted:
                    if rid not in traces:
                        traces[rid] = _RequestTrace(time.perf_counter())
                        open_ids.add(rid)
                        client.submit(rid, fillers[rid], opts.max_new_tokens)
                        ends.append(time.monotonic() + opts.timeout_s + 5.0)
                if stall.back and held:
                    after_restart = tuple(rid for rid, _ in held)
                    to_send += held
                    held = []
                    while to_send:
                        submit_next()
            if restart_from is not None:
                role = str(opts.kill_engine)
                engine = server.state.engines.get(role)
                back = engine is not None and engine.incarnation != restart_from
                if back or (not opts.restart and server.state.lost[role]):
                    say(
                        (
                            f"{role} is back as incarnation {engine.incarnation}"
                            if back and engine is not None
                            else f"the coordinator declared {role} lost"
                        )
                        + f"; sending requests {[rid for rid, _ in held]}"
                    )
                    restart_from = None
                    after_restart = tuple(rid for rid, _ in held)
                    to_send += held
                    held = []
                    while to_send:
                        submit_next()
            for ev in client.events(0.2):
                rid = int(ev["request_id"])
                tr = traces[rid]
                if rid not in open_ids:  # the coordinator ends each request exactly once
                    ended_twice.append(rid)
                    continue
                if ev["type"] is Msg.TOKENS:
                    if tr.first_token is None:
                        tr.first_token = time.perf_counter()
                    bar.update(len(ev["tokens"]))
                    if opts.kill_engine and not killed:
                        break  # kill now, while the first handoffs are in flight
                elif ev["type"] is Msg.DONE:
                    tr.done = time.perf_counter()
                    tr.tokens = list(ev["tokens"])
                    open_ids.discard(rid)
                elif ev["type"] is Msg.FAILED:
                    tr.error = str(ev["error"])
                    open_ids.discard(rid)
                if not open_ids:
                    break
            worker_reports += _drain(results)
        bar.close()
        elapsed = time.perf_counter() - t0
        if open_ids and not crashed():
            failures.append(f"requests {sorted(open_ids)} did not finish within {opts.timeout_s} s")
        if opts.control_faults > 0 and not crashed():
            # Lost RELEASE_KV / ABORT messages are recovered by lease expiry and import
            # deadlines: let the engines run past them before checking the pools.
            settle = time.monotonic() + opts.lease_s + 2.0
            while time.monotonic() < settle and not crashed():
                worker_reports += _drain(results, timeout=0.2)
        server.shutdown_engines()
        # A crashed rank leaves its peers stuck in collectives: give them a moment, then kill.
        # Healthy ranks get at least 30 s to report (the loop ends as soon as they all have):
        # on a loaded machine a rank that is still closing its transports is slow, not stuck.
        grace = time.monotonic() + (3.0 if crashed() else max(30.0, deadline - time.monotonic()))
        world = sup.world
        while sum(1 for r in worker_reports if sup.current(r)) < world:
            if time.monotonic() > grace:
                if not crashed():
                    failures.append("not every engine rank reported at shutdown")
                break
            worker_reports += _drain(results, timeout=0.1)
        for p in sup.all():
            p.join(timeout=5)
    finally:
        if stall is not None:
            stall.resume()  # a stopped process ignores SIGKILL's cleanup until continued
        for p in sup.all():
            if p.is_alive():
                p.kill()
        server.stop()
        serve.join(5)
        client.close()
        server.close()
    if ended_twice:
        failures.append(f"requests {sorted(set(ended_twice))} got messages after they ended")
    if opts.kill_engine and not killed and not crashed():
        failures.append(f"the {opts.kill_engine} engine was never killed (no token streamed)")
    for rep in worker_reports:
        if rep.get("error") and sup.current(rep):
            failures.append(f"{rep['role']} rank {rep['rank']} failed:\n{rep['error']}")
    wrong = 0
    failed_requests: dict[int, str] = {}
    for rid, tr in sorted(traces.items()):
        if tr.error is not None:
            failed_requests[rid] = tr.error
            # With injected faults a request may fail; after a restart, none may.
            may_fail = (
                (opts.kill_engine and (rid not in after_restart or not opts.restart))
                or (opts.corrupt is not None and rid == opts.corrupt[1])
                or (opts.stall_engine is not None and rid not in after_restart)
            )
            if opts.control_faults == 0 and not may_fail:
                failures.append(f"request {rid} failed: {tr.error}")
        elif tr.done is not None and tr.tokens != expected[rid]:
            wrong += 1
            failures.append(
                f"request {rid}: decode answered {tr.tokens}, colocated {expected[rid]}"
            )
    finals = [r for r in worker_reports if r.get("stats") is not None and sup.current(r)]
    if failures:  # where messages went, for the post-mortem
        failures.append(
            f"coordinator: undeliverable {server.undeliverable}, malformed {server.malformed}, "
            f"ignored {dict(server.state.ignored)}, engines lost {dict(server.state.lost)}, "
            f"pins left to their lease {server.state.left_to_lease}; "
            "engine imports "
            + "; ".join(
                f"{r['role']}{r['rank']}: "
                + ", ".join(f"{k}={v}" for k, v in sorted(r["stats"].items()) if v)
                for r in finals
            )
        )
    leaked = sum(int(r["leaked_blocks"]) for r in finals)
    quarantined = sum(int(r["quarantined"]) for r in finals)
    pinned = sum(int(r["pinned"]) for r in finals)
    if leaked or quarantined or pinned:
        failures.append(f"leaked blocks {leaked}, quarantined {quarantined}, pinned {pinned}")
    done = [t for t in traces.values() if t.done is not None]
    ttft = sorted((t.first_token or t.done or 0) - t.submitted for t in done)
    decode_tokens = sum(max(0, len(t.tokens) - 1) for t in done)
    moved = sum(int(r["stats"].get("bytes_pulled", 0)) for r in finals)
    descs = sum(int(r["stats"].get("descriptors", 0)) for r in finals)
    xfer_s = sum(int(r["stats"].get("transfer_ns", 0)) for r in finals) / 1e9
    post_s = sum(int(r["stats"].get("post_ns", 0)) for r in finals) / 1e9
    if not opts.quiet:
        rows = [
            (
                "requests",
                f"{len(done)}/{opts.requests} done, {wrong} wrong, {len(failed_requests)} failed",
            ),
            ("tokens generated", f"{sum(len(t.tokens) for t in done)}"),
            (
                "time to first token",
                f"p50 {_pct(ttft, 50) * 1e3:.0f} ms, p99 {_pct(ttft, 99) * 1e3:.0f} ms",
            ),
            ("decode tokens/s", f"{decode_tokens / elapsed:.1f}" if done else "-"),
            ("KV/SSM bytes moved", f"{moved:,}"),
            (
                "transfer GB/s",
                f"{moved / xfer_s / 1e9:.3f} (bytes / post-to-completion time, engine step "
                "latency included)"
                if xfer_s
                else "-",
            ),
            ("transfer descriptors", f"{descs:,}"),
            (
                "plan+compile+post",
                f"{post_s * 1e3:.1f} ms total, "
                f"{post_s * 1e6 / max(1, len(done)):.0f} us per request",
            ),
            ("colocated reference", f"{t_ref:.2f} s"),
            ("quarantined", f"{quarantined}"),
            ("leaked blocks", f"{leaked}"),
        ]
        if sup.restarts:
            rows.append(("engine restarts", f"{sup.restarts} ({opts.kill_engine})"))
        lost = dict(server.state.lost)
        ignored = dict(server.state.ignored)
        rows.append(
            (
                "coordinator",
                f"{server.faults_injected} faults injected, engines lost {lost or 0}, "
                f"late/duplicate messages ignored {ignored or 0}",
            )
        )
        print()
        for k, v in rows:
            print(f"  {k:<22} {v}")
        for rid, why in sorted(failed_requests.items()):
            print(f"  failed [{rid}]: {why}")
        print()
        for rid in sorted(r for r, t in traces.items() if t.done is not None)[:3]:
            tr = traces[rid]
            text = bytes(t for t in tr.tokens if 0 <= t < 256).decode(errors="replace")
            print(f"  [{rid}] {texts[rid % len(texts)]!r} -> {text!r}")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    if not failures:
        say("OK: every answer equals the colocated run; nothing leaked.")
    return DemoResult(
        exit_code=1 if failures else 0,
        failures=failures,
        answers={rid: tr.tokens for rid, tr in traces.items() if tr.done is not None},
        expected=expected,
        workers=worker_reports,
        failed_requests=failed_requests,
        faults_injected=server.faults_injected,
        restarts=sup.restarts,
        after_restart=after_restart,
    )


class _Stall:
    """The ``stall_engine`` fault test, step by step from the client loop: SIGSTOP, wait for
    the coordinator to declare the engine lost and for the prefill's leases to end, send the
    filler prompts (they reuse the prefill's blocks and fail: no decode), SIGCONT, wait for the
    engine to register again; then ``back`` is true."""

    def __init__(
        self, opts: DemoOptions, sup: _Supervisor, server: Any, fillers: dict[int, list[int]]
    ) -> None:
        self.opts, self.sup, self.server = opts, sup, server
        self.role = str(opts.stall_engine)
        self.fillers = fillers
        self.submitted: list[int] = []
        self.stopped = False
        self.lost_at: float | None = None
        self.back = False

    def stop(self) -> None:
        self.sup.signal(self.role, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        if self.stopped:
            self.sup.signal(self.role, signal.SIGCONT)
            self.stopped = False

    def step(self, open_ids: set[int], to_send: list[Any]) -> list[str]:
        lines: list[str] = []
        state = self.server.state
        if self.lost_at is None and state.lost[self.role]:
            self.lost_at = time.monotonic()
            lines.append(f"the coordinator declared {self.role} lost")
        # Every pin the stalled engine could read was taken before it was declared lost.
        leases_over = (
            self.lost_at is not None and time.monotonic() > self.lost_at + self.opts.lease_s + 1
        )
        if leases_over and not self.submitted and not to_send:
            self.submitted = sorted(self.fillers)
            lines.append(f"leases over; sending other prompts {self.submitted}")
        if self.stopped and self.submitted and not open_ids & set(self.submitted):
            self.resume()
            lines.append(f"continued {self.role} with SIGCONT")
        if not self.stopped and self.submitted and not self.back and self.role in state.engines:
            self.back = True
            lines.append(f"{self.role} registered again")
        return lines


def check_options(opts: DemoOptions) -> None:
    """Refuse option combinations the demo cannot run (``ValueError`` naming the options),
    before anything starts; :func:`run_demo` calls it first."""
    if not opts.engine_timeout_s > 0:
        raise ValueError(f"engine_timeout_s={opts.engine_timeout_s!r} must be > 0")
    if opts.backend == "nccl" and opts.device == "cuda" and (gpus := _gpu_count()) < 2:
        raise ValueError(
            f"backend='nccl' on device='cuda' needs two GPUs (the prefill on one, the decode on "
            f"another: NCCL joins no two ranks of one GPU), {gpus} visible; use backend='nixl' "
            "(CUDA IPC on one GPU) or device='cpu'"
        )
    if opts.corrupt is not None:
        rank, rid = opts.corrupt
        n = opts.decode_tp * opts.decode_pp
        if not (opts.verify_integrity and opts.backend == "nixl"):
            raise ValueError("corrupt needs verify_integrity=True and backend='nixl'")
        if not (0 <= rank < n and 0 <= rid < opts.requests):
            raise ValueError(
                f"corrupt={opts.corrupt}: decode rank must be in [0, {n}) and request id in "
                f"[0, {opts.requests})"
            )
    if opts.stall_engine is not None:
        if opts.stall_engine != "decode" or opts.kill_engine is not None:
            raise ValueError(
                f"stall_engine={opts.stall_engine!r}: expected 'decode', without kill_engine"
            )
        if opts.backend != "nixl" or opts.sequential or opts.requests < 2:
            raise ValueError("stall_engine needs backend='nixl', two waves and requests >= 2")
    if opts.kill_engine is None:
        return
    if opts.kill_engine not in ("prefill", "decode"):
        raise ValueError(f"kill_engine={opts.kill_engine!r}: expected 'prefill' or 'decode'")
    if opts.backend != "nixl":
        raise ValueError(
            f"kill_engine needs backend='nixl', got {opts.backend!r}: the two-sided backend "
            "moves state through one torch.distributed world spanning both engines, and a "
            "world's members cannot be replaced one at a time"
        )
    if opts.sequential:
        raise ValueError("kill_engine sends requests in two waves; sequential=True conflicts")
    if opts.requests < 2:
        raise ValueError(
            f"kill_engine needs requests >= 2 (one wave each side), got {opts.requests}"
        )
    n = (
        (opts.prefill_tp * opts.prefill_pp)
        if opts.kill_engine == "prefill"
        else (opts.decode_tp * opts.decode_pp)
    )
    if not -n <= opts.kill_rank < n:
        raise ValueError(f"kill_rank={opts.kill_rank} is outside the {n} ranks of the engine")


def _pct(values: list[float], p: int) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, (len(values) * p) // 100)]


def _drain(q: Any, timeout: float = 0.0) -> list[dict[str, Any]]:
    """Everything in ``q`` now (waiting up to ``timeout`` for the first item)."""
    out = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        return out


class _NoBar:
    def update(self, n: int) -> None:
        del n

    def close(self) -> None:
        pass


def _progress(total: int, quiet: bool) -> Any:
    if quiet:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="tokens", unit="tok", leave=False)


def _rank_and_request(text: str) -> tuple[int, int]:
    try:
        rank, request = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:REQUEST, got {text!r}") from None
    return rank, request


#: The demo's command-line options: (flag, argparse keywords besides the default, help). The
#: default of each is the :class:`DemoOptions` field its ``dest`` names.
_OPTIONS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("--backend", {"choices": ["nixl", "nccl"]},
     "transport: nixl (one-sided reads) or nccl (torch.distributed; gloo on CPU)"),
    ("--prefill-tp", {"type": int}, "prefill TP size"),
    ("--prefill-pp", {"type": int}, "prefill PP size"),
    ("--decode-tp", {"type": int}, "decode TP size"),
    ("--decode-pp", {"type": int}, "decode PP size"),
    ("--prefill-block-size", {"type": int}, "prefill KV block size in tokens"),
    ("--decode-block-size", {"type": int}, "decode KV block size in tokens"),
    ("--model", {"choices": ["hybrid", "attention"]},
     "reference model: hybrid (attention + Mamba2) or attention only"),
    ("--requests", {"type": int}, "number of prompts"),
    ("--max-new-tokens", {"type": int}, "tokens per answer"),
    ("--device", {"choices": ["cpu", "cuda"]}, "where caches and weights live"),
    ("--cache-layout", {"choices": ["megatron", "nhd", "hnd"]}, "paged KV cache memory layout"),
    ("--timeout", {"type": float, "dest": "timeout_s"}, "seconds the whole run may take"),
    ("--nixl-mode", {"choices": ["auto", "direct", "staged"]},
     "NIXL reads: direct descriptors, one packed region per source (staged), or auto"),
    ("--control-faults", {"type": float},
     "share of coordinator -> engine messages to drop, duplicate or delay (fault test)"),
    ("--lease", {"type": float, "dest": "lease_s"}, "prefill pin lease in seconds"),
    ("--kill-engine", {"choices": ["prefill", "decode"]},
     "fault test: SIGKILL one rank of this engine once the first token streamed, restart it "
     "as a new incarnation, then send the second half of the requests"),
    ("--no-restart", {"action": "store_false", "dest": "restart"},
     "with --kill-engine: leave the killed engine dead (its requests fail on liveness)"),
    ("--engine-timeout", {"type": float, "dest": "engine_timeout_s"},
     "coordinator declares an engine silent this many seconds lost"),
    ("--kill-rank", {"type": int},
     "which rank of the killed engine gets SIGKILL (-1: the last)"),
    ("--corrupt", {"type": _rank_and_request, "metavar": "RANK:REQUEST"},
     "fault test (with --verify-integrity): flip a bit of REQUEST's KV as it lands on decode "
     "rank RANK; the request must fail on every decode rank together"),
    ("--verify-integrity", {"action": "store_true"},
     "digest the handed-off state on prefill and verify it on decode before admission"),
    ("--metrics-port", {"type": int},
     "serve Prometheus metrics of rank r on BIND_HOST:(PORT + r)"),
    ("--insecure-plaintext", {"action": "store_true"},
     "run the control plane as plain TCP without CURVE keys (logs a warning; by default each "
     "run generates keys and admits only its own engines and client)"),
    ("--bind-host", {"metavar": "ADDR"},
     "address every socket of the demo binds to: coordinator, rendezvous store, collectives, "
     "UCX (default: loopback; another address exposes unauthenticated endpoints to that "
     "network)"),
)  # fmt: skip


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's command-line options (:data:`_OPTIONS`)."""
    d = DemoOptions()
    for flag, kwargs, text in _OPTIONS:
        kw = {**kwargs, "help": text}
        kw.setdefault("dest", flag.removeprefix("--").replace("-", "_"))
        p.add_argument(flag, default=getattr(d, kw["dest"]), **kw)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Build :class:`DemoOptions` from parsed arguments."""
    names = {f.name for f in dataclasses.fields(DemoOptions)}
    return DemoOptions(**{k: v for k, v in vars(args).items() if k in names})
