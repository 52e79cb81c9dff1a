"""Automatic prompt optimization: textual gradients (critique, then edit) with beam search over prompts.

Each round, for each prompt in the beam: run it on a training minibatch as real rollouts, show a critic
LLM the worst and best trajectories, ask an editor LLM for ``branch_factor`` improved prompts, score
every child on the validation set, and keep the best ``beam_width``. Every candidate is stored as a
resources version (metadata ``apo``: parent, round, critique); its score is its validation rollouts'
mean reward, so the history is queryable from the store (:func:`apo_history`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.algorithm.apo.trajectories import Trajectory, load_trajectories, render_trajectories
from agl.errors import ConfigError
from agl.schemas import LLM, PromptTemplate, Resource, RolloutCreate
from agl.store.base import LightningStore

log = logging.getLogger(__name__)

CRITIC_SYSTEM = (
    "You are a critic of prompts for an AI agent. You are shown the agent's current system prompt and "
    "trajectories where it did worst and best, with rewards and feedback. Name the systematic failures "
    "and what the prompt should say to prevent each."
)
EDITOR_SYSTEM = (
    "You improve system prompts for an AI agent. Rewrite the prompt to fix the issues in the critique. "
    "Keep every {placeholder} of the original. Return only the new prompt between <prompt> and </prompt>."
)


@dataclass(frozen=True)
class APOConfig:
    """Search shape, budget and the critic/editor endpoints (any OpenAI-compatible API).

    ``gate_on_minibatch``: a child is first run on its parent's minibatch and scored on the validation
    set only if it is not worse there, which saves most of the rollout budget on bad edits.
    ``perfect_score``: a parent whose whole minibatch reaches it has nothing to learn from this round.
    """

    critic: LLM
    editor: LLM
    beam_width: int = 2
    branch_factor: int = 2
    rounds: int = 3
    minibatch_size: int = 3
    val_size: int | None = None
    max_rollouts: int | None = None
    max_llm_calls: int | None = None
    prompt_name: str = "prompt"
    worst_k: int = 3
    best_k: int = 1
    gate_on_minibatch: bool = True
    perfect_score: float | None = 1.0
    llm_retries: int = 2
    rollout_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("beam_width", "branch_factor", "rounds", "minibatch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"APOConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_rollouts", "max_llm_calls", "val_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"APOConfig.{name} must be >= 1 or None (no limit), got {value}")


@dataclass
class Candidate:
    """One prompt in the search, stored as the resources version ``resources_id``."""

    resources_id: str
    template: str
    score: float | None = None
    parent_id: str | None = None
    round: int = 0
    critique: str | None = None


@dataclass
class APOResult:
    best: Candidate
    history: list[Candidate]
    rollouts_used: int
    llm_calls_used: int
    llm_calls_failed: int
    branches_skipped: int
    scores_by_round: list[float] = field(default_factory=list)


class BudgetExhausted(Exception):
    """Raised inside the search when the next step would exceed the rollout or LLM-call budget."""


class APO:
    """``await APO(config).run(store, train_tasks, val_tasks)`` returns the best prompt found.

    Runners must be serving the store's queue (the trainer starts them). The base resources are the
    store's latest version; its ``prompt_name`` entry must be a PromptTemplate (or pass ``initial_prompt``).
    """

    def __init__(self, config: APOConfig) -> None:
        self.config = config
        self.rollouts_used = 0
        self.llm_calls_used = 0
        self.llm_calls_failed = 0
        self.branches_skipped = 0
        self._rng = random.Random(config.seed)

    async def run(
        self,
        store: LightningStore,
        train_tasks: Sequence[Any],
        val_tasks: Sequence[Any],
        *,
        initial_prompt: str | None = None,
    ) -> APOResult:
        cfg = self.config
        base = await store.get_latest_resources()
        base_resources: dict[str, Resource] = dict(base.resources) if base else {}
        if initial_prompt is None:
            current = base_resources.get(cfg.prompt_name)
            if not isinstance(current, PromptTemplate):
                raise ConfigError(
                    f"APO needs a PromptTemplate named {cfg.prompt_name!r} in the latest resources, or initial_prompt"
                )
            initial_prompt = current.template
        val = list(val_tasks)[: cfg.val_size] if cfg.val_size else list(val_tasks)
        root = await self._store_candidate(store, base_resources, initial_prompt, None, 0, None)
        history = [root]
        scores_by_round: list[float] = []
        try:
            root.score = await self._score(store, root, val)
            beam = [root]
            scores_by_round.append(root.score)
            for round_no in range(1, cfg.rounds + 1):
                children = await self._expand(store, base_resources, beam, list(train_tasks), round_no)
                for child in children:
                    history.append(child)
                    child.score = await self._score(store, child, val)
                pool = beam + [c for c in children if c.score is not None]
                beam = sorted(pool, key=lambda c: (-(c.score or 0.0), c.round))[: cfg.beam_width]
                scores_by_round.append(beam[0].score or 0.0)
                log.info(
                    "APO round %d: best %.3f (%d children)", round_no, beam[0].score or 0.0, len(children)
                )
        except BudgetExhausted as exc:
            log.info("APO stopped early: %s", exc)
        scored = [c for c in history if c.score is not None]
        best = max(scored, key=lambda c: (c.score or 0.0, -c.round))
        return APOResult(
            best=best,
            history=history,
            rollouts_used=self.rollouts_used,
            llm_calls_used=self.llm_calls_used,
            llm_calls_failed=self.llm_calls_failed,
            branches_skipped=self.branches_skipped,
            scores_by_round=scores_by_round,
        )

    # ----- rollouts ------------------------------------------------------------------------
    async def _store_candidate(
        self,
        store: LightningStore,
        base: dict[str, Resource],
        template: str,
        parent: str | None,
        round_no: int,
        critique: str | None,
    ) -> Candidate:
        meta = {"apo": {"parent_id": parent, "round": round_no, "critique": critique}}
        version = await store.add_resources(
            {**base, self.config.prompt_name: PromptTemplate(template=template)}, metadata=meta
        )
        return Candidate(version.resources_id, template, None, parent, round_no, critique)

    async def _run_rollouts(
        self, store: LightningStore, candidate: Candidate, tasks: list[Any], mode: str
    ) -> list[str]:
        if (
            self.config.max_rollouts is not None
            and self.rollouts_used + len(tasks) > self.config.max_rollouts
        ):
            raise BudgetExhausted(
                f"rollout budget {self.config.max_rollouts} reached ({self.rollouts_used} used)"
            )
        self.rollouts_used += len(tasks)
        rollouts = await store.enqueue_rollouts(
            [
                RolloutCreate(
                    input=t,
                    mode=mode,
                    resources_id=candidate.resources_id,
                    metadata={"apo_candidate": candidate.resources_id},
                )
                for t in tasks
            ]
        )
        ids = [r.rollout_id for r in rollouts]
        done = await store.wait_for_rollouts(ids, timeout_s=self.config.rollout_timeout_s)
        if len(done) < len(ids):
            log.warning(
                "%d of %d rollouts did not finish in time; scoring them 0", len(ids) - len(done), len(ids)
            )
        return ids

    async def _score(self, store: LightningStore, candidate: Candidate, val: list[Any]) -> float:
        ids = await self._run_rollouts(store, candidate, val, "val")
        trajectories = await load_trajectories(store, ids)
        return sum(t.reward for t in trajectories) / max(len(trajectories), 1)

    # ----- critique and edit ---------------------------------------------------------------
    async def _expand(
        self,
        store: LightningStore,
        base: dict[str, Resource],
        beam: list[Candidate],
        train: list[Any],
        round_no: int,
    ) -> list[Candidate]:
        cfg = self.config
        children: list[Candidate] = []
        for parent in beam:
            batch = self._rng.sample(train, min(cfg.minibatch_size, len(train)))
            ids = await self._run_rollouts(store, parent, batch, "train")
            trajectories = sorted(await load_trajectories(store, ids), key=lambda t: t.reward)
            if cfg.perfect_score is not None and all(t.reward >= cfg.perfect_score for t in trajectories):
                continue  # no failure to critique on this minibatch
            critique = await self._critique(parent.template, trajectories)
            if critique is None:
                self.branches_skipped += cfg.branch_factor
                continue
            edits = await asyncio.gather(
                *(self._edit(parent.template, critique, round_no * 100 + b) for b in range(cfg.branch_factor))
            )
            seen = {c.template for c in children} | {parent.template}
            parent_minibatch = sum(t.reward for t in trajectories) / max(len(trajectories), 1)
            for template in edits:
                if template is None or template in seen:
                    self.branches_skipped += 1
                    continue
                seen.add(template)
                child = await self._store_candidate(
                    store, base, template, parent.resources_id, round_no, critique
                )
                if cfg.gate_on_minibatch:
                    ids = await self._run_rollouts(store, child, batch, "train")
                    child_trajectories = await load_trajectories(store, ids)
                    if sum(t.reward for t in child_trajectories) / max(len(ids), 1) < parent_minibatch:
                        self.branches_skipped += 1
                        continue
                children.append(child)
        return children

    async def _critique(self, template: str, trajectories: list[Trajectory]) -> str | None:
        cfg = self.config
        worst = trajectories[: cfg.worst_k]
        best = [t for t in trajectories[::-1][: cfg.best_k] if t not in worst]
        user = (
            f"Current prompt:\n<prompt>{template}</prompt>\n\n"
            f"Worst trajectories:\n{render_trajectories(worst)}\n\n"
            f"Best trajectories:\n{render_trajectories(best)}"
        )
        text = await self._chat(cfg.critic, CRITIC_SYSTEM, user, seed=0)
        if text is None or len(text.strip()) < 10:
            return None
        return text.strip()

    async def _edit(self, template: str, critique: str, seed: int) -> str | None:
        user = f"Prompt:\n<prompt>{template}</prompt>\n\nCritique:\n{critique}"
        for _ in range(self.config.llm_retries + 1):
            text = await self._chat(self.config.editor, EDITOR_SYSTEM, user, seed=seed)
            candidate = _extract_prompt(text or "", template)
            if candidate is not None:
                return candidate
        return None

    async def _chat(self, llm: LLM, system: str, user: str, *, seed: int) -> str | None:
        """One critic/editor call with retries; None when it keeps failing (the branch is skipped)."""
        import openai

        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "agl", max_retries=0)
        try:
            for attempt in range(self.config.llm_retries + 1):
                if self.config.max_llm_calls is not None and self.llm_calls_used >= self.config.max_llm_calls:
                    raise BudgetExhausted(f"LLM-call budget {self.config.max_llm_calls} reached")
                self.llm_calls_used += 1
                try:
                    response = await client.chat.completions.create(
                        model=llm.model,
                        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                        seed=seed,
                        **llm.sampling_parameters,
                    )
                    return response.choices[0].message.content or ""
                except openai.OpenAIError as exc:
                    self.llm_calls_failed += 1
                    log.warning("%s call failed (try %d): %s", llm.model, attempt + 1, exc)
                    await asyncio.sleep(0.05 * 2**attempt)
            return None
        finally:
            await client.close()


def _extract_prompt(text: str, original: str) -> str | None:
    """The prompt between <prompt> tags, if it is non-empty, sane in size and keeps the placeholders."""
    match = re.search(r"<prompt>(.*?)</prompt>", text, re.S)
    if match is None:
        return None
    prompt = match.group(1).strip()
    if not prompt or len(prompt) > 20 * max(len(original), 200):
        return None
    needed = set(PromptTemplate(template=original).placeholders)
    try:
        have = set(PromptTemplate(template=prompt).placeholders)
    except ValueError:
        return None
    return prompt if needed <= have else None


async def apo_history(store: LightningStore, prompt_name: str = "prompt") -> list[Candidate]:
    """Every APO candidate in the store, in creation order, scored by its validation rollouts' mean reward."""
    candidates: list[Candidate] = []
    cursor = None
    while True:
        page = await store.query_resources(cursor=cursor, limit=1000)
        for version in page.items:
            meta = version.metadata.get("apo")
            prompt = version.resources.get(prompt_name)
            if meta is not None and isinstance(prompt, PromptTemplate):
                candidates.append(
                    Candidate(
                        version.resources_id,
                        prompt.template,
                        None,
                        meta.get("parent_id"),
                        meta.get("round", 0),
                        meta.get("critique"),
                    )
                )
        cursor = page.next_cursor
        if cursor is None:
            break
    val_ids: dict[str, list[str]] = {}
    cursor = None
    while True:
        rollouts = await store.query_rollouts(mode="val", cursor=cursor, limit=1000)
        for r in rollouts.items:
            if r.resources_id is not None:
                val_ids.setdefault(r.resources_id, []).append(r.rollout_id)
        cursor = rollouts.next_cursor
        if cursor is None:
            break
    for candidate in candidates:
        ids = val_ids.get(candidate.resources_id)
        if ids:
            trajectories = await load_trajectories(store, ids)
            candidate.score = sum(t.reward for t in trajectories) / len(trajectories)
    return candidates
