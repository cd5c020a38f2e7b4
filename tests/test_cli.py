"""The `disagg-rs` console command (plan, bench, demo options)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from disagg_rs.cli import ParallelSpec, main, parse_parallel_spec
from disagg_rs.demo import add_demo_arguments, options_from_args


def test_plan_prints_a_table_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["plan", "--src", "tp=8,pp=1", "--dst", "tp=4,pp=2", "--layers", "80", "--kv-heads", "8"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "16 transfers, 8 source ranks -> 8 destination ranks" in out
    assert "327,680 bytes per token" in out
    assert "    0 -> 8 " in out


def test_plan_accepts_uneven_splits_and_ep_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--src", "tp=2,pp=2,ep=2,split=30/50", "--dst", "tp=1", "--layers", "80"])
    assert code == 0
    assert "[30, 80)" in capsys.readouterr().out


def test_parse_parallel_spec_reads_every_field() -> None:
    assert parse_parallel_spec("tp=4,pp=2,ep=2,split=1/3") == ParallelSpec(4, 2, 2, (1, 3))


def test_invalid_layout_exits_with_a_typed_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--src", "tp=3", "--dst", "tp=1", "--kv-heads", "8"]) == 2
    assert "LayoutError" in capsys.readouterr().err


def test_bad_spec_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "disagg_rs.cli", "plan", "--src", "tq=2", "--dst", "tp=1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "bad layout field 'tq=2'" in proc.stderr


def test_bench_times_the_compiler_on_the_design_geometry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "TP1->TP1 32K, contiguous blocks" in out
    # Contiguous blocks on both sides: one descriptor per (layer plane), 2 x 80.
    assert "160" in out.splitlines()[2]
    assert "TP8->TP4 8K head reshard" in out


def test_demo_fault_options_parse_into_demo_options() -> None:
    p = argparse.ArgumentParser()
    add_demo_arguments(p)
    args = "--kill-engine decode --kill-rank 0 --no-restart --engine-timeout 2.5 "
    args += "--verify-integrity --corrupt 1:3 --control-faults 0.1 --lease 4"
    opts = options_from_args(p.parse_args(args.split()))
    assert (opts.kill_engine, opts.kill_rank, opts.restart) == ("decode", 0, False)
    assert (opts.engine_timeout_s, opts.verify_integrity, opts.corrupt) == (2.5, True, (1, 3))
    assert (opts.control_faults, opts.lease_s) == (0.1, 4.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--corrupt", "1-3"])
