"""Offline SFT: train on finished rollouts already in a store, generating none.

An agent that runs in production already leaves its traces in a store: every model call the gateway
served carries the engine's prompt and completion token ids. ``SFTConfig(from_store=URL)`` picks the
succeeded rollouts by reward (``min_reward``, ``top_k_per_task``), agent and finish time, and trains on
those exact ids with the loss on the model's own tokens only, as the online SFT does. This module
selects; :class:`~agl.algorithm.sft.algorithm.SFT` trains on the selection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.adapter import Sample, final_reward
from agl.algorithm.base import rollout_spans
from agl.algorithm.sft.config import TimeBound, parse_time
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    samples_from_spans,
    select_rollouts,
    tools_from_spans,
)
from agl.errors import ConfigError
from agl.schemas import Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

if TYPE_CHECKING:
    from agl.algorithm.sft.config import SFTConfig

PAGE = 500  # rollouts per store query


@dataclass
class Selection:
    """What :func:`samples_from_store` found: the samples and how many rollouts each filter let through."""

    samples: list[Sample] = field(default_factory=list)
    conversations: list[list[dict[str, Any]]] = field(default_factory=list)
    tools: list[list[dict[str, Any]] | None] = field(
        default_factory=list
    )  # each conversation's declared tools
    counts: dict[str, float] = field(default_factory=dict)

    def explain(self, source: str) -> str:
        """Why nothing was selected, filter by filter."""
        c = self.counts
        return (
            f"no training data in {source}: {c.get('succeeded', 0):.0f} succeeded rollouts (of the "
            "modes from_modes names, if any), "
            f"{c.get('in_time_range', 0):.0f} in the since/until range, "
            f"{c.get('kept_rollouts', 0):.0f} kept by min_reward/top_k_per_task, "
            f"{c.get('with_agent_calls', 0):.0f} with model calls of the chosen agent carrying token ids; "
            "loosen SFTConfig(min_reward=..., agent=..., since=..., until=..., from_modes=...)"
        )


def _finished_at(rollout: Rollout) -> float:
    return rollout.ended_at if rollout.ended_at is not None else rollout.updated_at


async def _succeeded(store: LightningStore, modes: Sequence[str] | None = None) -> list[Rollout]:
    """The succeeded rollouts of ``modes`` (None: of every mode but a teacher's)."""
    out: list[Rollout] = []
    for mode in modes if modes is not None else [None]:
        cursor = None
        while True:
            page = await store.query_rollouts(
                status=[RolloutStatus.SUCCEEDED], mode=mode, limit=PAGE, cursor=cursor
            )
            # a teacher's rollouts carry another model's token ids: never the student's own samples
            out += [r for r in page.items if modes is not None or not r.mode.startswith("teacher")]
            cursor = page.next_cursor
            if cursor is None:
                break
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
    modes: Sequence[str] | None = None,
) -> Selection:
    """Masked samples from the store's succeeded rollouts that pass every filter.

    Rollouts are chosen by finish time (``since <= ended_at <= until``), then by final reward
    (``min_reward``, ``top_k_per_task`` best per group or input, as :func:`select_rollouts`); only the
    chosen ones' spans are read in full. With ``agent``, only that agent's calls become samples and a
    rollout without any is dropped. Calls recorded without token ids are skipped and counted. With
    ``modes`` only rollouts of those modes are read (``("online",)``: recorded production traffic).
    """
    lo, hi = parse_time(since, "since"), parse_time(until, "until")
    rollouts = await _succeeded(store, modes)
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
    selection.tools = tools_from_spans(used, spans)
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


async def load_selection(config: SFTConfig) -> Selection:
    """:func:`samples_from_store` over ``config.from_store`` (a URL is opened, and closed after)."""
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
            modes=config.from_modes,
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
