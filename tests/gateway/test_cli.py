"""``agl gateway serve`` as a real subprocess in front of a scripted upstream."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

import agl
from agl.cli import app
from agl.testing import free_port
from tests.support.openai_upstream import OpenAIUpstream


def wait_healthy(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
            return
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            time.sleep(0.1)


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
            wait_healthy(proc, port)
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


def test_serve_records_conversations_and_takes_late_rewards_with_the_reward_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--record-unattributed`` with ``AGL_GATEWAY_REWARD_TOKEN``: a conversation's call, then its reward."""
    help_text = CliRunner().invoke(app, ["gateway", "serve", "--help"], terminal_width=200).output
    assert "--reward-token" in help_text and "x-agl-session-id" in help_text
    port, reward_token = free_port(), "reward-tok-0123456789"
    with OpenAIUpstream(token_ids=True) as up:
        monkeypatch.setenv("AGL_GATEWAY_REWARD_TOKEN", reward_token)  # post_reward's default token, too
        env = {**os.environ, "AGL_GATEWAY_TOKEN": "admin-tok"}
        cmd = [sys.executable, "-m", "agl", "gateway", "serve", "--store", "memory://", "--upstream", up.base_url,
               "--port", str(port), "--kind", "agl", "--record-unattributed"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, port)
            base = f"http://127.0.0.1:{port}"
            chat = {"model": "m", "messages": [{"role": "user", "content": "ping"}]}
            r = httpx.post(f"{base}/v1/chat/completions", json=chat, headers={"x-agl-session-id": "c1"})
            assert r.status_code == 200
            answer = agl.post_reward(base, 1.0, response_id=r.json()["id"])  # the token from the environment
            assert answer["recorded"] and answer["rollout_id"].startswith("ro-online-")
            assert agl.post_reward(base, 1.0, session_id="c1")["rollout_id"] == answer["rollout_id"]
            refused = httpx.post(
                f"{base}/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {reward_token}"}
            )
            assert refused.status_code == 403
            with pytest.raises(agl.errors.GatewayError, match="401"):
                agl.post_reward(base, 1.0, session_id="c1", token="wrong-token-000")
        finally:
            proc.terminate()
            proc.wait(10)
