"""The SQL agent: a LangGraph ReAct graph with one ``run_sql`` tool, written as LangGraph users write it.

Only ``sql_agent`` (the last function) is agl's: it points ``ChatOpenAI`` at the LLM resource's endpoint and
scores the run. ``build_graph`` is plain LangGraph. Reward: 1 when the last query the agent ran returns the
gold query's rows (execution match), 0 otherwise, minus 0.5 when the graph hits its recursion limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import agl
from examples.sql_agent.shop import SCHEMA, format_rows, run_query, same_result

SYSTEM = (
    f"You answer questions about a shop database with SQLite. Tables: {SCHEMA}. Call run_sql, then answer."
)
RECURSION_LIMIT = 6  # agent -> tools -> agent -> tools -> agent: two queries, then an answer
LIMIT_PENALTY = 0.5


def make_sql_tool(database: Path | str, ran: list[str]) -> Any:
    """The ``run_sql`` tool over ``database``; each query it runs is appended to ``ran``."""

    @tool
    def run_sql(query: str) -> str:
        """Run a read-only SQLite query on the shop database and return the rows."""
        ran.append(query)
        try:
            return format_rows(run_query(database, query))
        except Exception as exc:  # the model sees the error and can fix its query
            return f"error: {exc}"

    return run_sql


def build_graph(model: ChatOpenAI, run_sql: Any) -> Any:
    """A ReAct graph: the model calls tools until it answers."""
    llm_with_tools = model.bind_tools([run_sql])

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm_with_tools.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([run_sql]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@agl.rollout(name="sql")
async def sql_agent(task: dict[str, Any], llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One question; validation rollouts decode greedily and score execution accuracy (no penalty)."""
    sampling = {"temperature": 0.0} if rollout.mode == "val" else dict(llm.sampling_parameters)
    model = ChatOpenAI(
        base_url=llm.endpoint, api_key=llm.api_key or "agl", model=llm.model, max_tokens=96, **sampling
    )
    database = task["database"]  # the path of the shop database, set by train.py
    ran: list[str] = []
    graph = build_graph(model, make_sql_tool(database, ran))
    messages = [SystemMessage(SYSTEM), HumanMessage(task["question"])]
    hit_limit = False
    try:
        await graph.ainvoke({"messages": messages}, {"recursion_limit": RECURSION_LIMIT})
    except GraphRecursionError:
        hit_limit = True
    agl.emit_object({"queries": ran, "hit_recursion_limit": hit_limit})
    matched = bool(ran) and same_result(database, ran[-1], task["sql"])
    if rollout.mode == "val":
        return float(matched)
    return float(matched) - (LIMIT_PENALTY if hit_limit else 0.0)
