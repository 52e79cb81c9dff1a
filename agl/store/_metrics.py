"""Prometheus metrics of the store server, served as text at ``GET /metrics``.

Only counts, latencies and route templates (``/v1/agl/rollouts/{rollout_id}``) are exposed, never
ids, inputs or span contents. ``/metrics`` still sits behind the bearer token when the server has
one (a Prometheus scrape job sends it with ``authorization: {credentials: <token>}``), since
queue depth and traffic are operational data a stranger has no need for.

Per request the server pays one dict lookup, a counter increment and a histogram observation
(a few µs); store-wide gauges (rollouts by status) are read from ``statistics()`` at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from agl.schemas import AttemptStatus, RolloutStatus
from agl.store.read_model import StoreStatistics

CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED = "<unmatched>"  # one label for every path that is no route, so stray paths add no series
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StoreMetrics:
    """The metrics of one server, in their own registry (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "agl_store_http_requests", "HTTP requests answered", ["route", "method", "status"], registry=r
        )
        self._latency = Histogram(
            "agl_store_http_request_duration_seconds",
            "Time from request to the last byte of the answer",
            ["route", "method"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.spans = Counter(
            "agl_store_spans_ingested", "Spans newly stored via POST /v1/agl/spans", registry=r
        )
        self.otlp_spans = Counter(
            "agl_store_otlp_spans_ingested", "Spans newly stored via OTLP POST /v1/traces", registry=r
        )
        self._rollouts = Gauge(
            "agl_store_rollouts", "Rollouts in the store by status", ["status"], registry=r
        )
        self._attempts = Gauge(
            "agl_store_attempts", "Attempts in the store by status", ["status"], registry=r
        )
        self._stored_spans = Gauge("agl_store_spans", "Spans held by the store", registry=r)
        self._idempotency = Gauge(
            "agl_store_idempotency_cache_entries", "Idempotency-Key answers kept for retries", registry=r
        )
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one answered request; the label children are cached, so this is two cheap calls."""
        key = (route, method, status)
        children = self._children.get(key)
        if children is None:
            children = self._requests.labels(route, method, str(status)), self._latency.labels(route, method)
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def scrape(self, stats: StoreStatistics, idempotency_entries: int) -> bytes:
        """The text exposition, with the store-wide gauges set from ``stats`` first."""
        for status in RolloutStatus:
            self._rollouts.labels(status.value).set(stats.rollouts_by_status.get(status.value, 0))
        for attempt_status in AttemptStatus:
            value = stats.attempts_by_status.get(attempt_status.value, 0)
            self._attempts.labels(attempt_status.value).set(value)
        self._stored_spans.set(stats.spans)
        self._idempotency.set(idempotency_entries)
        return generate_latest(self.registry)
