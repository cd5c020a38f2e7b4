"""Descriptor compiler: reshard plan x geometries x block lists -> :class:`TransferProgram`.

``compile_kv_transfer(src=[(layout, geometry), ...], dst=(layout, geometry), src_block_ids,
dst_block_ids, num_tokens, mode="auto", *, token_start=0)`` compiles the transfer of ONE
destination rank from every source rank that sends to it (so a decode rank compiles one
program; a prefill rank compiles one per destination rank it serves).

- ``src_block_ids``: one list (same ids on every source rank) or ``{src global_rank: list}``
  (pipeline stages allocate independently); lists or 1-D integer numpy arrays covering token
  positions ``[0, num_tokens)``. ``dst_block_ids`` likewise for the destination, or ``None``:
  then only ``mode="staged"`` compiles and only ``gather`` / ``packed_bytes`` are available
  (what a prefill needs to pack before it knows the decode's blocks).
- ``token_start``: positions ``[token_start, num_tokens)`` move (a cached prefix is skipped).
  Both sides of a staged transfer must use the same value: it shapes the packed region.
- ``mode``: ``"direct"`` (descriptor pairs, merged where contiguous on both sides),
  ``"staged"`` (gather, one descriptor per source rank, scatter) or ``"auto"`` (per source
  rank by the docs/architecture.md §4 cost model; keywords ``per_descriptor_s``,
  ``link_bytes_per_s``, ``gather_bytes_per_s``).

Canonical packed order (both sides compute identical offsets): the packed region of one
(source rank, destination rank) pair is ``[0, packed_bytes(src_rank))`` and holds that pair's
reshard transfers in plan order; each is a dense ``[kv][layer][token][head][dim]`` array
(``[kv][layer][head][token][dim]`` when the source geometry is HND) over the transfer's layers
and heads and the moved tokens. It depends on the plan, the source geometry, ``num_tokens``
and ``token_start`` only, never on block ids. For two-sided transports the packed region of a
source rank is the one message of that (source, destination) pair.

``TransferProgram``: ``src_ranks``, ``mode(r)``, ``descriptors(r)`` (two ``[N, 3]`` uint64
arrays ``(addr, len, device_id)`` ready for ``nixl_agent.get_xfer_descs``; for a staged source
one row at ``src_staging`` / ``dst_staging``), ``gather(r)`` ``(src_addr, len, packed_offset)``,
``scatter(r)`` ``(packed_offset, dst_addr, len)``, ``packed_bytes(r)``, ``stats``, ``verify()``.
``row_count(r, which)``, ``out=`` arrays for the three lists (reused buffers avoid page faults),
and ``gather_runs(r)`` / ``scatter_runs(r)``: the same lists as strided runs
``(a, b, len, count, a_stride, b_stride)`` for a pack/unpack kernel.
``compile_ssm_transfer(src, dst, src_slot, dst_slot, mode)`` does the same for SSM slots: its
packed region holds the conv pieces, then the recurrent ones, by source-local layer, then band
(x, B, C), then channel.
"""

from disagg_rs._core import TransferProgram, compile_kv_transfer, compile_ssm_transfer

__all__ = ["TransferProgram", "compile_kv_transfer", "compile_ssm_transfer"]
