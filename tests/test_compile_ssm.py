"""SSM state compiler against the byte-level oracle: conv ``[L, slots, C, d_conv]`` and
recurrent ``[L, slots, H, p, n]`` buffers filled from global tensors of unique values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _compile_oracle import apply_program
from disagg_rs import SSMGeometry, SSMShardLayout, SSMStateDims, compile_ssm_transfer
from disagg_rs.exceptions import BlockIdError, GeometryMismatchError, MetadataError

CONV_T, REC_T = np.uint16, np.uint32
CONV_SENT, REC_SENT = 0xFFFF, 0xFFFFFFFF


def layouts(dims: SSMStateDims, layers: int, tp: int, pp: int, rank0: int) -> list[SSMShardLayout]:
    return [
        SSMShardLayout(
            layers, dims, tp, t, pp, p, global_rank=rank0 + p * tp + t, replicate_groups=True
        )
        for p in range(pp)
        for t in range(tp)
    ]


class SsmRank:
    """One rank's conv and recurrent buffers and their geometry."""

    def __init__(self, lay: SSMShardLayout, slots: int, fill_conv: int, fill_rec: int) -> None:
        d = lay.dims
        n_l = lay.num_local_layers
        h = lay.heads[1] - lay.heads[0]
        self.layout = lay
        self.conv = np.full((n_l, slots, lay.local_conv_channels, d.d_conv), fill_conv, CONV_T)
        self.rec = np.full((n_l, slots, h, d.head_dim, d.d_state), fill_rec, REC_T)
        self.geometry = SSMGeometry.from_tensors(conv=self.conv, recurrent=self.rec)

    def write(self, gc: np.ndarray[Any, Any], gr: np.ndarray[Any, Any], slot: int) -> None:
        lay, l0 = self.layout, self.layout.layer_start
        for band in ("x", "B", "C"):
            (g_lo, g_hi), (lo, hi) = lay.band_span(band)  # type: ignore[arg-type]
            self.conv[:, slot, lo:hi] = gc[l0 : lay.layer_end, g_lo:g_hi]
        h0, h1 = lay.heads
        self.rec[:, slot] = gr[l0 : lay.layer_end, h0:h1]

    def ranges(self) -> list[tuple[int, int]]:
        return [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in (self.conv, self.rec)]


def tps(n_groups: int) -> list[int]:
    return [t for t in (1, 2, 4, 8) if n_groups % t == 0 or t % n_groups == 0]


@st.composite
def ssm_cases(draw: st.DrawFn) -> dict[str, Any]:
    n_groups = draw(st.sampled_from([1, 2, 4]))
    return {
        "n_groups": n_groups,
        "layers": draw(st.sampled_from([2, 4])),
        "src_tp": draw(st.sampled_from(tps(n_groups))),
        "dst_tp": draw(st.sampled_from(tps(n_groups))),
        "src_pp": draw(st.sampled_from([1, 2])),
        "dst_pp": draw(st.sampled_from([1, 2])),
        "src_slots": draw(st.lists(st.integers(0, 3), min_size=2, max_size=2)),
        "dst_slot": draw(st.integers(0, 2)),
        "mode": draw(st.sampled_from(["direct", "staged", "auto"])),
    }


@given(ssm_cases())
def test_every_destination_slot_byte_equals_a_direct_split_of_the_global_state(
    c: dict[str, Any],
) -> None:
    dims = SSMStateDims(num_heads=8, head_dim=3, d_state=2, n_groups=c["n_groups"], d_conv=4)
    layers = c["layers"]
    gc = (np.arange(layers * dims.conv_channels * 4) + 1).astype(CONV_T)
    gc = gc.reshape(layers, dims.conv_channels, 4)
    gr = (np.arange(layers * 8 * 3 * 2) + 1).astype(REC_T).reshape(layers, 8, 3, 2)
    srcs = []
    for lay in layouts(dims, layers, c["src_tp"], c["src_pp"], 0):
        r = SsmRank(lay, 4, CONV_SENT - 1, REC_SENT - 1)
        r.write(gc, gr, c["src_slots"][lay.pp_rank])
        srcs.append(r)
    slot_of = {r.layout.global_rank: c["src_slots"][r.layout.pp_rank] for r in srcs}
    for lay in layouts(dims, layers, c["dst_tp"], c["dst_pp"], 100):
        dst = SsmRank(lay, 3, CONV_SENT, REC_SENT)
        want = SsmRank(lay, 3, CONV_SENT, REC_SENT)
        want.write(gc, gr, c["dst_slot"])
        program = compile_ssm_transfer(
            [(r.layout, r.geometry) for r in srcs],
            (lay, dst.geometry),
            slot_of,
            c["dst_slot"],
            c["mode"],
        )
        program.verify()
        apply_program(program, {r.layout.global_rank: r.ranges() for r in srcs}, dst.ranges())
        np.testing.assert_array_equal(dst.conv, want.conv)
        np.testing.assert_array_equal(dst.rec, want.rec)


def test_a_conv_only_buffer_moves_only_the_conv_state() -> None:
    dims = SSMStateDims(num_heads=4, head_dim=2, d_state=2, n_groups=2, d_conv=3)
    lay = SSMShardLayout(2, dims)
    conv = np.arange(2 * 2 * dims.conv_channels * 3, dtype=np.uint16).reshape(2, 2, -1, 3)
    out = np.zeros_like(conv)
    program = compile_ssm_transfer(
        [(lay, SSMGeometry.from_tensors(conv=conv))],
        (lay, SSMGeometry.from_tensors(conv=out)),
        1,
        0,
        "direct",
    )
    s, _ = program.descriptors(0)
    assert len(s) == 2  # one per layer: the whole [x | B | C] channel row is contiguous
    program.verify()
    apply_program(
        program,
        {0: [(conv.ctypes.data, conv.ctypes.data + conv.nbytes)]},
        [(out.ctypes.data, out.ctypes.data + out.nbytes)],
    )
    np.testing.assert_array_equal(out[:, 0], conv[:, 1])
    assert not out[:, 1].any()


def test_slot_out_of_range_and_part_mismatches_are_typed_errors() -> None:
    dims = SSMStateDims(num_heads=4, head_dim=2, d_state=2, n_groups=1, d_conv=3)
    lay = SSMShardLayout(2, dims)
    conv = np.zeros((2, 2, dims.conv_channels, 3), np.uint16)
    rec = np.zeros((2, 2, 4, 2, 2), np.float32)
    g = SSMGeometry.from_tensors(conv=conv, recurrent=rec)
    with pytest.raises(BlockIdError, match="dst_slot=2 must be < num_slots=2"):
        compile_ssm_transfer([(lay, g)], (lay, g), 0, 2)
    rec16 = SSMGeometry.from_tensors(conv=conv, recurrent=rec.astype(np.float16))
    with pytest.raises(GeometryMismatchError, match="recurrent part"):
        compile_ssm_transfer([(lay, g)], (lay, rec16), 0, 1)
    with pytest.raises(GeometryMismatchError, match="no recurrent part"):
        compile_ssm_transfer([(lay, SSMGeometry.from_tensors(conv=conv))], (lay, g), 0, 1)


def test_ssm_geometry_round_trips_through_a_plain_dict() -> None:
    import json

    conv = np.zeros((2, 3, 10, 4), np.uint16)
    g = SSMGeometry.from_tensor(conv=conv, device_id=2)
    d = json.loads(json.dumps(g.to_dict()))
    assert SSMGeometry.from_dict(d) == g
    assert g.num_layers == 2 and g.num_slots == 3 and g.has_conv and not g.has_recurrent
    d["kind"] = "kv"
    with pytest.raises(MetadataError, match="kind"):
        SSMGeometry.from_dict(d)
