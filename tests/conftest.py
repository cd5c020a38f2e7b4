"""Shared test configuration: hypothesis profiles chosen by DISAGG_HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# NIXL/UCX in tests talk over loopback only (shared memory and TCP). On a GPU machine UCX must
# keep its CUDA transports (NIXL refuses a UCX_TLS without them when GPUs are present), so the
# restriction applies to CPU-only machines; spawned workers inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# "ci": what `make test` runs (>= 200 examples per property, no deadline: CI machines are slow
# and timing is never asserted). "dev": quick local iteration. "soak": long runs by hand.
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "soak", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("DISAGG_HYPOTHESIS_PROFILE", "dev"))
