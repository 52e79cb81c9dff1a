"""A two-agent LangGraph team: a solver with a calculator tool, and a checker that approves its answer or
sends it back once. Both call the same served model, each through its own agent endpoint
(``llm.endpoint_for(name)``), so ``GRPOConfig(agents=("solver",))`` trains on the solver's calls only, and
``GRPOConfig(agents=("solver", "checker"), lora_rank=16)`` trains a LoRA adapter per agent, each serving
that agent's endpoint.

``build_team`` is plain LangGraph; ``team_agent`` is agl's part. Reward: 1 when the team's final answer is
right, else 0.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import agl
from examples.calc.agent import calculate, final_number

SOLVER = "Call the calculator with the arithmetic expression, then reply 'Answer: ' and the result."
CHECKER = "You check a math answer. Reply OK if the answer is right, or WRONG if it is not."
RECURSION_LIMIT = 12


class TeamState(MessagesState):
    question: str
    reviews: int


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * 7'."""
    return calculate(expression)


def build_team(solver: ChatOpenAI, checker: ChatOpenAI) -> Any:
    """solver <-> calculator until it answers; the checker reviews the answer once and may send it back."""
    solver_with_tools = solver.bind_tools([calculator])

    async def solve(state: TeamState) -> dict[str, Any]:
        return {"messages": [await solver_with_tools.ainvoke(state["messages"])]}

    async def check(state: TeamState) -> dict[str, Any]:
        answer = state["messages"][-1].content
        review = await checker.ainvoke(
            [SystemMessage(CHECKER), HumanMessage(f"Question: {state['question']}\n{answer}")]
        )
        if "WRONG" in str(review.content).upper() and state["reviews"] == 0:
            retry = HumanMessage(
                "A checker says this answer is wrong. Check the calculation and answer again."
            )
            return {"messages": [retry], "reviews": 1}
        return {"reviews": state["reviews"] + 1}

    def after_solver(state: TeamState) -> str:
        return "tools" if tools_condition(state["messages"]) == "tools" else "check"

    def after_check(state: TeamState) -> str:
        return "solve" if isinstance(state["messages"][-1], HumanMessage) else END

    graph = StateGraph(TeamState)
    graph.add_node("solve", solve)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_conditional_edges("solve", after_solver, ["tools", "check"])
    graph.add_edge("tools", "solve")
    graph.add_conditional_edges("check", after_check, ["solve", END])
    return graph.compile()


def _model(llm: agl.LLM, name: str, sampling: dict[str, Any]) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=llm.endpoint_for(name),
        api_key=llm.api_key or "agl",
        model=llm.model,
        max_tokens=40,
        **sampling,
    )


@agl.rollout(name="team")
async def team_agent(task: dict[str, Any], llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One word problem through the team; validation rollouts decode greedily."""
    sampling = {"temperature": 0.0} if rollout.mode == "val" else dict(llm.sampling_parameters)
    team = build_team(_model(llm, "solver", sampling), _model(llm, "checker", {"temperature": 0.0}))
    state = {
        "messages": [SystemMessage(SOLVER), HumanMessage(task["question"])],
        "question": task["question"],
        "reviews": 0,
    }
    try:
        final = await team.ainvoke(state, {"recursion_limit": RECURSION_LIMIT})
    except GraphRecursionError:
        return 0.0
    answers = [m.content for m in final["messages"] if isinstance(m, AIMessage) and not m.tool_calls]
    value = final_number(str(answers[-1])) if answers else None
    return 1.0 if value is not None and abs(value - task["answer"]) < 1e-6 else 0.0
