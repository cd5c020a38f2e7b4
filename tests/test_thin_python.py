"""The library's Python stays thin: decisions live in Rust.

``tests/decision_lines.py`` counts the lines of library Python that make a decision (a
branch, a loop, a comparison, a boolean operator, a raise, an assert, an except clause, a
match or a comprehension filter). The reference engine (``reference/``), the demo and soak
tools (``tools/``) and the command line (``cli.py``) are applications built on the library and
are not counted. The bound below is a ratchet: lower it when decisions move to Rust, never
raise it to let new ones in.

The Rust bindings (``rust/disagg-py``) convert arguments and results and decide nothing a
``cargo test`` of ``rust/disagg-core`` cannot reach; ``BINDING_BOUND`` is the same kind of
ratchet on their size: a new rule goes into the core, its binding stays a conversion.
"""

from __future__ import annotations

from pathlib import Path

from decision_lines import count_tree, decision_lines

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "python" / "disagg_rs"
BINDINGS = ROOT / "rust" / "disagg-py" / "src"
APPLICATIONS = ("reference/", "tools/", "cli.py")
BOUND = 483
BINDING_BOUND = 5_483


def test_the_counter_counts_branches_checks_and_filters_but_not_docstrings() -> None:
    source = '''
def f(xs, y):
    """if this were code it would count: for x in xs"""
    # if a comment
    total = 0
    for x in xs:
        if x > y and x:
            total += x
    ok = [x for x in xs if x]
    z = 1 if y else 2
    try:
        pass
    except ValueError:
        raise
    return total + z + len(ok)
'''
    assert decision_lines(source) == {6, 7, 9, 10, 13, 14}


def _within(counts: dict[str, int], bound: int, what: str, advice: str) -> None:
    total = sum(counts.values())
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total <= bound, f"{total} {what} (bound {bound}); the most in {top}: {advice}"


def test_the_library_python_makes_no_more_decisions_than_the_bound() -> None:
    _within(
        count_tree(LIBRARY, APPLICATIONS),
        BOUND,
        "decision lines in the library's Python",
        "move the new decisions into rust/disagg-core "
        "(`python tests/decision_lines.py python/disagg_rs reference/ tools/ cli.py`)",
    )


def test_the_bindings_grow_no_larger_than_the_bound() -> None:
    _within(
        {p.name: len(p.read_text().splitlines()) for p in sorted(BINDINGS.glob("*.rs"))},
        BINDING_BOUND,
        "lines in rust/disagg-py",
        "put new rules into rust/disagg-core and keep the binding a conversion "
        "(`wc -l rust/disagg-py/src/*.rs`)",
    )
