"""OpenAI clients for rollouts that share one connection pool per event loop.

A new ``openai.AsyncOpenAI`` builds its own HTTP client, and with it an SSL context that loads the system's
CA bundle: CPU time for each, paid on the runner's event loop by every
rollout that makes one, even for a plain-HTTP gateway. :func:`openai_client` hands a rollout a client for its
own endpoint over a pool built once per event loop; closing that client leaves the pool open for the next
rollout. Runners close the pool when the last of them on the loop stops (:func:`shared_pool_scope`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agl.schemas import LLM

if TYPE_CHECKING:
    import openai


@functools.cache
def _shared_client_class() -> type[Any]:
    """The pool's class, made on first use (importing openai takes a while)."""
    import openai

    class SharedHttpClient(openai.DefaultAsyncHttpxClient):
        """``aclose`` from a rollout's client is ignored; :meth:`close_pool` really closes it."""

        async def aclose(self) -> None:
            return None  # one rollout closing its client must not close the others' connections

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedHttpClient


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
_users: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


def _running_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "agl.openai_client needs a running event loop: call it inside an async agent; a sync agent can use "
            "openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key)"
        ) from None


def shared_http_client() -> openai.DefaultAsyncHttpxClient:
    """The running event loop's shared HTTP client (made on first use)."""
    loop = _running_loop()
    pool = _pools.get(loop)
    if pool is None or pool.is_closed:
        pool = _pools[loop] = _shared_client_class()()
    client: openai.DefaultAsyncHttpxClient = pool
    return client


def openai_client(llm: LLM, **options: Any) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` for ``llm`` (its endpoint, and the gateway's token as the key) over the event
    loop's shared connections: next to nothing to make, where a fresh client loads the CA bundle again.

    ``options`` go to ``AsyncOpenAI`` (``max_retries``, ``timeout``, ...). Closing the client (or leaving an
    ``async with`` block) is allowed and leaves the shared pool open.
    """
    if not isinstance(llm, LLM):
        raise TypeError(f"openai_client takes the rollout's agl.LLM resource, got {type(llm).__name__}")
    for name in ("base_url", "http_client"):
        if name in options:
            raise TypeError(f"openai_client sets {name} itself (the LLM's endpoint, the shared pool)")
    import openai

    options.setdefault("api_key", llm.api_key or "unused")
    return openai.AsyncOpenAI(base_url=llm.endpoint, http_client=shared_http_client(), **options)


@contextlib.asynccontextmanager
async def shared_pool_scope() -> AsyncIterator[None]:
    """Held by a runner while it runs: the loop's shared pool closes when the last holder leaves."""
    loop = _running_loop()
    _users[loop] = _users.get(loop, 0) + 1
    try:
        yield
    finally:
        _users[loop] -= 1
        if not _users[loop]:
            pool = _pools.pop(loop, None)
            if pool is not None:
                await pool.close_pool()


__all__ = ["openai_client", "shared_http_client", "shared_pool_scope"]
