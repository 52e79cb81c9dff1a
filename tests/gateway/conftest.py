"""Fixtures: a scripted upstream, an in-memory store with a running rollout, and a gateway between them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from agl.gateway import Gateway, GatewayConfig
from agl.schemas.rollout import RolloutCreate
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream


@pytest.fixture
def upstream() -> Iterator[OpenAIUpstream]:
    with OpenAIUpstream(token_ids=True, model_version="weights-v3") as up:
        yield up


@pytest.fixture
async def store() -> AsyncIterator[InMemoryLightningStore]:
    s = InMemoryLightningStore(watchdog_interval_s=0)
    yield s
    await s.aclose()


@pytest.fixture
async def rollout(store: InMemoryLightningStore) -> tuple[str, str]:
    resources = await store.add_resources({})
    started = await store.start_rollout(RolloutCreate(input="task", resources_id=resources.resources_id))
    return started.rollout.rollout_id, started.attempt.attempt_id


@pytest.fixture
def gateway(store: InMemoryLightningStore, upstream: OpenAIUpstream) -> Iterator[Gateway]:
    with Gateway(store, [upstream.base_url], GatewayConfig(health_interval_s=0.1, backoff_s=0.01)) as gw:
        yield gw
