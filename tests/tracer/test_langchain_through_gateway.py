"""A LangChain ``ChatOpenAI`` agent through the real gateway to the built-in engine, traced by the LangChain
and openai instrumentors: each model call is recorded up to three times, and must count once.

LangChain's traced output is its ``LLMResult`` (the response id sits in ``llm_output``, and a streamed call
carries none), not the OpenAI body; a call the agent sends past the gateway is the one left untrainable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import agl
from agl.adapter import llm_calls, to_samples
from agl.adapter.calls import call_agents
from agl.algorithm.grpo import GRPOConfig, build_batch
from agl.engines.builtin.server import EngineServer
from agl.gateway import Gateway, UpstreamConfig
from agl.schemas import LLM, Rollout, RolloutCreate, RolloutStatus, Span
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream

from ..engines.conftest import tiny_path  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> Iterator[EngineServer]:  # noqa: F811
    assert agl.instrument("langchain", required=True) == ["langchain"]
    with EngineServer(tiny_path, max_batch_size=2) as srv:
        yield srv


@agl.rollout
async def chat_agent(llm: LLM, direct: LLM) -> float:
    """Two calls through the gateway (one streamed) in a named agent, and one to an API past it."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    with agl.agent_scope("writer"):
        plain = ChatOpenAI(base_url=llm.endpoint, api_key="k", model=llm.model, max_tokens=5)
        await plain.ainvoke([HumanMessage("hi")])
        streamed = ChatOpenAI(
            base_url=llm.endpoint, api_key="k", model=llm.model, max_tokens=5, streaming=True
        )
        await streamed.ainvoke([HumanMessage("hello")])
    outside = ChatOpenAI(base_url=direct.endpoint, api_key="k", model=direct.model, max_tokens=5)
    await outside.ainvoke([HumanMessage("bye")])
    return 1.0


async def _run(engine: EngineServer) -> list[Span]:
    store = InMemoryLightningStore()
    # "direct": a hosted API the agent calls without the gateway (stood in for at its HTTP boundary)
    with Gateway(store, [UpstreamConfig(url=engine.base_url, kind="agl")]) as gw, OpenAIUpstream() as api:
        resources = await store.add_resources(
            {
                "llm": LLM(endpoint=gw.endpoint_template, model="policy"),
                "direct": LLM(endpoint=api.base_url, model=api.model),
            }
        )
        (rollout,) = await store.enqueue_rollouts(
            [RolloutCreate(input=None, resources_id=resources.resources_id)]
        )
        (outcome,) = await agl.Runner(chat_agent, store).run(max_rollouts=1)
        assert outcome.status.value == "succeeded", outcome.error
        await gw.flush()
    return list((await store.query_spans(rollout_id=rollout.rollout_id)).items)


async def test_each_langchain_call_counts_once_and_only_the_one_past_the_gateway_is_untrainable(
    engine: EngineServer,
) -> None:
    spans = await _run(engine)
    traced = [s for s in spans if s.attributes.get("agl.llm.source") == "openinference"]
    # agent_scope switches the openai instrumentor on too: each call has two traced records, and the
    # gateway's record besides for the two sent through it
    assert len(traced) == 6

    calls = llm_calls(spans)
    assert [c.source for c in calls] == ["gateway", "gateway", "openinference"]
    assert all(c.has_token_ids for c in calls[:2]) and not calls[2].has_token_ids
    assert call_agents(calls, spans)[:2] == ["writer", "writer"]  # the streamed call's twin too

    samples, report = to_samples(calls, 1.0)
    assert report.calls == 3 and len(samples) == 2
    assert report.untrainable == {"not_through_gateway": 1}

    other = [s.model_copy(update={"rollout_id": "r2"}) for s in spans]
    batch_spans = {"r1": spans, "r2": other}
    rollouts = [
        Rollout(rollout_id=r, group_id="g", status=RolloutStatus.SUCCEEDED, created_at=0.0, updated_at=0.0)
        for r in batch_spans
    ]
    metrics = build_batch(rollouts, batch_spans, GRPOConfig(model_path="-")).metrics
    assert metrics["untrainable_calls"] == 2.0 and metrics["untrainable_not_through_gateway"] == 2.0
