"""Prometheus metrics of the handoff lifecycle (one registry per engine rank).

``HandoffMetrics`` is optional: the mixin records into it when an engine attaches one
(``engine.handoff_metrics = HandoffMetrics(role, rank)``), and ``serve(port)`` exposes it over
HTTP (``disagg-rs demo --metrics-port P`` serves rank ``r`` on ``P + r``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["HandoffMetrics"]

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class HandoffMetrics:
    """Transfer bytes, descriptors, import latency, failures and queue depths of one rank."""

    def __init__(self, role: str, rank: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = {"role": role, "rank": str(rank)}
        names = ["role", "rank"]
        self._bytes = Counter(
            "disagg_transfer_bytes",
            "Bytes moved by completed transfers.",
            names,
            registry=self.registry,
        )
        self._descriptors = Counter(
            "disagg_transfer_descriptors",
            "Descriptors (or packed messages) posted.",
            names,
            registry=self.registry,
        )
        self._latency = Histogram(
            "disagg_import_transfer_seconds",
            "Time from posting an import's transfers to seeing them complete on this rank.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._post = Histogram(
            "disagg_import_post_seconds",
            "Plan + compile + post time of one import on this rank.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._failures = Counter(
            "disagg_handoff_failures",
            "Failed handoffs by reason.",
            [*names, "reason"],
            registry=self.registry,
        )
        self._queue = Gauge(
            "disagg_handoff_queue_depth",
            "Handoffs per lifecycle state.",
            [*names, "state"],
            registry=self.registry,
        )

    def transfer_done(self, nbytes: int, descriptors: int, seconds: float) -> None:
        """Record one import whose transfers completed on this rank."""
        self._bytes.labels(**self._labels).inc(nbytes)
        self._descriptors.labels(**self._labels).inc(descriptors)
        self._latency.labels(**self._labels).observe(seconds)

    def posted(self, seconds: float) -> None:
        """Record the plan + compile + post time of one import."""
        self._post.labels(**self._labels).observe(seconds)

    def failed(self, reason: str) -> None:
        """Record one failed handoff."""
        self._failures.labels(**self._labels, reason=reason).inc()

    def queue_depths(self, depths: dict[str, int]) -> None:
        """Set the gauges of every lifecycle state (deferred, importing, ready, ...)."""
        for state, value in depths.items():
            self._queue.labels(**self._labels, state=state).set(value)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Serve the registry over HTTP on ``addr:port`` (loopback by default)."""
        return start_http_server(port, addr=addr, registry=self.registry)
