"""KV cache reshard planning (the reference design's ``kv_reshard`` module).

``plan_kv_reshard(srcs, dsts)`` returns a :class:`KVReshardPlan`, a sequence of
:class:`KVReshardTransfer` records: source rank, destination rank, global layer and head ranges
(half-open) and the local-slice helpers each side needs.
"""

from disagg_rs._core import KVReshardPlan, KVReshardTransfer, KVShardLayout, plan_kv_reshard

__all__ = ["KVReshardPlan", "KVReshardTransfer", "KVShardLayout", "plan_kv_reshard"]
