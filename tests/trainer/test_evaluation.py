"""``agl.evaluate_models``: the pass@k estimator against hand computation, and a real evaluation of the tiny
model (served by fit's engine and gateway) against an endpoint, with failures counted by class, not 0."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import agl
from agl.errors import ConfigError
from agl.store import open_store
from agl.trainer.dev import serve_model
from agl.trainer.evaluation import bootstrap, pass_at_k
from tests.tiny_agents import scored_agent

TASKS = [
    {"id": 0, "rewards": [1, 0, 0, 0], "rewards_tiny": [1, 1, 1, 1]},
    {"id": 1, "rewards": [1, 1, 0, 0], "rewards_tiny": [0, 1, 0, 1]},
    {"id": 2, "rewards": [0, 0, 0, 0], "rewards_tiny": [0, 0, 0, 1]},
    {"id": 3, "fail": "agent"},
    {"id": 4, "fail": "reward"},
]


def test_pass_at_k_matches_the_hand_computed_estimate() -> None:
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    assert pass_at_k(3, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_the_bootstrap_interval_holds_the_mean_and_narrows_to_a_point() -> None:
    low, high = bootstrap([0.0, 1.0] * 20)
    assert low < 0.5 < high and high - low < 0.4
    assert bootstrap([0.3]) == (0.3, 0.3)
    assert all(math.isnan(v) for v in bootstrap([]))


@pytest.fixture(scope="module")
def endpoint() -> Iterator[agl.LLM]:
    with serve_model("tiny") as llm:  # a second, separately served model the agent reaches by URL
        yield llm


def test_evaluate_models_scores_each_model_and_compares_them(endpoint: agl.LLM, tmp_path: Path) -> None:
    result = agl.evaluate_models(
        scored_agent,
        TASKS,
        {"base": "tiny", "endpoint": f"{endpoint.endpoint}#tiny"},
        k=4,
        pass_k=2,
        compare=("base", "endpoint"),
        output_dir=tmp_path,
        n_runners=4,
    )
    base = result.model("base")
    # the failed tasks (3, 4) are counted by class and left out of every score, not scored 0
    assert base.mean_reward == pytest.approx(3 / 12)
    assert base.mean_at_k == pytest.approx((0.25 + 0.5 + 0) / 3)
    assert base.pass_at_k == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert base.mean_at_k_ci[0] <= base.mean_at_k <= base.mean_at_k_ci[1]
    assert (base.failures.total, base.failures.failed) == (20, 8)
    assert dict(base.failures.by_class) == {"agent": 4, "reward": 4}
    assert [t.failed for t in base.tasks] == [0, 0, 0, 4, 4]
    other = result.model("endpoint")
    assert other.mean_at_k == pytest.approx((1 + 0.5 + 0.25) / 3)
    assert other.pass_at_k == pytest.approx((1 + 5 / 6 + 0.5) / 3)
    comparison = result.comparison
    assert comparison is not None and (comparison.a, comparison.b) == ("base", "endpoint")
    assert [(t.index, t.diff) for t in comparison.changed] == [(0, 0.75), (2, 0.25)]
    assert comparison.mean_diff == pytest.approx(1 / 3)
    assert comparison.ci[0] <= comparison.mean_diff <= comparison.ci[1]
    # the rollouts are in the store, as validation rollouts like training's
    assert result.store is not None
    store = open_store(result.store)
    try:
        import asyncio

        rollouts = asyncio.run(store.query_rollouts()).items
        versions = asyncio.run(store.query_resources()).items
    finally:
        asyncio.run(store.aclose())
    assert len(rollouts) == 40 and {r.mode for r in rollouts} == {"val"}
    # each model's rollouts ran at a resources version carrying its label (the dashboard shows it)
    labels = {v.resources_id: v.metadata.get("label") for v in versions}
    assert Counter(labels[r.resources_id or ""] for r in rollouts) == {"base": 20, "endpoint": 20}


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        agl.evaluate_models(scored_agent, TASKS, [str(tmp_path)])
    with pytest.raises(ConfigError, match="model name after '#'"):
        agl.evaluate_models(scored_agent, TASKS, ["http://127.0.0.1:9/v1"])
    with pytest.raises(ConfigError, match="pass_k must be a whole number from 1 to k=2"):
        agl.evaluate_models(scored_agent, TASKS, ["tiny"], k=2, pass_k=3)
    with pytest.raises(ConfigError, match="compare: no model labelled 'b'"):
        agl.evaluate_models(scored_agent, TASKS, ["tiny"], compare=("tiny", "b"))


def test_an_unreachable_endpoint_is_an_infra_failure_not_a_zero(tmp_path: Path) -> None:
    result = agl.evaluate_models(
        scored_agent, TASKS[:2], ["http://127.0.0.1:9/v1#gone"], k=1, output_dir=tmp_path
    )
    (gone,) = result.models
    assert dict(gone.failures.by_class) == {"infra": 2}
    assert math.isnan(gone.mean_reward) and math.isnan(gone.pass_at_k)
    data = result.to_json()["models"][0]
    assert data["mean_at_k"] is None and data["failed_by_class"] == {"infra": 2}
    assert "APIConnectionError" in (gone.failures.first_error or "")
