"""The LightningStore: task queue, versioned resources and spans.

:class:`LightningStore` is the lifecycle core that runners, the trainer and algorithms use; every backend
also serves the read model the dashboard reads (``agl.store.read_model``): :class:`StoreWithReadModel`.
Backends: :class:`InMemoryLightningStore` and :class:`SqliteLightningStore` (the embedded default);
remote and PostgreSQL backends live beside them. :func:`open_store` picks one by URL.
"""

from __future__ import annotations

from typing import Any

from agl.errors import ConfigError
from agl.store.base import LightningStore, Page
from agl.store.memory import InMemoryLightningStore
from agl.store.read_model import StoreReadModel, StoreStatistics, StoreWithReadModel
from agl.store.sqlite import SqliteLightningStore
from agl.store.sync import SyncLightningStore

DEFAULT_STORE_URL = "sqlite:///agl-store.db"


def open_store(url: str = DEFAULT_STORE_URL, **options: Any) -> StoreWithReadModel:
    """A store for ``url``: ``memory://``, ``sqlite:///path.db`` (relative), ``sqlite:////abs/path.db``,
    ``postgresql://user@host:port/db?schema=NAME`` or ``http://host:port`` (a remote store server;
    ``token=`` or ``AGL_STORE_TOKEN``).

    Raises:
        ConfigError: an unknown scheme.
    """
    if url.startswith("memory://"):
        return InMemoryLightningStore(**options)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        path = path[1:] if path.startswith("/") else path
        return SqliteLightningStore(path or "agl-store.db", **options)
    if url.startswith(("postgresql://", "postgres://")):
        from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

        from agl.store.postgres import PostgresLightningStore

        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        for own in ("schema", "connections"):  # agl's own options; libpq would reject them
            if own in query:
                options.setdefault(own, query.pop(own))
        dsn = urlunsplit(parts._replace(query=urlencode(query)))
        return PostgresLightningStore(dsn, **options)
    if url.startswith(("http://", "https://")):
        from agl.store.client import LightningStoreClient

        return LightningStoreClient(url, **options)
    raise ConfigError(
        f"unknown store URL {url!r}; use memory://, sqlite:///path.db, postgresql://... or http://..."
    )


__all__ = [
    "DEFAULT_STORE_URL",
    "InMemoryLightningStore",
    "LightningStore",
    "Page",
    "SqliteLightningStore",
    "StoreReadModel",
    "StoreStatistics",
    "StoreWithReadModel",
    "SyncLightningStore",
    "open_store",
]
