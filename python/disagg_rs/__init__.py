"""disagg_rs: move a finished prompt's state from a prefill engine to a decode engine.

Decisions (layouts, reshard plans, descriptor programs, pools, ledgers) are made in Rust
(``disagg_rs._core``); this package re-exports them under the public names of the reference
design and adds the thin I/O drivers. All ranges are half-open ``[lo, hi)``.
"""

from disagg_rs import exceptions
from disagg_rs._core import (
    BlockPool,
    CompletionQuorum,
    ImportLedger,
    KVReshardPlan,
    KVReshardTransfer,
    KVShardLayout,
    LedgerAction,
    PinLedger,
    SlotPool,
    SSMReshardPlan,
    SSMReshardTransfer,
    SSMShardLayout,
    SSMStateDims,
    __version__,
    plan_kv_reshard,
    plan_ssm_reshard,
)
from disagg_rs.exceptions import (
    DisaggError,
    LayoutError,
    PlanCoverageError,
    TransferError,
    TransferTimeout,
)

__all__ = [
    "BlockPool",
    "CompletionQuorum",
    "ImportLedger",
    "LedgerAction",
    "PinLedger",
    "SlotPool",
    "DisaggError",
    "KVReshardPlan",
    "KVReshardTransfer",
    "KVShardLayout",
    "LayoutError",
    "PlanCoverageError",
    "SSMReshardPlan",
    "SSMReshardTransfer",
    "SSMShardLayout",
    "SSMStateDims",
    "TransferError",
    "TransferTimeout",
    "__version__",
    "exceptions",
    "plan_kv_reshard",
    "plan_ssm_reshard",
]
