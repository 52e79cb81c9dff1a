"""The instrumentors the recipes use record each framework's own steps around the model calls, inside the
rollout: the OpenAI Agents SDK's agent run, and a LangGraph graph's nodes and tool calls."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import agl
from agl.schemas import LLM, RolloutCreate, Span
from agl.store import InMemoryLightningStore
from examples.apo.simulated_lm import LOOKUP_TOOL, SimulatedLMServer

KIND = "openinference.span.kind"


@pytest.fixture(scope="module")
def server() -> Iterator[SimulatedLMServer]:
    assert set(agl.instrument("openai-agents", "langchain", required=True)) == {"openai-agents", "langchain"}
    with SimulatedLMServer() as s:
        yield s


@pytest.fixture
async def store(server: SimulatedLMServer) -> AsyncIterator[InMemoryLightningStore]:
    s = InMemoryLightningStore()
    await s.add_resources({"llm": LLM(endpoint=server.base_url, model="task")})
    yield s


async def _spans(store: InMemoryLightningStore, agent: Any) -> list[Span]:
    (rollout,) = await store.enqueue_rollouts([RolloutCreate(input=None)])
    (outcome,) = await agl.Runner(agent, store).run(max_rollouts=1)
    assert outcome.status.value == "succeeded", outcome.error
    return list((await store.query_spans(rollout_id=rollout.rollout_id)).items)


async def test_agents_sdk_agent_run_is_recorded_in_the_rollout(store: InMemoryLightningStore) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    @agl.rollout
    async def agent(llm: LLM) -> float:
        client = AsyncOpenAI(base_url=llm.endpoint, api_key="k")
        coder = Agent(
            name="coder",
            instructions="End with ANSWER: <number>.",
            model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        )
        result = await Runner.run(coder, "One item-1 costs 4 dollars. What do 2 of them cost?", max_turns=2)
        return 1.0 if "ANSWER" in str(result.final_output) else 0.0

    spans = await _spans(store, agent)
    kinds = {(s.name, s.attributes.get(KIND)) for s in spans}
    assert ("coder", "AGENT") in kinds  # the SDK's own agent step
    assert any(kind == "LLM" for _, kind in kinds)  # its model call, inside the same rollout
    assert all(s.rollout_id == spans[0].rollout_id for s in spans)


async def test_langgraph_nodes_and_tools_are_recorded(store: InMemoryLightningStore) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def lookup(item: str) -> str:
        """Look up an item's price."""
        return "7"

    assert LOOKUP_TOOL["function"]["name"] == lookup.name  # the simulated LM calls this tool

    @agl.rollout
    async def agent(llm: LLM) -> None:
        model = ChatOpenAI(base_url=llm.endpoint, api_key="k", model=llm.model).bind_tools([lookup])

        async def call_model(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await model.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", call_model)
        graph.add_node("tools", ToolNode([lookup]))
        graph.add_edge(START, "agent")
        graph.add_conditional_edges("agent", tools_condition)
        graph.add_edge("tools", "agent")
        question = "What do 3 units of item-5 cost, in catalog units?"
        system = "Use the lookup tool when a price is not given. End with ANSWER: <number>."
        await graph.compile().ainvoke({"messages": [SystemMessage(system), HumanMessage(question)]})

    spans = await _spans(store, agent)
    kinds = {(s.name, s.attributes.get(KIND)) for s in spans}
    assert ("LangGraph", "CHAIN") in kinds and ("tools", "CHAIN") in kinds  # the graph and its nodes
    assert ("agent", "AGENT") in kinds
    assert ("lookup", "TOOL") in kinds  # the tool call
    assert any(kind == "LLM" for _, kind in kinds)
