"""APO against the simulated LM: beam and budget logic, failure handling, stored history, and a learning test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import agl
from agl.algorithm.apo import APO, APOConfig, apo_history
from agl.algorithm.apo.apo import _extract_prompt
from agl.errors import AgentError, ConfigError
from agl.schemas import LLM, PromptTemplate
from agl.store import InMemoryLightningStore
from examples.apo.agent import price_agent
from examples.apo.simulated_lm import BASIC_RULES, RULES, SimulatedLM, SimulatedLMServer, make_tasks

BASE_PROMPT = "You are a shopping assistant. Answer the question."


class Bed:
    def __init__(self, server: SimulatedLMServer, store: InMemoryLightningStore) -> None:
        self.server, self.store = server, store

    def config(self, **overrides: object) -> APOConfig:
        critic = LLM(endpoint=self.server.base_url, model="critic")
        editor = LLM(endpoint=self.server.base_url, model="editor")
        return APOConfig(critic=critic, editor=editor, **overrides)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serving(model: SimulatedLM) -> AsyncIterator[Bed]:
    """The simulated LM over HTTP, a store holding the base prompt, and a runner serving its queue."""
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


@pytest.fixture
async def bed(request: pytest.FixtureRequest) -> AsyncIterator[Bed]:
    async with serving(SimulatedLM(**getattr(request, "param", {}))) as served:
        yield served


async def test_apo_finds_the_known_best_prompt(bed: Bed) -> None:
    train, val = make_tasks(12, seed=1), make_tasks(9, seed=2)
    result = await APO(bed.config(beam_width=2, branch_factor=2, rounds=3, minibatch_size=6)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    root = result.history[0]
    assert root.score == 0.0
    assert result.best.score == 1.0  # all of the available gain
    assert all(RULES[r][0].lower() in result.best.template.lower() for r in BASIC_RULES)
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


@pytest.mark.parametrize("bed", [{"task_outage_calls": 6}], indirect=True)
async def test_rollouts_lost_to_a_model_outage_run_again_instead_of_scoring_zero(bed: Bed) -> None:
    """The first task calls fail (the agent's client retries once): those rollouts are ``infra``
    failures, run again, so the search scores every candidate as if there had been no outage."""
    train, val = make_tasks(6, seed=3), make_tasks(6, seed=4)
    config = bed.config(rounds=2, beam_width=1, branch_factor=1, minibatch_size=3)
    result = await APO(config).run(bed.store, [t.as_input() for t in train], [t.as_input() for t in val])
    assert result.rollouts_resampled > 0
    async with serving(SimulatedLM()) as quiet:
        config = quiet.config(rounds=2, beam_width=1, branch_factor=1, minibatch_size=3)
        clean = await APO(config).run(quiet.store, [t.as_input() for t in train], [t.as_input() for t in val])
    assert clean.rollouts_resampled == 0
    assert [(c.template, c.score) for c in result.history] == [(c.template, c.score) for c in clean.history]
    assert result.rollouts_used == clean.rollouts_used + result.rollouts_resampled


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


async def test_budget_drives_the_run_and_validation_is_a_minority(bed: Bed, tmp_path: Path) -> None:
    train, val = make_tasks(12, seed=11), make_tasks(12, seed=12)
    result = await APO(bed.config(max_rollouts=120, output_dir=str(tmp_path))).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    assert result.rollouts_used <= 120
    assert sum(result.rollouts_by_phase.values()) == result.rollouts_used
    assert len(result.scores_by_round) - 1 > 3  # more rounds than the old default of 3
    assert result.best.score == 1.0 and result.best.val_evaluated == len(val)
    assert result.stop_reason == "perfect validation score"
    # children are compared on a third of the validation set; few candidates get all of it
    fully_validated = [c for c in result.history if c.val_evaluated == len(val)]
    assert len(fully_validated) <= 2 < len([c for c in result.history if c.val_evaluated > 0])
    assert (tmp_path / "metrics.csv").read_text().startswith("step,")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert result.curve and result.curve[-1] == (result.rollouts_used, 1.0)


async def test_budget_stops_the_search_before_it_is_exceeded(bed: Bed) -> None:
    train, val = make_tasks(12, seed=13), make_tasks(12, seed=14)
    result = await APO(bed.config(max_rollouts=40)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val]
    )
    assert result.rollouts_used <= 40 and "budget" in result.stop_reason
    assert result.best.val_evaluated == len(val)  # the reported score is a full validation score


async def test_a_misnamed_placeholder_stops_with_the_missing_key(bed: Bed) -> None:
    train, val = make_tasks(6, seed=15), make_tasks(9, seed=16)
    apo = APO(bed.config(max_rollouts=200))
    with pytest.raises(AgentError, match=r"'questoin'.*\['answer', 'level', 'question'\]"):
        await apo.run(
            bed.store,
            [t.as_input() for t in train],
            [t.as_input() for t in val],
            initial_prompt="Answer the customer's question: {questoin}",
        )
    assert apo.rollouts_used == 3  # stopped after the first validation probe


async def test_literal_json_braces_survive_the_agent_and_the_editor(bed: Bed) -> None:
    prompt = 'You answer price questions like {question}. Reply as {"answer": <number>}.'
    train, val = make_tasks(6, seed=17), make_tasks(6, seed=18)
    result = await APO(bed.config(rounds=2, minibatch_size=3)).run(
        bed.store, [t.as_input() for t in train], [t.as_input() for t in val], initial_prompt=prompt
    )
    assert len(result.history) > 1
    for candidate in result.history:
        assert '{"answer": <number>}' in candidate.template and "{question}" in candidate.template


def test_prompt_template_substitutes_only_placeholders() -> None:
    template = PromptTemplate(template='Reply as {"answer": <number>} to {question} {{literal}} {x}')
    assert template.placeholders == ["question", "x"]
    assert template.format(question="Q?", x=1) == 'Reply as {"answer": <number>} to Q? {literal} 1'
    with pytest.raises(KeyError, match=r"questoin.*\['question'\]"):
        PromptTemplate(template="Hi {questoin}").format(question="x")
    assert _extract_prompt('<prompt>Reply as {"a": 1} to {question}</prompt>', "{question}") is not None
    assert _extract_prompt('<prompt>Reply as {"a": 1}</prompt>', "Answer {question}") is None


@pytest.mark.timeout(60)
def test_evaluate_after_fit_runs_its_own_runner_or_says_nothing_serves_it(tmp_path: Path) -> None:
    with SimulatedLMServer(SimulatedLM()) as server:
        store = InMemoryLightningStore()
        config = APOConfig(
            critic=LLM(endpoint=server.base_url, model="critic"),
            editor=LLM(endpoint=server.base_url, model="editor"),
            rounds=1,
            minibatch_size=3,
        )
        apo = APO(config)
        trainer = agl.Trainer(
            algorithm=apo,
            store=store,
            n_runners=4,
            output_dir=str(tmp_path),
            initial_resources={
                "llm": LLM(endpoint=server.base_url, model="task"),
                "prompt": PromptTemplate(template=BASE_PROMPT),
            },
        )
        result = trainer.fit(
            price_agent,
            [t.as_input() for t in make_tasks(3, seed=1)],
            [t.as_input() for t in make_tasks(3, seed=2)],
        )
        test = [t.as_input() for t in make_tasks(6, seed=9)]
        # fit's runners are gone: no silent 0.0 after a long wait, but an error naming the fix
        with pytest.raises(
            AgentError, match=r"no runner claimed any of the 6 test rollouts in 0.5 s.*agent="
        ):
            asyncio.run(apo.evaluate(store, result.best.template, test, claim_timeout_s=0.5))
        known_best = " ".join(RULES[r][0] for r in BASIC_RULES)
        score = asyncio.run(apo.evaluate(store, f"{BASE_PROMPT} {known_best}", test, agent=price_agent))
        bland = asyncio.run(apo.evaluate(store, BASE_PROMPT, test, agent=price_agent))
    assert (score, bland) == (1.0, 0.0)  # the in-process runner served every rollout, and scores differ


async def test_evaluate_says_what_was_not_served_when_rollouts_outlast_the_timeout(bed: Bed) -> None:
    store = InMemoryLightningStore()  # no runner: nothing ever claims these
    await store.add_resources({"prompt": PromptTemplate(template=BASE_PROMPT)})
    apo = APO(bed.config(rollout_timeout_s=0.3))
    with pytest.raises(
        AgentError, match=r"2 of 2 test rollouts were not served within rollout_timeout_s=0.3 s.*queuing"
    ):
        await apo.evaluate(store, BASE_PROMPT, ["a", "b"])
