"""Prometheus metrics of one gateway, served at ``GET /metrics``.

Per call the hot path does two dict lookups, a counter increment and two histogram observations (a few
microseconds); in-flight, paused, recorder and upstream figures are read from the gateway only when
Prometheus scrapes. Token counts come from the recorder, so they cover recorded calls. Each gateway has
its own registry, so several gateways in one process do not clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _StateCollector(Collector):
    """Gauges and counters read from ``Gateway.stats()`` at scrape time (no per-call cost)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily("agl_gateway_inflight_calls", "Model calls in flight.", value=s["inflight"])
        yield GaugeMetricFamily(
            "agl_gateway_paused", "1 while the gateway refuses calls.", value=int(s["paused"])
        )
        spans = CounterMetricFamily(
            "agl_gateway_spans",
            "Call spans by outcome: recorded, dropped (queue full), failed.",
            labels=["outcome"],
        )
        for outcome in ("recorded", "dropped", "failed"):
            spans.add_metric([outcome], s[f"{outcome}_spans"])
        yield spans
        yield GaugeMetricFamily(
            "agl_gateway_span_queue", "Spans waiting to be written to the store.", value=s["queued_spans"]
        )
        up = [r["backend"] for r in s["upstreams"]]
        healthy = GaugeMetricFamily(
            "agl_gateway_upstream_healthy", "1 if the replica is in use.", labels=["backend"]
        )
        busy = GaugeMetricFamily(
            "agl_gateway_upstream_inflight", "Calls open on the replica.", labels=["backend"]
        )
        calls = CounterMetricFamily(
            "agl_gateway_upstream_calls", "Tries sent to the replica.", labels=["backend"]
        )
        failures = CounterMetricFamily(
            "agl_gateway_upstream_failures", "Transport errors and 5xx from the replica.", labels=["backend"]
        )
        for name, r in zip(up, s["upstreams"], strict=True):
            healthy.add_metric([name], int(r["healthy"]))
            busy.add_metric([name], r["inflight"])
            calls.add_metric([name], r["calls"])
            failures.add_metric([name], r["failures"])
        yield from (healthy, busy, calls, failures)


class GatewayMetrics:
    """The gateway's registry; :meth:`observe` is called once per model call."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._calls = Counter(
            "agl_gateway_calls",
            "Model calls by API and HTTP status.",
            ["api", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "agl_gateway_call_seconds",
            "Whole call latency as the agent sees it (streams: until the last chunk).",
            ["api"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._overhead = Histogram(
            "agl_gateway_overhead_seconds",
            "Time the gateway adds: the call's latency minus the upstream exchange.",
            ["api"],
            buckets=_OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self._tokens = Counter(
            "agl_gateway_tokens", "Tokens of recorded calls.", ["direction"], registry=self.registry
        )
        self._prompt_tokens = self._tokens.labels("prompt")
        self._completion_tokens = self._tokens.labels("completion")
        self._children: dict[Any, Any] = {}
        self.registry.register(_StateCollector(stats))

    def observe(self, api: str, status: int, total_s: float, upstream_s: float | None) -> None:
        """Count one finished call; ``upstream_s`` is None when no upstream answered."""
        children = self._children.get((api, status))
        if children is None:
            children = self._children[(api, status)] = (
                self._calls.labels(api, str(status)),
                self._latency.labels(api),
                self._overhead.labels(api),
            )
        calls, latency, overhead = children
        calls.inc()
        latency.observe(total_s)
        if upstream_s is not None:
            overhead.observe(max(total_s - upstream_s, 0.0))

    def count(self, api: str, status: int) -> None:
        """Count a call refused before it started (paused, unauthorized): no latency to observe."""
        self._calls.labels(api, str(status)).inc()

    def add_tokens(self, usage: Any) -> None:
        """Add a recorded call's usage (chat/completions or Responses field names)."""
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(prompt, int) and prompt > 0:
            self._prompt_tokens.inc(prompt)
        if isinstance(completion, int) and completion > 0:
            self._completion_tokens.inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)
