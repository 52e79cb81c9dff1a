"""A LoRA adapter per agent (``GRPOConfig(agents=("solver", "checker"))``): each adapter learns from its own
agent's calls only, and each agent's endpoint is answered by its own adapter.

The batch and policy tests run on hand-made spans and the tiny model's policy; the fit test runs two GRPO
steps through the real gateway and built-in engines, where the checker's calls all tie (it is called only
when the solver scored 1), so its adapter must stay as it started while the solver's moves.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

import agl
from agl import semconv as sc
from agl.adapter import llm_calls
from agl.adapter.calls import calls_by_agent
from agl.algorithm.base import rollout_spans
from agl.algorithm.grpo import GRPO, GRPOConfig, build_batch
from agl.algorithm.grpo.agents import check_agents_called, step_agents
from agl.algorithm.policy import Policy, PolicyConfig
from agl.algorithm.policy.loss import LossConfig
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import Rollout, RolloutStatus, Span
from tests.adapter.spans import SpanMaker

AGENTS = ("solver", "checker")


def _rollout(rid: str, group: str) -> Rollout:
    return Rollout(
        rollout_id=rid, group_id=group, status=RolloutStatus.SUCCEEDED, created_at=0.0, updated_at=0.0
    )


def _served(agent: str, model: str | None = None) -> dict[str, Any]:
    """A gateway call's attributes: its agent, and the model that answered (the agent's adapter)."""
    return {sc.AGENT_NAME: agent, sc.LLM_MODEL: model or agent}


def _team_spans(scoped_solver: bool = False) -> tuple[list[Rollout], dict[str, list[Span]]]:
    """Two rollouts of one task: a solver call and a checker call each, rewards 1 and 0. With
    ``scoped_solver`` the second rollout's solver call also ran under ``agl.agent_scope``, so the base
    model (``policy``) answered it."""
    spans: dict[str, list[Span]] = {}
    for rid, reward in (("t1", 1.0), ("t2", 0.0)):
        m = SpanMaker(rollout_id=rid)
        base = scoped_solver and not reward
        spans[rid] = [
            m.call([11, 12, 13], [20 + int(reward), 30], attrs=_served("solver", "policy" if base else None)),
            m.call([14, 15], [40, 41 + int(reward)], attrs=_served("checker", "checker@v3")),  # vLLM's name
            m.call([16], [50], attrs=_served("other", "policy")),  # an agent no adapter trains
            m.reward(reward),
        ]
    return [_rollout(r, "g") for r in spans], spans


def test_config_names_the_field_for_several_agents_without_lora() -> None:
    with pytest.raises(ConfigError, match=r"GRPOConfig\(agents=\('solver', 'checker'\)\).*lora_rank > 0"):
        GRPOConfig(model_path="m", agents=AGENTS)
    with pytest.raises(ConfigError, match="GRPOConfig.agents must be a tuple"):
        GRPOConfig(model_path="m", agents="solver")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="names an agent twice"):
        GRPOConfig(model_path="m", agents=("a", "a"), lora_rank=4)
    with pytest.raises(ConfigError, match="world_size=1"):
        GRPOConfig(model_path="m", agents=AGENTS, lora_rank=4, world_size=2)
    with pytest.raises(ConfigError, match="cannot hold '.'"):
        GRPOConfig(model_path="m", agents=("a.b", "c"), lora_rank=4)
    assert GRPOConfig(model_path="m", agents=["solver"]).agents == ("solver",)  # type: ignore[arg-type]
    spec = GRPO(GRPOConfig(model_path="/m", agents=AGENTS, lora_rank=4)).model_spec()
    assert spec.lora_rank == 0 and {a: (s.name, s.rank) for a, s in spec.adapters.items()} == {
        "solver": ("solver", 4),
        "checker": ("checker", 4),
    }
    assert not GRPO(GRPOConfig(model_path="/m", agents=("solver",), lora_rank=4)).model_spec().adapters


def test_the_batch_groups_and_tags_samples_per_agent() -> None:
    rollouts, spans = _team_spans()
    batch = build_batch(rollouts, spans, GRPOConfig(model_path="m", group_size=2, agents=AGENTS, lora_rank=4))
    assert batch.agents == ["solver", "checker", "solver", "checker"]
    assert [s.input_ids for s, a in zip(batch.samples, batch.agents, strict=True) if a == "checker"] == [
        (14, 15, 40, 42),
        (14, 15, 40, 41),
    ]
    assert batch.metrics["groups"] == 2 and batch.metrics["samples_solver"] == 2
    assert batch.advantages == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-4)  # the rollout's reward
    assert batch.unseen_agents == () and batch.metrics["calls_off_adapter"] == 0


def test_a_call_the_base_answered_does_not_train_an_adapter(caplog: pytest.LogCaptureFixture) -> None:
    """A call tagged as the solver's only after it ran reached the base: its log-probs are not the
    adapter's, so it leaves the solver's group (and the step says so)."""
    rollouts, spans = _team_spans(scoped_solver=True)
    batch = build_batch(rollouts, spans, GRPOConfig(model_path="m", group_size=2, agents=AGENTS, lora_rank=4))
    assert batch.agents == ["checker", "checker"] and batch.metrics["calls_off_adapter"] == 1
    assert batch.metrics["zero_variance_groups"] == 1  # the solver's group holds one rollout now
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.grpo.agents"):
        check_agents_called(batch, AGENTS, 1)
    assert "1 calls of GRPOConfig.agents 'solver', 'checker' in step 1 reached the base model" in caplog.text


def test_an_agent_that_never_calls_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    rollouts, spans = _team_spans()
    typo = build_batch(rollouts, spans, GRPOConfig(model_path="m", group_size=2, agents=("solvr",)))
    assert typo.samples == [] and typo.unseen_agents == ("solvr",)
    with pytest.raises(
        ConfigError, match=r"GRPOConfig.agents names 'solvr'.*came from 'checker', 'other', 'solver'"
    ):
        check_agents_called(typo, ("solvr",), 1)
    config = GRPOConfig(model_path="m", group_size=2, agents=("solver", "critic"), lora_rank=4)
    partly = build_batch(rollouts, spans, config)
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.grpo.agents"):
        check_agents_called(partly, config.agents, 1)  # the solver trains; the critic is only reported
    assert "GRPOConfig.agents names 'critic', which made no model call in step 1" in caplog.text


def _policy(lr: float = 1e-2) -> Policy:
    config = PolicyConfig(model_path=str(tiny_model()), lora_rank=4, adapters=AGENTS, lr=lr, seed=3)
    return Policy(config, LossConfig())


def _adapter(policy: Policy, name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.named_parameters() if f".{name}." in k}


def test_each_adapter_steps_on_its_own_agents_samples_only() -> None:
    """One step over both agents' samples leaves each adapter exactly as a step over its own samples alone."""
    rollouts, spans = _team_spans()
    batch = build_batch(rollouts, spans, GRPOConfig(model_path="m", group_size=2, agents=AGENTS, lora_rank=4))
    both = _policy()
    start = {name: _adapter(both, name) for name in AGENTS}
    row = step_agents(both, batch, AGENTS)
    assert row["grad_norm_solver"] > 0 and row["grad_norm_checker"] > 0
    assert row["trained_tokens"] == 8  # both agents' completion tokens
    for name in AGENTS:
        alone = _policy()
        assert all(torch.equal(v, _adapter(alone, name)[k]) for k, v in start[name].items())
        mine = [i for i, a in enumerate(batch.agents) if a == name]
        alone.use_adapter(name)
        alone.step([batch.samples[i] for i in mine], [batch.advantages[i] for i in mine], [0, 1])
        moved = _adapter(both, name)
        assert all(torch.equal(v, _adapter(alone, name)[k]) for k, v in moved.items()), name
        assert any(not torch.equal(v, start[name][k]) for k, v in moved.items()), name
    checker_only = _policy()
    batch.agents = ["checker" if a == "checker" else "nobody" for a in batch.agents]
    step_agents(checker_only, batch, AGENTS)
    assert all(torch.equal(v, start["solver"][k]) for k, v in _adapter(checker_only, "solver").items())


def test_each_adapter_has_its_own_weights_and_folder(tmp_path: Path) -> None:
    policy = _policy()
    rollouts, spans = _team_spans()
    batch = build_batch(rollouts, spans, GRPOConfig(model_path="m", group_size=2, agents=AGENTS, lora_rank=4))
    batch.agents = ["solver" if a == "solver" else "x" for a in batch.agents]
    step_agents(policy, batch, AGENTS)
    solver, checker = policy.engine_weights("solver"), policy.engine_weights("checker")
    assert set(solver) == set(checker) and not any("lora_" in k for k in solver)
    assert any(not torch.equal(solver[k], checker[k]) for k in solver)
    with pytest.raises(ConfigError, match="no adapter 'critic' to push"):
        policy.engine_weights("critic")
    policy.save_adapter(tmp_path / "checker", "checker")
    assert (tmp_path / "checker" / "adapter_config.json").is_file()


# ---- through Trainer.fit: the gateway and the built-in engines -------------------------------------------

_order = itertools.count()
PROBE: dict[str, Any] = {}
QUESTION: list[Any] = [{"role": "user", "content": "what is two plus three"}]


async def _ask(llm: agl.LLM, agent: str | None, messages: list[Any], **options: Any) -> Any:
    url = llm.endpoint if agent is None else llm.endpoint_for(agent)
    client = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0)
    try:
        return await client.chat.completions.create(
            model=llm.model, messages=messages, max_tokens=4, **options
        )
    finally:
        await client.close()


@agl.rollout(name="pair")
async def pair(task: str, llm: agl.LLM) -> float:
    """The solver answers; rewards alternate 1/0 in call order; the checker is asked only after a 1, so
    its calls all tie; a helper no adapter trains reaches the base model. Task "probe": one greedy call
    through each endpoint, kept in PROBE."""
    if task == "probe":
        for agent in (*AGENTS, None):
            reply = await _ask(llm, agent, QUESTION, temperature=0.0)
            PROBE[agent or "base"] = reply
        return 0.0
    await _ask(llm, "solver", [{"role": "user", "content": task}], temperature=1.0)
    await _ask(llm, "helper", [{"role": "user", "content": f"help {task}"}], temperature=1.0)
    reward = float(next(_order) % 2 == 0)
    if reward:
        await _ask(llm, "checker", [{"role": "user", "content": f"check {task}"}], temperature=1.0)
    return reward


class ProbedGRPO(GRPO):
    """GRPO that keeps each adapter's starting weights and, after training, runs the probe rollout."""

    def __init__(self, config: GRPOConfig) -> None:
        super().__init__(config)
        self.start: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}

    def _make_policy(self, model_path: str | None = None) -> Any:
        policy = super()._make_policy(model_path)
        self.start = {name: _adapter(policy, name) for name in AGENTS}
        return policy

    async def run(self, ctx: agl.TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        result = await super().run(ctx, train, val)
        resources_id = (await ctx.publish_policy(None)).resources_id
        ((probe, probe_spans),) = await ctx.rollouts(
            ["probe"], mode="val", resources_id=resources_id, timeout_s=60
        )
        assert probe.status.value == "succeeded"
        PROBE["models"] = [c.model for c in llm_calls(probe_spans)]
        for rollout in (await ctx.store.query_rollouts(mode="train", limit=100)).items:
            spans = await rollout_spans(ctx.store, rollout.rollout_id)
            for agent, own in calls_by_agent(llm_calls(spans), spans).items():
                self.calls[str(agent)] = self.calls.get(str(agent), 0) + len(own)
        return result


def _engine_view(reply: Any) -> tuple[list[int], list[int], list[float]]:
    extra = reply.model_extra or {}
    choice = reply.choices[0]
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    return list(extra["prompt_token_ids"]), list(choice.model_extra["token_ids"]), logprobs


def _trainer_logprobs(
    policy: Policy, adapter: str | None, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        if adapter is None:
            with policy.model.disable_adapter():  # type: ignore[operator]
                logits = policy.model(input_ids=ids).logits[0]
        else:
            policy.use_adapter(adapter)
            logits = policy.model(input_ids=ids).logits[0]
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    picked = logprobs[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    return picked[len(prompt) - 1 :]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_agent_trains_and_is_served_by_its_own_adapter(tmp_path: Path) -> None:
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=1,
        group_size=4,
        lr=1e-2,
        lora_rank=4,
        agents=AGENTS,
        eval_every=0,
        export_model=True,
    )
    algorithm = ProbedGRPO(config)
    result = agl.Trainer(algorithm=algorithm, n_runners=4, output_dir=str(tmp_path)).fit(pair, ["a", "b"], [])
    for row in result["history"]:  # the solver's groups have signal; the checker's all scored 1
        assert row["samples_solver"] == 4 and row["samples_checker"] == 0 and row["grad_norm_solver"] > 0, row
    policy = algorithm.policy
    assert (
        algorithm.calls.get("checker", 0) > 0 and algorithm.calls["solver"] == algorithm.calls["helper"] == 8
    )
    moved = _adapter(policy, "solver")
    assert any(not torch.equal(v, algorithm.start["solver"][k]) for k, v in moved.items())
    kept = _adapter(policy, "checker")
    assert all(torch.equal(v, algorithm.start["checker"][k]) for k, v in kept.items())
    # each endpoint's call went to its own model, and the engine's log-probs are that adapter's
    assert PROBE["models"] == ["solver", "checker", "policy"]
    for agent, adapter in (("solver", "solver"), ("checker", "checker"), ("base", None)):
        prompt, completion, engine = _engine_view(PROBE[agent])
        ours = _trainer_logprobs(policy, adapter, prompt, completion)
        torch.testing.assert_close(torch.tensor(engine), ours, atol=1e-4, rtol=0)
    prompt, completion, _ = _engine_view(PROBE["checker"])
    solver_lp = _trainer_logprobs(policy, "solver", prompt, completion)
    checker_lp = _trainer_logprobs(policy, "checker", prompt, completion)
    assert (solver_lp - checker_lp).abs().max() > 1e-3  # the trained adapter answers differently
    exported = Path(result["model_path"])
    assert (exported / "solver" / "config.json").is_file() and (
        exported / "checker" / "config.json"
    ).is_file()
