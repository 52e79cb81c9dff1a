"""``scripts/gpu_smoke.py`` refuses to run without a GPU unless ``--allow-cpu``; then it runs its GRPO loop, a
bf16 step and an FSDP2 step on the CPU, says so, and reports tokens/s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_smoke_script_runs_on_cpu_with_a_warning() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--model", "tiny", "--steps", "2", "--tasks-per-step", "2", "--group-size", "4", "--runners", "8"]
    args += ["--allow-cpu", "--train-samples", "4", "--train-tokens", "64", "--train-steps", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no CUDA device" in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["steps"] == 2
    assert report["generated_tokens"] > 0 and report["generation_tokens_per_s"] > 0
    assert report["trained_steps"] >= 1 and report["training_tokens_per_s"] > 0
    assert len(report["rewards"]) == 2
    # a policy step under bf16 autocast, and one sharded by FSDP2 (one gloo rank)
    for part in ("bf16", "fsdp"):
        assert report[part]["steps"] == 1 and report[part]["tokens_per_s"] > 0, report[part]
    assert report["fsdp"]["ranks"] == 1 and report["fsdp"]["shard_gib_per_rank"][0] > 0


def test_gpu_smoke_script_refuses_to_run_without_a_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "no CUDA device visible" in proc.stderr and "--allow-cpu" in proc.stderr
    assert proc.stdout.strip() == ""  # no figures printed


def test_gpu_smoke_script_rejects_an_unknown_model() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--model", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode != 0
    assert "--model must be tiny, smollm2 or a local model folder" in proc.stderr


def _smoke(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = str(ROOT / "scripts" / "gpu_smoke.py")
    return subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def test_plan_names_every_part_and_its_budget_without_a_gpu() -> None:
    proc = _smoke("--plan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for part in ("setup", "fit", "bf16", "fsdp", "vllm"):
        assert any(line.split()[:1] == [part] for line in lines), (part, proc.stdout)
    assert "vllm: not available (no CUDA device" in proc.stdout
    plan = json.loads(lines[-1])
    assert plan["plan"] == ["fit", "bf16", "fsdp", "vllm"]
    assert plan["total_s"] == sum(plan["budget_s"].values()) <= 8 * 60


def test_vllm_part_without_cuda_reports_not_available_and_passes() -> None:
    proc = _smoke("--model", "tiny", "--allow-cpu", "--parts", "vllm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm: not available (no CUDA device visible" in proc.stdout
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["vllm"]["available"] is False and report["ok"] is True
    assert report["checks"]["vllm"]["ok"] is None and report["checks"]["setup"]["ok"] is True


def _image_site(folder: Path) -> Path:
    """This venv's copies of the device image's packages (torch, numpy, pip, ...), alone on a path."""
    import importlib.metadata as md

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_smoke_bundle import IMAGE_PACKAGES, canonical
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    folder.mkdir()
    for dist in md.distributions():
        if canonical(dist.metadata["Name"]) not in IMAGE_PACKAGES:
            continue
        for top in {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source, link = Path(str(dist.locate_file(top))), folder / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return folder


GATEWAY_UP = """
import sys, httpx, torch, agl
from agl.gateway import Gateway
from agl.store.memory import InMemoryLightningStore
assert agl.__file__.startswith(sys.argv[1]), agl.__file__  # agl from its wheel, torch from the 'image'
with Gateway(InMemoryLightningStore(watchdog_interval_s=0), ["http://127.0.0.1:9/v1"]) as gw:
    print("health", httpx.get(gw.url + "/health", timeout=10).status_code, torch.__version__)
"""


def test_bundle_installs_offline_beside_only_the_image_packages(tmp_path: Path) -> None:
    """The bundle, for this Python, installed by its install.sh with no index into a folder, runs agl's
    gateway on a path holding only the bundle and the device image's packages (no site-packages)."""
    bundle = tmp_path / "whl"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = _smoke("--bundle", str(bundle), "--bundle-python", python, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])["bundle"]
    assert 0 < made["bytes"] <= 64 * 2**20 and "MiB" in proc.stdout
    names = {w.split("-")[0].lower() for w in made["wheels"]}
    assert {"agl", "openai", "starlette", "uvicorn", "orjson", "pydantic_core", "opentelemetry_sdk"} <= names
    assert not names & {"torch", "transformers", "numpy", "peft", "anyio"}  # the image has these
    # a python that sees only the image's packages, as on the device: -S drops this venv's site-packages
    image = _image_site(tmp_path / "image")
    wrapper = tmp_path / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    site = tmp_path / "site"
    env = {
        "PATH": os.environ["PATH"],
        "PYTHON": str(wrapper),
        "PYTHONPATH": str(image),
        "HOME": str(tmp_path),
    }
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
    install = subprocess.run(
        ["sh", str(bundle / "install.sh"), str(site)], capture_output=True, text=True, timeout=120, env=env
    )
    assert install.returncode == 0, install.stdout + install.stderr[-3000:]
    assert f"{len(made['wheels'])} packages installed; 0 unmet requirements" in install.stdout
    env["PYTHONPATH"] = f"{site}:{image}"
    up = subprocess.run(
        [str(wrapper), "-c", GATEWAY_UP, str(site)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    assert up.stdout.startswith("health 200")
