"""Paged KV cache with a selectable memory layout, and the SSM state slots.

The KV cache of one rank holds its local attention layers and local KV heads. Three layouts are
supported because real engines use all three and the transports must handle each:

- ``megatron``: one tensor ``[2, L, B, T, H, d]`` (Megatron-LM's dynamic engine),
- ``nhd``: per layer, a tensor ``[2, B, T, H, d]`` (vLLM's flash-attention layout),
- ``hnd``: per layer, a tensor ``[2, B, H, T, d]`` (heads before tokens).

``L`` local attention layers, ``B`` blocks, ``T`` tokens per block, ``H`` local KV heads, ``d``
head dim; axis 0 is ``[key, value]``. The SSM state lives in slots: conv ``[L, slots, C,
d_conv]`` (``C`` local conv channels packed ``[x | B | C]``) and recurrent ``[L, slots, H, p,
n]``. All reads and writes are vectorized gathers and scatters; nothing loops over blocks.
"""

from __future__ import annotations

import torch

from disagg_rs.reference.config import CacheLayoutName

__all__ = ["PagedKVCache", "SsmStateCache"]

DTYPE = torch.float64
"""Element type of every cache: float64, so that TP layouts agree to rounding."""


class PagedKVCache:
    """One rank's paged KV cache in one of the three layouts."""

    def __init__(
        self,
        layout: CacheLayoutName,
        num_layers: int,
        num_blocks: int,
        block_size_tokens: int,
        num_heads: int,
        head_dim: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if layout not in ("megatron", "nhd", "hnd"):
            raise ValueError(f"cache_layout={layout!r} is not one of 'megatron', 'nhd', 'hnd'")
        self.layout: CacheLayoutName = layout
        """Layout name (see the module docstring)."""
        self.num_layers = num_layers
        """Local attention layers."""
        self.num_blocks = num_blocks
        """Blocks per layer."""
        self.block_size_tokens = block_size_tokens
        """Tokens per block."""
        self.num_heads = num_heads
        """Local KV heads."""
        self.head_dim = head_dim
        """Channels per head."""
        b, t, h, d = num_blocks, block_size_tokens, num_heads, head_dim
        self.megatron: torch.Tensor | None = None
        """The ``[2, L, B, T, H, d]`` tensor of the ``megatron`` layout (else None)."""
        self.per_layer: list[torch.Tensor] = []
        """One tensor per local layer in the ``nhd`` / ``hnd`` layouts (else empty)."""
        if layout == "megatron":
            self.megatron = torch.zeros((2, num_layers, b, t, h, d), dtype=DTYPE, device=device)
        else:
            shape = (2, b, t, h, d) if layout == "nhd" else (2, b, h, t, d)
            self.per_layer = [
                torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(num_layers)
            ]

    @property
    def tensors(self) -> torch.Tensor | list[torch.Tensor]:
        """The cache memory: one tensor (``megatron``) or one tensor per local layer."""
        return self.megatron if self.megatron is not None else self.per_layer

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views ``[B, T, H, d]`` of local layer ``layer`` (writes go through)."""
        if self.megatron is not None:
            return self.megatron[0, layer], self.megatron[1, layer]
        t = self.per_layer[layer]
        if self.layout == "hnd":
            return t[0].transpose(1, 2), t[1].transpose(1, 2)
        return t[0], t[1]

    def write(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` ``[N, H, d]`` of N tokens at (``blocks[i]``, ``offsets[i]``)."""
        kc, vc = self.layer_views(layer)
        kc[blocks, offsets] = k
        vc[blocks, offsets] = v

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, length)`` of each sequence: ``[S, length, H, d]``.

        ``block_table`` is ``[S, max_blocks]`` (padded rows point at block 0; callers mask the
        positions past each sequence's end).
        """
        kc, vc = self.layer_views(layer)
        pos = torch.arange(length, device=block_table.device)
        blocks = block_table[:, pos // self.block_size_tokens]
        offsets = (pos % self.block_size_tokens).expand_as(blocks)
        return kc[blocks, offsets], vc[blocks, offsets]


class SsmStateCache:
    """One rank's SSM state slots: conv ``[L, slots, C, d_conv]``, recurrent ``[L, slots, H,
    p, n]``. A slot holds the state after the last token a request has run."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        conv_channels: int,
        d_conv: int,
        num_heads: int,
        head_dim: int,
        d_state: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.conv = torch.zeros(
            (num_layers, num_slots, conv_channels, d_conv), dtype=DTYPE, device=device
        )
        """Last ``d_conv`` conv inputs per channel (most recent last)."""
        self.recurrent = torch.zeros(
            (num_layers, num_slots, num_heads, head_dim, d_state), dtype=DTYPE, device=device
        )
        """Recurrent state per head."""
