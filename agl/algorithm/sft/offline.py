"""Offline SFT: train on finished rollouts already in a store, generating none.

An agent that runs in production already leaves its traces in a store: every model call the gateway
served carries the engine's prompt and completion token ids. ``SFTConfig(from_store=URL)`` picks the
succeeded rollouts by reward (``min_reward``, ``top_k_per_task``), agent and finish time, and trains on
those exact ids with the loss on the model's own tokens only, as the online SFT does.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.adapter import Sample, final_reward
from agl.algorithm.base import TrainingContext, rollout_spans
from agl.algorithm.export import BEST_DIR, BestExport, export_outputs
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    export_jsonl,
    samples_from_spans,
    select_rollouts,
)
from agl.errors import ConfigError
from agl.schemas import ModelWeights, Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

if TYPE_CHECKING:
    from agl.algorithm.sft.algorithm import SFT, SFTConfig

TimeBound = float | int | str | datetime | None
PAGE = 500  # rollouts per store query


def parse_time(value: TimeBound, name: str) -> float | None:
    """A time bound as Unix seconds: a number, a ``datetime`` (naive = local time) or an ISO 8601 string."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be Unix seconds, a datetime or an ISO 8601 string, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite time, got {value!r}")
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            raise ConfigError(
                f"{name}={value!r} is no time: use Unix seconds or ISO 8601 (e.g. 2026-12-01T09:00:00+00:00)"
            ) from None
    raise ConfigError(
        f"{name} must be Unix seconds, a datetime or an ISO 8601 string, got {type(value).__name__}"
    )


@dataclass
class Selection:
    """What :func:`samples_from_store` found: the samples and how many rollouts each filter let through."""

    samples: list[Sample] = field(default_factory=list)
    conversations: list[list[dict[str, Any]]] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)

    def explain(self, source: str) -> str:
        """Why nothing was selected, filter by filter."""
        c = self.counts
        return (
            f"no training data in {source}: {c.get('succeeded', 0):.0f} succeeded rollouts, "
            f"{c.get('in_time_range', 0):.0f} in the since/until range, "
            f"{c.get('kept_rollouts', 0):.0f} kept by min_reward/top_k_per_task, "
            f"{c.get('with_agent_calls', 0):.0f} with model calls of the chosen agent carrying token ids; "
            "loosen SFTConfig(min_reward=..., agent=..., since=..., until=...)"
        )


def _finished_at(rollout: Rollout) -> float:
    return rollout.ended_at if rollout.ended_at is not None else rollout.updated_at


async def _succeeded(store: LightningStore) -> list[Rollout]:
    out: list[Rollout] = []
    cursor = None
    while True:
        page = await store.query_rollouts(status=[RolloutStatus.SUCCEEDED], limit=PAGE, cursor=cursor)
        out += page.items
        cursor = page.next_cursor
        if cursor is None:
            return out


async def _reward_spans(store: LightningStore, rollout_id: str) -> list[Span]:
    spans: list[Span] = []
    cursor = None
    while True:
        page = await store.query_spans(
            rollout_id=rollout_id, attempt_id="latest", name=sc.SPAN_REWARD, cursor=cursor
        )
        spans += page.items
        cursor = page.next_cursor
        if cursor is None:
            return spans


async def samples_from_store(
    store: LightningStore,
    *,
    min_reward: float | None = None,
    top_k_per_task: int | None = None,
    agent: str | None = None,
    since: TimeBound = None,
    until: TimeBound = None,
) -> Selection:
    """Masked samples from the store's succeeded rollouts that pass every filter.

    Rollouts are chosen by finish time (``since <= ended_at <= until``), then by final reward
    (``min_reward``, ``top_k_per_task`` best per group or input, as :func:`select_rollouts`); only the
    chosen ones' spans are read in full. With ``agent``, only that agent's calls become samples and a
    rollout without any is dropped. Calls recorded without token ids are skipped and counted.
    """
    lo, hi = parse_time(since, "since"), parse_time(until, "until")
    rollouts = await _succeeded(store)
    in_range = [
        r for r in rollouts if (lo is None or _finished_at(r) >= lo) and (hi is None or _finished_at(r) <= hi)
    ]
    rewards = {r.rollout_id: await _reward_spans(store, r.rollout_id) for r in in_range}
    kept = select_rollouts(in_range, rewards, min_reward=min_reward, top_k_per_task=top_k_per_task)
    spans = {r.rollout_id: await rollout_spans(store, r.rollout_id) for r in kept}
    selection = Selection()
    used: list[Rollout] = []
    for rollout in kept:
        made = samples_from_spans([rollout], spans, agent=agent)
        if made:
            used.append(rollout)
            selection.samples += made
    selection.conversations = conversations_from_spans(used, spans)
    selection.counts = {
        "succeeded": float(len(rollouts)),
        "in_time_range": float(len(in_range)),
        "kept_rollouts": float(len(kept)),
        "with_agent_calls": float(len(used)),
        "samples": float(len(selection.samples)),
        "model_tokens": float(sum(s.num_model_tokens for s in selection.samples)),
        "reward_mean": sum(final_reward(rewards[r.rollout_id]) or 0.0 for r in used) / max(len(used), 1),
    }
    return selection


async def _load(config: SFTConfig) -> Selection:
    source = config.from_store
    store, owned = (_open(source), True) if isinstance(source, str) else (source, False)
    if not isinstance(store, LightningStore):
        raise ConfigError(f"from_store must be a store URL or a LightningStore, got {type(source).__name__}")
    try:
        return await samples_from_store(
            store,
            min_reward=config.min_reward,
            top_k_per_task=config.top_k_per_task,
            agent=config.agent,
            since=config.since,
            until=config.until,
        )
    finally:
        if owned:
            await store.aclose()


def _open(url: str) -> LightningStore:
    from agl.store import open_store

    if url.startswith("sqlite://"):  # a missing file would be created empty: say so instead
        path = url.removeprefix("sqlite://")
        path = path[1:] if path.startswith("/") else path
        if not Path(path).is_file():
            raise ConfigError(f"from_store={url!r}: no SQLite file at {path}")
    return open_store(url)


async def run_offline(sft: SFT, ctx: TrainingContext, val: Sequence[Any]) -> dict[str, Any]:
    """Train ``sft.config.epochs`` epochs on the store's selected rollouts; validate when an engine serves.

    Under ``Trainer.fit`` the new weights go to the engine and ``val`` is scored before and after
    (those are the only rollouts run). Without an engine (``ctx.sync_weights`` None) it only trains
    and exports.
    """
    from agl.algorithm.grpo.loss import LossConfig
    from agl.algorithm.grpo.policy import Policy
    from agl.metrics import MetricsLogger

    cfg = sft.config
    selection = await _load(cfg)
    if not selection.samples:
        raise ConfigError(selection.explain(str(cfg.from_store)))
    out = Path(ctx.output_dir)
    if cfg.export_jsonl:
        export_jsonl(selection.conversations, out / "sft-from-store.jsonl")
    sft.policy = await asyncio.to_thread(Policy, sft.policy_config(), LossConfig())
    serving = ctx.llm is not None and ctx.sync_weights is not None
    best = BestExport(
        out / BEST_DIR, enabled=cfg.export_model and bool(val) and serving, base_path=cfg.model_path
    )
    metrics = MetricsLogger(
        out,
        total_steps=cfg.epochs,
        progress=cfg.progress,
        console=cfg.progress,
        shown=("epoch", "sft_loss", "val_reward", "samples"),
        label="epoch",
        step_name="step",
        progress_key="epoch",
        plot_y=("sft_loss", "val_reward"),
        title="SFT from a store",
        tensorboard=False,
    )
    before = after = float("nan")
    async with sft.ranks():  # world_size > 1: every step on every rank (FSDP2 shards)
        try:
            if serving and val:
                before = after = await _validate(sft, ctx, val, "v0")
                metrics.log(0, {"epoch": 0, "val_reward": before, **selection.counts})
                await asyncio.to_thread(best.offer, sft.policy, before, epoch=0)
            await _train(sft, selection.samples, metrics)
            if serving:
                assert ctx.sync_weights is not None
                version = await ctx.sync_weights(await asyncio.to_thread(sft.policy.engine_weights))
                if val:
                    after = await _validate(sft, ctx, val, version)
                    sft.history[-1]["val_reward"] = after
                    metrics.log(len(sft.history), {"epoch": cfg.epochs, "val_reward": after})
                    await asyncio.to_thread(best.offer, sft.policy, after, epoch=cfg.epochs)
        finally:
            metrics.close()
    exported = await asyncio.to_thread(
        export_outputs,
        sft.policy,
        out,
        enabled=cfg.export_model,
        adapter=cfg.export_adapter,
        base_path=cfg.model_path,
        best=best,
        info={"algorithm": "SFT", "from_store": str(cfg.from_store), "epochs": cfg.epochs},
    )
    return {
        "val_reward_before": before,
        "val_reward_after": after,
        "warm_start_samples": 0,
        "history": sft.history,
        "selected": selection.counts,
        **exported,
    }


async def _validate(sft: SFT, ctx: TrainingContext, val: Sequence[Any], version: str) -> float:
    assert ctx.llm is not None
    weights = ModelWeights(uri=sft.config.model_path, version=version)
    resources_id = await ctx.publish({"llm": ctx.llm, "weights": weights}, model_version=version)
    return await sft.evaluate(ctx, val, resources_id)


async def _train(sft: SFT, samples: list[Sample], metrics: Any) -> None:
    """``epochs`` passes over ``samples`` in shuffled batches; a history row (mean loss) per epoch."""
    cfg = sft.config
    rng = random.Random(cfg.seed)
    batches = math.ceil(len(samples) / cfg.batch_size)
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        order = list(samples)
        rng.shuffle(order)
        losses = []
        for b in range(batches):
            stats = await asyncio.to_thread(
                sft.policy.sft_step, order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            )
            losses.append(stats["sft_loss"])
            step += 1
            metrics.log(step, {"epoch": epoch - 1 + (b + 1) / batches, "sft_loss": stats["sft_loss"]})
        sft.history.append(
            {
                "epoch": float(epoch),
                "sft_loss": sum(losses) / len(losses),
                "samples": float(len(samples)),
                "model_tokens": float(sum(s.num_model_tokens for s in samples)),
            }
        )


def train_from_store(config: SFTConfig, output_dir: str | Path = "results") -> dict[str, Any]:
    """Offline SFT without an engine or agent (``config.from_store`` must be set): train, export, return.

    What a command line needs: ``train_from_store(SFTConfig(model_path=..., from_store=URL), OUT)``.
    """
    from agl.algorithm.sft.algorithm import SFT
    from agl.store.memory import InMemoryLightningStore

    if config.from_store is None:
        raise ConfigError("train_from_store needs SFTConfig(from_store=URL)")

    async def main() -> dict[str, Any]:
        store = InMemoryLightningStore()  # the context needs one; offline training never uses it
        try:
            return await SFT(config).run(TrainingContext(store=store, output_dir=str(output_dir)), [], [])
        finally:
            await store.aclose()

    return asyncio.run(main())
