"""Engine-side lifecycle of a disaggregated KV/SSM state handoff (the reference design's
``inference_state_handoff`` module): every name of that module, from :mod:`disagg_rs.handoff`.

The implementation lives in :mod:`disagg_rs.handoff` (decode side, prefill side, the
reference-design compatibility layer and the composed mixin); this module keeps the reference
design's import path working.
"""

from __future__ import annotations

from disagg_rs.decode_admission import (
    additional_decode_blocks,
    admit_prefilled_decode,
    can_admit_prefilled_decode,
)
from disagg_rs.handoff.base import (
    _SSM_STATE_KINDS,
    DEFAULT_IMPORT_TIMEOUT_NS,
    DEFAULT_LEASE_NS,
    LEASE_READ_FRACTION,
    MAX_TWO_SIDED_REQUEST_ID,
    RankImport,
    _tag,
)
from disagg_rs.handoff.compat import (
    compute_block_hashes_batched,
    drop_transfer_prefix_blocks,
    get_pg_rank,
    get_pg_size,
    transfer_block_count,
)
from disagg_rs.handoff.mixin import InferenceStateHandoffMixin
from disagg_rs.handoff.prefill import with_push_destination
from disagg_rs.pending_handoff_imports import DeferredKvHandoff, PendingKvImport, PendingSSMImport
from disagg_rs.transfer_backends import construct_kv_transfer_backend_class

__all__ = [
    "DeferredKvHandoff",
    "InferenceStateHandoffMixin",
    "PendingKvImport",
    "PendingSSMImport",
    "RankImport",
    "_SSM_STATE_KINDS",
    "additional_decode_blocks",
    "admit_prefilled_decode",
    "can_admit_prefilled_decode",
    "compute_block_hashes_batched",
    "construct_kv_transfer_backend_class",
    "get_pg_rank",
    "get_pg_size",
    "with_push_destination",
]

# Also importable from here, as before the split (not part of ``__all__``).
_REEXPORTED = (
    DEFAULT_IMPORT_TIMEOUT_NS,
    DEFAULT_LEASE_NS,
    LEASE_READ_FRACTION,
    MAX_TWO_SIDED_REQUEST_ID,
    _tag,
    drop_transfer_prefix_blocks,
    transfer_block_count,
)
