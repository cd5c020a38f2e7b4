"""The torch.distributed collectives one engine rank needs (gloo on CPU, NCCL on GPU).

An engine is ``tp * pp`` ranks of the default process group. Tensor-parallel ranks of a stage
all-reduce after row-parallel projections; stages pass activations to the next stage with
point-to-point send/recv between equal TP ranks; the last stage's first TP rank broadcasts the
sampled tokens to every rank so that all ranks schedule identically. A one-rank engine needs no
process group at all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disagg_rs.reference.config import EngineConfig

__all__ = ["EngineComm"]


_GROUPS: dict[tuple[int, ...], Any] = {}
"""Subgroups made so far, by sorted member ranks, for the current default group."""
_GROUPS_WORLD: list[Any] = [None]
"""The default group ``_GROUPS`` belongs to (a re-initialized world starts afresh)."""


def _group(ranks: tuple[int, ...]) -> Any:
    """A process group over ``ranks``: the default group when it is the whole world (None),
    else a group that only its members create (others need not take part).

    Groups are reused by member set: locally synchronized groups are named by a hash of their
    ranks, so creating a second one over the same ranks would collide.
    """
    members = tuple(sorted(ranks))
    if members == tuple(range(dist.get_world_size())):
        return None
    if _GROUPS_WORLD[0] is not dist.group.WORLD:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = dist.group.WORLD
    if members not in _GROUPS:
        _GROUPS[members] = dist.new_group(list(members), use_local_synchronization=True)
    return _GROUPS[members]


class EngineComm:
    """Where this process sits in an engine, and the collectives between its ranks."""

    def __init__(self, cfg: EngineConfig) -> None:
        ranks = cfg.engine_ranks()
        self.tp = cfg.tp
        """Tensor-parallel size."""
        self.pp = cfg.pp
        """Pipeline-parallel size."""
        self.ranks = ranks
        """Global ranks of the engine, ``pp_rank * tp + tp_rank`` order."""
        self.distributed = len(ranks) > 1
        """Whether the engine spans processes."""
        if self.distributed:
            if not dist.is_initialized():
                raise RuntimeError(
                    f"tp={cfg.tp} x pp={cfg.pp} engine needs torch.distributed initialized"
                )
            me = dist.get_rank()
            if me not in ranks:
                raise ValueError(f"this process (rank {me}) is not one of the engine ranks {ranks}")
            index = ranks.index(me)
        else:
            index = 0
        self.global_rank = ranks[index]
        """This process's global rank."""
        self.tp_rank = index % cfg.tp
        """Tensor-parallel rank."""
        self.pp_rank = index // cfg.tp
        """Pipeline stage."""
        self._tp_group: Any = None
        self._engine_group: Any = None
        if self.distributed:
            self._engine_group = _group(ranks)
            if cfg.tp > 1:
                # Every stage's group is created by its own members only.
                stage = ranks[self.pp_rank * cfg.tp : (self.pp_rank + 1) * cfg.tp]
                self._tp_group = _group(stage)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank embeds the tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the logits."""
        return self.pp_rank == self.pp - 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the stage's TP ranks (in place; returns ``t``)."""
        if self.tp > 1:
            dist.all_reduce(t, group=self._tp_group)
        return t

    def send_next(self, t: torch.Tensor) -> None:
        """Send activations to the same TP rank of the next stage."""
        dist.send(t.contiguous(), dst=self.ranks[(self.pp_rank + 1) * self.tp + self.tp_rank])

    def recv_prev(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Receive activations of ``shape`` from the same TP rank of the previous stage."""
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=self.ranks[(self.pp_rank - 1) * self.tp + self.tp_rank])
        return t

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Give every rank the tokens sampled by the last stage's first TP rank."""
        if self.distributed:
            src = self.ranks[(self.pp - 1) * self.tp]
            dist.broadcast(tokens, src=src, group=self._engine_group)
        return tokens
