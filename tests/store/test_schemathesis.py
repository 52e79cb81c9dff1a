"""Property-based API fuzzing: schemathesis derives requests from the server's own ``/openapi.json``.

Every generated request to a real server must get a non-5xx answer, and every 4xx the documented
``{"error": {...}}`` body. Bounded (a few examples per operation) to stay under a minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

try:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.core.result import Err
except ImportError as exc:  # never a silent skip: the dev extra provides it
    raise ImportError("schemathesis is missing; install the dev extra: pip install -e '.[dev]'") from exc

from agl.asgi_server import BackgroundServer
from agl.schemas import RolloutCreate
from agl.store import InMemoryLightningStore
from agl.store.server import create_app

EXAMPLES_PER_OPERATION = 10


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    store = InMemoryLightningStore()
    asyncio.run(store.enqueue_rollouts([RolloutCreate(input=i, rollout_id=f"ro-{i}") for i in range(3)]))
    with BackgroundServer(create_app(store)) as server:
        # the served spec is the one the tests were generated from
        assert httpx.get(f"{server.url}/openapi.json").json() == SPEC
        yield server.url


# generated from the app's spec at collection (schemathesis' lazy fixture loader breaks on pytest 9); one
# test per operation with its own id ("GET /health"): schemathesis' own parametrize gives every case the
# same node id, which pytest-xdist collapses into one test
SPEC = create_app(InMemoryLightningStore()).app.openapi()


def _operations() -> list[Any]:
    """Every operation of the spec; one schemathesis cannot read fails collection with its reason."""
    operations = []
    for result in schemathesis.openapi.from_dict(SPEC).get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operations.append(result.ok())
    return operations


OPERATIONS = _operations()


@pytest.mark.slow
@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_generated_requests_never_get_a_5xx(operation: Any, server_url: str) -> None:
    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        if case.path.endswith("/rollouts/wait") and isinstance(case.body, dict):
            # a wait on ids an earlier example enqueued long-polls up to 30 s: time, not coverage
            timeout = case.body.get("timeout_s")
            case.body["timeout_s"] = min(timeout, 0.2) if isinstance(timeout, (int, float)) else 0.2
        response = case.call(base_url=server_url, timeout=40)
        assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["type"] and error["message"], response.text

    check()
