"""KV cache reshard planning (the reference design's ``kv_reshard`` module).

``KVShardLayout(num_layers, num_heads, tp_size, tp_rank, pp_size, pp_rank, global_rank,
ep_size=1, ep_rank=0, etp_size=1, etp_rank=0, layer_start=None, num_local_layers=None)``
describes one rank's slice, in the reference design's positional order and keywords
(``num_kv_heads=`` is an alias of ``num_heads``). ``plan_kv_reshard(srcs, dsts)`` returns a
:class:`KVReshardPlan`, a sequence of :class:`KVReshardTransfer` records: source rank,
destination rank, global layer and head ranges (``global_layer_lo``/``_hi``,
``global_head_lo``/``_hi``, half-open) and ``src_layer_slice(src)``, ``src_head_slice(src)``,
``dst_layer_slice(dst)``, ``dst_head_slice(dst)`` for indexing each side's local buffers. EP and
ETP replicas (and GQA copies) are read once, from the smallest global rank.
"""

from disagg_rs._core import KVReshardPlan, KVReshardTransfer, KVShardLayout, plan_kv_reshard

__all__ = ["KVReshardPlan", "KVReshardTransfer", "KVShardLayout", "plan_kv_reshard"]
