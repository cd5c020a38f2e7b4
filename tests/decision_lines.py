"""Count the lines of library Python that make decisions.

A line counts when it holds a branch or a check: ``if``/``elif``/``while``/``for``, a conditional
expression, a comparison, a boolean operator, ``raise``, ``assert``, ``except``, ``match`` or a
comprehension filter. Docstrings, comments and blank lines never count; each physical line
counts once.

Run: ``python tests/decision_lines.py python/disagg_rs [EXCLUDED_PREFIX ...]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

_DECISIONS = (
    ast.If,
    ast.IfExp,
    ast.While,
    ast.For,
    ast.Compare,
    ast.BoolOp,
    ast.Raise,
    ast.Assert,
    ast.ExceptHandler,
    ast.Match,
)


def decision_lines(source: str) -> set[int]:
    """Line numbers of ``source`` that hold a decision."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, _DECISIONS):
            lines.add(node.lineno)
        elif isinstance(node, ast.comprehension) and node.ifs:
            lines.add(node.ifs[0].lineno)
    return lines


def count_tree(root: Path, excluded: tuple[str, ...] = ()) -> dict[str, int]:
    """Decision lines per ``.py`` file under ``root`` (paths relative to it), skipping files
    whose relative path starts with one of ``excluded``."""
    counts = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(excluded):
            counts[rel] = len(decision_lines(path.read_text()))
    return counts


def main(argv: list[str]) -> None:
    counts = count_tree(Path(argv[0]), tuple(argv[1:]))
    for rel, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d} {rel}")
    print(f"{sum(counts.values()):6d} total")


if __name__ == "__main__":
    main(sys.argv[1:])
