"""The algorithm seam: ``Algorithm.run(ctx, train, val)`` with a ``TrainingContext`` to reach the loop.

An algorithm reaches runners only through the store, and only through the context's two doors:
:meth:`TrainingContext.rollouts` (enqueue, wait, flush the gateway, read spans) and
:meth:`TrainingContext.publish_policy` (new weights to the engines, published as a resources version).
:func:`evaluate` scores a validation set the same way for every algorithm.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agl.adapter import final_reward
from agl.algorithm.health import Failures, rollout_failures
from agl.algorithm.spec import ModelSpec
from agl.errors import ConfigError
from agl.schemas import LLM, ModelWeights, Resource, Rollout, RolloutCreate, RolloutStatus, Span, new_id
from agl.seeding import ROLLOUT_SEED, derive_seed
from agl.store.base import LightningStore

if TYPE_CHECKING:
    from agl.engines.launch import ServedEngines, WeightSource
    from agl.gateway import Gateway


async def _no_flush() -> None:
    return None


@dataclass(frozen=True)
class PublishedPolicy:
    """What :meth:`TrainingContext.publish_policy` published: the engines' weights version and the
    resources version (``llm`` + ``weights``) that rollouts should run with."""

    version: str
    resources_id: str


class PendingRollouts:
    """Rollouts :meth:`TrainingContext.start_rollouts` enqueued: wait for them, collect them with their
    spans, or cancel the unfinished ones."""

    def __init__(self, ctx: TrainingContext, ids: list[str]) -> None:
        self.ctx, self.ids = ctx, ids

    async def wait(self, timeout_s: float | None) -> list[Rollout]:
        """The rollouts that finished within ``timeout_s`` (all of them when as many come back)."""
        return await self.ctx.store.wait_for_rollouts(self.ids, timeout_s=timeout_s)

    async def collect(self, timeout_s: float | None = 600.0) -> list[tuple[Rollout, list[Span]]]:
        """Wait (up to ``timeout_s``), flush the gateway's span writes, and return each rollout, in
        enqueue order, with its latest attempt's spans. Rollouts still unfinished come back in their
        current (non-succeeded) state, so callers drop them rather than train on them."""
        store = self.ctx.store
        done = {r.rollout_id: r for r in await self.wait(timeout_s)}
        await self.ctx.flush()
        out = []
        for rollout_id in self.ids:
            rollout = done.get(rollout_id) or await store.get_rollout(rollout_id)
            out.append((rollout, await rollout_spans(store, rollout_id)))
        return out

    async def cancel(self) -> int:
        """Cancel, in the store, those not finished yet; returns how many were."""
        cancelled = 0
        for rollout_id in self.ids:
            rollout = await self.ctx.store.get_rollout(rollout_id)
            if not rollout.status.is_terminal:
                await self.ctx.store.cancel_rollout(rollout_id)
                cancelled += 1
        return cancelled


@dataclass
class TrainingContext:
    """What the trainer hands an algorithm.

    Args:
        store: the LightningStore the runners serve.
        llm: the LLM resource agents should call (the gateway's rollout-scoped endpoint).
        flush: makes every recorded model call visible in the store (the gateway batches its writes).
        output_dir: where checkpoints, metrics and plots go.
        model_path: the served model's folder (the ``uri`` of the published ``weights``).
        engines: the engine replicas serving ``model_path``; None when the trainer serves no local
            engine (APO against a hosted model).
        gateway: the gateway in front of ``engines`` (paused around weight updates that need it).
        model_version: the weights version the engines serve now; ``publish_policy`` advances it.
        tools: the tool schemas the agent declares, for rendering conversations as the agent sees them
            (SFT's warm start).
        teacher_llm: the LLM resource that reaches the teacher (``ModelSpec.teacher``) through the same
            gateway; None when the algorithm declares none.
        release_teacher: stops the engine fit serves a local teacher on, freeing its weights and cache for
            training once its traces are in (a no-op for an endpoint teacher, or none).
    """

    store: LightningStore
    llm: LLM | None = None
    flush: Callable[[], Awaitable[None]] = _no_flush
    output_dir: str = "results"
    model_path: str | None = None
    engines: ServedEngines | None = None
    gateway: Gateway | None = None
    model_version: str = "v0"
    tools: list[dict[str, Any]] | None = None
    teacher_llm: LLM | None = None
    release_teacher: Callable[[], Awaitable[None]] = _no_flush

    async def publish(self, resources: dict[str, Resource], **metadata: Any) -> str:
        """Store a new resources version (rollouts enqueued with its id run with it); returns the id."""
        published = await self.store.add_resources(resources, metadata=metadata or None)
        return published.resources_id

    async def publish_policy(self, policy: WeightSource | None = None, **metadata: Any) -> PublishedPolicy:
        """Push ``policy``'s weights to every engine (None: the weights they serve now) and publish them,
        with ``llm``, as a new resources version (metadata ``model_version`` plus ``metadata``).

        Raises:
            ConfigError: the trainer serves no engine (no ``llm`` or ``engines`` on this context).
        """
        if self.llm is None or self.engines is None:
            raise ConfigError(
                "publishing a policy needs a served model: run the algorithm through Trainer.fit, which "
                "serves the model its model_spec() declares behind the gateway"
            )
        if policy is not None:
            self.model_version = await self.engines.sync(policy, self.gateway)
        weights = ModelWeights(uri=self.model_path or "", version=self.model_version)
        resources_id = await self.publish(
            {"llm": self.llm, "weights": weights}, model_version=self.model_version, **metadata
        )
        return PublishedPolicy(self.model_version, resources_id)

    async def start_rollouts(
        self,
        tasks: Sequence[Any],
        *,
        mode: str = "train",
        group_size: int = 1,
        resources_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling_seed: int | None = None,
    ) -> PendingRollouts:
        """Enqueue ``group_size`` rollouts per task (one ``group_id`` per task) and return at once;
        :meth:`rollouts` is this plus :meth:`PendingRollouts.collect`. ``sampling_seed``: each rollout's
        model calls sample from seeds derived from it and the rollout's (task, sample) index."""
        requests = []
        for t, task in enumerate(tasks):
            group = new_id("gr")
            requests += [
                RolloutCreate(
                    input=task,
                    mode=mode,
                    resources_id=resources_id,
                    group_id=group,
                    metadata=_with_seed(metadata, sampling_seed, t, n),
                )
                for n in range(group_size)
            ]
        ids = [r.rollout_id for r in await self.store.enqueue_rollouts(requests)]
        return PendingRollouts(self, ids)

    async def rollouts(
        self,
        tasks: Sequence[Any],
        *,
        mode: str = "train",
        group_size: int = 1,
        resources_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        timeout_s: float | None = 600.0,
        sampling_seed: int | None = None,
    ) -> list[tuple[Rollout, list[Span]]]:
        """Run ``group_size`` rollouts per task (one ``group_id`` per task), wait for all, return them with spans.

        Waiting goes through ``store.wait_for_rollouts``; rollouts still unfinished at ``timeout_s`` come
        back in their current (non-succeeded) state, so callers drop them rather than train on them.
        """
        pending = await self.start_rollouts(
            tasks,
            mode=mode,
            group_size=group_size,
            resources_id=resources_id,
            metadata=metadata,
            sampling_seed=sampling_seed,
        )
        return await pending.collect(timeout_s)


@dataclass(frozen=True)
class Evaluation:
    """``group_size`` rollouts per task: the mean final reward over the rollouts that yielded one (NaN
    when none did), the failures apart from it (counted per class), and the rollouts with their spans
    (in task order, each task's rollouts together)."""

    score: float
    failures: Failures
    results: list[tuple[Rollout, list[Span]]]

    def summary(self) -> str:
        """``0.420 over 9 of 10 rollouts; failed: infra 1`` (the score, then the failures apart)."""
        scored = self.failures.total - self.failures.failed
        text = f"{self.score:.3f} over {scored} of {self.failures.total} rollouts"
        if self.failures.failed:
            text += "; failed: " + ", ".join(f"{c} {n}" for c, n in self.failures.by_class.items())
        return text


async def evaluate(
    ctx: TrainingContext,
    tasks: Sequence[Any],
    resources_id: str | None,
    *,
    mode: str = "val",
    timeout_s: float | None = 600.0,
    sampling_seed: int | None = None,
    group_size: int = 1,
) -> Evaluation:
    """Score ``tasks`` under ``resources_id`` (``group_size`` ``mode`` rollouts each; NaN without tasks):
    the one evaluation every algorithm, and ``agl.evaluate_models``, uses. Failed rollouts are counted by
    class, not scored. ``sampling_seed`` seeds the rollouts' sampling (see ``start_rollouts``)."""
    if not tasks:
        return Evaluation(float("nan"), Failures(0, 0), [])
    done = await ctx.rollouts(
        tasks,
        mode=mode,
        group_size=group_size,
        resources_id=resources_id,
        timeout_s=timeout_s,
        sampling_seed=sampling_seed,
    )
    return Evaluation(
        rewarded_score(done),
        await rollout_failures(ctx.store, [r for r, _ in done], dict(_by_id(done))),
        done,
    )


def rewarded_score(done: Sequence[tuple[Rollout, list[Span]]]) -> float:
    """Mean final reward over the rollouts that succeeded (one without a reward span scores 0); NaN
    when none did. Failed rollouts are left out: :class:`Failures` counts them."""
    rewards = [final_reward(spans) or 0.0 for r, spans in done if succeeded(r)]
    return sum(rewards) / len(rewards) if rewards else float("nan")


def _with_seed(metadata: dict[str, Any] | None, seed: int | None, task: int, sample: int) -> dict[str, Any]:
    """A rollout's metadata: ``metadata`` plus, when seeded, the seed of its (task, sample) position."""
    out = dict(metadata or {})
    if seed is not None:
        out[ROLLOUT_SEED] = derive_seed(seed, task, sample)
    return out


def score_of(done: Sequence[tuple[Rollout, list[Span]]]) -> float:
    """Mean final reward; a rollout that did not succeed scores 0 (APO's search objective)."""
    rewards = [(final_reward(spans) or 0.0) if succeeded(r) else 0.0 for r, spans in done]
    return sum(rewards) / len(rewards) if rewards else float("nan")


def _by_id(done: Sequence[tuple[Rollout, list[Span]]]) -> Iterator[tuple[str, list[Span]]]:
    return ((r.rollout_id, spans) for r, spans in done)


async def validate(
    ctx: TrainingContext, val: Sequence[Any], resources_id: str, *, timeout_s: float = 600.0
) -> tuple[float, Failures]:
    """Mean final reward of one ``mode="val"`` rollout per task over those that yielded one, and the failures."""
    result = await evaluate(ctx, val, resources_id, timeout_s=timeout_s)
    return result.score, result.failures


async def rollout_spans(store: LightningStore, rollout_id: str) -> list[Span]:
    """Every span of the rollout's latest attempt, across pages."""
    spans: list[Span] = []
    cursor = None
    while True:
        page = await store.query_spans(rollout_id=rollout_id, attempt_id="latest", cursor=cursor)
        spans += page.items
        cursor = page.next_cursor
        if cursor is None:
            return spans


def succeeded(rollout: Rollout) -> bool:
    return rollout.status == RolloutStatus.SUCCEEDED


#: the function form of an algorithm: ``async def fn(ctx, train, val)`` (``Trainer`` takes it as is)
AlgorithmFn = Callable[[TrainingContext, Sequence[Any], Sequence[Any]], Awaitable[Any]]


class Algorithm:
    """Subclass and implement :meth:`run`; ``Trainer.fit`` calls it once with the wired context.

    An algorithm that trains a local model declares it in :meth:`model_spec`; fit serves that model
    (engines and gateway) before calling :meth:`run`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "model_path" in cls.__dict__ and cls.model_spec is Algorithm.model_spec:
            # fit reads only model_spec(): a model_path of its own would leave the model unserved, silently
            raise TypeError(
                f"{cls.__name__} defines model_path, which Trainer.fit does not read: declare the model with "
                "def model_spec(self) -> agl.ModelSpec | None: return agl.ModelSpec(path=...)"
            )

    def model_spec(self) -> ModelSpec | None:
        """The local model this algorithm trains, which ``Trainer.fit`` serves; None (the default): none
        (e.g. APO against a hosted model)."""
        return None

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx, train, val)")


class FunctionAlgorithm(Algorithm):
    def __init__(self, fn: AlgorithmFn) -> None:
        self.fn = fn

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        return await self.fn(ctx, train, val)


def as_algorithm(fn: AlgorithmFn) -> Algorithm:
    """Make an ``async def fn(ctx, train, val)`` an Algorithm (the function form)."""
    return FunctionAlgorithm(fn)
