"""A blocking facade over any async LightningStore, for scripts and notebooks.

It owns one event loop on a background thread and runs every call there, so the async store keeps
a single home loop and no logic is written twice.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from agl.store.base import LightningStore

R = TypeVar("R")


class SyncLightningStore:
    """``SyncLightningStore(store).enqueue_rollout(...)`` blocks and returns what the coroutine returns.

    Every public coroutine method of the wrapped store is available under the same name.
    """

    def __init__(self, store: LightningStore) -> None:
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agl-store-sync", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run one coroutine on the facade's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        attr = getattr(self.store, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr  # type: ignore[no-any-return]

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.run(attr(*args, **kwargs))

        return call

    def close(self) -> None:
        """Close the wrapped store and stop the loop thread."""
        if self._loop.is_closed():
            return
        self.run(self.store.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncLightningStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
