"""The ``disagg-rs`` console command: plan KV reshards, run the disaggregated demo, time the
descriptor compiler.

``disagg-rs plan --src "tp=8,pp=1" --dst "tp=4,pp=2" --layers 80 --kv-heads 8`` prints the KV
reshard plan between two parallel layouts as a table, with totals (``--svg FILE`` also draws
it). ``disagg-rs demo`` runs a real disaggregated prefill -> decode run of the reference engine
and checks every answer. Bad options fail at once with one line naming the flag and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from disagg_rs._core import KVReshardPlan, KVShardLayout, __version__, plan_kv_reshard
from disagg_rs.exceptions import DisaggError

__all__ = ["ParallelSpec", "layouts_for", "main", "parse_parallel_spec"]


@dataclass(frozen=True)
class ParallelSpec:
    """One engine's parallel layout: TP and PP sizes, EP replicas, optional uneven PP split."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    split: tuple[int, ...] | None = None


def parse_parallel_spec(text: str) -> ParallelSpec:
    """Parse ``"tp=8,pp=2[,ep=2][,split=30/50]"`` (split: layers per PP stage)."""
    fields: dict[str, str] = {}
    if not text.strip():
        raise argparse.ArgumentTypeError(
            'empty layout; expected e.g. "tp=8,pp=1" (fields tp=N, pp=N, ep=N, split=A/B/...)'
        )
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in {"tp", "pp", "ep", "split"}:
            raise argparse.ArgumentTypeError(
                f"bad layout field {part!r} in {text!r}; expected tp=N, pp=N, ep=N, split=A/B/..."
            )
        if key in fields:
            raise argparse.ArgumentTypeError(f"{key} is given twice in {text!r}")
        fields[key] = value
    try:
        split = tuple(int(x) for x in fields["split"].split("/")) if "split" in fields else None
        spec = ParallelSpec(
            tp=int(fields.get("tp", 1)),
            pp=int(fields.get("pp", 1)),
            ep=int(fields.get("ep", 1)),
            split=split,
        )
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad number in layout {text!r}: {e}") from None
    for name in ("tp", "pp", "ep"):
        if getattr(spec, name) < 1:
            raise argparse.ArgumentTypeError(f"{name}={getattr(spec, name)} must be >= 1")
    if spec.split is not None and any(n < 1 for n in spec.split):
        raise argparse.ArgumentTypeError(f"split={fields['split']}: every stage needs >= 1 layer")
    if spec.split is not None and len(spec.split) != spec.pp:
        raise argparse.ArgumentTypeError(
            f"split={fields['split']} has {len(spec.split)} stages but pp={spec.pp}"
        )
    return spec


def layouts_for(
    spec: ParallelSpec, num_layers: int, num_kv_heads: int, rank_offset: int = 0
) -> list[KVShardLayout]:
    """All ranks of one engine; global rank = ((ep * pp) + pp_rank) * tp + tp_rank + offset."""
    starts = [0]
    for n in spec.split or ():
        starts.append(starts[-1] + n)
    out = []
    for ep in range(spec.ep):
        for pp in range(spec.pp):
            for tp in range(spec.tp):
                window = (
                    {"layer_start": starts[pp], "num_local_layers": spec.split[pp]}
                    if spec.split
                    else {}
                )
                out.append(
                    KVShardLayout(
                        num_layers,
                        num_kv_heads,
                        tp_size=spec.tp,
                        tp_rank=tp,
                        pp_size=spec.pp,
                        pp_rank=pp,
                        global_rank=rank_offset + (ep * spec.pp + pp) * spec.tp + tp,
                        ep_rank=ep,
                        **window,
                    )
                )
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _print_plan(plan: KVReshardPlan, head_dim: int, dtype_bytes: int, tokens: int) -> None:
    header = f"{'src':>5} -> {'dst':<5} {'layers':>12} {'heads':>10} {'bytes/token':>12}"
    print(header)
    print("-" * len(header))
    for t in plan:
        layers = f"[{t.layers[0]}, {t.layers[1]})"
        heads = f"[{t.heads[0]}, {t.heads[1]})"
        print(
            f"{t.src_rank:>5} -> {t.dst_rank:<5} {layers:>12} {heads:>10} "
            f"{t.bytes_per_token(head_dim, dtype_bytes):>12,}"
        )
    per_token = plan.bytes_per_token(head_dim, dtype_bytes)
    print("-" * len(header))
    print(
        f"{len(plan)} transfers, {len({t.src_rank for t in plan})} source ranks -> "
        f"{len({t.dst_rank for t in plan})} destination ranks"
    )
    print(
        f"{per_token:,} bytes per token; {_fmt_bytes(per_token * tokens)} "
        f"for a {tokens:,}-token prompt"
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    srcs = layouts_for(args.src, args.layers, args.kv_heads)
    dsts = layouts_for(args.dst, args.layers, args.kv_heads, rank_offset=len(srcs))
    t0 = time.perf_counter()
    plan = plan_kv_reshard(srcs, dsts)
    plan.verify()
    elapsed = time.perf_counter() - t0
    # Every size is computed (and may fail, typed) before anything is printed.
    plan.bytes_per_token(args.head_dim, args.dtype_bytes)
    print(
        f"KV reshard: {args.layers} layers, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{args.dtype_bytes}-byte elements; src {len(srcs)} ranks -> dst {len(dsts)} ranks "
        f"(dst global ranks start at {len(srcs)})"
    )
    _print_plan(plan, args.head_dim, args.dtype_bytes, args.tokens)
    print(f"planned and verified exact-once coverage in {elapsed * 1e6:.0f} us")
    if args.svg:
        with open(args.svg, "w", encoding="utf-8") as f:
            f.write(plan_svg(plan, srcs, dsts))
        print(f"wrote {args.svg}")
    return 0


def plan_svg(plan: KVReshardPlan, srcs: list[KVShardLayout], dsts: list[KVShardLayout]) -> str:
    """An SVG drawing of a KV reshard plan: one column per destination rank, one row per source
    rank; each cell shows the (layer x head) band that source sends that destination."""
    cell, pad, label = 120, 6, 56
    src_ranks = [s.global_rank for s in srcs]
    dst_ranks = [d.global_rank for d in dsts]
    width = label + cell * len(dst_ranks) + pad
    height = label + cell * len(src_ranks) + pad
    num_layers, num_heads = srcs[0].num_layers, srcs[0].num_kv_heads
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="11">',
        f"<title>KV reshard plan: {len(plan)} transfers, {num_layers} layers x "
        f"{num_heads} KV heads</title>",
        f'<text x="{label}" y="14">destination rank -> (box: layers down, heads across)</text>',
    ]
    for j, r in enumerate(dst_ranks):
        out.append(f'<text x="{label + j * cell + cell // 2}" y="40">dst {r}</text>')
    for i, r in enumerate(src_ranks):
        out.append(f'<text x="2" y="{label + i * cell + cell // 2}">src {r}</text>')
        for j in range(len(dst_ranks)):
            x, y = label + j * cell, label + i * cell
            out.append(
                f'<rect x="{x}" y="{y}" width="{cell - pad}" height="{cell - pad}" '
                'fill="#f4f4f4" stroke="#bbb"/>'
            )
    inner = cell - pad
    for t in plan:
        i, j = src_ranks.index(t.src_rank), dst_ranks.index(t.dst_rank)
        x0, y0 = label + j * cell, label + i * cell
        hx = x0 + inner * t.heads[0] / num_heads
        hw = inner * (t.heads[1] - t.heads[0]) / num_heads
        ly = y0 + inner * t.layers[0] / num_layers
        lh = inner * (t.layers[1] - t.layers[0]) / num_layers
        out.append(
            f'<rect x="{hx:.1f}" y="{ly:.1f}" width="{hw:.1f}" height="{lh:.1f}" '
            'fill="#4a90d9" fill-opacity="0.8" stroke="#1d4f8a">'
            f"<title>src {t.src_rank} -> dst {t.dst_rank}: layers [{t.layers[0]}, "
            f"{t.layers[1]}) heads [{t.heads[0]}, {t.heads[1]})</title></rect>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


# What `disagg-rs demo` and `bench` import, and the package each comes from.
_DEMO_MODULES = {
    "torch": "torch",
    "zmq": "pyzmq",
    "msgpack": "msgpack",
    "tqdm": "tqdm",
    "prometheus_client": "prometheus_client",
}


def missing_demo_packages() -> list[str]:
    """Packages of the ``demo`` extra that are not importable here."""
    from importlib.util import find_spec

    return [pkg for mod, pkg in _DEMO_MODULES.items() if find_spec(mod) is None]


def _require_demo_extra(command: str) -> None:
    missing = missing_demo_packages()
    if missing:
        print(
            f"disagg-rs {command}: needs {', '.join(missing)}: "
            'pip install "disagg_rs[demo]" (or "disagg_rs[all]" for NIXL too)',
            file=sys.stderr,
        )
        raise SystemExit(2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_tp_sizes(model: str) -> tuple[list[int], str]:
    """TP sizes the reference model allows, and what limits them (computed from the model)."""
    from disagg_rs.tools.demo import _model_config

    cfg = _model_config(model)
    limits = {"num_q_heads": cfg.num_q_heads, "num_kv_heads": cfg.num_kv_heads}
    if cfg.num_ssm_layers:
        limits |= {"ssm_num_heads": cfg.ssm_num_heads, "ssm_n_groups": cfg.ssm_n_groups}
    sizes = [
        tp
        for tp in _divisors(min(limits.values()))
        if all(v % tp == 0 for v in limits.values())
        and all(KVShardLayout(cfg.num_layers, cfg.num_kv_heads, tp, r) for r in range(tp))
    ]
    why = ", ".join(f"{k}={v}" for k, v in limits.items())
    return sizes, why


def validate_demo_args(args: argparse.Namespace) -> str | None:
    """The first bad demo option as one line naming the flag and the valid values, else None.
    Runs before any process starts."""
    from disagg_rs.tools.demo import _model_config

    cfg = _model_config(args.model)
    tp_sizes, why = _valid_tp_sizes(args.model)
    for flag, value in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if value not in tp_sizes:
            return f"{flag} {value}: the {args.model} model allows TP sizes {tp_sizes} ({why})"
    for flag, value in (("--prefill-pp", args.prefill_pp), ("--decode-pp", args.decode_pp)):
        if not 1 <= value <= cfg.num_layers:
            return f"{flag} {value}: must be in [1, {cfg.num_layers}] (the model's layers)"
    positive_ints = (
        ("--prefill-block-size", args.prefill_block_size),
        ("--decode-block-size", args.decode_block_size),
        ("--requests", args.requests),
        ("--max-new-tokens", args.max_new_tokens),
    )
    for flag, value in positive_ints:
        if value < 1:
            return f"{flag} {value}: must be >= 1"
    for flag, fvalue in (
        ("--timeout", args.timeout_s),
        ("--lease", args.lease_s),
        ("--engine-timeout", args.engine_timeout_s),
    ):
        if not fvalue > 0:
            return f"{flag} {fvalue}: must be > 0 seconds"
    if args.verify_integrity and args.cache_layout != "megatron":
        return (
            f"--verify-integrity digests one contiguous cache per rank: it needs "
            f"--cache-layout megatron, not {args.cache_layout}"
        )
    if not 0.0 <= args.control_faults <= 1.0:
        return f"--control-faults {args.control_faults}: must be a share in [0, 1]"
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        return f"--metrics-port {args.metrics_port}: must be in [1, 65535]"
    if args.corrupt is not None:
        rank, rid = args.corrupt
        n = args.decode_tp * args.decode_pp
        if not (args.verify_integrity and args.backend == "nixl"):
            return "--corrupt needs --verify-integrity and --backend nixl"
        if not (0 <= rank < n and 0 <= rid < args.requests):
            return (
                f"--corrupt {rank}:{rid}: RANK must be in [0, {n}) (decode ranks) and REQUEST "
                f"in [0, {args.requests}) (--requests)"
            )
    if args.kill_engine is not None:
        if args.backend != "nixl":
            return (
                "--kill-engine needs --backend nixl (a torch.distributed world cannot "
                "replace one member)"
            )
        if args.requests < 2:
            return f"--kill-engine needs --requests >= 2 (one wave each side), got {args.requests}"
        n = (
            args.prefill_tp * args.prefill_pp
            if args.kill_engine == "prefill"
            else args.decode_tp * args.decode_pp
        )
        if not -n <= args.kill_rank < n:
            return (
                f"--kill-rank {args.kill_rank}: must be in [{-n}, {n}) "
                f"(the {args.kill_engine} engine's ranks)"
            )
    elif not args.restart:
        return "--no-restart needs --kill-engine"
    return None


def _cmd_demo(args: argparse.Namespace) -> int:
    _require_demo_extra("demo")
    bad = validate_demo_args(args)
    if bad is not None:
        print(f"disagg-rs demo: error: {bad}", file=sys.stderr)
        return 2
    from disagg_rs.tools.demo import check_options, options_from_args, run_demo

    opts = options_from_args(args)
    try:
        check_options(opts)  # what only the machine can refuse (e.g. too few GPUs)
    except ValueError as e:
        print(f"disagg-rs demo: error: {e}", file=sys.stderr)
        return 2
    return run_demo(opts).exit_code


def _cmd_bench(args: argparse.Namespace) -> int:
    del args
    _require_demo_extra("bench")
    from disagg_rs.tools.quickbench import main as bench_main

    return bench_main()


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``disagg-rs plan: error: argument --src: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``disagg-rs``."""
    parser = _Parser(
        prog="disagg-rs",
        description="Move a finished prompt's KV cache and SSM state from a prefill engine to a "
        "decode engine across TP/PP layouts. Commands: plan (print a reshard plan), demo (run "
        "a disaggregated prefill -> decode job on CPU or GPU and check every answer), bench "
        "(time the descriptor compiler). See docs/architecture.md and docs/integration.md.",
    )
    parser.add_argument("--version", action="version", version=f"disagg-rs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,demo,bench}")
    p = sub.add_parser(
        "plan",
        help="print the KV reshard plan between two layouts",
        description="Print the verified KV reshard plan from a source (prefill) layout to a "
        "destination (decode) layout: which source rank sends which layers and KV heads to "
        "which destination rank, with bytes per token and totals.",
    )
    p.add_argument(
        "--src",
        type=parse_parallel_spec,
        required=True,
        help='source layout, e.g. "tp=8,pp=1" (fields tp, pp, ep >= 1; split=A/B/... layers '
        "per PP stage)",
    )
    p.add_argument(
        "--dst",
        type=parse_parallel_spec,
        required=True,
        help='destination layout, e.g. "tp=4,pp=2"',
    )
    p.add_argument("--layers", type=_positive_int, default=80, help="global layers (default 80)")
    p.add_argument("--kv-heads", type=_positive_int, default=8, help="global KV heads (default 8)")
    p.add_argument(
        "--head-dim", type=_positive_int, default=128, help="head dimension (default 128)"
    )
    p.add_argument(
        "--dtype-bytes", type=_positive_int, default=2, help="bytes per element (default 2)"
    )
    p.add_argument(
        "--tokens", type=_positive_int, default=8192, help="prompt length for totals (default 8192)"
    )
    p.add_argument("--svg", metavar="FILE", help="also draw the plan as an SVG file")
    p.set_defaults(func=_cmd_plan)
    d = sub.add_parser(
        "demo",
        help="run a disaggregated prefill -> decode demo of the reference engine",
        description="Run a coordinator, a prefill engine and a decode engine of the reference "
        "hybrid attention + Mamba2 model as separate processes; hand every prompt's KV cache "
        "and SSM state from prefill to decode; check every answer token for token against a "
        "colocated run. Exit code 0 only if every answer matches and nothing leaked. Needs the "
        'demo extra (pip install "disagg_rs[demo]").',
    )
    from disagg_rs.tools.demo import add_demo_arguments

    add_demo_arguments(d)
    d.set_defaults(func=_cmd_demo)
    b = sub.add_parser(
        "bench",
        help="time the descriptor compiler on a large reference geometry",
        description="Time the descriptor compiler on the large geometry of "
        "docs/architecture.md (Performance) and print descriptors per second.",
    )
    b.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``disagg-rs`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DisaggError as e:
        print(f"disagg-rs: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
