"""Trainer.fit end to end on the tiny model: it trains, checkpoints, resumes, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@agl.rollout
async def digits_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task}],
        max_tokens=6,
        seed=abs(hash(rollout.rollout_id)) % 1000,
    )
    await client.close()
    text = reply.choices[0].message.content or ""
    return sum(c.isdigit() for c in text) / 6


def _fit(out: Path, steps: int, resume: bool = False) -> dict[str, Any]:
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=steps,
        tasks_per_step=2,
        group_size=3,
        lr=1e-3,
        eval_every=0,
        checkpoint_every=1,
        resume=resume,
    )
    result: dict[str, Any] = agl.Trainer(algorithm=GRPO(config), n_runners=6, output_dir=str(out)).fit(
        digits_agent, ["a", "b", "c"], ["a"]
    )
    return result


@pytest.mark.timeout(240)
def test_fit_checkpoints_and_resumes(tmp_path: Path) -> None:
    first = _fit(tmp_path, steps=2)
    assert len(first["history"]) == 2
    for row in first["history"]:  # the saving is timed apart, so a benchmark can leave it out of the step's
        assert 0 < row["checkpoint_time_s"] < row["step_time_s"], row
        assert 0 < row["checkpoint_cpu_s"] < row["cpu_time_s"], row
    state = json.loads((tmp_path / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["step"] == 2
    resumed = _fit(tmp_path, steps=3, resume=True)
    assert len(resumed["history"]) == 1  # only step 3 ran
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(float(row["step"])) for row in rows] == [0, 1, 2, 3]
    # step 0: the held-out rollouts' behaviour (one model call each) and the memory peak before step 1
    assert float(rows[0]["val_behaviour_calls_per_rollout"]) == 1.0 and float(rows[0]["peak_rss_gb"]) > 0.1
    assert (tmp_path / "checkpoints" / "step-3" / "optimizer.pt").exists()


SLOW_FIT = textwrap.dedent(
    """
    import asyncio, sys
    import agl
    from agl.algorithm.grpo import GRPO, GRPOConfig
    from agl.models import tiny_model

    @agl.rollout
    async def agent(task):
        print("rollout running", flush=True)
        await asyncio.sleep(120)
        return 1.0

    config = GRPOConfig(model_path=str(tiny_model()), steps=5, tasks_per_step=1, group_size=2, eval_every=0)
    try:
        agl.Trainer(algorithm=GRPO(config), output_dir=sys.argv[1]).fit(agent, ["x"], [])
    except KeyboardInterrupt:
        print("interrupted cleanly", flush=True)
    """
)


@pytest.mark.timeout(180)
def test_ctrl_c_stops_fit_promptly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_FIT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while "rollout running" not in proc.stdout.readline():
        assert time.monotonic() < deadline
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "interrupted cleanly" in out


class _CacheProbe(GRPO):
    """GRPO that records the engine's cached prefixes before the pre-update release, and its cached
    prefixes and weights during the update."""

    def __init__(self, config: GRPOConfig) -> None:
        super().__init__(config)
        self.before_release: list[int] = []
        self.at_update: list[tuple[int, int]] = []

    async def run(self, ctx: Any, train: Any, val: Any) -> dict[str, Any]:
        engine = ctx.engines.replicas[0].engine
        free = ctx.engines.free_for_update

        async def recorded_free() -> None:
            self.before_release.append(len(engine.prefix_cache))
            await free()

        ctx.engines.free_for_update = recorded_free
        self._engine = engine
        result: dict[str, Any] = await super().run(ctx, train, val)
        import torch

        served = dict(engine.model.named_parameters())
        self.served_is_trained = all(
            torch.equal(served[name], param) for name, param in self.policy.model.named_parameters()
        )
        return result

    def _update(self, batch: Any) -> dict[str, float]:
        weights = sum(p.numel() for p in self._engine.model.parameters())
        self.at_update.append((len(self._engine.prefix_cache), weights))
        return super()._update(batch)


@pytest.mark.timeout(240)
def test_a_synchronous_update_runs_with_the_engines_prefix_cache_and_weights_released(tmp_path: Path) -> None:
    """The cached prefixes and the engine's copy of the weights go stale with an update (the warm start's
    and each step's): freed before it, their memory serves the update's peak instead of sitting beside it;
    the push after the update gives the engine the trained weights, which the next step samples from."""
    warm = agl.WarmStart(
        [[{"role": "user", "content": "17"}, {"role": "assistant", "content": "1717"}]], steps=1
    )
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=2,
        group_size=3,
        lr=1e-3,
        eval_every=0,
        warm_start=warm,
    )
    probe = _CacheProbe(config)
    tasks = [f"Write the digits of the number {n} twice, then once more backwards." for n in (17, 42, 93)]
    result = agl.Trainer(algorithm=probe, n_runners=6, output_dir=str(tmp_path)).fit(digits_agent, tasks, [])
    assert [row["rollouts"] for row in result["history"]] == [6, 6]  # the second step's after a release
    assert probe.at_update and all(n == (0, 0) for n in probe.at_update), probe.at_update
    # the warm start trains with the engine's weights released too; then each GRPO update
    assert len(probe.before_release) == len(probe.at_update) + 1, probe.before_release
    assert all(n > 0 for n in probe.before_release[1:]), probe.before_release
    assert probe.served_is_trained  # the last push filled the released weights with the policy's
