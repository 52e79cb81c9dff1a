"""``agl runner`` processes attached to a real ``agl store serve``, and Trainer.fit with only external runners."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import agl
from agl.algorithm.base import Algorithm, TrainingContext
from agl.cli.runner import load_agent
from agl.schemas import AttemptStatus, RolloutCreate, RolloutStatus
from agl.store.client import LightningStoreClient
from tests.runner.store_process import PYTHON, ROOT, StoreProcess, child_env

pytestmark = pytest.mark.slow
TOKEN = "runner-test-token"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[StoreProcess]:
    server = StoreProcess(tmp_path / "store.db", token=TOKEN).start()
    yield server
    server.stop()


def agl_runner(url: str, agent: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    cmd = [PYTHON, "-m", "agl", "runner", "--store", url, "--agent", agent, "--token", TOKEN, *args]
    return subprocess.Popen(  # dev mode: unclosed clients and sockets show as ResourceWarnings
        cmd,
        env=child_env(PYTHONDEVMODE="1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


async def _enqueue(url: str, inputs: Sequence[Any]) -> list[str]:
    client = LightningStoreClient(url, token=TOKEN)
    rollouts = await client.enqueue_rollouts([RolloutCreate(input=i) for i in inputs])
    await client.aclose()
    return [r.rollout_id for r in rollouts]


async def _finished(url: str, ids: list[str]) -> tuple[list[agl.Rollout], set[str]]:
    """The rollouts after they finish, and the workers whose attempts ran them."""
    client = LightningStoreClient(url, token=TOKEN)
    rollouts = await client.wait_for_rollouts(ids, timeout_s=60)
    workers = set()
    for rid in ids:
        for attempt in (await client.query_attempts(rollout_id=rid)).items:
            workers.add(str(attempt.worker_id))
    await client.aclose()
    return rollouts, workers


@pytest.mark.timeout(120)
def test_runner_processes_complete_real_rollouts(served: StoreProcess) -> None:
    ids = asyncio.run(_enqueue(served.url, list(range(12))))
    proc = agl_runner(
        served.url, "tests.runner.store_process:square", "--workers", "2", "--max-rollouts", "6"
    )
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    rollouts, workers = asyncio.run(_finished(served.url, ids))
    assert [r.status for r in rollouts] == [RolloutStatus.SUCCEEDED] * 12
    assert len(workers) == 2  # two worker processes shared the queue
    assert out.count("6 attempts, 6 succeeded") == 2


@pytest.mark.timeout(60)
def test_agent_may_be_a_lit_agent_class_and_bad_specs_are_explained(served: StoreProcess) -> None:
    ids = asyncio.run(_enqueue(served.url, [3, 4]))
    proc = agl_runner(served.url, "tests.runner.store_process:Doubler", "--max-rollouts", "2")
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 0, out
    rollouts, _ = asyncio.run(_finished(served.url, ids))
    assert all(r.status == RolloutStatus.SUCCEEDED for r in rollouts)

    bad = agl_runner(served.url, "no_such_module_xyz:f")
    out, _ = bad.communicate(timeout=30)
    assert bad.returncode == 2 and "no_such_module_xyz" in out and "cannot" in out, out
    for spec, reason in [
        ("no_colon", "module:attr"),
        ("tests.runner.store_process:nothing", "no attribute 'nothing'"),
        ("tests.runner.store_process:ROOT", "PosixPath"),
    ]:
        with pytest.raises(ValueError, match=reason):
            load_agent(spec)


@pytest.mark.timeout(90)
def test_sigterm_reaches_every_worker_and_lets_in_flight_attempts_finish(served: StoreProcess) -> None:
    ids = asyncio.run(_enqueue(served.url, [2, 2]))
    proc = agl_runner(served.url, "tests.runner.store_process:sleepy", "--workers", "2", "--grace", "20")
    assert proc.stdout is not None
    deadline, started = time.monotonic() + 60, 0
    while started < 2:  # one attempt in each worker process
        assert time.monotonic() < deadline and proc.poll() is None
        started += "sleepy started" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)  # to the parent only: it passes the signal on
    out, _ = proc.communicate(timeout=40)
    assert proc.returncode == 0, out
    assert out.count("1 attempts, 1 succeeded") == 2, out
    rollouts, workers = asyncio.run(_finished(served.url, ids))
    assert [r.status for r in rollouts] == [RolloutStatus.SUCCEEDED] * 2 and len(workers) == 2


class Sum(Algorithm):
    """Runs the tasks as rollouts and sums the rewards; its runners are wherever the store's are."""

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> float:
        done = await ctx.rollouts(train, timeout_s=60)
        assert all(r.status == RolloutStatus.SUCCEEDED for r, _ in done)
        rewards: list[float] = [s.attributes[agl.semconv.REWARD_VALUE] for _, spans in done for s in spans]
        return sum(rewards)


@pytest.mark.timeout(90)
def test_fit_with_only_external_runners(
    served: StoreProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)  # fit opens store=URL with it
    proc = agl_runner(served.url, "tests.runner.store_process:square", "--concurrency", "4")
    try:
        local_agent = agl.rollout(lambda task: 0.0)  # never runs: the squares prove the external one did
        trainer = agl.Trainer(algorithm=Sum(), n_runners=0, store=served.url, output_dir=str(tmp_path))
        assert trainer.fit(local_agent, [1, 2, 3]) == 14.0
        client = LightningStoreClient(served.url, token=TOKEN)  # a client object works too, and stays usable
        trainer = agl.Trainer(algorithm=Sum(), n_runners=0, store=client, output_dir=str(tmp_path))
        assert trainer.fit(local_agent, [4]) == 16.0
        assert trainer.fit(local_agent, [5]) == 25.0
        attempts = asyncio.run(_attempt_statuses(served.url))
        assert len(attempts) == 5 and set(attempts) == {AttemptStatus.SUCCEEDED}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


async def _attempt_statuses(url: str) -> list[AttemptStatus]:
    client = LightningStoreClient(url, token=TOKEN)
    statuses = []
    for rollout in (await client.query_rollouts()).items:
        statuses += [a.status for a in (await client.query_attempts(rollout_id=rollout.rollout_id)).items]
    await client.aclose()
    return statuses


@pytest.mark.timeout(90)
def test_runner_logs_no_request_per_poll_and_leaves_no_client_open(served: StoreProcess) -> None:
    asyncio.run(_enqueue(served.url, [1, 2]))
    quiet = agl_runner(
        served.url, "tests.runner.store_process:square", "--max-rollouts", "2", "--poll-interval", "0.01"
    )
    out, _ = quiet.communicate(timeout=60)
    assert quiet.returncode == 0 and "2 attempts, 2 succeeded" in out, out
    assert "HTTP Request" not in out  # httpx logs every poll at INFO; the runner keeps them for debug
    assert "Unclosed" not in out and "ResourceWarning" not in out, out

    asyncio.run(_enqueue(served.url, [3]))
    loud = agl_runner(
        served.url, "tests.runner.store_process:square", "--max-rollouts", "1", "--log-level", "debug"
    )
    out, _ = loud.communicate(timeout=60)
    assert loud.returncode == 0 and "HTTP Request" in out, out  # still there when asked for
