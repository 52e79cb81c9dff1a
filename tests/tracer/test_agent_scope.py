"""Agent tagging: ``agl.agent_scope`` names the current agent; the gateway tags calls made through an
agent endpoint (``LLM.endpoint_for``) or with an ``x-agl-agent`` header, and refuses bad names with 400."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import agl
from agl import semconv as sc
from agl.errors import AgentError
from agl.gateway import Gateway, GatewayConfig
from agl.schemas import LLM
from agl.schemas.rollout import RolloutCreate
from agl.store import InMemoryLightningStore
from agl.tracer.context import current_agent
from tests.support.openai_upstream import OpenAIUpstream


def test_agent_scope_nests_and_rejects_bad_names() -> None:
    assert current_agent() is None
    with agl.agent_scope("team"):
        with agl.agent_scope("critic"):
            assert current_agent() == "critic"
        assert current_agent() == "team"
    assert current_agent() is None
    for bad in ("", "a/b", "x" * 200, "-lead"):
        with pytest.raises(AgentError, match="agent name"), agl.agent_scope(bad):
            pass


def test_endpoint_for_inserts_the_agent_segment() -> None:
    llm = LLM(endpoint="http://h:1/rollout/ro-1/attempt/at-1/v1/", model="m")
    assert llm.endpoint_for("writer") == "http://h:1/rollout/ro-1/attempt/at-1/agent/writer/v1"
    with pytest.raises(ValueError, match="agl gateway rollout endpoint"):
        LLM(endpoint="https://api.openai.com/v1", model="m").endpoint_for("writer")


@pytest.fixture
def upstream() -> Iterator[OpenAIUpstream]:
    with OpenAIUpstream(token_ids=True) as up:
        yield up


async def test_the_gateway_tags_calls_by_agent_endpoint_or_header(upstream: OpenAIUpstream) -> None:
    store = InMemoryLightningStore(watchdog_interval_s=0)
    started = await store.start_rollout(RolloutCreate(input="task"))
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with Gateway(store, [upstream.base_url], GatewayConfig(health_interval_s=0.1)) as gw:
        base = gw.rollout_base_url(rid, aid)
        llm = LLM(endpoint=base, model="m")
        async with httpx.AsyncClient(timeout=30) as client:
            ok = await client.post(f"{llm.endpoint_for('critic')}/chat/completions", json=body)
            assert ok.status_code == 200, ok.text
            ok = await client.post(f"{base}/chat/completions", json=body, headers={"x-agl-agent": "writer"})
            assert ok.status_code == 200, ok.text
            for url, headers in (
                (f"{gw.url}/rollout/{rid}/attempt/{aid}/agent/bad%20name/v1/chat/completions", {}),
                (f"{gw.url}/rollout/{rid}/attempt/{aid}/agent//v1/chat/completions", {}),
                (f"{base}/chat/completions", {"x-agl-agent": "a/b"}),
            ):
                bad = await client.post(url, json=body, headers=headers)
                assert bad.status_code == 400, (url, bad.text)
                assert bad.json()["error"]["code"] == "invalid_agent"
        await gw.flush()
    spans = (await store.query_spans(rollout_id=rid)).items
    agents = [s.attributes.get(sc.AGENT_NAME) for s in spans if s.name == sc.SPAN_LLM_CALL]
    assert agents == ["critic", "writer"]
    await store.aclose()
