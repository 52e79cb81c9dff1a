"""``agl engine serve`` as a real process: /health open, chat behind its token, and it stops on SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agl.testing import free_port


def test_engine_serve_command(tiny_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "AGL_ENGINE_TOKEN": "engine-secret"}
    cmd = [sys.executable, "-m", "agl", "engine", "serve", "--model", str(tiny_path), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "agl engine serve did not come up within 60 s"
            time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        denied = httpx.post(url, json=body, timeout=30)  # AGL_ENGINE_TOKEN is set: calls need it
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": "Bearer engine-secret"}
        resp = httpx.post(url, json=body, headers=auth, timeout=30).json()
        assert len(resp["choices"][0]["token_ids"]) == 3 and resp["model_version"] == "v0"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
