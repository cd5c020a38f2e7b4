"""Pack and scatter of the fragments a transfer program names, on any device.

A staged transfer moves many small fragments as one packed region: the source gathers its
fragments into a contiguous staging region (:func:`pack`), one large descriptor or message
moves the region, and the destination scatters it into its paged buffer (:func:`scatter`).
The fragment lists are the Rust descriptor compiler's ``uint64`` arrays, gather rows
``(src_addr, len, packed_offset)`` and scatter rows ``(packed_offset, dst_addr, len)``.

:func:`pack` and :func:`scatter` are ``kernels.pack`` / ``kernels.scatter``: CUDA buffers take
the Triton kernel (one launch, 16-byte lanes), host buffers the vectorised torch path of
``torch_copy.py`` (``DISAGG_STAGING_KERNEL`` overrides, see ``kernels.path_for``). The
modules import in one direction only: ``torch_copy`` <- ``kernels`` <- ``staging``.
"""

from __future__ import annotations

from disagg_rs.transfer_backends.kernels import pack, scatter
from disagg_rs.transfer_backends.torch_copy import byte_view, pack_torch, scatter_torch

__all__ = ["byte_view", "pack", "pack_torch", "scatter", "scatter_torch"]
