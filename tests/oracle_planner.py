"""A plain-Python implementation of the reshard planning algorithm, used as the test oracle.

Written cell by cell for clarity, not speed: for every destination rank (by global rank), every
layer and every unit (head or group) it holds, the source is the holder with the smallest global
rank; consecutive cells with the same source merge into runs along the unit axis, and identical
runs on consecutive layers merge into rectangles. Ranges are half-open ``[lo, hi)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Holding:
    """One rank's holding: layers ``[l0, l1)`` x units ``[u0, u1)``."""

    rank: int
    l0: int
    l1: int
    u0: int
    u1: int


@dataclass(frozen=True)
class Rect:
    """``src`` sends layers ``[l0, l1)`` x units ``[u0, u1)`` to ``dst``."""

    src: int
    dst: int
    l0: int
    l1: int
    u0: int
    u1: int


class CoverageGap(Exception):
    """A destination cell that no source holds."""


def plan_rects(srcs: Sequence[Holding], dsts: Sequence[Holding]) -> list[Rect]:
    """The oracle planner."""
    out: list[Rect] = []
    for d in sorted(dsts, key=lambda h: h.rank):
        rects: list[list[int]] = []  # [src, l0, l1, u0, u1]
        prev_runs: dict[tuple[int, int, int], int] = {}
        for layer in range(d.l0, d.l1):
            runs: list[list[int]] = []  # [src, u0, u1]
            for unit in range(d.u0, d.u1):
                holders = [s.rank for s in srcs if s.l0 <= layer < s.l1 and s.u0 <= unit < s.u1]
                if not holders:
                    raise CoverageGap(f"dst {d.rank} layer {layer} unit {unit}")
                src = min(holders)
                if runs and runs[-1][0] == src and runs[-1][2] == unit:
                    runs[-1][2] = unit + 1
                else:
                    runs.append([src, unit, unit + 1])
            cur: dict[tuple[int, int, int], int] = {}
            for src, u0, u1 in runs:
                k = prev_runs.get((src, u0, u1))
                if k is not None and rects[k][2] == layer:
                    rects[k][2] = layer + 1
                    cur[(src, u0, u1)] = k
                else:
                    cur[(src, u0, u1)] = len(rects)
                    rects.append([src, layer, layer + 1, u0, u1])
            prev_runs = cur
        rects.sort(key=lambda r: (r[1], r[3], r[0]))
        out.extend(Rect(src, d.rank, l0, l1, u0, u1) for src, l0, l1, u0, u1 in rects)
    return out
