"""Conformance backends reached over HTTP: a real uvicorn server in a thread, a real httpx client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agl.serving import BackgroundServer
from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore
from agl.store.client import LightningStoreClient
from agl.store.server import create_app


@contextlib.asynccontextmanager
async def serve(inner: LightningStore, token: str | None = None) -> AsyncIterator[LightningStoreClient]:
    """``inner`` behind a server on a free port; yields a client whose ``inner_store`` is ``inner``."""
    with BackgroundServer(create_app(inner, token=token)) as server:
        client = LightningStoreClient(server.url, token=token, retries=2, backoff_s=0.05)
        client.inner_store = inner  # type: ignore[attr-defined]
        try:
            yield client
        finally:
            await client.aclose()
    await inner.aclose()


@contextlib.asynccontextmanager
async def _http_memory(tmp_path: Path, clock: Any) -> AsyncIterator[LightningStore]:
    async with serve(InMemoryLightningStore(clock=clock, watchdog_interval_s=0)) as client:
        yield client


@contextlib.asynccontextmanager
async def _http_sqlite(tmp_path: Path, clock: Any) -> AsyncIterator[LightningStore]:
    async with serve(
        SqliteLightningStore(tmp_path / "http.db", clock=clock, watchdog_interval_s=0)
    ) as client:
        yield client


REMOTE_BACKENDS = {"http-memory": _http_memory, "http-sqlite": _http_sqlite}
