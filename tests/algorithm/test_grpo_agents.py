"""Multi-agent and per-call credit end to end: real openai SDK calls through the real gateway to the
tiny built-in engine, spans from the store, then ``build_batch``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl import semconv as sc
from agl.adapter import llm_calls
from agl.algorithm.grpo import GRPOConfig, build_batch
from agl.models import tiny_model
from agl.schemas import Rollout, Span

pytestmark = pytest.mark.slow
_turn = itertools.count()


async def _ask(client: openai.AsyncOpenAI, model: str, text: str) -> Any:
    return await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0.0
    )


@agl.rollout(name="team")
async def team(task: str, llm: agl.LLM) -> float:
    """``agents``: the writer via ``agl.agent_scope``, the critic via its own gateway endpoint.
    ``credit``: two calls of one agent, the first rewarded -5. Rewards alternate 0/1 across rollouts."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        if task == "agents":
            with agl.agent_scope("writer"):
                await _ask(client, llm.model, "Write a line")
            critic = openai.AsyncOpenAI(base_url=llm.endpoint_for("critic"), api_key="k", max_retries=0)
            await _ask(critic, llm.model, "Judge it")
            await critic.close()
            return float(next(_turn) % 2)
        first = await _ask(client, llm.model, "Plan")
        agl.emit_reward(-5.0, response_id=first.id)
        await _ask(client, llm.model, "Answer")
        return 1.0
    finally:
        await client.close()


class Collect(agl.Algorithm):
    """Runs each task as its own group of two rollouts, one group at a time; returns them with spans."""

    def __init__(self) -> None:
        self.path = str(tiny_model())

    def model_spec(self) -> agl.ModelSpec:
        return agl.ModelSpec(self.path)

    async def run(self, ctx: agl.TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        assert ctx.llm is not None
        resources_id = await ctx.publish({"llm": ctx.llm})
        out = {}
        for task in train:
            out[task] = await ctx.rollouts([task], group_size=2, resources_id=resources_id, timeout_s=120)
        return out


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[Rollout, list[Span]]]]:
    out: Path = tmp_path_factory.mktemp("fit")
    trainer = agl.Trainer(algorithm=Collect(), n_runners=2, output_dir=str(out))
    result: dict[str, list[tuple[Rollout, list[Span]]]] = trainer.fit(team, ["agents", "credit"])
    return result


def _batch(done: list[tuple[Rollout, list[Span]]], **config: Any) -> Any:
    assert all(r.status.value == "succeeded" for r, _ in done), [
        (r.rollout_id, r.status.value) for r, _ in done
    ]
    spans = {r.rollout_id: s for r, s in done}
    return build_batch([r for r, _ in done], spans, GRPOConfig(model_path="unused", group_size=2, **config))


def test_each_agent_gets_its_own_samples(done: dict[str, Any]) -> None:
    rollouts = done["agents"]
    for _, spans in rollouts:
        calls = llm_calls(spans)
        assert [c.source for c in calls] == ["gateway", "gateway"] and all(c.has_token_ids for c in calls)
        assert [c.agent_name for c in calls] == ["writer", "critic"]  # scope via tracer twin; endpoint tag
    writer = _batch(rollouts, agents=("writer",))
    critic = _batch(rollouts, agents=("critic",))
    assert len(writer.samples) == 2 and len(critic.samples) == 2
    first = {r.rollout_id: llm_calls(s) for r, s in rollouts}
    for sample in writer.samples:
        call = first[sample.rollout_id][0]
        assert sample.input_ids == tuple(call.prompt_token_ids or []) + tuple(call.completion_token_ids or [])
    for sample in critic.samples:
        call = first[sample.rollout_id][1]
        assert sample.input_ids == tuple(call.prompt_token_ids or []) + tuple(call.completion_token_ids or [])
    assert sorted(writer.advantages) == pytest.approx([-1.0, 1.0], abs=1e-4)
    both = _batch(rollouts)
    assert len(both.samples) == 4  # writer and critic, each normalised within its own (task, agent) group
    assert _batch(rollouts, agents=("nobody",)).samples == []


def test_a_call_rewarded_minus_five_gets_a_negative_advantage(done: dict[str, Any]) -> None:
    rollouts = done["credit"]
    assert _batch(rollouts).samples == []  # final credit: equal rewards, the -5 never reaches the loss
    punished = {
        str(s.attributes[sc.REWARD_RESPONSE_ID])
        for _, spans in rollouts
        for s in spans
        if s.name == sc.SPAN_REWARD and sc.REWARD_RESPONSE_ID in s.attributes
    }
    assert len(punished) == 2  # one per rollout, each naming a gateway-recorded response
    signs = []
    for sample in _batch(rollouts, credit="per_call").samples:
        assert sample.token_advantages is not None
        for response_id, (start, end) in zip(sample.call_response_ids, sample.call_spans, strict=True):
            values = sample.token_advantages[start:end]
            assert values and len(set(values)) == 1  # one advantage over the call's completion tokens
            signs.append((response_id in punished, values[0]))
    assert sorted(p for p, _ in signs) == [False, False, True, True]  # every call of both rollouts trained
    assert all(adv < 0 for p, adv in signs if p) and all(adv > 0 for p, adv in signs if not p)
