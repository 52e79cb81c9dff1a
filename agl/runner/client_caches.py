"""HTTP clients that agent frameworks cache per base URL, released after each rollout.

Each rollout reaches the gateway at a URL of its own (that is how its calls are attributed), so a framework that
caches a client per base URL keeps one per rollout. LangChain's ``ChatOpenAI`` caches an httpx client pair per
URL (``functools.lru_cache``, 128 entries each), each with its own TLS context: about 1.7 MB per rollout, so a
run's memory climbed by a few hundred MB until the caches filled. The runner clears those caches when a rollout
ends; a client still in use stays referenced by its ``ChatOpenAI`` and is freed with it.
"""

from __future__ import annotations

import sys
from typing import Any

#: (module, its per-URL client caches), looked up only if the framework is already imported
PER_URL_CLIENT_CACHES = (
    (
        "langchain_openai.chat_models._client_utils",
        ("_cached_sync_httpx_client", "_cached_async_httpx_client"),
    ),
)


def release_client_caches() -> int:
    """Clear the frameworks' per-URL client caches; returns how many cached clients were let go."""
    released = 0
    for module_name, names in PER_URL_CLIENT_CACHES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            cached: Any = getattr(module, name, None)
            if hasattr(cached, "cache_clear"):  # a later release may have changed how it caches
                released += cached.cache_info().currsize
                cached.cache_clear()
    return released
