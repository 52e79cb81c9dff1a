"""``agl.evaluate_models``: run an agent k times on each task under one or more models and score them.

Each model is served and run the way training serves and runs one (``Trainer.fit``: engine, gateway and
runners over a store), and scored by the algorithms' own helper (:func:`agl.algorithm.base.evaluate`), so
the rollouts land in a store like training's (mode ``val``) and failed rollouts are counted by class,
never scored as 0. Confidence intervals are percentile bootstraps over tasks (:data:`CI_METHOD`).
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.adapter import final_reward
from agl.agent.base import LitAgent
from agl.algorithm.base import Algorithm, Evaluation, TrainingContext, evaluate
from agl.algorithm.health import Failures
from agl.algorithm.spec import ModelSpec
from agl.errors import ConfigError
from agl.schemas import LLM, RolloutStatus
from agl.trainer.serving import Serving

RESAMPLES = 2000  # bootstrap resamples: the 95% interval's ends move by well under 0.01 between seeds
CONFIDENCE = 0.95
CI_METHOD = f"percentile bootstrap over tasks ({RESAMPLES} resamples, {CONFIDENCE:.0%})"
Interval = tuple[float, float]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` scored samples of which ``c`` passed (Chen et al. 2021):
    the chance that at least one of ``k`` samples drawn without replacement passes, ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap(values: Sequence[float], seed: int = 0) -> Interval:
    """The :data:`CONFIDENCE` percentile bootstrap interval of the mean of ``values`` (one per task);
    NaN ends without values, the value itself for one."""
    if not values:
        return (math.nan, math.nan)
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(RESAMPLES))
    tail = (1 - CONFIDENCE) / 2
    return (means[int(tail * (RESAMPLES - 1))], means[int(math.ceil((1 - tail) * (RESAMPLES - 1)))])


@dataclass(frozen=True)
class TaskScore:
    """One task under one model: the rewards of its scored samples, how many of them passed (reward at
    or above the threshold) and how many samples failed (no reward: counted apart, not scored)."""

    index: int
    task: Any
    rewards: tuple[float, ...]
    passed: int
    failed: int

    @property
    def mean(self) -> float:
        """The mean reward of its scored samples; NaN when every sample failed."""
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan


@dataclass(frozen=True)
class ModelResult:
    """One model's scores: ``mean_reward`` over every scored rollout, ``mean_at_k`` (mean over tasks of
    each task's mean reward) and ``pass_at_k`` (mean over tasks of the unbiased estimate), each with a
    :data:`CI_METHOD` interval, over the tasks with at least one scored sample; failures by class apart.
    A task with fewer scored samples than pass@k's k (some failed) is estimated at k = those it has."""

    label: str
    model: str
    mean_reward: float
    mean_at_k: float
    mean_at_k_ci: Interval
    pass_at_k: float
    pass_at_k_ci: Interval
    failures: Failures
    tasks: tuple[TaskScore, ...] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "model": self.model,
            "mean_reward": _num(self.mean_reward),
            "mean_at_k": _num(self.mean_at_k),
            "mean_at_k_ci": [_num(v) for v in self.mean_at_k_ci],
            "pass_at_k": _num(self.pass_at_k),
            "pass_at_k_ci": [_num(v) for v in self.pass_at_k_ci],
            "rollouts": self.failures.total,
            "failed": self.failures.failed,
            "failed_by_class": dict(self.failures.by_class),
            "first_error": self.failures.first_error,
            "tasks": [
                {
                    "index": t.index,
                    "task": t.task,
                    "rewards": list(t.rewards),
                    "passed": t.passed,
                    "failed": t.failed,
                }
                for t in self.tasks
            ],
        }


@dataclass(frozen=True)
class TaskDiff:
    """One task's mean reward under models ``a`` and ``b`` and the change ``b - a``."""

    index: int
    task: Any
    a: float
    b: float

    @property
    def diff(self) -> float:
        return self.b - self.a


@dataclass(frozen=True)
class Comparison:
    """Model ``b`` against model ``a`` over the tasks both scored: the mean per-task change with a
    :data:`CI_METHOD` interval (paired: tasks are resampled), and each task's change."""

    a: str
    b: str
    mean_diff: float
    ci: Interval
    tasks: tuple[TaskDiff, ...] = field(repr=False)

    @property
    def changed(self) -> tuple[TaskDiff, ...]:
        """The tasks whose mean reward changed, largest change first."""
        moved = [t for t in self.tasks if abs(t.diff) > 1e-12]
        return tuple(sorted(moved, key=lambda t: -abs(t.diff)))

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "mean_diff": _num(self.mean_diff),
            "ci": [_num(v) for v in self.ci],
            "tasks_compared": len(self.tasks),
            "changed": [
                {"index": t.index, "task": t.task, "a": t.a, "b": t.b, "diff": t.diff} for t in self.changed
            ],
        }


@dataclass(frozen=True)
class EvalResult:
    """What :func:`evaluate_models` returns: the settings, one :class:`ModelResult` per model (in the
    order given) and, when asked, the :class:`Comparison` of two of them."""

    k: int
    pass_k: int
    pass_threshold: float
    ci_method: str
    models: tuple[ModelResult, ...]
    comparison: Comparison | None = None
    store: str | None = None

    def model(self, label: str) -> ModelResult:
        """The result of the model labelled ``label``."""
        for result in self.models:
            if result.label == label:
                return result
        raise KeyError(f"no model labelled {label!r}; labels: {', '.join(m.label for m in self.models)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "pass_k": self.pass_k,
            "pass_threshold": self.pass_threshold,
            "ci_method": self.ci_method,
            "store": self.store,
            "models": [m.to_json() for m in self.models],
            "comparison": None if self.comparison is None else self.comparison.to_json(),
        }


def _num(value: float) -> float | None:
    """JSON has no NaN: None stands for 'nothing scored'."""
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class Target:
    """One model to evaluate: a local folder fit serves, or an endpoint the agent calls directly."""

    label: str
    path: str | None = None
    llm: LLM | None = None


def parse_model(spec: str | Path | LLM) -> Target:
    """A model as given: ``"tiny"``/``"smollm2"`` (built in), a local Hugging Face folder (or a fit run's
    folder holding ``model/``), ``URL#NAME`` (an OpenAI-compatible endpoint and model name; the key from
    ``OPENAI_API_KEY``), or an ``agl.LLM``.

    Raises:
        ConfigError: none of these, naming the spec.
    """
    if isinstance(spec, LLM):
        return Target(f"{spec.model}@{spec.endpoint}", llm=spec)
    text = str(spec)
    if text.startswith(("http://", "https://")):
        endpoint, _, name = text.partition("#")
        if not name:
            raise ConfigError(
                f"model {text!r}: an endpoint needs its model name after '#', e.g. {endpoint}#gpt-4o-mini"
            )
        return Target(text, llm=LLM(endpoint=endpoint, model=name, api_key=os.environ.get("OPENAI_API_KEY")))
    if text in ("tiny", "smollm2"):
        from agl import models

        return Target(text, path=str(models.tiny_model() if text == "tiny" else models.smollm2()))
    folder = Path(text)
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file():
            return Target(text, path=str(candidate))
    raise ConfigError(
        f"model {text!r}: not a Hugging Face model folder (no config.json there or in {text}/model), "
        "not 'tiny'/'smollm2' and not an endpoint URL#MODEL_NAME"
    )


class _Evaluate(Algorithm):
    """What ``fit`` runs for one model: publish it, then :func:`evaluate` ``k`` samples of every task."""

    def __init__(self, target: Target, k: int, timeout_s: float | None, seed: int | None) -> None:
        self.target, self.k, self.timeout_s, self.seed = target, k, timeout_s, seed

    def model_spec(self) -> ModelSpec | None:
        return None if self.target.path is None else ModelSpec(path=self.target.path)

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Evaluation:
        # the label names the version in the store, so the dashboard compares "base" and "tuned", not v1, v2
        if self.target.llm is not None:
            resources_id = await ctx.publish({"llm": self.target.llm}, label=self.target.label)
        else:
            resources_id = (await ctx.publish_policy(label=self.target.label)).resources_id
        return await evaluate(
            ctx,
            train,
            resources_id,
            mode="val",
            timeout_s=self.timeout_s,
            sampling_seed=self.seed,
            group_size=self.k,
        )


def score_model(
    target: Target, tasks: Sequence[Any], evaluation: Evaluation, k: int, pass_k: int, threshold: float
) -> ModelResult:
    """The :class:`ModelResult` of ``evaluation`` (``k`` rollouts per task, in task order)."""
    scores = []
    for index, task in enumerate(tasks):
        group = evaluation.results[index * k : (index + 1) * k]
        rewards = tuple(final_reward(s) or 0.0 for r, s in group if r.status == RolloutStatus.SUCCEEDED)
        passed = sum(r >= threshold for r in rewards)
        scores.append(TaskScore(index, task, rewards, passed, len(group) - len(rewards)))
    scored = [t for t in scores if t.rewards]
    means = [t.mean for t in scored]
    # a task with fewer scored samples than pass_k is estimated from those it has
    passes = [pass_at_k(len(t.rewards), t.passed, min(pass_k, len(t.rewards))) for t in scored]
    all_rewards = [r for t in scored for r in t.rewards]
    model = target.path or (f"{target.llm.model}@{target.llm.endpoint}" if target.llm else target.label)
    return ModelResult(
        label=target.label,
        model=model,
        mean_reward=sum(all_rewards) / len(all_rewards) if all_rewards else math.nan,
        mean_at_k=sum(means) / len(means) if means else math.nan,
        mean_at_k_ci=bootstrap(means),
        pass_at_k=sum(passes) / len(passes) if passes else math.nan,
        pass_at_k_ci=bootstrap(passes),
        failures=evaluation.failures,
        tasks=tuple(scores),
    )


def compare_results(a: ModelResult, b: ModelResult) -> Comparison:
    """``b`` against ``a`` over the tasks both scored (see :class:`Comparison`)."""
    pairs = [
        TaskDiff(ta.index, ta.task, ta.mean, tb.mean)
        for ta, tb in zip(a.tasks, b.tasks, strict=True)
        if ta.rewards and tb.rewards
    ]
    diffs = [p.diff for p in pairs]
    mean = sum(diffs) / len(diffs) if diffs else math.nan
    return Comparison(a.label, b.label, mean, bootstrap(diffs), tuple(pairs))


def _check(k: int, pass_k: int | None, models: Sequence[Any], compare_with: tuple[str, str] | None) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k must be a whole number >= 1 (samples per task), got {k!r}")
    pass_k = k if pass_k is None else pass_k
    if isinstance(pass_k, bool) or not isinstance(pass_k, int) or not 1 <= pass_k <= k:
        raise ConfigError(f"pass_k must be a whole number from 1 to k={k}, got {pass_k!r}")
    if not models:
        raise ConfigError(
            "evaluate_models needs at least one model: 'tiny', a model folder, or URL#MODEL_NAME"
        )
    if compare_with is not None and len(compare_with) != 2:
        raise ConfigError(f"compare takes two model labels (A, B), got {compare_with!r}")
    return pass_k


def evaluate_models(
    agent: LitAgent,
    tasks: Sequence[Any],
    models: Sequence[str | Path | LLM] | Mapping[str, str | Path | LLM],
    *,
    k: int = 1,
    pass_k: int | None = None,
    pass_threshold: float = 1.0,
    compare: tuple[str, str] | None = None,
    store: str | None = None,
    output_dir: str | Path | None = None,
    serving: Serving | None = None,
    n_runners: int = 4,
    timeout_s: float | None = 600.0,
    sampling_seed: int | None = None,
) -> EvalResult:
    """Run ``agent`` ``k`` times on each task under each model and score them (see :class:`ModelResult`).

    Args:
        models: each ``"tiny"``/``"smollm2"``, a local model folder (or a fit run's folder with
            ``model/``), ``URL#MODEL_NAME`` (an OpenAI-compatible endpoint) or an ``agl.LLM``; a mapping
            gives them labels (else the spec as given is the label).
        pass_k: the k of pass@k (default ``k``); a reward at or above ``pass_threshold`` passes.
        compare: two labels (A, B): adds :class:`Comparison` of B against A.
        store: the store URL the rollouts go to (default: ``output_dir/store.db``, or a temporary one).
        output_dir: where each model's run folder (``runs/<n>``) and the default store go.
        serving: how local models are served (:class:`agl.Serving`; its sampling goes to endpoints too).
    """
    pass_k = _check(k, pass_k, list(models), compare)
    targets = _targets(models)
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise ConfigError(
            f"two models share a label: {labels}; pass a mapping {{label: model}} to tell them apart"
        )
    if compare is not None:
        for label in compare:
            if label not in labels:
                raise ConfigError(f"compare: no model labelled {label!r}; labels: {', '.join(labels)}")
    if not tasks:
        raise ConfigError("evaluate_models got no tasks")
    from agl.trainer.trainer import Trainer

    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="agl-eval-"))
    store_url = store or f"sqlite:///{(out / 'store.db').resolve()}"
    serving = serving or Serving()
    results = []
    for n, target in enumerate(targets):
        if target.llm is not None and serving.sampling and not target.llm.sampling_parameters:
            target = Target(
                target.label, llm=target.llm.model_copy(update={"sampling_parameters": serving.sampling})
            )
        trainer = Trainer(
            _Evaluate(target, k, timeout_s, sampling_seed),
            store=store_url,
            n_runners=n_runners,
            output_dir=str(out / "runs" / str(n)),
            serving=serving,
        )
        evaluation = trainer.fit(agent, list(tasks))
        results.append(score_model(target, tasks, evaluation, k, pass_k, pass_threshold))
    by_label = {r.label: r for r in results}
    comparison = None if compare is None else compare_results(by_label[compare[0]], by_label[compare[1]])
    return EvalResult(k, pass_k, pass_threshold, CI_METHOD, tuple(results), comparison, store_url)


def _targets(models: Sequence[str | Path | LLM] | Mapping[str, str | Path | LLM]) -> list[Target]:
    if isinstance(models, Mapping):
        parsed = {str(label): parse_model(spec) for label, spec in models.items()}
        return [Target(label, t.path, t.llm) for label, t in parsed.items()]
    if isinstance(models, (str, Path, LLM)):
        raise ConfigError("models must be a list of models (or a mapping label -> model), not one model")
    return [parse_model(spec) for spec in models]


__all__ = [
    "CI_METHOD",
    "Comparison",
    "EvalResult",
    "ModelResult",
    "TaskDiff",
    "TaskScore",
    "bootstrap",
    "compare_results",
    "evaluate_models",
    "pass_at_k",
    "parse_model",
    "score_model",
]
