"""The coding agent: an OpenAI Agents SDK agent that writes a Python function for a short spec.

``build_agent`` is plain Agents-SDK code; only ``coding_agent`` is agl's: it points the SDK's chat-completions
model at the LLM resource's endpoint and scores the reply. Reward: the fraction of the task's hidden unit tests
that the function passes, run in ``agl.sandbox`` (a program that loops, forks, allocates without bound, reads
outside its folder or calls the network scores 0 and leaves the host untouched).
"""

from __future__ import annotations

import json
import re
from typing import Any

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_trace_processors
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

import agl
from agl.sandbox import SandboxLimits, run_python

INSTRUCTIONS = "You write Python. Reply with only the requested function in a ```python code block."
LIMITS = SandboxLimits(cpu_s=2, wall_s=10, memory_mb=256, processes=8, output_bytes=20_000)
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
# runs inside the sandbox: import the solution, call it on each hidden case, print one JSON list of booleans
_HARNESS = """import json, sys
results = []
try:
    from solution import {function} as fn
except BaseException as exc:
    print(json.dumps([False] * {count})); sys.exit(0)
for case, expected in {tests!r}:
    try:
        results.append(repr(fn(eval(case))) == expected)
    except BaseException:
        results.append(False)
print(json.dumps(results))
"""

# the SDK would otherwise export its traces to OpenAI's servers; agl.instrument("openai-agents") records them
# instead (left off in the recipe: its model-call spans carry no response id to pair with the gateway's record)
set_trace_processors([])


def build_agent(client: AsyncOpenAI, model: str, settings: ModelSettings) -> Agent:
    """The coder: one agent, no tools, on any OpenAI-compatible chat-completions endpoint."""
    return Agent(
        name="coder",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=settings,
    )


def extract_code(reply: str) -> str:
    """The first fenced code block of ``reply``, or the whole reply when it has none."""
    match = _FENCE.search(reply or "")
    return match.group(1) if match else (reply or "")


def pass_fraction(code: str, task: dict[str, Any]) -> float:
    """The share of ``task``'s hidden tests that ``code`` passes, run in the sandbox (0 when it cannot run)."""
    tests = [tuple(t) for t in task["tests"]]
    harness = _HARNESS.format(function=task["function"], count=len(tests), tests=tests)
    result = run_python({"solution.py": code, "run_tests.py": harness}, ["run_tests.py"], LIMITS)
    lines = result.stdout.strip().splitlines()
    if result.limit_hit is not None or result.returncode != 0 or not lines:
        return 0.0
    try:
        passed = json.loads(lines[-1])
    except json.JSONDecodeError:  # the solution printed after the harness: treat as a failed run
        return 0.0
    return sum(bool(p) for p in passed) / len(tests) if isinstance(passed, list) and passed else 0.0


@agl.rollout(name="coder")
async def coding_agent(task: dict[str, Any], llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One spec; validation rollouts decode greedily."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "agl", max_retries=2)
    temperature = 0.0 if rollout.mode == "val" else llm.sampling_parameters.get("temperature", 0.7)
    agent = build_agent(client, llm.model, ModelSettings(temperature=temperature, max_tokens=96))
    try:
        result = await Runner.run(agent, task["spec"], max_turns=2)
        reply = str(result.final_output or "")
    except MaxTurnsExceeded:
        reply = ""
    finally:
        await client.close()
    code = extract_code(reply)
    agl.emit_object({"code": code})
    return pass_fraction(code, task)
