"""Offline SFT: ``SFTConfig(from_store=URL)`` trains on rollouts already in a store and generates none.

A real tiny-model GRPO ``fit`` fills a SQLite store; SFT then trains on its recorded token ids through
``Trainer.fit`` (the store of that fit stays empty) and the loss falls, the weights change and only
completion tokens carry loss. The selection filters (reward, agent, finish time) run on hand-made
rollouts in a SQLite store whose clock the test sets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

import agl
from agl import semconv as sc
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.algorithm.policy.logprobs import token_logprobs
from agl.algorithm.policy.model import collate, sft_loss
from agl.algorithm.sft import SFT, SFTConfig
from agl.algorithm.sft.offline import samples_from_store
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import AttemptStatus, RolloutStatus, Span
from agl.store.sqlite import SqliteLightningStore
from tests.adapter.spans import SpanMaker
from tests.tiny_agents import digits_agent


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQLite store of a finished tiny-model GRPO run (2 steps of 2 tasks x 4 rollouts)."""
    out = tmp_path_factory.mktemp("earlier-run")
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=2,
        group_size=4,
        eval_every=0,
        export_model=False,
    )
    agl.Trainer(algorithm=GRPO(config), n_runners=8, output_dir=str(out)).fit(digits_agent, ["1 2", "3 4"])
    return out / "store.db"


async def _recorded(db: Path) -> dict[str, tuple[float, list[int], list[int]]]:
    """Each succeeded rollout's reward and its (single) gateway call's prompt and completion ids."""
    from agl.adapter import final_reward
    from agl.algorithm.base import rollout_spans

    async with SqliteLightningStore(db) as store:
        rollouts = (await store.query_rollouts(status=[RolloutStatus.SUCCEEDED], limit=1000)).items
        out = {}
        for r in rollouts:
            spans = await rollout_spans(store, r.rollout_id)
            (call,) = [s for s in spans if s.name == sc.SPAN_LLM_CALL]
            out[r.rollout_id] = (
                final_reward(spans) or 0.0,
                list(call.attributes[sc.LLM_PROMPT_TOKEN_IDS]),
                list(call.attributes[sc.LLM_COMPLETION_TOKEN_IDS]),
            )
        return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offline_samples_are_the_recorded_ids_with_loss_on_completions_only(earlier_run: Path) -> None:
    recorded = asyncio.run(_recorded(earlier_run))
    rewards = sorted(r for r, _, _ in recorded.values())
    assert len(recorded) == 16 and rewards[0] < rewards[-1]
    threshold = rewards[len(rewards) // 2]
    expected = {rid for rid, (r, _, _) in recorded.items() if r >= threshold}

    async def select() -> Any:
        async with SqliteLightningStore(earlier_run) as store:
            return await samples_from_store(store, min_reward=threshold)

    selection = asyncio.run(select())
    assert {s.rollout_id for s in selection.samples} == expected
    for sample in selection.samples:
        _, prompt, completion = recorded[sample.rollout_id]
        assert list(sample.input_ids) == prompt + completion
        assert list(sample.loss_mask) == [0] * len(prompt) + [1] * len(completion)
    assert selection.counts["model_tokens"] == sum(len(recorded[r][2]) for r in expected)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_trains_offline_from_the_store_without_new_rollouts(earlier_run: Path, tmp_path: Path) -> None:
    before_count = len(asyncio.run(_recorded(earlier_run)))
    config = SFTConfig(
        model_path=str(tiny_model()),
        from_store=f"sqlite:///{earlier_run}",
        min_reward=None,
        top_k_per_task=None,
        epochs=4,
        batch_size=4,
        lr=3e-3,
        progress=False,
    )
    sft = SFT(config)
    result = agl.Trainer(algorithm=sft, n_runners=1, output_dir=str(tmp_path)).fit(digits_agent, [], [])
    losses = [row["sft_loss"] for row in result["history"]]
    print("offline SFT loss per epoch:", " ".join(f"{x:.3f}" for x in losses))
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.9
    assert result["selected"]["samples"] == before_count == 16

    async def rollouts_of_this_fit() -> int:
        async with SqliteLightningStore(tmp_path / "store.db") as store:
            return len((await store.query_rollouts(limit=1000)).items)

    assert asyncio.run(rollouts_of_this_fit()) == 0  # nothing was generated
    assert len(asyncio.run(_recorded(earlier_run))) == before_count  # the source store is untouched
    assert (tmp_path / "sft-from-store.jsonl").read_text().count("\n") == 16

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model()).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(result["model_path"]).state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base)

    # the loss of a real offline sample reaches the logits of completion positions only
    (sample, *_) = asyncio.run(_one_sample(earlier_run))
    batch = collate([sample], [0.0], [0], sft.policy.pad_id)
    captured: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        output.logits.retain_grad()
        captured["logits"] = output.logits

    handle = sft.policy.model.register_forward_hook(keep)
    logprobs, _ = token_logprobs(sft.policy.model, batch.input_ids, batch.attention)
    handle.remove()
    sft_loss(logprobs, batch.mask).backward()
    logits_grad = captured["logits"].grad
    assert logits_grad is not None
    grad = logits_grad[0, :-1]  # position t predicts token t+1
    carries = grad.abs().sum(-1) > 0
    assert torch.equal(carries, batch.mask[0] > 0) and int(carries.sum()) == sample.num_model_tokens
    sft.policy.model.zero_grad(set_to_none=True)


async def _one_sample(db: Path) -> Any:
    async with SqliteLightningStore(db) as store:
        return (await samples_from_store(store)).samples


# ----- the filters, on hand-made rollouts -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _finish(
    store: SqliteLightningStore,
    clock: Clock,
    at: float,
    reward: float,
    agent: str | None,
    ok: bool = True,
    mode: str = "train",
) -> str:
    """A rollout of ``mode`` that finished at ``at`` with one call (prompt 1 2 3, completion 7 8) and ``reward``."""
    clock.now = at - 1
    rollout = await store.enqueue_rollout({"q": at}, mode=mode)
    claimed = await store.dequeue("w")
    assert claimed is not None and claimed.rollout.rollout_id == rollout.rollout_id
    maker = SpanMaker(rollout.rollout_id, claimed.attempt.attempt_id)
    extra = {} if agent is None else {sc.AGENT_NAME: agent}
    spans: list[Span] = [maker.call([1, 2, 3], [7, 8], attrs=extra), maker.reward(reward)]
    await store.add_spans(spans)
    clock.now = at
    status = AttemptStatus.SUCCEEDED if ok else AttemptStatus.FAILED
    await store.update_attempt(rollout.rollout_id, claimed.attempt.attempt_id, status=status)
    return rollout.rollout_id


def test_rollouts_are_chosen_by_reward_agent_and_finish_time(tmp_path: Path) -> None:
    async def main() -> None:
        clock = Clock()
        async with SqliteLightningStore(tmp_path / "s.db", clock=clock) as store:
            early = await _finish(store, clock, 2000, 1.0, "writer")
            low = await _finish(store, clock, 3000, 0.2, "writer")
            critic = await _finish(store, clock, 4000, 1.0, "critic")
            late = await _finish(store, clock, 5000, 1.0, None)
            await _finish(store, clock, 6000, 1.0, "writer", ok=False)  # failed: never a candidate

            async def ids(**filters: Any) -> set[str]:
                return {s.rollout_id for s in (await samples_from_store(store, **filters)).samples}

            assert await ids() == {early, low, critic, late}
            assert await ids(min_reward=0.5) == {early, critic, late}
            assert await ids(agent="writer") == {early, low}
            assert await ids(min_reward=0.5, agent="writer") == {early}
            assert await ids(since=3000) == {low, critic, late}
            assert await ids(since=2500, until=4000.0) == {low, critic}
            iso = "1970-01-01T01:06:40+00:00"  # 4000 s
            assert await ids(until=iso) == {early, low, critic}
            selection = await samples_from_store(store, min_reward=0.5, agent="nobody")
            assert selection.samples == [] and selection.counts["kept_rollouts"] == 3
            assert "0 with model calls of the chosen agent" in selection.explain("s.db")
            # from_modes: only production traffic the gateway recorded (mode "online")
            online = await _finish(store, clock, 7000, 1.0, None, mode="online")
            assert online in await ids()
            assert await ids(modes=("online",)) == {online}
            assert await ids(modes=("online", "train"), since=4500) == {late, online}
            assert await ids(modes=("val",)) == set()

    asyncio.run(main())


def test_bad_offline_settings_are_clear_errors(tmp_path: Path) -> None:
    model = str(tiny_model())
    with pytest.raises(ConfigError, match="since='yesterday' is no time"):
        SFTConfig(model_path=model, from_store="sqlite:///x.db", since="yesterday")
    with pytest.raises(ConfigError, match="is after until"):
        SFTConfig(model_path=model, from_store="sqlite:///x.db", since=5, until=4)
    with pytest.raises(ConfigError, match="set from_store too"):
        SFTConfig(model_path=model, since=5)
    with pytest.raises(ConfigError, match="from_modes selects rollouts already in a store"):
        SFTConfig(model_path=model, from_modes=("online",))
    with pytest.raises(ConfigError, match="from_modes must be a list of rollout modes"):
        SFTConfig(model_path=model, from_store="sqlite:///x.db", from_modes="online")  # type: ignore[arg-type]
    listed = SFTConfig(model_path=model, from_store="sqlite:///x.db", from_modes=["online"])  # type: ignore[arg-type]
    assert listed.from_modes == ("online",)
    from agl.algorithm.sft import train_from_store

    missing = SFTConfig(model_path=model, from_store=f"sqlite:///{tmp_path / 'none.db'}", progress=False)
    with pytest.raises(ConfigError, match="no SQLite file"):
        train_from_store(missing, tmp_path / "out")
    empty = tmp_path / "empty.db"
    asyncio.run(_create_empty(empty))
    with pytest.raises(ConfigError, match="no training data in .*0 succeeded rollouts"):
        train_from_store(
            SFTConfig(model_path=model, from_store=f"sqlite:///{empty}", progress=False), tmp_path
        )


async def _create_empty(path: Path) -> None:
    async with SqliteLightningStore(path) as store:
        await store.statistics()
