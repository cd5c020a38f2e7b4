"""The engine-side handoff mixin, split by side: :mod:`.decode`, :mod:`.prefill`, the
reference-design compatibility layer :mod:`.compat`, their shared state :mod:`.base`, and the
composed :class:`~disagg_rs.handoff.mixin.InferenceStateHandoffMixin`."""

from disagg_rs.handoff.mixin import InferenceStateHandoffMixin

__all__ = ["InferenceStateHandoffMixin"]
