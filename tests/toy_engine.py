"""The engine side of the handoff protocol that every toy engine of the tests shares.

A toy engine resolves its handoff futures on ``_loop`` (``None``: no loop yet), keeps the
imports it was told to expect in ``expected`` (``request_id`` -> ``(prompt, resume_tokens,
max_new)``) and records the requests finished without a forward pass through
:meth:`ExpectingEngine.finish_without_forward`.
"""

from __future__ import annotations

import asyncio
from typing import Any


class ExpectingEngine:
    """``expect_import`` / ``abort`` / ``complete_request_without_forward`` over a dict of
    expected imports, and a one-rank ``handoff_all_gather``."""

    expected: dict[int, Any]
    _loop: asyncio.AbstractEventLoop | None

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise AttributeError("no event loop")
        return self._loop

    def handoff_all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def expect_import(self, request_id: int, prompt: Any, resume_tokens: Any, max_new: int) -> None:
        self.expected[request_id] = (list(prompt), list(resume_tokens), max_new)

    def abort(self, request_id: int) -> bool:
        return self.expected.pop(request_id, None) is not None

    def complete_request_without_forward(self, request_id: int, result: Any) -> None:
        self.expected.pop(request_id)
        self.finish_without_forward(request_id, list(result))

    def finish_without_forward(self, request_id: int, tokens: list[int]) -> None:
        """Record a request answered by its handed-off tokens alone."""
        raise NotImplementedError
