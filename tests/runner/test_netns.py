"""Runners in another network namespace: they reach the store and the trainer's gateway only across a veth.

The test builds its own namespace and a veth pair in a private /30 (10.200.N.0/30, on this machine only)
and removes both afterwards. It needs root (CAP_NET_ADMIN); without it the test fails and says so.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import agl
from agl.algorithm.base import Algorithm, TrainingContext
from agl.models import tiny_model
from agl.schemas import LLMCall, RolloutStatus
from agl.store.client import LightningStoreClient
from tests.runner.store_process import PYTHON, ROOT, StoreProcess, child_env

pytestmark = pytest.mark.slow
TOKEN = "netns-token"


@dataclass
class Netns:
    name: str
    host_ip: str  # the host side of the veth
    ns_ip: str  # inside the namespace

    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], text=True, **kw)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


@pytest.fixture
def netns() -> Iterator[Netns]:
    if shutil.which("ip") is None:
        pytest.fail("the network-namespace test needs iproute2's `ip` (apt-get install iproute2)")
    n = os.getpid() % 250 + 1
    name, host_if, ns_if = f"agl-t{n}", f"aglh{n}", f"agln{n}"
    subnet = f"10.200.{n}"
    try:
        _ip("netns", "add", name)
    except RuntimeError as exc:
        pytest.fail(
            f"cannot create a network namespace ({exc}); this test needs root or CAP_NET_ADMIN "
            "(run the suite as root, or in a container started with --cap-add NET_ADMIN)"
        )
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{subnet}.1/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/30", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield Netns(name, f"{subnet}.1", f"{subnet}.2")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


class CallThePolicy(Algorithm):
    """Publishes the gateway's LLM and runs the tasks; returns the recorded model calls per rollout."""

    def model_spec(self) -> agl.ModelSpec:
        return agl.ModelSpec(str(tiny_model()))

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> list[int]:
        assert ctx.llm is not None
        resources_id = await ctx.publish({"llm": ctx.llm})
        done = await ctx.rollouts(train, resources_id=resources_id, timeout_s=120)
        assert all(r.status == RolloutStatus.SUCCEEDED for r, _ in done), [r.status for r, _ in done]
        return [sum(LLMCall.from_span(s) is not None for s in spans) for _, spans in done]


def test_namespace_is_isolated_from_the_host_loopback(netns: Netns, tmp_path: Path) -> None:
    server = StoreProcess(tmp_path / "lo.db").start()  # on the host's 127.0.0.1 only
    try:
        probe = netns.popen(
            [PYTHON, "-c", f"import httpx; httpx.get('{server.url}/health', timeout=2)"],
            env=child_env(),
            stderr=subprocess.PIPE,
        )
        _, err = probe.communicate(timeout=60)
        assert probe.returncode != 0 and "ConnectError" in err  # so the test below proves the veth path
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_runner_in_a_namespace_trains_through_store_and_gateway_across_the_veth(
    netns: Netns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)  # fit opens store=URL with it
    server = StoreProcess(tmp_path / "store.db", host=netns.host_ip, token=TOKEN).start()
    runner = netns.popen(
        [PYTHON, "-m", "agl", "runner", "--store", server.url, "--token", TOKEN]
        + ["--agent", "tests.runner.store_process:llm_caller", "--concurrency", "2"],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        trainer = agl.Trainer(
            algorithm=CallThePolicy(),
            n_runners=0,
            store=server.url,
            output_dir=str(tmp_path / "out"),
            serving=agl.Serving(host=netns.host_ip),
        )
        calls = trainer.fit(agl.rollout(lambda task: 0.0), ["a", "b", "c"])
        assert calls == [1, 1, 1]  # each rollout's model call went through the gateway and was recorded
        workers = asyncio.run(_worker_hosts(server.url))
    finally:
        runner.send_signal(signal.SIGTERM)
        out, _ = runner.communicate(timeout=60)
        server.stop()
    assert runner.returncode == 0, out
    assert "3 attempts, 3 succeeded" in out, out
    assert workers, "the namespaced runner registered no worker"


async def _worker_hosts(url: str) -> list[Any]:
    client = LightningStoreClient(url, token=TOKEN)
    workers = (await client.query_workers()).items
    await client.aclose()
    return [w.host for w in workers]
