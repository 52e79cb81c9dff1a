"""The LightningStore: task queue, versioned resources and spans.

Backends: :class:`InMemoryLightningStore` and :class:`SqliteLightningStore` (the embedded default);
remote and PostgreSQL backends live beside them. Use :func:`open_store` to pick one by URL.
"""

from agl.store.base import LightningStore, Page, StoreStatistics
from agl.store.memory import InMemoryLightningStore
from agl.store.sync import SyncLightningStore

__all__ = ["InMemoryLightningStore", "LightningStore", "Page", "StoreStatistics", "SyncLightningStore"]
