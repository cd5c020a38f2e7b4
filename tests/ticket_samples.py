"""A prefill ticket's required fields, for the tests that need a valid ticket: two source
blocks of 16 tokens, no SSM slot, one resume token, pin epoch 1 and a one-second lease."""

from __future__ import annotations

from typing import Any

TICKET_FIELDS: dict[str, Any] = {
    "src_block_ids": [0, 1],
    "src_block_size_tokens": 16,
    "src_ssm_slot": None,
    "resume_tokens": [7],
    "pin_epoch": 1,
    "lease_ns": 10**9,
}
