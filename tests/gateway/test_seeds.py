"""A seeded rollout's model calls reach the upstream with their own sampling seeds: the attempt's seed and
the call's index, so a rerun of the rollout samples every call the same way."""

from __future__ import annotations

import openai

from agl.gateway import Gateway
from agl.schemas.rollout import RolloutCreate
from agl.seeding import ROLLOUT_SEED, derive_seed
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream


async def _start(store: InMemoryLightningStore, metadata: dict[str, int]) -> tuple[str, str, int]:
    started = await store.start_rollout(RolloutCreate(input="task", metadata=metadata))
    return started.rollout.rollout_id, started.attempt.attempt_id, started.attempt.attempt_number


async def test_seeded_rollout_calls_get_one_seed_each_and_an_agent_seed_wins(
    gateway: Gateway, store: InMemoryLightningStore, upstream: OpenAIUpstream
) -> None:
    rid, aid, number = await _start(store, {ROLLOUT_SEED: 5})
    client = openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rid, aid), api_key="k", max_retries=0)
    latest = openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rid), api_key="k", max_retries=0)
    user = [{"role": "user", "content": "hi"}]
    await client.chat.completions.create(model="m", messages=user)  # type: ignore[arg-type]
    await latest.chat.completions.create(model="m", messages=user)  # type: ignore[arg-type]
    await client.completions.create(model="m", prompt="hi")
    await client.chat.completions.create(model="m", messages=user, seed=42)  # type: ignore[arg-type]
    await client.close()
    await latest.close()
    seeds = [r.body.get("seed") for r in upstream.requests[-4:]]
    base = derive_seed(5, number)
    assert seeds == [derive_seed(base, 0), derive_seed(base, 1), derive_seed(base, 2), 42]


async def test_unseeded_rollouts_and_other_seeds_sample_differently(
    gateway: Gateway, store: InMemoryLightningStore, upstream: OpenAIUpstream
) -> None:
    plain = await _start(store, {})
    other = await _start(store, {ROLLOUT_SEED: 6})
    for rid, aid, _ in (plain, other):
        client = openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rid, aid), api_key="k", max_retries=0)
        await client.completions.create(model="m", prompt="hi")
        await client.close()
    assert "seed" not in upstream.requests[-2].body
    assert upstream.requests[-1].body["seed"] == derive_seed(derive_seed(6, other[2]), 0)
