"""APO against the simulated LM: beam and budget logic, failure handling, stored history, and a learning test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

import agl
from agl.algorithm.apo import APO, APOConfig, apo_history
from agl.algorithm.apo.apo import _extract_prompt
from agl.errors import ConfigError
from agl.schemas import LLM, PromptTemplate
from agl.store import InMemoryLightningStore
from agl.testing.simulated_lm import RULES, SimulatedLM, SimulatedLMServer, make_tasks
from examples.apo.agent import price_agent

BASE_PROMPT = "You are a shopping assistant. Answer the question."


class Bed:
    def __init__(self, server: SimulatedLMServer, store: InMemoryLightningStore) -> None:
        self.server, self.store = server, store

    def config(self, **overrides: object) -> APOConfig:
        critic = LLM(endpoint=self.server.base_url, model="critic")
        editor = LLM(endpoint=self.server.base_url, model="editor")
        return APOConfig(critic=critic, editor=editor, **overrides)  # type: ignore[arg-type]


@pytest.fixture
async def bed(request: pytest.FixtureRequest) -> AsyncIterator[Bed]:
    model = SimulatedLM(**getattr(request, "param", {}))
    with SimulatedLMServer(model) as server:
        store = InMemoryLightningStore()
        await store.add_resources(
            {
                "llm": LLM(endpoint=server.base_url, model="task"),
                "prompt": PromptTemplate(template=BASE_PROMPT),
            }
        )
        runner = agl.Runner(price_agent, store, max_concurrency=8, poll_interval_s=0.01)
        task = asyncio.create_task(runner.run())
        yield Bed(server, store)
        runner.stop()
        await task


async def test_apo_finds_the_known_best_prompt(bed: Bed) -> None:
    train, val = make_tasks(12, seed=1), make_tasks(9, seed=2)
    result = await APO(bed.config(beam_width=2, branch_factor=2, rounds=3, minibatch_size=6)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    root = result.history[0]
    assert root.score == 0.0
    assert result.best.score == 1.0  # all of the available gain
    assert all(needle.lower() in result.best.template.lower() for needle, _, _ in RULES.values())
    assert result.scores_by_round == sorted(result.scores_by_round)


async def test_history_is_stored_with_parents_and_scores(bed: Bed) -> None:
    train, val = make_tasks(6, seed=3), make_tasks(6, seed=4)
    result = await APO(bed.config(rounds=2, beam_width=1, branch_factor=1, minibatch_size=3)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    history = await apo_history(bed.store)
    assert [c.resources_id for c in history] == [c.resources_id for c in result.history]
    by_id = {c.resources_id: c for c in history}
    for candidate in result.history:
        stored = by_id[candidate.resources_id]
        assert stored.score == pytest.approx(candidate.score)
        assert stored.parent_id == candidate.parent_id and stored.template == candidate.template
        if candidate.parent_id is not None:
            assert candidate.parent_id in by_id and candidate.critique


async def test_rollout_budget_stops_the_search_and_keeps_best(bed: Bed) -> None:
    train, val = make_tasks(6, seed=5), make_tasks(3, seed=6)
    result = await APO(bed.config(rounds=10, max_rollouts=20, minibatch_size=3)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    assert result.rollouts_used <= 20
    assert result.best.score is not None and result.best.score >= result.history[0].score  # type: ignore[operator]


async def test_llm_call_budget_is_respected(bed: Bed) -> None:
    train, val = make_tasks(6, seed=5), make_tasks(3, seed=6)
    result = await APO(bed.config(rounds=10, max_llm_calls=4, minibatch_size=3)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    assert result.llm_calls_used <= 4


@pytest.mark.parametrize("bed", [{"garbage_every": 2, "fail_every": 3}], indirect=True)
async def test_garbage_and_failures_skip_branches_without_crashing(bed: Bed) -> None:
    train, val = make_tasks(9, seed=7), make_tasks(6, seed=8)
    result = await APO(
        bed.config(max_rollouts=90, beam_width=2, branch_factor=2, minibatch_size=3, llm_retries=1)
    ).run(bed.store, [t.as_input() for t in train], [t.as_input() for t in val])
    assert result.llm_calls_failed > 0 and result.branches_skipped > 0
    assert result.best.score is not None and result.best.score > 0  # progress despite the chaos


def test_extract_prompt_rejects_garbage() -> None:
    assert _extract_prompt("no tags here", "x") is None
    assert _extract_prompt("<prompt>  </prompt>", "x") is None
    assert _extract_prompt("<prompt>Hi there</prompt>", "Say {name}") is None  # lost a placeholder
    assert _extract_prompt("<prompt>Hi {name}!</prompt>", "Say {name}") == "Hi {name}!"


def test_config_validation_names_the_field() -> None:
    llm = LLM(endpoint="http://127.0.0.1:1/v1", model="m")
    with pytest.raises(ConfigError, match="beam_width"):
        APOConfig(critic=llm, editor=llm, beam_width=0)
    with pytest.raises(ConfigError, match="max_rollouts"):
        APOConfig(critic=llm, editor=llm, max_rollouts=0)
