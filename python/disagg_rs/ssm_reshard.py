"""SSM state reshard planning (the reference design's ``ssm_reshard`` module).

The conv state packs bands ``[x | B | C]`` on its channel axis (x head-sharded, B and C
group-sharded); the recurrent state is head-sharded. ``plan_ssm_reshard`` returns an
:class:`SSMReshardPlan`: a sequence of single-layer :class:`SSMReshardTransfer` records with
the reference design's fields (``band``, ``global_layer``, ``src_layer``, ``dst_layer``,
``src_lo``/``src_hi``, ``dst_lo``/``dst_hi`` as local channel or head offsets, ``is_conv``);
``plan.ranges`` holds the same moves merged over layer ranges.

``SSMStateDims(nheads, headdim, d_state, ngroups, d_conv)`` takes the reference design's names
(``num_heads=``, ``head_dim=``, ``n_groups=`` are aliases). ``SSMShardLayout`` takes either the
reference design's form ``(global_rank, tp_size, tp_rank, layer_start, num_layers, dims)``,
where ``num_layers`` counts the stage's layers, or ours ``(num_layers, dims, tp_size, tp_rank,
pp_size, pp_rank, global_rank)``, where it is the model's total. Like the reference design it
rejects ``ngroups < tp_size`` (Mamba mixers split the B/C groups across TP ranks) with a
``LayoutError``; ``replicate_groups=True`` opts in to layouts where each group of
``tp_size / ngroups`` ranks holds a full copy of one group.
"""

from disagg_rs._core import (
    SSMReshardPlan,
    SSMReshardTransfer,
    SSMShardLayout,
    SSMStateDims,
    plan_ssm_reshard,
)

__all__ = [
    "SSMReshardPlan",
    "SSMReshardTransfer",
    "SSMShardLayout",
    "SSMStateDims",
    "plan_ssm_reshard",
]
