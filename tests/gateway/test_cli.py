"""``agl gateway serve`` as a real subprocess in front of a scripted upstream."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from typer.testing import CliRunner

from agl.cli import app
from tests.support.openai_upstream import OpenAIUpstream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_proxies_and_rejects_bad_urls() -> None:
    bad = CliRunner().invoke(app, ["gateway", "serve", "--upstream", "ftp://nope", "--store", "memory://"])
    assert bad.exit_code != 0 and "http://" in bad.output
    port = free_port()
    with OpenAIUpstream(api_key="upstream-key-123") as up:
        env = {
            **os.environ,
            "AGL_GATEWAY_UPSTREAM_API_KEY": "upstream-key-123",
            "AGL_GATEWAY_TOKEN": "admin-tok",
        }
        cmd = [sys.executable, "-m", "agl", "gateway", "serve", "--store", "memory://", "--upstream", up.base_url,
               "--port", str(port), "--kind", "openai"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
                    break
                except httpx.HTTPError:
                    assert proc.poll() is None and time.monotonic() < deadline, (
                        proc.stdout and proc.stdout.read()
                    )
                    time.sleep(0.1)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "ping"}]})  # fmt: skip
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: ping"
            assert up.requests[-1].headers["authorization"] == "Bearer upstream-key-123"
            base, admin = f"http://127.0.0.1:{port}", {"authorization": "Bearer admin-tok"}
            assert httpx.post(f"{base}/admin/pause").status_code == 401  # AGL_GATEWAY_TOKEN guards admin
            assert httpx.get(f"{base}/admin/stats", headers=admin).json()["paused"] is False
            metrics = httpx.get(f"{base}/metrics", headers=admin).text
            assert 'agl_gateway_calls_total{api="chat.completions",status="200"} 1.0' in metrics
        finally:
            proc.terminate()
            proc.wait(10)
