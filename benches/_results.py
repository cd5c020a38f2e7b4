"""Write one benchmark's section into benches/RESULTS.md, leaving the other sections alone.

Each bench script owns the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``;
a run replaces its own section (or appends it) and stamps machine and date.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
from pathlib import Path

__all__ = ["bench_args", "machine_line", "publish", "table_section", "write_section"]


def bench_args(doc: str | None, section: str, **counts: int) -> argparse.Namespace:
    """A bench's command line: ``--write`` (the results file whose section ``section`` the
    run updates) and one int option per ``counts`` entry (its default), e.g. ``--requests``."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    for name, default in counts.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--write", default=None, help=f"results file to update (section: {section})")
    return ap.parse_args()


def machine_line() -> str:
    """One line naming the machine, CPU count and date of this run."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    today = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    host = platform.node() or "host"
    return f"{today}, {host}: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def write_section(path: str | Path, name: str, markdown: str) -> None:
    """Replace (or append) the section ``name`` of the results file at ``path``."""
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmark results\n\nRatios are from one run.\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block + "\n"
    )
    p.write_text(text)


def publish(path: str | Path | None, name: str, markdown: str) -> None:
    """Print one benchmark's section and, given a results file ``path``, write it there."""
    print(markdown)
    if path:
        write_section(path, name, markdown)


def table_section(title: str, intro: list[str], columns: list[str], rows: list[str]) -> str:
    """A results section: ``## title``, the machine line, ``intro`` and a table of ``rows``
    (already-formatted markdown rows) under ``columns``."""
    header = "| " + " | ".join(columns) + " |"
    rule = "|" + "---|" * len(columns)
    return "\n".join([f"## {title}", "", machine_line(), "", *intro, "", header, rule, *rows])
