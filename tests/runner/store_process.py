"""A real ``agl store serve`` in a child process, and agents the ``agl runner`` subprocess tests import."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import agl
from agl.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def child_env(**extra: str) -> dict[str, str]:
    """The environment of agl child processes: this checkout importable, no proxies, offline models."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return {
        **env,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NO_PROXY": "*",
        **extra,
    }


class StoreProcess:
    """``agl store serve`` on ``host:port`` over a SQLite file; restartable on the same port and file."""

    def __init__(self, db: Path, host: str = "127.0.0.1", port: int | None = None, token: str | None = None):
        self.db, self.host, self.token = db, host, token
        self.port = port or free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> StoreProcess:  # returns once healthy; slow on a busy host
        cmd = [PYTHON, "-m", "agl", "store", "serve", "--host", self.host, "--port", str(self.port)]
        cmd += ["--backend", f"sqlite:///{self.db}"] + (["--token", self.token] if self.token else [])
        self.proc = subprocess.Popen(cmd, env=child_env(), cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"agl store serve exited with {self.proc.returncode}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"agl store serve did not answer on {self.url} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-request, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# ----- agents the `agl runner` subprocesses load by module:attr ---------------------------------------


@agl.rollout
async def square(task: int) -> float:
    await asyncio.sleep(0.05)
    return float(task * task)


class Doubler(agl.LitAgent):
    async def rollout(self, task: Any, resources: Any, rollout: agl.Rollout) -> float:
        return float(task * 2)


@agl.rollout
async def sleepy(task: int) -> float:
    print(f"sleepy started {task}", flush=True)
    await asyncio.sleep(float(task))
    return 1.0


@agl.rollout
async def llm_caller(task: str, llm: agl.LLM) -> float:
    """Calls the policy through the gateway endpoint it was given (the trainer's, across the network);
    the gateway bound beyond loopback wants the token fit published as ``llm.api_key``."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
    )
    await client.close()
    return 1.0 if reply.choices[0].message.content is not None else 0.0
