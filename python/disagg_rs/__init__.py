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
    KVGeometry,
    KVReshardPlan,
    KVReshardTransfer,
    KVShardLayout,
    LedgerAction,
    PinLedger,
    SlotPool,
    SSMGeometry,
    SSMReshardPlan,
    SSMReshardTransfer,
    SSMShardLayout,
    SSMStateDims,
    TransferProgram,
    __version__,
    compile_kv_transfer,
    compile_ssm_transfer,
    plan_kv_reshard,
    plan_ssm_reshard,
)
from disagg_rs.exceptions import *  # noqa: F403  (every typed error, also at the top level)

__all__ = [
    "BlockPool",
    "CompletionQuorum",
    "ImportLedger",
    "LedgerAction",
    "PinLedger",
    "SlotPool",
    "KVGeometry",
    "KVReshardPlan",
    "KVReshardTransfer",
    "KVShardLayout",
    "SSMReshardPlan",
    "SSMReshardTransfer",
    "SSMShardLayout",
    "SSMGeometry",
    "SSMStateDims",
    "TransferProgram",
    "__version__",
    "compile_kv_transfer",
    "compile_ssm_transfer",
    "exceptions",
    "plan_kv_reshard",
    "plan_ssm_reshard",
]
__all__ += exceptions.__all__
