"""Shared test configuration: hypothesis profiles chosen by DISAGG_HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
