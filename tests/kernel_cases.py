"""Inputs shared by the kernel, device-plan and staging tests: random fragment lists and
random source caches of a TP group."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from disagg_rs import KVGeometry, KVShardLayout


def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Triton kernels on host tensors through Triton's interpreter from now on; skip
    the test where the interpreter cannot run them: it turns its 1-element scalar arrays into
    loop bounds with ``int()``, which numpy 2.4 and later refuse (an interpreted launch that
    fails there also leaves the interpreter's patches on ``triton.language`` in place, which
    breaks the compiled kernels of later tests in the process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            int(np.zeros(1, dtype=np.int64))  # type: ignore[arg-type]
        except TypeError:
            pytest.skip(f"Triton's interpreter cannot run under numpy {np.__version__}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def fragments(
    draw: st.DrawFn, units: list[int], max_n: int, max_len: int
) -> tuple[int, int, np.ndarray]:
    """``(unit, end, frags)``: up to ``max_n`` non-overlapping fragments ``(offset, len)`` of
    whole ``unit``s in random order, the last ending at ``end``."""
    unit = draw(st.sampled_from(units))
    n = draw(st.integers(0, max_n))
    lens = [unit * draw(st.integers(1, max_len)) for _ in range(n)]
    gaps = [unit * draw(st.integers(0, 3)) for _ in range(n)]
    ends = np.cumsum(np.add(gaps, lens), dtype=np.int64)
    offsets = ends - np.asarray(lens, dtype=np.int64)
    order = draw(st.permutations(list(range(n))))
    frags = np.stack([offsets, lens], axis=1).astype(np.int64)[order].reshape(-1, 2)
    return unit, int(ends[-1]) if n else 0, frags


def source_caches(
    src_tp: int, shape: tuple[int, ...], heads: int, gen: torch.Generator
) -> tuple[dict[int, torch.Tensor], list[tuple[KVShardLayout, Any]]]:
    """Random int16 caches of shape ``shape`` (heads per rank last but one) for every rank of a
    TP group of ``src_tp`` over ``heads`` KV heads, and their (layout, geometry) pairs."""
    layers = shape[1]
    bufs, srcs = {}, []
    for r in range(src_tp):
        t = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
        bufs[r] = t
        lay = KVShardLayout(layers, heads, tp_size=src_tp, tp_rank=r, global_rank=r)
        srcs.append((lay, KVGeometry.from_tensor(t)))
    return bufs, srcs
