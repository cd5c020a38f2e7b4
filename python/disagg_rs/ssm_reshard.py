"""SSM state reshard planning (the reference design's ``ssm_reshard`` module).

The conv state packs bands ``[x | B | C]`` on its channel axis (x head-sharded, B and C
group-sharded); the recurrent state is head-sharded. ``plan_ssm_reshard`` emits one transfer
per (source, destination, layer range, band) where ranges overlap.
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
