"""Direct admission of imported prefill state into a decode batch (the reference design's
``decode_admission`` module).

An imported request skips prompt execution: its prompt KV (and exact SSM state) is already in
the decode engine's cache, so it enters the running batch with the resume tokens as its next
query. These functions work on a dynamic-batching context that keeps per-request and
per-token rows in tensors (the reference design's ``DynamicInferenceContext``); each admission
writes whole rows with tensor operations.
"""

from __future__ import annotations

from typing import Any

import torch

from disagg_rs._core import ImportLedger, check_reference
from disagg_rs.exceptions import MetadataError

__all__ = ["additional_decode_blocks", "admit_prefilled_decode", "can_admit_prefilled_decode"]


def additional_decode_blocks(
    prompt_length: int, input_token_count: int, block_size: int, mtp_kv_cache: bool = False
) -> int:
    """Blocks an imported request needs beyond its prompt blocks: room for the resume tokens
    (sampled token plus speculative proposals) and, with a speculative KV cache, the drafts
    beyond them (decided by :meth:`disagg_rs.ImportLedger.continuation_blocks`)."""
    return ImportLedger.continuation_blocks(
        prompt_length, input_token_count, block_size, mtp_kv_cache
    )


def can_admit_prefilled_decode(context: Any, input_token_count: int) -> bool:
    """Whether an imported request with ``input_token_count`` query tokens fits the batch now.

    Raises ``HandoffStateError`` when the context holds prefill work: a decode-only engine
    never runs prompts.
    """
    facts = {
        "num_prefill_requests": int(context.num_prefill_requests),
        "chunked_prefill_request_id": int(context.chunked_prefill_request_id),
    }
    check_reference("decode_only", facts)
    return ImportLedger.batch_fits(
        context.total_request_count,
        context.max_requests,
        context.active_token_count,
        context.max_tokens,
        input_token_count,
    )


def admit_prefilled_decode(
    context: Any,
    request: Any,
    prompt_block_ids: list[int],
    continuation_block_ids: list[int],
    input_tokens: list[int],
    ssm_state_idx: int | None = None,
) -> None:
    """Admit imported KV/SSM state as a running decode request.

    The prompt blocks and continuation blocks each carry one allocator reference, which moves
    to the live request; ``ssm_state_idx`` is the live slot holding the exact post-prompt SSM
    state of a hybrid model. ``input_tokens`` (the sampled token plus the speculative
    proposals) become the request's next query. Everything is validated before the context
    changes.
    """
    n_in = len(input_tokens)
    bs = int(context.block_size_tokens)
    prompt_length = len(request.prompt_tokens)
    can_admit_prefilled_decode(context, n_in)  # refuses a context that holds prefill work
    ImportLedger.check_prefilled_admission(
        request.request_id,
        prompt_length,
        len(prompt_block_ids),
        len(continuation_block_ids),
        n_in,
        has_ssm_slot=ssm_state_idx is not None,
        block_size=bs,
        num_speculative_tokens=context.num_speculative_tokens,
        mtp_kv_cache=bool(getattr(context, "enable_mtp_kv_cache", False)),
        hybrid=bool(context.is_hybrid_model),
        total_request_count=context.total_request_count,
        max_requests=context.max_requests,
        active_token_count=context.active_token_count,
        max_tokens=context.max_tokens,
    )
    if request.get_metadata_types() != context.request_metadata_types:
        raise MetadataError(
            f"request {request.request_id}: metadata types {request.get_metadata_types()} differ "
            f"from the context's {context.request_metadata_types}",
            "request_metadata_types",
        )

    row = int(context.total_request_count)
    blocks = list(prompt_block_ids) + list(continuation_block_ids)
    table = context.request_to_kv_block_ids[row]
    table.fill_(-1)
    table[: len(blocks)] = torch.tensor(blocks, dtype=table.dtype, device=table.device)
    context.request_ids[row] = request.request_id
    types, values = request.get_metadata_types(), request.tracked_metadata
    for (label, _), value in zip(types, values, strict=True):
        column = context.request_metadata[label]
        column[row] = torch.as_tensor(value, dtype=column.dtype, device=column.device)
    context.request_kv_length_offsets[row] = prompt_length
    context.request_query_lengths[row] = n_in
    context.request_output_lengths[row] = (
        prompt_length + request.sampling_params.num_tokens_to_generate
    )
    context.request_in_prefill_status_tensor[row] = 0
    context.request_kv_block_counts[row] = len(blocks)
    mtp = getattr(context, "mtp_metadata", None)
    if mtp is not None:
        mtp.reset_request_rows(row)
    context.request_last_kv_block_id[row] = blocks[(prompt_length + n_in - 1) // bs]
    context.request_last_kv_block_offset[row] = (prompt_length + n_in - 1) % bs

    start = int(context.active_token_count)
    end = start + n_in
    pos = torch.arange(
        prompt_length,
        prompt_length + n_in,
        dtype=context.token_to_pos_ids.dtype,
        device=context.token_to_pos_ids.device,
    )
    ids = context.token_to_input_ids
    context.token_to_input_ids[start:end] = torch.tensor(
        list(input_tokens), dtype=ids.dtype, device=ids.device
    )
    context.token_to_pos_ids[start:end] = pos
    context.token_to_request_idx[start:end] = row
    context.token_to_position_in_request[start:end] = pos
    context.token_to_local_position_within_kv_block[start:end] = pos % bs
    idx = context.token_to_block_idx
    context.token_to_block_idx[start:end] = torch.tensor(
        blocks, dtype=idx.dtype, device=idx.device
    )[pos // bs]
    if context.is_hybrid_model:
        context.mamba_metadata.request_to_mamba_state_idx[row] = ssm_state_idx
    context.active_token_count = end
    context.total_request_count = row + 1
    request.remaining_prompt_tokens = request.remaining_prompt_tokens[:0]
    add_event = getattr(request, "add_event_add_context", None)
    if add_event is not None:
        add_event()
