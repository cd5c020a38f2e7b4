"""A small, real engine for the byte-level hybrid model (attention + Mamba2-style SSM).

It exists so that the handoff layer, the demo and the tests run against real state: float64
weights drawn from a seed (every TP/PP layout computes with the same global weights, so layouts
agree to rounding and greedy tokens agree exactly), tensor parallelism over torch.distributed
(column/row-parallel projections, KV heads and SSM heads/groups sharded as
:class:`disagg_rs.KVShardLayout` / :class:`disagg_rs.SSMShardLayout` say), pipeline stages with
uneven layer windows, a paged KV cache in three memory layouts, SSM state slots, a block pool
with prefix caching, continuous decode batching and greedy sampling.

Engine protocol (docs/architecture.md §6) as the handoff mixin uses it, on every rank of an engine:

It satisfies :class:`disagg_rs.engine_protocol.HandoffEngine` once given an event loop.

- ``block_pool`` / ``ssm_slot_pool``: the pools (new ``disagg_rs.BlockPool`` / ``SlotPool`` by
  default; pass a ledger's pool views so both account the same blocks).
- ``block_size_tokens``, ``num_speculative_tokens`` (0), ``event_loop``.
- ``kv_cache`` + ``kv_cache_layout``, ``ssm_conv_state``, ``ssm_recurrent_state``,
  ``kv_layout`` and ``ssm_layout``: what the transports register and plan with.
- prefill role: ``step()`` returns :class:`PrefillHandoff` records (blocks and slot pinned, first
  token); ``release_pinned(handoff)`` unpins on RELEASE_KV.
- decode role: ``admit(...)`` takes a request whose state was written from outside and continues
  decoding from its resume token(s); or, ledger-driven, ``expect_import(...)`` when the request
  arrives, then ``decode_batch.can_admit(n)`` / ``decode_batch.admit(id, block_ids, ssm_slot)``
  or ``complete_request_without_forward(id)``.
"""

from disagg_rs.reference.cache import PagedKVCache, SsmStateCache
from disagg_rs.reference.config import (
    CacheLayoutName,
    EngineConfig,
    LayerKind,
    ModelConfig,
    Role,
    StageWindow,
    attention_model,
    hybrid_model,
    kv_layout_for,
    ssm_layout_for,
)
from disagg_rs.reference.engine import (
    EngineStats,
    FinishedRequest,
    PrefillHandoff,
    ReferenceDecodeBatch,
    ReferenceEngine,
    StepOutput,
    decode_text,
    encode_text,
)

__all__ = [
    "CacheLayoutName",
    "EngineConfig",
    "EngineStats",
    "FinishedRequest",
    "LayerKind",
    "ModelConfig",
    "PagedKVCache",
    "PrefillHandoff",
    "ReferenceDecodeBatch",
    "ReferenceEngine",
    "Role",
    "SsmStateCache",
    "StageWindow",
    "StepOutput",
    "attention_model",
    "decode_text",
    "encode_text",
    "hybrid_model",
    "kv_layout_for",
    "ssm_layout_for",
]
