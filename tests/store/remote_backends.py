"""Conformance backends reached over HTTP: a real uvicorn server in a thread, a real httpx client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agl.asgi_server import BackgroundServer
from agl.store import InMemoryLightningStore, SqliteLightningStore, StoreWithReadModel
from agl.store.client import LightningStoreClient
from agl.store.server import create_app


@contextlib.asynccontextmanager
async def serve(
    inner: StoreWithReadModel, token: str | None = None, close_inner: bool = True
) -> AsyncIterator[LightningStoreClient]:
    """``inner`` behind a server on a free port; yields a client whose ``inner_store`` is ``inner``."""
    with BackgroundServer(create_app(inner, token=token)) as server:
        client = LightningStoreClient(server.url, token=token, retries=2, backoff_s=0.05)
        client.inner_store = inner  # type: ignore[attr-defined]
        try:
            yield client
        finally:
            await client.aclose()
    if close_inner:
        await inner.aclose()


@contextlib.asynccontextmanager
async def _http_memory(tmp_path: Path, clock: Any) -> AsyncIterator[StoreWithReadModel]:
    async with serve(InMemoryLightningStore(clock=clock, watchdog_interval_s=0)) as client:
        yield client


@contextlib.asynccontextmanager
async def _http_sqlite(tmp_path: Path, clock: Any) -> AsyncIterator[StoreWithReadModel]:
    async with serve(
        SqliteLightningStore(tmp_path / "http.db", clock=clock, watchdog_interval_s=0)
    ) as client:
        yield client


REMOTE_BACKENDS = {"http-memory": _http_memory, "http-sqlite": _http_sqlite}


PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def postgres_reachable() -> str | None:
    """None when PostgreSQL answers at PG_DSN, else the reason it does not."""
    try:
        import psycopg

        psycopg.connect(PG_DSN, connect_timeout=3).close()
    except Exception as exc:
        return f"PostgreSQL at {PG_DSN} is not reachable ({exc}); .ci/run starts it"
    return None


@contextlib.asynccontextmanager
async def postgres_store(clock: Any = None, **options: Any) -> AsyncIterator[StoreWithReadModel]:
    """A PostgresLightningStore in a fresh schema (``options``: its other arguments), dropped afterwards."""
    import uuid

    import psycopg
    import pytest

    from agl.store.postgres import PostgresLightningStore

    reason = postgres_reachable()
    if reason:
        pytest.skip(reason)
    schema = f"agl_test_{uuid.uuid4().hex[:10]}"
    kwargs: dict[str, Any] = {"schema": schema, "watchdog_interval_s": 0, **options}
    if clock is not None:
        kwargs["clock"] = clock
    store = PostgresLightningStore(PG_DSN, **kwargs)
    try:
        yield store
    finally:
        await store.aclose()
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextlib.asynccontextmanager
async def _postgres(tmp_path: Path, clock: Any) -> AsyncIterator[StoreWithReadModel]:
    async with postgres_store(clock) as store:
        yield store


@contextlib.asynccontextmanager
async def _http_postgres(tmp_path: Path, clock: Any) -> AsyncIterator[StoreWithReadModel]:
    async with postgres_store(clock) as inner, serve(inner, close_inner=False) as client:
        yield client


REMOTE_BACKENDS.update({"postgres": _postgres, "http-postgres": _http_postgres})
