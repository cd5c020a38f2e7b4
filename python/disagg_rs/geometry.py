"""Memory geometry of one rank's state buffers (docs/architecture.md §4).

A geometry says where byte ``(kv, layer, block, token, head, dim)`` of a rank's paged KV cache
lives (:class:`KVGeometry`), or byte ``(layer, slot, channel|head, ...)`` of its SSM state
(:class:`SSMGeometry`): plane base addresses, strides in bytes, element size, device id and
the extent of every axis. It is plain data: peers exchange ``geometry.to_dict()`` once and
rebuild it with ``from_dict``. Geometries never read or write the memory they describe.

Constructors:

- ``KVGeometry.from_tensor(t, axes="kv layer block token head dim", device_id=None)``: one
  tensor (torch or numpy) with named axes in any order; Megatron ``[2, L, B, T, H, d]`` is the
  default, MLA latent ``[L, B, T, d]`` is ``axes="layer block token dim"`` (or
  ``KVGeometry.from_mla_tensor(t)``).
- ``KVGeometry.from_layer_tensors(ts, axes="kv block token head dim")``: one tensor per local
  layer, NHD ``[2, B, T, H, d]`` or HND ``[2, B, H, T, d]`` (``axes="kv block head token dim"``).
- ``KVGeometry(num_layers=..., ..., plane_bases=[...])``: explicit fields.
- ``SSMGeometry.from_tensors(conv=[L, slots, C, d_conv], recurrent=[L, slots, H, p, n])``.

The head row (``head_dim`` elements) must be contiguous; ranges are half-open ``[lo, hi)``.
"""

from disagg_rs._core import KVGeometry, SSMGeometry

__all__ = ["KVGeometry", "SSMGeometry"]
