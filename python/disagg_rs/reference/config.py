"""Configuration of the reference engine: the model's global shape and one engine's layout.

Everything here is a plain frozen dataclass so that every rank of an engine (and every engine of
a test) builds exactly the same model from the same values. Layer windows are half-open
``[lo, hi)`` over the model's layers in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal, TypeVar

from disagg_rs._core import KVShardLayout, SSMShardLayout, SSMStateDims

__all__ = [
    "CacheLayoutName",
    "EngineConfig",
    "LayerKind",
    "ModelConfig",
    "Role",
    "StageWindow",
    "attention_model",
    "hybrid_model",
    "kv_layout_for",
    "ssm_layout_for",
]

LayerKind = Literal["attention", "ssm"]
_L = TypeVar("_L")
"""What mixes tokens in one layer: GQA self-attention or a Mamba2-style SSM."""

CacheLayoutName = Literal["megatron", "nhd", "hnd"]
"""Memory layout of the paged KV cache.

``megatron``: one tensor ``[2, L, B, T, H, d]``; ``nhd``: one tensor ``[2, B, T, H, d]`` per
layer; ``hnd``: one tensor ``[2, B, H, T, d]`` per layer (L local attention layers, B blocks, T
tokens per block, H local KV heads, d head dim).
"""

Role = Literal["colocated", "prefill", "decode"]
"""What an engine does with a request: everything, only the prompt, or only the generation."""


@dataclass(frozen=True)
class ModelConfig:
    """Global shape of the byte-level hybrid model (the same on every layout).

    The vocabulary is the 256 byte values, so prompts are real UTF-8 text. Attention layers use
    grouped-query attention with rotary positions; SSM layers are Mamba2-style (scalar decay per
    head, B/C shared by groups of heads, causal depthwise conv over ``[x | B | C]``). Every layer
    is followed by a SwiGLU MLP. Weights are drawn from ``seed`` in float64.
    """

    layer_kinds: tuple[LayerKind, ...] = ("attention", "ssm") * 3
    """Kind of each layer, in model order."""
    hidden: int = 64
    """Residual stream width."""
    num_q_heads: int = 4
    """Query heads of every attention layer."""
    num_kv_heads: int = 2
    """KV heads of every attention layer (GQA: each serves num_q_heads / num_kv_heads queries)."""
    head_dim: int = 16
    """Channels per attention head."""
    ssm_num_heads: int = 4
    """SSM heads (Mamba2 ``nheads``)."""
    ssm_head_dim: int = 8
    """Channels per SSM head (``headdim``, p)."""
    ssm_d_state: int = 8
    """State size per group (``d_state``, n)."""
    ssm_n_groups: int = 2
    """B/C groups (``ngroups``)."""
    ssm_d_conv: int = 4
    """Causal conv kernel width; the conv state keeps the last ``d_conv`` inputs."""
    mlp_hidden: int = 128
    """Inner width of every MLP."""
    vocab_size: int = 256
    """Byte vocabulary."""
    rope_base: float = 10000.0
    """Rotary embedding base."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    seed: int = 0
    """Seed of every weight (weights are global; ranks slice them)."""

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            raise ValueError("layer_kinds=() must name at least one layer")
        bad = sorted({k for k in self.layer_kinds if k not in ("attention", "ssm")})
        if bad:
            raise ValueError(f"layer_kinds has unknown kinds {bad}; use 'attention' or 'ssm'")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.ssm_num_heads % self.ssm_n_groups:
            raise ValueError(
                f"ssm_num_heads={self.ssm_num_heads} is not divisible by "
                f"ssm_n_groups={self.ssm_n_groups}"
            )

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return len(self.layer_kinds)

    @property
    def num_attention_layers(self) -> int:
        """Layers that hold KV cache (the ``num_layers`` of a :class:`KVShardLayout`)."""
        return sum(k == "attention" for k in self.layer_kinds)

    @property
    def num_ssm_layers(self) -> int:
        """Layers that hold SSM state (the ``num_layers`` of an :class:`SSMShardLayout`)."""
        return sum(k == "ssm" for k in self.layer_kinds)

    @property
    def ssm_dims(self) -> SSMStateDims:
        """Global per-layer SSM dimensions."""
        return SSMStateDims(
            self.ssm_num_heads,
            self.ssm_head_dim,
            self.ssm_d_state,
            self.ssm_n_groups,
            self.ssm_d_conv,
        )

    def kind_index(self, layer: int) -> int:
        """Index of model layer ``layer`` among the layers of its kind (its KV or SSM layer)."""
        kind = self.layer_kinds[layer]
        return sum(k == kind for k in self.layer_kinds[:layer])

    def kind_window(self, window: tuple[int, int], kind: LayerKind) -> tuple[int, int]:
        """The ``[lo, hi)`` range of KV (or SSM) layer indices inside model window ``window``."""
        lo, hi = window
        before = sum(k == kind for k in self.layer_kinds[:lo])
        inside = sum(k == kind for k in self.layer_kinds[lo:hi])
        return before, before + inside


def hybrid_model(**overrides: object) -> ModelConfig:
    """The default hybrid model: 6 layers alternating attention and SSM, hidden 64."""
    return ModelConfig(**overrides)  # type: ignore[arg-type]


def attention_model(**overrides: object) -> ModelConfig:
    """An attention-only model of the same size (prefix caching skips its prompt compute)."""
    kwargs: dict[str, object] = {"layer_kinds": ("attention",) * 4}
    kwargs.update(overrides)
    return ModelConfig(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StageWindow:
    """Model layers ``[lo, hi)`` run by one pipeline stage."""

    lo: int
    """First model layer of the stage."""
    hi: int
    """One past the last model layer of the stage."""


@dataclass(frozen=True)
class EngineConfig:
    """One engine's parallel layout, cache layout, capacity and role.

    ``ranks`` are the global ranks of the default process group that form this engine, ordered
    ``pp_rank * tp + tp_rank``; ``None`` means ``range(tp * pp)``. ``stage_layers`` gives the
    number of model layers of each pipeline stage (uneven windows allowed); ``None`` splits the
    layers evenly.
    """

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    stage_layers: tuple[int, ...] | None = None
    """Model layers per pipeline stage, in stage order (sums to the model's layer count)."""
    ranks: tuple[int, ...] | None = None
    """Global ranks of this engine in the default process group."""
    cache_layout: CacheLayoutName = "megatron"
    """Memory layout of the paged KV cache."""
    block_size_tokens: int = 16
    """Tokens per KV block."""
    num_blocks: int = 64
    """KV blocks in the pool."""
    num_ssm_slots: int = 8
    """SSM state slots (one per live request of a hybrid model)."""
    max_batch: int = 8
    """Most requests in the running batch (prefill and decode together)."""
    role: Role = "colocated"
    """What the engine does with requests."""
    enable_prefix_caching: bool = True
    """Publish full blocks and reuse matching prompt prefixes (attention-only models skip the
    cached prefix's compute; hybrid models still run it because the SSM state is not cached)."""
    eos_token: int | None = None
    """Token that finishes a request early, if any."""
    device: str = "cpu"
    """Torch device of weights, caches and activations (``cpu``, ``cuda``, ``cuda:1``). A
    multi-rank engine needs a default process group whose backend serves it (gloo: cpu,
    NCCL: cuda)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "block_size_tokens", "num_blocks", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_ssm_slots < 0:
            raise ValueError(f"num_ssm_slots={self.num_ssm_slots} must be >= 0")
        if self.role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role={self.role!r} is not 'colocated', 'prefill' or 'decode'")

    def windows(self, model: ModelConfig) -> list[StageWindow]:
        """The model-layer window ``[lo, hi)`` of every pipeline stage."""
        counts = self.stage_layers
        if counts is None:
            if model.num_layers % self.pp:
                raise ValueError(
                    f"num_layers={model.num_layers} is not divisible by pp={self.pp}; "
                    "give stage_layers for an uneven split"
                )
            counts = (model.num_layers // self.pp,) * self.pp
        if len(counts) != self.pp:
            raise ValueError(f"len(stage_layers)={len(counts)} != pp={self.pp}")
        if sum(counts) != model.num_layers or min(counts) < 1:
            raise ValueError(
                f"stage_layers={counts} must be >= 1 each and sum to num_layers={model.num_layers}"
            )
        out: list[StageWindow] = []
        lo = 0
        for c in counts:
            out.append(StageWindow(lo, lo + c))
            lo += c
        return out

    def engine_ranks(self) -> tuple[int, ...]:
        """Global ranks of the engine, ``pp_rank * tp + tp_rank`` order."""
        ranks = self.ranks if self.ranks is not None else tuple(range(self.tp * self.pp))
        if len(ranks) != self.tp * self.pp:
            raise ValueError(f"len(ranks)={len(ranks)} != tp*pp={self.tp * self.pp}")
        return ranks


def _layout_for(
    model: ModelConfig,
    cfg: EngineConfig,
    tp_rank: int,
    pp_rank: int,
    kind: LayerKind,
    make: Callable[..., _L],
) -> _L | None:
    """``make(tp_size, tp_rank, pp_size, pp_rank, global_rank, layer_start=...,
    num_local_layers=...)`` for one rank, or ``None`` when its stage has no ``kind`` layer."""
    window = cfg.windows(model)[pp_rank]
    lo, hi = model.kind_window((window.lo, window.hi), kind)
    if hi == lo:
        return None
    global_rank = cfg.engine_ranks()[pp_rank * cfg.tp + tp_rank]
    explicit = cfg.pp > 1
    return make(
        cfg.tp,
        tp_rank,
        cfg.pp,
        pp_rank,
        global_rank,
        layer_start=lo if explicit else None,
        num_local_layers=hi - lo if explicit else None,
    )


def kv_layout_for(
    model: ModelConfig, cfg: EngineConfig, tp_rank: int, pp_rank: int
) -> KVShardLayout | None:
    """The :class:`KVShardLayout` of one rank, or ``None`` when its stage has no attention."""
    make = partial(KVShardLayout, model.num_attention_layers, model.num_kv_heads)
    return _layout_for(model, cfg, tp_rank, pp_rank, "attention", make)


def ssm_layout_for(
    model: ModelConfig, cfg: EngineConfig, tp_rank: int, pp_rank: int
) -> SSMShardLayout | None:
    """The :class:`SSMShardLayout` of one rank, or ``None`` when its stage has no SSM layer."""
    # The reference mixer gives each rank a full copy of its B/C group when tp > groups.
    make = partial(SSMShardLayout, model.num_ssm_layers, model.ssm_dims, replicate_groups=True)
    return _layout_for(model, cfg, tp_rank, pp_rank, "ssm", make)
