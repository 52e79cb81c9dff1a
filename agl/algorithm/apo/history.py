"""APO's search history, read back from the store: every candidate prompt with its parent and score."""

from __future__ import annotations

from agl.algorithm.apo.search import Candidate
from agl.algorithm.apo.trajectories import load_trajectories
from agl.schemas import PromptTemplate
from agl.store.base import LightningStore


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
            candidate.val_evaluated = len(ids)
    return candidates
