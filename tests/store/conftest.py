"""The ``store`` fixture: every conformance test runs against every backend listed here.

A backend factory is an async context manager ``factory(tmp_path, clock)`` that yields a ready store.
Remote backends (HTTP client against a real server, PostgreSQL) join through ``remote_backends``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agl.store import InMemoryLightningStore, SqliteLightningStore, StoreWithReadModel
from tests.store.remote_backends import REMOTE_BACKENDS


class FakeClock:
    """A clock the test moves by hand, so timeouts are tested without sleeping."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.asynccontextmanager
async def _memory(tmp_path: Path, clock: FakeClock) -> AsyncIterator[StoreWithReadModel]:
    store = InMemoryLightningStore(clock=clock, watchdog_interval_s=0)
    yield store
    await store.aclose()


@contextlib.asynccontextmanager
async def _sqlite(tmp_path: Path, clock: FakeClock) -> AsyncIterator[StoreWithReadModel]:
    store = SqliteLightningStore(tmp_path / "store.db", clock=clock, watchdog_interval_s=0)
    yield store
    await store.aclose()


# a failed import of the remote backends is a collection error, never a silently smaller suite
BACKENDS: dict[str, Callable[[Path, FakeClock], Any]] = {
    "memory": _memory,
    "sqlite": _sqlite,
    **REMOTE_BACKENDS,
}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=sorted(BACKENDS))
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> AsyncIterator[StoreWithReadModel]:
    async with BACKENDS[request.param](tmp_path, clock) as s:
        yield s
