"""Deterministic global weights of the reference model, sliced per tensor-parallel rank.

Every weight is drawn as the full global tensor from a generator seeded by (model seed, layer,
name), then sliced; so every TP/PP layout computes with exactly the same global weights, and a
stage only draws the layers it runs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from disagg_rs._core import KVShardLayout, SSMShardLayout
from disagg_rs.reference.config import ModelConfig

__all__ = [
    "AttentionWeights",
    "MlpWeights",
    "SsmWeights",
    "global_tensor",
    "q_head_range",
    "shard_range",
]

DTYPE = torch.float64
"""Element type of every weight and activation (float64: layouts agree to rounding)."""


def global_tensor(
    model: ModelConfig, layer: int, name: str, shape: tuple[int, ...]
) -> torch.Tensor:
    """The global weight ``name`` of model layer ``layer`` (``-1`` for embedding and head).

    Drawn from a generator seeded by a CRC of (seed, layer, name), so it does not depend on
    which other weights a rank draws. Matrices are scaled by ``1/sqrt(fan_in)``.
    """
    seed = zlib.crc32(f"{model.seed}/{layer}/{name}".encode())
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=DTYPE)
    if len(shape) == 2:
        t = t / shape[1] ** 0.5
    return t


def shard_range(total: int, tp: int, rank: int, what: str = "units") -> tuple[int, int]:
    """Even split ``[lo, hi)`` of ``total`` units (named ``what``) for TP rank ``rank``."""
    if total % tp:
        raise ValueError(f"{what}={total} is not divisible by tp={tp}")
    per = total // tp
    return rank * per, (rank + 1) * per


def q_head_range(model: ModelConfig, tp: int, rank: int) -> tuple[int, int]:
    """Query heads ``[lo, hi)`` of a TP rank: an even split, which keeps each rank's queries on
    the KV head(s) that :class:`KVShardLayout` gives it, GQA replication included."""
    return shard_range(model.num_q_heads, tp, rank, "num_q_heads")


@dataclass(frozen=True)
class AttentionWeights:
    """One rank's slice of a GQA attention layer (column-parallel q/k/v, row-parallel o)."""

    wq: torch.Tensor
    """``[local q heads * d, hidden]``."""
    wk: torch.Tensor
    """``[local kv heads * d, hidden]``."""
    wv: torch.Tensor
    """``[local kv heads * d, hidden]``."""
    wo: torch.Tensor
    """``[hidden, local q heads * d]``."""
    q_to_kv: torch.Tensor
    """Local KV head serving each local query head (int64)."""

    @classmethod
    def build(cls, model: ModelConfig, layer: int, kv: KVShardLayout) -> AttentionWeights:
        """Slice layer ``layer``'s global weights for the rank described by ``kv``."""
        d, h = model.head_dim, model.hidden
        q_lo, q_hi = q_head_range(model, kv.tp_size, kv.tp_rank)
        k_lo, k_hi = kv.heads
        wq = global_tensor(model, layer, "wq", (model.num_q_heads * d, h))[q_lo * d : q_hi * d]
        wk = global_tensor(model, layer, "wk", (model.num_kv_heads * d, h))[k_lo * d : k_hi * d]
        wv = global_tensor(model, layer, "wv", (model.num_kv_heads * d, h))[k_lo * d : k_hi * d]
        wo = global_tensor(model, layer, "wo", (h, model.num_q_heads * d))[:, q_lo * d : q_hi * d]
        group = model.num_q_heads // model.num_kv_heads
        q_to_kv = torch.arange(q_lo, q_hi) // group - k_lo
        return cls(wq.contiguous(), wk.contiguous(), wv.contiguous(), wo.contiguous(), q_to_kv)


@dataclass(frozen=True)
class SsmWeights:
    """One rank's slice of a Mamba2-style layer.

    In-projections are column-parallel (z, x and dt by head; B and C by group, replicated when
    tp exceeds the groups); the conv runs over the local ``[x | B | C]`` channels in the order
    :class:`SSMShardLayout` packs them; the out-projection is row-parallel.
    """

    wz: torch.Tensor
    """``[local heads * p, hidden]``: gate."""
    wxbc: torch.Tensor
    """``[local conv channels, hidden]``: x, B and C rows packed ``[x | B | C]``."""
    wdt: torch.Tensor
    """``[local heads, hidden]``: step size."""
    conv_w: torch.Tensor
    """``[local conv channels, d_conv]``: depthwise causal conv."""
    conv_b: torch.Tensor
    """``[local conv channels]``."""
    dt_bias: torch.Tensor
    """``[local heads]``."""
    a_log: torch.Tensor
    """``[local heads]``: decay rate is ``-exp(a_log)``."""
    d_skip: torch.Tensor
    """``[local heads]``: skip connection."""
    norm_w: torch.Tensor
    """``[local heads * p]``: gated RMSNorm weight (normalized per head, so TP-local)."""
    wout: torch.Tensor
    """``[hidden, local heads * p]``."""
    head_to_group: torch.Tensor
    """Local group serving each local head (int64)."""

    @classmethod
    def build(cls, model: ModelConfig, layer: int, ssm: SSMShardLayout) -> SsmWeights:
        """Slice layer ``layer``'s global weights for the rank described by ``ssm``."""
        h = model.hidden
        p, n, k = model.ssm_head_dim, model.ssm_d_state, model.ssm_d_conv
        heads, groups = model.ssm_num_heads, model.ssm_n_groups
        h_lo, h_hi = ssm.heads
        g_lo, g_hi = ssm.groups
        x_rows = slice(h_lo * p, h_hi * p)
        bc_rows = slice(g_lo * n, g_hi * n)
        conv_ch = heads * p + 2 * groups * n
        wx = global_tensor(model, layer, "wx", (heads * p, h))[x_rows]
        wb = global_tensor(model, layer, "wB", (groups * n, h))[bc_rows]
        wc = global_tensor(model, layer, "wC", (groups * n, h))[bc_rows]
        conv_w = global_tensor(model, layer, "conv_w", (conv_ch, k)) / k**0.5
        conv_b = global_tensor(model, layer, "conv_b", (conv_ch,)) * 0.1
        x_band = torch.arange(h_lo * p, h_hi * p)
        b_band = heads * p + torch.arange(g_lo * n, g_hi * n)
        c_band = heads * p + groups * n + torch.arange(g_lo * n, g_hi * n)
        channels = torch.cat([x_band, b_band, c_band])
        dt_bias = global_tensor(model, layer, "dt_bias", (heads,)) * 0.5 - 1.0
        a_log = global_tensor(model, layer, "a_log", (heads,)) * 0.5
        d_skip = global_tensor(model, layer, "D", (heads,)) * 0.5 + 1.0
        norm_w = 1.0 + 0.1 * global_tensor(model, layer, "norm_w", (heads * p,))
        heads_per_group = heads // groups
        return cls(
            wz=global_tensor(model, layer, "wz", (heads * p, h))[x_rows].contiguous(),
            wxbc=torch.cat([wx, wb, wc]).contiguous(),
            wdt=global_tensor(model, layer, "wdt", (heads, h))[h_lo:h_hi].contiguous(),
            conv_w=conv_w[channels].contiguous(),
            conv_b=conv_b[channels].contiguous(),
            dt_bias=dt_bias[h_lo:h_hi].contiguous(),
            a_log=a_log[h_lo:h_hi].contiguous(),
            d_skip=d_skip[h_lo:h_hi].contiguous(),
            norm_w=norm_w[x_rows].contiguous(),
            wout=global_tensor(model, layer, "wout", (h, heads * p))[:, x_rows].contiguous(),
            head_to_group=torch.arange(h_lo, h_hi) // heads_per_group - g_lo,
        )


@dataclass(frozen=True)
class MlpWeights:
    """One rank's slice of a SwiGLU MLP (column-parallel gate/up, row-parallel down) and the
    two RMSNorm weights of the layer (replicated)."""

    norm_mix: torch.Tensor
    """``[hidden]``: norm before the mixer (attention or SSM)."""
    norm_mlp: torch.Tensor
    """``[hidden]``: norm before the MLP."""
    w_gate: torch.Tensor
    """``[local mlp, hidden]``."""
    w_up: torch.Tensor
    """``[local mlp, hidden]``."""
    w_down: torch.Tensor
    """``[hidden, local mlp]``."""

    @classmethod
    def build(cls, model: ModelConfig, layer: int, tp: int, tp_rank: int) -> MlpWeights:
        """Slice layer ``layer``'s MLP for TP rank ``tp_rank`` of ``tp``."""
        h, f = model.hidden, model.mlp_hidden
        lo, hi = shard_range(f, tp, tp_rank, "mlp_hidden")
        return cls(
            norm_mix=1.0 + 0.1 * global_tensor(model, layer, "norm_mix", (h,)),
            norm_mlp=1.0 + 0.1 * global_tensor(model, layer, "norm_mlp", (h,)),
            w_gate=global_tensor(model, layer, "w_gate", (f, h))[lo:hi].contiguous(),
            w_up=global_tensor(model, layer, "w_up", (f, h))[lo:hi].contiguous(),
            w_down=global_tensor(model, layer, "w_down", (h, f))[:, lo:hi].contiguous(),
        )
