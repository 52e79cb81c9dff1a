"""Gateway bearer tokens (admin routes, optional client token on model routes) and its Prometheus /metrics."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from agl.gateway import Gateway, UpstreamConfig
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream, prompt_text, token_ids_of

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "two plus two"}]
ADMIN, CLIENT = "admin-token-0123456789", "client-token-0123456789"


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text output (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/admin/pause"), ("POST", "/admin/resume"), ("POST", "/admin/flush"), ("GET", "/admin/stats"),
     ("GET", "/metrics")],
)  # fmt: skip
def test_admin_routes_need_the_admin_token(
    store: InMemoryLightningStore, upstream: OpenAIUpstream, method: str, path: str
) -> None:
    with Gateway(store, [upstream.base_url], token=ADMIN) as gw:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {CLIENT}"}):
            r = httpx.request(method, gw.url + path, headers=headers)
            assert r.status_code == 401, (path, headers)
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and "AGL_GATEWAY_TOKEN" in error["message"]
        r = httpx.request(method, gw.url + path, headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200
        httpx.post(gw.url + "/admin/resume", headers={"authorization": f"Bearer {ADMIN}"})
        assert httpx.get(gw.url + "/health").json()["status"] == "ok"  # health stays open


async def test_model_routes_stay_open_and_forward_the_agent_key_without_a_client_token(
    store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    with Gateway(store, [upstream.base_url], token=ADMIN) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rollout[0]), api_key="sk-agent-key")
        reply = await client.chat.completions.create(model="m", messages=USER)
        assert reply.choices[0].message.content == "echo: two plus two"
    assert upstream.requests[-1].headers["authorization"] == "Bearer sk-agent-key"


async def test_client_token_guards_model_routes_and_is_not_forwarded(
    store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    with Gateway(store, [upstream.base_url], token=ADMIN, client_token=CLIENT) as gw:
        url = gw.rollout_base_url(rollout[0])
        with pytest.raises(openai.AuthenticationError, match="AGL_GATEWAY_CLIENT_TOKEN"):
            await openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=USER
            )
        assert len(upstream.requests) == 0  # refused before anything went upstream
        assert httpx.get(f"{gw.base_url}/models").status_code == 401
        for key in (CLIENT, ADMIN):
            client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
            reply = await client.chat.completions.create(model="m", messages=USER)
            assert reply.choices[0].message.content == "echo: two plus two"
            assert "authorization" not in upstream.requests[-1].headers  # the gateway's key stays here
        models = httpx.get(f"{gw.base_url}/models", headers={"authorization": f"Bearer {CLIENT}"})
        assert models.status_code == 200


async def test_metrics_count_calls_latency_tokens_pause_and_spans(
    store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    with Gateway(store, [UpstreamConfig(url=upstream.base_url, kind="agl")]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rollout[0]), api_key="x", max_retries=0)
        for _ in range(3):
            await client.chat.completions.create(model="m", messages=USER)
        stream = await client.chat.completions.create(model="m", messages=USER, stream=True)
        async for _chunk in stream:
            pass
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=[])
        await gw.pause()
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", messages=USER)
        await gw.flush()
        text = httpx.get(gw.url + "/metrics").text
        await gw.resume()

    assert metric(text, "agl_gateway_calls_total", api="chat.completions", status="200") == 4
    assert metric(text, "agl_gateway_calls_total", api="chat.completions", status="400") == 1
    assert metric(text, "agl_gateway_calls_total", api="chat.completions", status="429") == 1
    assert metric(text, "agl_gateway_call_seconds_count", api="chat.completions") == 5
    assert (
        metric(text, "agl_gateway_overhead_seconds_count", api="chat.completions") == 4
    )  # upstream answered
    total = metric(text, "agl_gateway_call_seconds_sum", api="chat.completions")
    assert 0 < metric(text, "agl_gateway_overhead_seconds_sum", api="chat.completions") < total
    per_call = len(token_ids_of("echo: two plus two"))  # the scripted upstream's reply, as its usage says
    assert metric(text, "agl_gateway_tokens_total", direction="completion") == 4 * per_call
    assert metric(text, "agl_gateway_tokens_total", direction="prompt") == 4 * len(
        token_ids_of(prompt_text(USER))
    )
    assert metric(text, "agl_gateway_paused") == 1 and metric(text, "agl_gateway_inflight_calls") == 0
    assert metric(text, "agl_gateway_spans_total", outcome="recorded") == 5
    assert metric(text, "agl_gateway_spans_total", outcome="dropped") == 0
    assert metric(text, "agl_gateway_upstream_healthy", backend=upstream.base_url) == 1
    # valid exposition format: Prometheus' own parser reads it, buckets are cumulative and end at the count
    families = {f.name: f for f in text_string_to_metric_families(text)}
    buckets = [x.value for x in families["agl_gateway_call_seconds"].samples if x.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 5
