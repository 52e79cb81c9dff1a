"""Prometheus metrics of one gateway, served at ``GET /metrics``.

Per call the hot path bumps plain counters and bucket counts; in-flight, paused, recorder and upstream
figures are read from the gateway only when Prometheus scrapes. Token counts come from the recorder, so they cover recorded calls. Each gateway has
its own registry, so several gateways in one process do not clash.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
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
        yield CounterMetricFamily(
            "agl_gateway_span_store_errors",
            "Failed span writes to the store (each retry through an outage counts).",
            value=s["span_store_errors"],
        )
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


class _Histogram:
    """Cumulative-bucket counts kept as plain numbers: the gateway's loop is the only writer and reader."""

    __slots__ = ("buckets", "count", "counts", "total")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.total += value

    def samples(self) -> list[tuple[str, float]]:
        running, out = 0, list[tuple[str, float]]()
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class GatewayMetrics:
    """The gateway's registry; :meth:`observe` is called once per model call, on the gateway's loop.

    Calls, latency and tokens are plain counters turned into Prometheus families at scrape time:
    ``prometheus_client``'s locked metric objects cost more per call.
    """

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.calls: dict[tuple[str, int], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.overhead: dict[str, _Histogram] = {}
        self.tokens = {"prompt": 0, "completion": 0}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StateCollector(stats))
        self.registry.register(_CallCollector(self))

    def observe(self, api: str, status: int, total_s: float, upstream_s: float | None) -> None:
        """Count one finished call; ``upstream_s`` is None when no upstream answered."""
        key = (api, status)
        self.calls[key] = self.calls.get(key, 0) + 1
        latency = self.latency.get(api)
        if latency is None:
            latency = self.latency[api] = _Histogram(_LATENCY_BUCKETS)
            self.overhead[api] = _Histogram(_OVERHEAD_BUCKETS)
        latency.observe(total_s)
        if upstream_s is not None:
            self.overhead[api].observe(max(total_s - upstream_s, 0.0))

    def count(self, api: str, status: int) -> None:
        """Count a call refused before it started (paused, unauthorized): no latency to observe."""
        self.calls[(api, status)] = self.calls.get((api, status), 0) + 1

    def add_tokens(self, usage: Any) -> None:
        """Add a recorded call's usage (chat/completions or Responses field names)."""
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(prompt, int) and prompt > 0:
            self.tokens["prompt"] += prompt
        if isinstance(completion, int) and completion > 0:
            self.tokens["completion"] += completion

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CallCollector(Collector):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "agl_gateway_calls", "Model calls by API and HTTP status.", labels=["api", "status"]
        )
        for (api, status), n in sorted(self.m.calls.items()):
            calls.add_metric([api, str(status)], n)
        yield calls
        for name, doc, table in (
            (
                "agl_gateway_call_seconds",
                "Whole call latency as the agent sees it (streams: until the last chunk).",
                self.m.latency,
            ),
            (
                "agl_gateway_overhead_seconds",
                "Time the gateway adds: the call's latency minus the upstream exchange.",
                self.m.overhead,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=["api"])
            for api, h in sorted(table.items()):
                family.add_metric([api], h.samples(), h.total)
            yield family
        tokens = CounterMetricFamily("agl_gateway_tokens", "Tokens of recorded calls.", labels=["direction"])
        for direction, n in self.m.tokens.items():
            tokens.add_metric([direction], n)
        yield tokens
