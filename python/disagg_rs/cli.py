"""The ``disagg-rs`` console command.

``disagg-rs plan --src "tp=8,pp=1" --dst "tp=4,pp=2" --layers 80 --kv-heads 8`` prints the KV
reshard plan between two parallel layouts as a table, with totals. ``disagg-rs demo`` runs a
real disaggregated prefill -> decode run of the reference engine and checks every answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from disagg_rs._core import KVReshardPlan, KVShardLayout, plan_kv_reshard
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
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in {"tp", "pp", "ep", "split"}:
            raise argparse.ArgumentTypeError(
                f"bad layout field {part!r} in {text!r}; expected tp=N, pp=N, ep=N, split=A/B/..."
            )
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
    print(
        f"KV reshard: {args.layers} layers, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{args.dtype_bytes}-byte elements; src {len(srcs)} ranks -> dst {len(dsts)} ranks "
        f"(dst global ranks start at {len(srcs)})"
    )
    _print_plan(plan, args.head_dim, args.dtype_bytes, args.tokens)
    print(f"planned and verified exact-once coverage in {elapsed * 1e6:.0f} us")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from disagg_rs.demo import options_from_args, run_demo

    return run_demo(options_from_args(args)).exit_code


def _cmd_bench(args: argparse.Namespace) -> int:
    del args
    from disagg_rs.quickbench import main as bench_main

    return bench_main()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``disagg-rs``."""
    parser = argparse.ArgumentParser(prog="disagg-rs", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the KV reshard plan between two layouts")
    p.add_argument("--src", type=parse_parallel_spec, required=True, help='e.g. "tp=8,pp=1"')
    p.add_argument("--dst", type=parse_parallel_spec, required=True, help='e.g. "tp=4,pp=2"')
    p.add_argument("--layers", type=int, default=80, help="global layers (default 80)")
    p.add_argument("--kv-heads", type=int, default=8, help="global KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element (default 2)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length for totals")
    p.set_defaults(func=_cmd_plan)
    d = sub.add_parser(
        "demo",
        help="run a real disaggregated prefill -> decode demo of the reference engine on CPU",
    )
    from disagg_rs.demo import add_demo_arguments

    add_demo_arguments(d)
    d.set_defaults(func=_cmd_demo)
    b = sub.add_parser("bench", help="time the descriptor compiler on the DESIGN §8 geometry")
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
