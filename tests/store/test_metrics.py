"""``GET /metrics`` after real traffic: Prometheus text that the official parser reads, with counts that match."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agl import semconv as sc
from agl.asgi_server import BackgroundServer
from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import InMemoryLightningStore, SqliteLightningStore
from agl.store.client import LightningStoreClient
from agl.store.server import create_app

TOKEN = "metrics-token"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample as ``(name, labels) -> value``, parsed by prometheus_client's own parser."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(parsed: dict[Any, float], name: str, **labels: str) -> float:
    return parsed.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_metrics_count_real_traffic(backend: str, tmp_path: Any) -> None:
    store = InMemoryLightningStore() if backend == "memory" else SqliteLightningStore(tmp_path / "m.db")
    with BackgroundServer(create_app(store, token=TOKEN)) as server:
        client = LightningStoreClient(server.url, token=TOKEN)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        rollouts = await client.enqueue_rollouts([RolloutCreate(input=i) for i in range(5)])
        claims = [await client.dequeue("w") for _ in range(3)]
        assert all(c is not None for c in claims)
        first, second = claims[0], claims[1]
        assert first is not None and second is not None
        rid, aid = first.rollout.rollout_id, first.attempt.attempt_id
        await client.add_spans([Span.new(rid, aid, f"s{i}") for i in range(4)])
        await client.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
        await client.update_attempt(
            second.rollout.rollout_id, second.attempt.attempt_id, status=AttemptStatus.FAILED
        )
        await client.next_sequence_id(rollouts[4].rollout_id)  # keyed: one idempotency entry
        with httpx.Client(base_url=server.url, headers=auth) as raw:
            otlp = {
                "resourceSpans": [
                    {
                        "resource": {
                            "attributes": [
                                {"key": sc.ROLLOUT_ID, "value": {"stringValue": rid}},
                                {"key": sc.ATTEMPT_ID, "value": {"stringValue": aid}},
                            ]
                        },
                        "scopeSpans": [
                            {"spans": [{"traceId": "a" * 32, "spanId": "b" * 16, "name": "otel"}]}
                        ],
                    }
                ]
            }
            assert raw.post("/v1/traces", json=otlp).status_code == 200
            assert raw.post("/v1/agl/rollouts", json={"rollouts": "x"}).status_code == 422
            for n in range(20):  # stray paths: one series, not twenty
                assert raw.get(f"/nothing/here/{n}").status_code == 404
            assert raw.get(f"/v1/agl/rollouts/{rid}").status_code == 200
            assert httpx.get(f"{server.url}/metrics").status_code == 401
            response = raw.get("/metrics")
        await client.aclose()
    await store.aclose()

    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    parsed = samples(text)
    requests = "agl_store_http_requests_total"
    p = "/v1/agl"
    assert value(parsed, requests, route=f"{p}/rollouts/dequeue", method="POST", status="200") == 3
    assert value(parsed, requests, route=f"{p}/rollouts", method="POST", status="200") == 1
    assert value(parsed, requests, route=f"{p}/rollouts", method="POST", status="422") == 1
    assert value(parsed, requests, route=f"{p}/spans", method="POST", status="200") == 1
    attempt_route = f"{p}/rollouts/{{rollout_id}}/attempts/{{attempt_id}}"
    assert value(parsed, requests, route=attempt_route, method="PATCH", status="200") == 2
    assert value(parsed, requests, route=f"{p}/rollouts/{{rollout_id}}", method="GET", status="200") == 1
    assert value(parsed, requests, route="/v1/traces", method="POST", status="200") == 1
    assert value(parsed, requests, route="<unmatched>", method="GET", status="404") == 20
    assert (
        value(parsed, requests, route="<unmatched>", method="GET", status="401") == 1
    )  # refused before routing
    latency = "agl_store_http_request_duration_seconds"
    dequeue = {"route": f"{p}/rollouts/dequeue", "method": "POST"}
    assert value(parsed, f"{latency}_count", **dequeue) == 3
    assert 0 < value(parsed, f"{latency}_sum", **dequeue) < 30
    assert value(parsed, f"{latency}_bucket", le="+Inf", **dequeue) == 3
    assert value(parsed, "agl_store_spans_ingested_total") == 4
    assert value(parsed, "agl_store_otlp_spans_ingested_total") == 1
    assert value(parsed, "agl_store_spans") == 5
    by_status = {s: value(parsed, "agl_store_rollouts", status=s) for s in ("queuing", "succeeded", "failed")}
    assert by_status == {"queuing": 2, "succeeded": 1, "failed": 1}
    assert value(parsed, "agl_store_rollouts", status="preparing") == 1  # the third claim
    assert value(parsed, "agl_store_attempts", status="succeeded") == 1
    assert value(parsed, "agl_store_idempotency_cache_entries") >= 4  # 3 dequeues + 1 sequence id
    # counts and route templates only: no ids, inputs or span names leak
    for secret in [rid, aid, "otel", "s0", *(r.rollout_id for r in rollouts)]:
        assert secret not in text
    assert json.dumps(sorted({name for name, _ in parsed})).count("agl_store_") >= 8


async def test_metrics_are_open_without_a_token() -> None:
    with BackgroundServer(create_app(InMemoryLightningStore())) as server:
        response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert value(samples(response.text), "agl_store_rollouts", status="queuing") == 0
