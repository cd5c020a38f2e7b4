"""The README's Python examples run as written and print what the README says they print
(lines starting with ``#> `` in an example are its expected output). Fragments that need
a running engine are fenced as ``py`` instead of ``python`` and are not executed."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

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
