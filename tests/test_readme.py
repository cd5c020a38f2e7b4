"""The README's Python examples run as written and print what the README says they print
(lines starting with ``#> `` in an example are its expected output). Fragments that need
a running engine are fenced as ``py`` instead of ``python`` and are not executed.

Console samples (fenced ``console``, first line ``$ disagg-rs ...``) are the output of their
command: ``make readme`` (``python tests/test_readme.py --write``) rewrites them from a fresh
run, and the tests below compare them with one, timings masked."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_examples() -> None:
    assert _python_blocks()


def test_readme_python_examples_print_what_they_claim() -> None:
    for block in _python_blocks():
        # Lines starting with "#> " are the output the example claims to print.
        expected = [line[3:] for line in block.splitlines() if line.startswith("#> ")]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(README), "exec"), {})
        for line in expected:
            assert line in out.getvalue(), f"README claims {line!r}; got:\n{out.getvalue()}"


# ---- console samples: ```console blocks whose first line is `$ disagg-rs ...` ----
CONSOLE = re.compile(r"(```console\n\$ (disagg-rs [^\n]*)\n)(.*?)(```)", re.S)
# Timings vary from run to run: numbers with a time or rate unit, and decimals.
TIMING = re.compile(r"\d[\d,]*(?:\.\d+)?(?= ?(?:us|ms|s|GB/s)\b)|\b\d+\.\d+\b")


def run_console_command(command: str) -> str:
    """Run one README command (``disagg-rs ...``) and return what it prints on stdout."""
    argv = shlex.split(command)
    assert argv[0] == "disagg-rs", command
    proc = subprocess.run(
        [sys.executable, "-m", "disagg_rs.cli", *argv[1:]],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,  # a hang guard for the multi-process demo, not a measurement
    )
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


# How many engines the coordinator saw go silent while the run shut down, and how many late
# messages it ignored, depend on timing.
SHUTDOWN = re.compile(r"(engines lost|messages ignored) (\{[^}]*\}|0)")


def _mask(text: str) -> list[str]:
    return [
        SHUTDOWN.sub(r"\1 <n>", TIMING.sub("<t>", line)).rstrip()
        for line in text.strip().splitlines()
    ]


def _console_samples() -> list[tuple[str, str]]:
    return [(m.group(2), m.group(3)) for m in CONSOLE.finditer(README.read_text())]


def test_readme_has_console_samples_of_plan_and_demo() -> None:
    commands = [c for c, _ in _console_samples()]
    assert any(c.startswith("disagg-rs plan") for c in commands)
    assert any(c.startswith("disagg-rs demo") for c in commands)


@pytest.mark.parametrize(
    "command", [c for c, _ in _console_samples() if not c.startswith("disagg-rs demo")]
)
def test_readme_console_sample_is_what_the_command_prints(command: str) -> None:
    shown = dict(_console_samples())[command]
    assert _mask(run_console_command(command)) == _mask(shown)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [c for c, _ in _console_samples() if c.startswith("disagg-rs demo")]
)
def test_readme_demo_sample_is_what_the_demo_prints(command: str) -> None:
    shown = dict(_console_samples())[command]
    assert _mask(run_console_command(command)) == _mask(shown)


def write_console_samples() -> None:
    """Rewrite every console sample of the README with a fresh run of its command."""
    text = README.read_text()

    def fresh(m: re.Match[str]) -> str:
        return m.group(1) + run_console_command(m.group(2)) + m.group(4)

    README.write_text(CONSOLE.sub(fresh, text))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_readme.py --write  (rewrites the README's samples)")
    write_console_samples()


def test_the_readme_engine_loop_is_the_code_the_demo_runs() -> None:
    import inspect

    from disagg_rs.tools.demo import serve_engine

    blocks = re.findall(r"```py\n(def serve_engine.*?)```", README.read_text(), re.S)
    assert blocks == [inspect.getsource(serve_engine)]
    assert len(blocks[0].splitlines()) < 30
