"""The Triton kernel behind ``kernels.py`` (imported lazily: only CUDA buffers need it).

One kernel serves pack (gather) and scatter. The packed side of a staged transfer is dense:
the compiler's strided runs, sorted by packed offset, cover ``[0, total)`` back to back. So
the kernel walks the *packed* space in equal chunks (perfect load balance whatever the
fragment sizes) and finds, for each 16-byte lane, the run that holds it by binary search in
the run table, which stays in L1 for the few runs one chunk touches. Run ``r`` covers packed
units ``[packed_start[r], packed_start[r + 1])``; fragment ``k`` of it starts at
``other_start[r] + k * other_stride[r]`` on the scattered side and is ``frag_len[r]`` units
long. A flat fragment list is a run table whose runs have one fragment each.

All offsets are in *units* (``VEC`` elements of the pointer's type; 16 bytes when alignment
allows, which makes each lane one 128-bit load and one 128-bit store). Offsets are int64:
KV caches exceed 2**31 elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


# Run-time scalars are not specialised: a value of 1 would otherwise turn into a constant
# (and a recompile) for tiny transfers.
@triton.jit(do_not_specialize=["n_runs", "packed_lo", "packed_hi", "outer_steps", "inner_steps"])
def copy_runs_kernel(
    src_ptr,
    dst_ptr,
    packed_start_ptr,
    other_start_ptr,
    frag_len_ptr,
    other_stride_ptr,
    n_runs,
    packed_lo,
    packed_hi,
    outer_steps,
    inner_steps,
    GATHER: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    DIV: tl.constexpr,
):
    """Copy packed units ``[packed_lo, packed_hi)`` between the packed and scattered sides.

    ``GATHER``: read the scattered side (``src_ptr``), write packed (``dst_ptr``); else the
    reverse. Program ``p`` owns packed units ``[packed_lo + p * BLOCK * SUB, ...)`` clipped
    to ``packed_hi``. ``packed_start_ptr`` has ``n_runs + 1`` entries, the last one being
    the packed total. ``outer_steps`` >= ceil(log2(n_runs)); ``inner_steps`` >=
    ceil(log2(runs one chunk can touch)); extra steps are harmless (the search is stable).
    ``DIV``: 0 when every run has one fragment, 32 when every run spans < 2**31 units
    (32-bit fragment index), else 64.
    """
    pid = tl.program_id(0).to(tl.int64)
    chunk_lo = packed_lo.to(tl.int64) + pid * (BLOCK * SUB)
    chunk_hi = tl.minimum(chunk_lo + BLOCK * SUB, packed_hi.to(tl.int64))
    last = chunk_hi - 1
    # Scalar searches for the runs holding the chunk's first and last unit. Invariant:
    # packed_start[lo] <= q < packed_start[hi].
    lo_a = pid * 0
    hi_a = lo_a + n_runs
    lo_b = lo_a
    hi_b = hi_a
    for _ in range(outer_steps):
        mid_a = (lo_a + hi_a) // 2
        right_a = tl.load(packed_start_ptr + mid_a) <= chunk_lo
        lo_a = tl.where(right_a, mid_a, lo_a)
        hi_a = tl.where(right_a, hi_a, mid_a)
        mid_b = (lo_b + hi_b) // 2
        right_b = tl.load(packed_start_ptr + mid_b) <= last
        lo_b = tl.where(right_b, mid_b, lo_b)
        hi_b = tl.where(right_b, hi_b, mid_b)
    first_run = lo_a
    end_run = lo_b + 1
    first_start = tl.load(packed_start_ptr + first_run)

    lanes = tl.arange(0, BLOCK).to(tl.int64)
    vec = tl.arange(0, VEC)
    for s in range(SUB):
        q = chunk_lo + s * BLOCK + lanes
        live = q < chunk_hi
        # Per-lane search inside [first_run, end_run): every index read stays in that range.
        lo = tl.full([BLOCK], 0, tl.int64) + first_run
        hi = tl.full([BLOCK], 0, tl.int64) + end_run
        start = tl.full([BLOCK], 0, tl.int64) + first_start
        for _ in range(inner_steps):
            mid = (lo + hi) // 2
            at = tl.load(packed_start_ptr + mid)
            right = at <= q
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
            start = tl.where(right, at, start)
        offset = q - start
        if DIV == 0:
            # Every run is one fragment: no division at all (flat lists).
            other = tl.load(other_start_ptr + lo) + offset
        else:
            flen = tl.load(frag_len_ptr + lo)
            if DIV == 32:
                # Runs shorter than 2**31 units: a 32-bit division is several times cheaper.
                k = (offset.to(tl.int32) // flen.to(tl.int32)).to(tl.int64)
            else:
                k = offset // flen
            first = tl.load(other_start_ptr + lo) + k * tl.load(other_stride_ptr + lo)
            other = first + (offset - k * flen)
        if GATHER:
            src_unit = other
            dst_unit = q
        else:
            src_unit = q
            dst_unit = other
        src_el = src_unit[:, None] * VEC + vec[None, :]
        dst_el = dst_unit[:, None] * VEC + vec[None, :]
        mask = live[:, None]
        data = tl.load(src_ptr + src_el, mask=mask)
        tl.store(dst_ptr + dst_el, data, mask=mask)
