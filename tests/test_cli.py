"""The `disagg-rs` console command (plan, bench, demo options)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import disagg_rs
from disagg_rs.cli import ParallelSpec, build_parser, main, parse_parallel_spec
from disagg_rs.tools.demo import add_demo_arguments, options_from_args


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


def _plan_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["plan", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--src", "tp=0", "--dst", "tp=1"], "argument --src: tp=0 must be >= 1"),
        (["--src", "tp=-2", "--dst", "tp=1"], "argument --src: tp=-2 must be >= 1"),
        (["--src", "tp=1", "--dst", "pp=0"], "argument --dst: pp=0 must be >= 1"),
        (["--src", "", "--dst", "tp=1"], "argument --src: empty layout"),
        (["--src", "tp=1,tp=4", "--dst", "tp=1"], "argument --src: tp is given twice"),
        (["--src", "tp=1,", "--dst", "tp=1"], "bad layout field ''"),
        (["--src", "tp=1", "--dst", "tp=1", "--tokens", "-5"], "argument --tokens: -5 must be"),
        (["--src", "tp=1", "--dst", "tp=1", "--layers", "0"], "argument --layers: 0 must be"),
        (["--src", "tp=2,pp=2,split=0/80", "--dst", "tp=1"], "every stage needs >= 1 layer"),
    ],
)
def test_plan_rejects_zero_negative_empty_and_repeated_fields_in_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert says in _plan_error(capsys, *args)


def test_plan_reports_an_overflowing_size_as_one_typed_line_before_printing_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "plan",
            "--src",
            "tp=2",
            "--dst",
            "tp=1",
            "--head-dim",
            "99999999999",
            "--dtype-bytes",
            "99999999999",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("disagg-rs: error: AddressOverflowError: ")
    assert err.count("\n") == 1


def test_plan_svg_draws_one_box_per_transfer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    svg = tmp_path / "plan.svg"
    assert main(["plan", "--src", "tp=4", "--dst", "tp=2,pp=2", "--svg", str(svg)]) == 0
    text = svg.read_text()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>")
    assert "wrote" in capsys.readouterr().out
    # 8 transfers: one blue band each, titled with its ranks, layers and heads.
    assert text.count('fill="#4a90d9"') == 8
    assert "src 0 -> dst 4: layers [0, 40) heads [0, 2)" in text


def test_version_and_help_describe_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"disagg-rs {disagg_rs.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "decode engine" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["plan", "demo", "bench"])
def test_every_flag_has_help_text(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        assert action.help, (command, action.option_strings)


def _demo_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str
) -> str:
    import disagg_rs.tools.demo

    def no_run(*a: object, **k: object) -> None:
        raise AssertionError("the demo started although an option is invalid")

    monkeypatch.setattr(disagg_rs.tools.demo, "run_demo", no_run)
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--decode-tp", "3"], "--decode-tp 3: the hybrid model allows TP sizes [1, 2]"),
        (["--prefill-tp", "0"], "--prefill-tp 0: the hybrid model allows TP sizes [1, 2]"),
        (["--prefill-pp", "7"], "--prefill-pp 7: must be in [1, 6]"),
        (["--requests", "0"], "--requests 0: must be >= 1"),
        (["--decode-block-size", "0"], "--decode-block-size 0: must be >= 1"),
        (["--timeout", "0"], "--timeout 0.0: must be > 0"),
        (["--corrupt", "0:1"], "--corrupt needs --verify-integrity and --backend nixl"),
        (
            ["--corrupt", "5:1", "--verify-integrity"],
            "--corrupt 5:1: RANK must be in [0, 1)",
        ),
        (["--kill-engine", "decode", "--backend", "nccl"], "--kill-engine needs --backend nixl"),
        (["--kill-engine", "prefill", "--kill-rank", "2"], "--kill-rank 2: must be in [-2, 2)"),
        (["--no-restart"], "--no-restart needs --kill-engine"),
        (["--control-faults", "2"], "--control-faults 2.0: must be a share in [0, 1]"),
        (
            ["--verify-integrity", "--cache-layout", "hnd"],
            "--verify-integrity digests one contiguous cache per rank",
        ),
        pytest.param(
            ["--backend", "nccl", "--device", "cuda"],
            "backend='nccl' on device='cuda' needs two GPUs",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() >= 2, reason="two GPUs: the demo runs this"
            ),
        ),
    ],
)
def test_bad_demo_options_fail_before_any_process_starts_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    says: str,
) -> None:
    assert f"disagg-rs demo: error: {says}" in _demo_error(capsys, monkeypatch, *args)


def test_the_attention_model_allows_tp_sizes_computed_from_its_heads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = _demo_error(capsys, monkeypatch, "--model", "attention", "--decode-tp", "4")
    assert "the attention model allows TP sizes [1, 2] (num_q_heads=4, num_kv_heads=2)" in err


def test_demo_without_its_extra_names_the_extra_in_one_line() -> None:
    # A fresh interpreter where `import prometheus_client` and `import tqdm` fail.
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "sys.modules['tqdm'] = None\n"
        "import importlib.util as u\n"
        "real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n in ('prometheus_client', 'tqdm') else real(n, *a)\n"
        "from disagg_rs.cli import main\n"
        "sys.exit(main(['demo']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert 'pip install "disagg_rs[demo]"' in proc.stderr
    assert "tqdm, prometheus_client" in proc.stderr
