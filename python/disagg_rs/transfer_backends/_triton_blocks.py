"""The Triton kernel behind ``device_plan.py`` (imported lazily: only CUDA buffers need it).

One program copies one *item*: the tokens of one block of one plane row of a
:class:`~disagg_rs.transfer_backends.device_plan.DevicePlan`. Item ``k`` is plane row
``k // n_blk`` and block index ``k % n_blk``; block index ``i`` holds tokens
``[i * tpb, min((i + 1) * tpb, n_tok))``. Every token of a plane row is ``row`` contiguous
units on each side, so the item is ``n_tokens x row`` units and lane ``u`` of it is token
``u // row``, unit ``u % row``.

The plane table has five int64 columns per row: source offset, destination offset, packed
coefficient, row (all in units) and the row's *id set*. A side is either *paged* (a KV cache:
the plane's base from column ``col`` of the plane table, plus ``ids[set * set_stride + i] *
block_stride + token * token_stride``, so one launch can read several source ranks, each
with its own block ids) or *packed* (the canonical
packed region: ``plane[2] * n_tok + (i * tpb + token) * row``, minus ``bias`` so a chunk of
the packed region can live in a smaller window; a packed destination may take up to three
consecutive item ranges, each at its own place, in one launch). The block ids are read on
the device: the host uploads only the two id arrays per handoff.

Offsets are in units of ``VEC`` elements (16 bytes when alignment allows) and int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Columns of the plane table.
COLS: tl.constexpr = tl.constexpr(5)


@triton.jit
def _side_base(
    plane_ptr, ids_ptr, p, i, n_tok, tpb, row, col, bs, bias, set_stride, PACKED: tl.constexpr
):
    """Unit offset of token 0 of item (p, i) and the unit stride between its tokens."""
    if PACKED:
        base = tl.load(plane_ptr + p * COLS + 2) * n_tok + i * tpb * row - bias
        ts = row
    else:
        id_at = tl.load(plane_ptr + p * COLS + 4) * set_stride + i
        block = tl.load(ids_ptr + id_at).to(tl.int64)
        base = tl.load(plane_ptr + p * COLS + col) + block * bs
        ts = row  # replaced by the caller's token stride
    return base, ts


@triton.jit(
    do_not_specialize=[
        "n_blk",
        "n_tok",
        "tpb",
        "k_lo",
        "a_col",
        "a_bs",
        "a_ts",
        "a_bias",
        "b_col",
        "b_bs",
        "b_ts",
        "b_bias",
        "a_set",
        "b_set",
        "b_cut1",
        "b_bias1",
        "b_cut2",
        "b_bias2",
    ]
)
def copy_blocks_kernel(
    a_ptr,
    b_ptr,
    plane_ptr,
    a_ids_ptr,
    b_ids_ptr,
    n_blk,
    n_tok,
    tpb,
    k_lo,
    a_col,
    a_bs,
    a_ts,
    a_bias,
    b_col,
    b_bs,
    b_ts,
    b_bias,
    a_set,
    b_set,
    b_cut1,
    b_bias1,
    b_cut2,
    b_bias2,
    A_PACKED: tl.constexpr,
    B_PACKED: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Copy item ``k_lo + program_id`` from side ``a`` to side ``b``.

    A packed ``b`` takes up to three consecutive item ranges at their own places: items from
    ``b_cut1`` on use bias ``b_bias1``, from ``b_cut2`` on ``b_bias2`` (cuts past the last
    item: one range, bias ``b_bias``)."""
    k = k_lo.to(tl.int64) + tl.program_id(0).to(tl.int64)
    b_bias_k = tl.where(
        k >= b_cut2.to(tl.int64),
        b_bias2.to(tl.int64),
        tl.where(k >= b_cut1.to(tl.int64), b_bias1.to(tl.int64), b_bias.to(tl.int64)),
    )
    p = k // n_blk
    i = k - p * n_blk
    n_tok64 = n_tok.to(tl.int64)
    tpb64 = tpb.to(tl.int64)
    row = tl.load(plane_ptr + p * COLS + 3)
    first = i * tpb64
    ntok = tl.minimum(tpb64, n_tok64 - first)
    a_base, a_pts = _side_base(
        plane_ptr,
        a_ids_ptr,
        p,
        i,
        n_tok64,
        tpb64,
        row,
        a_col,
        a_bs,
        a_bias,
        a_set.to(tl.int64),
        A_PACKED,
    )
    b_base, b_pts = _side_base(
        plane_ptr,
        b_ids_ptr,
        p,
        i,
        n_tok64,
        tpb64,
        row,
        b_col,
        b_bs,
        b_bias_k,
        b_set.to(tl.int64),
        B_PACKED,
    )
    if not A_PACKED:
        a_pts = a_ts.to(tl.int64)
    if not B_PACKED:
        b_pts = b_ts.to(tl.int64)
    total = ntok * row
    lanes = tl.arange(0, BLOCK)
    vec = tl.arange(0, VEC)
    row32 = row.to(tl.int32)
    for start in range(0, total, BLOCK):
        u = start + lanes
        live = u < total
        t = (u.to(tl.int32) // row32).to(tl.int64)
        x = u - t * row
        a_unit = a_base + t * a_pts + x
        b_unit = b_base + t * b_pts + x
        mask = live[:, None]
        data = tl.load(a_ptr + (a_unit[:, None] * VEC + vec[None, :]), mask=mask)
        tl.store(b_ptr + (b_unit[:, None] * VEC + vec[None, :]), data, mask=mask)
