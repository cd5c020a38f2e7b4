"""The reference engine with the handoff mixin composed in: what the demo and the end-to-end
tests run, and the worked example of integrating :class:`InferenceStateHandoffMixin`.

The engine's pools come from the role's ledger (``ImportLedger`` on decode, ``PinLedger`` on
prefill), so the ledger accounts exactly the blocks the engine allocates.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch.distributed as dist

from disagg_rs.inference_state_handoff import InferenceStateHandoffMixin
from disagg_rs.reference.config import EngineConfig, ModelConfig
from disagg_rs.reference.engine import ReferenceEngine

__all__ = ["HandoffReferenceEngine"]


class HandoffReferenceEngine(InferenceStateHandoffMixin, ReferenceEngine):
    """One rank of a prefill or decode reference engine that hands state off."""

    def __init__(
        self,
        model: ModelConfig,
        config: EngineConfig,
        *,
        backend: str = "nixl",
        event_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._initialize_disaggregation_state()
        ranks = config.engine_ranks()
        index = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
        self.handoff_mp_rank = index
        ledger = self.make_handoff_ledger(
            config.role,
            config.num_blocks,
            config.block_size_tokens,
            config.num_ssm_slots if model.num_ssm_layers else 0,
            world_size=len(ranks),
            rank=index,
            pull=backend != "nccl",
            num_speculative_tokens=self.num_speculative_tokens,
        )
        self.attach_handoff_ledger(ledger)
        super().__init__(
            model,
            config,
            block_pool=ledger.block_pool,
            ssm_slot_pool=ledger.slot_pool if model.num_ssm_layers else None,
            event_loop=event_loop,
        )
        self._setup_handoff_completion_tracking()

    def handoff_all_gather(self, obj: Any) -> list[Any]:
        """All-gather a small picklable object over this engine's model-parallel ranks."""
        if not self.comm.distributed:
            return [obj]
        out: list[Any] = [None] * len(self.comm.ranks)
        dist.all_gather_object(out, obj, group=self.comm._engine_group)
        return out

    def handoff_broadcast(self, obj: Any) -> Any:
        """Broadcast a small picklable object from the engine's first rank to all its ranks."""
        if not self.comm.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.comm.ranks[0], group=self.comm._engine_group)
        return box[0]

    def leaked_blocks(self) -> int:
        """Blocks neither free nor evictable (call when the engine should be idle)."""
        pool = self.block_pool
        return int(pool.num_blocks - pool.num_free)
