"""Crash safety: kill -9 the store server mid-load, and kill a runner mid-rollout; nothing acknowledged is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl.errors import AglError
from agl.schemas import AttemptStatus, RetryConfig, RolloutCreate, RolloutStatus, Span
from agl.store.client import LightningStoreClient
from agl.testing import free_port
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _start_server(backend: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl", "store", "serve", "--backend", backend, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("store server did not start")


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/crash.db"
        return
    from tests.store.remote_backends import PG_DSN, postgres_reachable

    reason = postgres_reachable()
    if reason:
        pytest.skip(reason)
    import uuid

    import psycopg

    schema = f"agl_crash_{uuid.uuid4().hex[:8]}"
    yield f"{PG_DSN}?schema={schema}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_kill_9_server_mid_load_loses_nothing_acknowledged(backend: str) -> None:
    port = free_port()
    server = _start_server(backend, port)
    client = LightningStoreClient(f"http://127.0.0.1:{port}", retries=60, backoff_s=0.05, timeout_s=10)
    retry = RetryConfig(max_attempts=5, heartbeat_timeout_s=1.5)
    created = await client.enqueue_rollouts([RolloutCreate(input=i, retry=retry) for i in range(60)])
    acked_spans: set[str] = set()

    async def worker(name: str) -> None:
        while True:
            try:
                claimed = await client.dequeue(name)
            except AglError:
                continue
            if claimed is None:
                rollouts = (
                    await client.query_rollouts(rollout_ids=[r.rollout_id for r in created], limit=100)
                ).items
                if all(r.status.is_terminal for r in rollouts):
                    return
                await asyncio.sleep(0.1)
                continue
            rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
            try:
                for _ in range(3):
                    stored = await client.add_spans([Span.new(rid, aid, "step", {"w": name})])
                    acked_spans.update(s.span_id for s in stored)
                    await asyncio.sleep(0.01)
                await client.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
            except AglError:
                pass  # superseded while the server was down: the store retries the rollout

    workers = [asyncio.create_task(worker(f"w{i}")) for i in range(6)]
    # mid-load: spans are being acknowledged (3 per rollout, 180 in all) when the server dies
    await until(lambda: len(acked_spans) >= 12, "the workers to have spans acknowledged")
    server.send_signal(signal.SIGKILL)
    server.wait()
    await asyncio.sleep(0.3)  # the outage itself: the workers' calls fail and retry meanwhile
    server = _start_server(backend, port)
    try:
        await asyncio.wait_for(asyncio.gather(*workers), 90)
        done = await client.wait_for_rollouts([r.rollout_id for r in created], timeout_s=30)
        assert len(done) == 60 and all(r.status == RolloutStatus.SUCCEEDED for r in done)
        stored_ids: set[str] = set()
        for r in created:
            stored_ids |= {s.span_id for s in (await client.query_spans(rollout_id=r.rollout_id)).items}
        assert acked_spans <= stored_ids
    finally:
        await client.aclose()
        server.kill()
        server.wait()


RUNNER = textwrap.dedent(
    """
    import asyncio, sys
    import agl
    from agl.store.client import LightningStoreClient

    @agl.rollout
    async def agent(task):
        print("working", flush=True)
        await asyncio.sleep(60)

    store = LightningStoreClient(sys.argv[1])
    asyncio.run(agl.Runner(agent, store, heartbeat_interval_s=0.2).run(max_rollouts=1))
    """
)


async def test_killed_runner_attempt_becomes_unresponsive_and_is_retried(tmp_path: Path) -> None:
    port = free_port()
    server = _start_server(f"sqlite:///{tmp_path}/runner.db", port)
    url = f"http://127.0.0.1:{port}"
    client = LightningStoreClient(url)
    try:
        rollout = await client.enqueue_rollout(
            "job", retry=RetryConfig(max_attempts=2, heartbeat_timeout_s=1.0)
        )
        runner = subprocess.Popen(
            [sys.executable, "-c", RUNNER, url],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert runner.stdout is not None
        assert (await asyncio.to_thread(runner.stdout.readline)).strip() == b"working"
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        started = time.monotonic()
        while (claimed := await client.dequeue("rescuer")) is None:
            assert time.monotonic() - started < 20, "the lost attempt was never retried"
            await asyncio.sleep(0.2)
        assert claimed.rollout.rollout_id == rollout.rollout_id and claimed.attempt.attempt_number == 2
        first = (await client.query_attempts(rollout_id=rollout.rollout_id)).items[0]
        assert first.status == AttemptStatus.UNRESPONSIVE
        await client.update_attempt(
            rollout.rollout_id, claimed.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
        )
        assert (await client.get_rollout(rollout.rollout_id)).status == RolloutStatus.SUCCEEDED
    finally:
        await client.aclose()
        server.kill()
        server.wait()
