"""The model slice one rank runs: its pipeline stage's layers, sharded for its TP rank.

One forward call runs a ragged batch: S sequences, sequence ``i`` contributes ``n_i`` new tokens
at positions ``[start_i, start_i + n_i)`` (a whole prompt, a prompt suffix after a prefix-cache
hit, or one decode token). Tokens arrive flat (sequence by sequence); attention and the SSM scan
work on a padded ``[S, max n_i]`` view built with one scatter, so nothing loops over tokens or
blocks. The SSM scan is the exact quadratic (state-space dual) form of the Mamba2 recurrence,
which lets a whole prompt and a single decode step share the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch
import torch.nn.functional as F

from disagg_rs._core import KVShardLayout, SSMShardLayout
from disagg_rs.reference.cache import PagedKVCache, SsmStateCache
from disagg_rs.reference.config import ModelConfig, StageWindow
from disagg_rs.reference.parallel import EngineComm
from disagg_rs.reference.weights import (
    DTYPE,
    AttentionWeights,
    MlpWeights,
    SsmWeights,
    global_tensor,
)

__all__ = ["BatchInput", "StageModel"]


@dataclass(frozen=True)
class BatchInput:
    """One ragged batch, identical on every rank of the engine.

    Per-sequence tensors have length S; ``tokens`` and ``positions`` are flat over all new
    tokens, sequence by sequence.
    """

    tokens: torch.Tensor
    """New token ids, flat ``[N]`` (int64)."""
    positions: torch.Tensor
    """Position of each new token in its sequence ``[N]``."""
    seq_ids: torch.Tensor
    """Sequence index of each new token ``[N]``."""
    offsets: torch.Tensor
    """Index of each new token among its sequence's new tokens ``[N]``."""
    num_new: torch.Tensor
    """New tokens per sequence ``[S]``."""
    starts: torch.Tensor
    """First new position per sequence ``[S]`` (0 means: start from an empty SSM state)."""
    block_table: torch.Tensor
    """KV block ids per sequence ``[S, max blocks]``, right-padded with block 0."""
    ssm_slots: torch.Tensor
    """SSM slot per sequence ``[S]`` (0 for attention-only models)."""

    @classmethod
    def build(
        cls,
        new_tokens: list[list[int]],
        starts: list[int],
        block_ids: list[list[int]],
        ssm_slots: list[int],
        device: str | torch.device = "cpu",
    ) -> BatchInput:
        """Pack per-sequence lists (one entry per sequence) into flat and padded tensors on
        ``device``."""
        num_new = torch.tensor([len(t) for t in new_tokens], dtype=torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        seq_ids = torch.repeat_interleave(torch.arange(len(new_tokens)), num_new)
        first = torch.cumsum(num_new, 0) - num_new
        offsets = torch.arange(int(num_new.sum())) - first[seq_ids]
        flat = torch.cat([torch.tensor(seq, dtype=torch.int64) for seq in new_tokens])
        table = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(b, dtype=torch.int64) for b in block_ids], batch_first=True
        )
        return cls(
            tokens=flat.to(device),
            positions=(start_t[seq_ids] + offsets).to(device),
            seq_ids=seq_ids.to(device),
            offsets=offsets.to(device),
            num_new=num_new.to(device),
            starts=start_t.to(device),
            block_table=table.to(device),
            ssm_slots=torch.tensor(ssm_slots, dtype=torch.int64).to(device),
        )

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (S)."""
        return int(self.num_new.numel())

    @property
    def max_new(self) -> int:
        """Longest run of new tokens (the padded width)."""
        return int(self.num_new.max())

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """Scatter flat ``[N, ...]`` rows into a zero-padded ``[S, max_new, ...]`` tensor."""
        out = flat.new_zeros((self.num_seqs, self.max_new, *flat.shape[1:]))
        out[self.seq_ids, self.offsets] = flat
        return out

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pad`."""
        return padded[self.seq_ids, self.offsets]


_W = TypeVar("_W", AttentionWeights, SsmWeights, MlpWeights)


def _moved(weights: _W, device: str | torch.device) -> _W:
    """``weights`` with every tensor on ``device``."""
    moved = {f.name: getattr(weights, f.name).to(device) for f in fields(weights)}
    return replace(weights, **moved)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[N, H, d]`` at ``positions`` ``[N]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=DTYPE, device=x.device) / half)
    ang = positions.to(DTYPE)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class StageModel:
    """The layers of one pipeline stage, sharded for one TP rank, with its caches."""

    def __init__(
        self,
        model: ModelConfig,
        window: StageWindow,
        comm: EngineComm,
        kv_layout: KVShardLayout | None,
        ssm_layout: SSMShardLayout | None,
        kv_cache: PagedKVCache,
        ssm_cache: SsmStateCache | None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        """Global model shape."""
        self.window = window
        """Model layers ``[lo, hi)`` of this stage."""
        self.comm = comm
        """Collectives of this rank."""
        self.kv_cache = kv_cache
        """This rank's paged KV cache (local attention layers)."""
        self.ssm_cache = ssm_cache
        """This rank's SSM slots (local SSM layers), None without SSM layers."""
        attn_lo = model.kind_window((window.lo, window.hi), "attention")[0]
        ssm_lo = model.kind_window((window.lo, window.hi), "ssm")[0]
        # (kind, local cache index, mixer weights, mlp weights) per layer of the stage.
        self.layers: list[tuple[str, int, AttentionWeights | SsmWeights, MlpWeights]] = []
        for layer in range(window.lo, window.hi):
            mlp = _moved(MlpWeights.build(model, layer, comm.tp, comm.tp_rank), device)
            if model.layer_kinds[layer] == "attention":
                assert kv_layout is not None  # a stage with an attention layer has a KV layout
                local = model.kind_index(layer) - attn_lo
                self.layers.append(
                    (
                        "attention",
                        local,
                        _moved(AttentionWeights.build(model, layer, kv_layout), device),
                        mlp,
                    )
                )
            else:
                assert ssm_layout is not None  # a stage with an SSM layer has an SSM layout
                local = model.kind_index(layer) - ssm_lo
                self.layers.append(
                    ("ssm", local, _moved(SsmWeights.build(model, layer, ssm_layout), device), mlp)
                )
        h, v = model.hidden, model.vocab_size
        self.embedding = (global_tensor(model, -1, "embedding", (v, h)) * h**0.5).to(device)
        self.final_norm = (1.0 + 0.1 * global_tensor(model, -1, "final_norm", (h,))).to(device)
        self.lm_head = global_tensor(model, -1, "lm_head", (v, h)).to(device)

    def forward(self, batch: BatchInput) -> torch.Tensor | None:
        """Run the stage on ``batch``; return next-token logits ``[S, vocab]`` on the last stage
        (the prediction after each sequence's last new token), None elsewhere."""
        n = int(batch.tokens.numel())
        if self.comm.is_first_stage:
            x = self.embedding[batch.tokens]
        else:
            x = self.comm.recv_prev((n, self.model.hidden), DTYPE, self.lm_head.device)
        eps = self.model.rms_eps
        for kind, local, weights, mlp in self.layers:
            h = _rms_norm(x, mlp.norm_mix, eps)
            if kind == "attention":
                assert isinstance(weights, AttentionWeights)
                x = x + self._attention(h, batch, local, weights)
            else:
                assert isinstance(weights, SsmWeights)
                x = x + self._ssm(h, batch, local, weights)
            h = _rms_norm(x, mlp.norm_mlp, eps)
            up = F.silu(h @ mlp.w_gate.T) * (h @ mlp.w_up.T)
            x = x + self.comm.all_reduce(up @ mlp.w_down.T)
        if not self.comm.is_last_stage:
            self.comm.send_next(x)
            return None
        last = torch.cumsum(batch.num_new, 0) - 1
        return _rms_norm(x[last], self.final_norm, eps) @ self.lm_head.T

    def _attention(
        self, x: torch.Tensor, batch: BatchInput, local: int, w: AttentionWeights
    ) -> torch.Tensor:
        m = self.model
        n, d = x.shape[0], m.head_dim
        q = _rope((x @ w.wq.T).view(n, -1, d), batch.positions, m.rope_base)
        k = _rope((x @ w.wk.T).view(n, -1, d), batch.positions, m.rope_base)
        v = (x @ w.wv.T).view(n, -1, d)
        bs = self.kv_cache.block_size_tokens
        blocks = batch.block_table[batch.seq_ids, batch.positions // bs]
        self.kv_cache.write(local, blocks, batch.positions % bs, k, v)
        length = int((batch.starts + batch.num_new).max())
        keys, values = self.kv_cache.gather(local, batch.block_table, length)
        keys, values = keys[:, :, w.q_to_kv], values[:, :, w.q_to_kv]  # GQA: [S, L, hq, d]
        qp = batch.pad(q)  # [S, Q, hq, d]
        dev = x.device
        qpos = batch.starts[:, None] + torch.arange(batch.max_new, device=dev)[None, :]  # [S, Q]
        kpos = torch.arange(length, device=dev)
        scores = torch.einsum("sqhd,skhd->shqk", qp, keys) / d**0.5
        visible = kpos[None, None, None, :] <= qpos[:, None, :, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = batch.unpad(torch.einsum("shqk,skhd->sqhd", probs, values))
        return self.comm.all_reduce(out.reshape(n, -1) @ w.wo.T)

    def _ssm(self, x: torch.Tensor, batch: BatchInput, local: int, w: SsmWeights) -> torch.Tensor:
        m = self.model
        cache = self.ssm_cache
        assert cache is not None  # SSM layers imply SSM slots
        n = x.shape[0]
        p, ds, kw = m.ssm_head_dim, m.ssm_d_state, m.ssm_d_conv
        hl = int(w.dt_bias.numel())
        gl = int(w.wxbc.shape[0] - hl * p) // (2 * ds)
        z = (x @ w.wz.T).view(n, hl, p)
        xbc = x @ w.wxbc.T  # [N, C]
        dt = F.softplus(x @ w.wdt.T + w.dt_bias)  # [N, hl]
        slots = batch.ssm_slots
        fresh = (batch.starts == 0)[:, None, None]

        # Causal depthwise conv over [previous d_conv inputs | new inputs].
        prev = torch.where(fresh, 0.0, cache.conv[local, slots])  # [S, C, K]
        s_count, channels = batch.num_seqs, xbc.shape[1]
        u = xbc.new_zeros((s_count, channels, kw + batch.max_new))
        u[:, :, :kw] = prev
        u[batch.seq_ids, :, kw + batch.offsets] = xbc
        windows = u.unfold(2, kw, 1)  # [S, C, Q + 1, K]: window i covers u[i : i + K]
        conv = torch.einsum("sctk,ck->stc", windows[:, :, 1:], w.conv_w) + w.conv_b
        xbc_c = F.silu(batch.unpad(conv))  # [N, C]
        keep = batch.num_new[:, None, None] + torch.arange(kw, device=x.device)
        keep = keep.expand(s_count, channels, kw)
        cache.conv[local, slots] = torch.gather(u, 2, keep)

        xs = xbc_c[:, : hl * p].view(n, hl, p)
        b_h = xbc_c[:, hl * p : hl * p + gl * ds].view(n, gl, ds)[:, w.head_to_group]
        c_h = xbc_c[:, hl * p + gl * ds :].view(n, gl, ds)[:, w.head_to_group]
        d_a = dt * -torch.exp(w.a_log)  # [N, hl], <= 0

        # Exact scan in quadratic form; padded tokens have d_a = 0 and no input, so they
        # neither decay nor feed the state.
        cum = torch.cumsum(batch.pad(d_a), dim=1)  # [S, Q, hl]
        xdt = batch.pad(xs * dt[..., None])  # [S, Q, hl, p]
        bp, cp = batch.pad(b_h), batch.pad(c_h)  # [S, Q, hl, n]
        q = batch.max_new
        causal = torch.ones((q, q), dtype=torch.bool, device=x.device).tril()
        seg = cum[:, :, None, :] - cum[:, None, :, :]  # [S, t, u, hl]
        decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
        cb = torch.einsum("sthn,suhn->stuh", cp, bp)
        y = torch.einsum("stuh,suhp->sthp", decay * cb, xdt)
        h0 = torch.where(fresh[..., None], 0.0, cache.recurrent[local, slots])  # [S, hl, p, n]
        y = y + torch.einsum("sthn,shpn->sthp", cp, h0) * torch.exp(cum)[..., None]
        to_end = torch.exp(cum[:, -1:, :] - cum)  # [S, Q, hl]
        h_end = torch.exp(cum[:, -1])[..., None, None] * h0
        h_end = h_end + torch.einsum("suh,suhp,suhn->shpn", to_end, xdt, bp)
        cache.recurrent[local, slots] = h_end

        out = batch.unpad(y) + xs * w.d_skip[:, None]
        gated = out * F.silu(z)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + m.rms_eps)
        normed = normed.reshape(n, hl * p) * w.norm_w
        return self.comm.all_reduce(normed @ w.wout.T)
