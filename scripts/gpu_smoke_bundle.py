"""``gpu_smoke.py --bundle DIR``: the wheels agl needs beyond the device machines' image, for an offline install.

The lent GPU machines reach no package index and carry at most 64 MiB of the working tree per call. Their
image ('cuda': Python 3.12, torch 2.11 with CUDA 13, transformers, peft, ...) lacks agl's serving stack
(fastapi/starlette, uvicorn, the openai SDK, OpenTelemetry, pydantic, orjson). The set is agl's declared
requirements, followed through each one's own, stopping at packages the image already has; versions are
the ones installed here, fetched for the target Python (compiled ones as manylinux x86_64 wheels).
``DIR/install.sh`` then installs them with ``pip install --no-index --no-deps``.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # what one device call carries, working tree included

# The device image's Python packages, as KINDS.md lists them (read 2026-11-17): never bundled, and their own
# requirements are the image's business.
_IMAGE_LIST = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
    lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
    patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
    pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
    sacrebleu scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
    zipp"""
IMAGE_PACKAGES = frozenset(_IMAGE_LIST.split())
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _environment(python: str) -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


def _agl_requirements() -> list[Requirement]:
    """agl's core requirements, read from pyproject.toml (the checkout's, not an installed copy's)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the project venv is 3.11+
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def required_packages(python: str = "3.12") -> dict[str, str]:
    """{canonical name: pinned requirement} that agl needs beyond the image, for a Python ``python``.

    Walks Requires-Dist from agl's own requirements (with the extras they name, e.g. uvicorn[standard]),
    evaluating markers for CPython ``python`` on Linux x86_64, and stops at image packages. A package not
    installed here is an error: the pin would be a guess.
    """
    env = _environment(python)
    todo: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset({""})) for r in _agl_requirements()]
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, parent_extras = todo.pop()  # parent_extras: the extras the requiring package was asked with
        if req.marker is not None and not any(
            req.marker.evaluate({**env, "extra": e}) for e in parent_extras
        ):
            continue
        name, extras = canonical(req.name), frozenset(req.extras)
        if name in IMAGE_PACKAGES or (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise SystemExit(
                f"--bundle: {req.name} (needed by agl on the device) is not installed in this Python "
                f"({sys.executable}); install agl's requirements here first"
            ) from None
        found[name] = f"{name}=={dist.version}"
        todo += [(Requirement(line), extras | {""}) for line in dist.requires or []]
    return dict(sorted(found.items()))


def _download(pins: list[str], out: Path, python: str) -> None:
    """``pip download`` of exactly these pins, as wheels for CPython ``python`` on manylinux x86_64."""
    version = python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    cmd += ["--python-version", python, "--implementation", "cp", "--abi", f"cp{version}", "--abi", "abi3"]
    cmd += ["--abi", "none"]
    for platform in _PLATFORMS:
        cmd += ["--platform", platform]
    proc = subprocess.run([*cmd, "-d", str(out), *pins], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"--bundle: pip download failed for Python {python} (is this machine's package index reachable?):"
            f"\n{proc.stderr[-3000:]}"
        )


def _agl_wheel(out: Path) -> Path:
    """agl as a wheel, built from a clean copy of the checkout (no build/ or egg-info left in it)."""
    with tempfile.TemporaryDirectory(prefix="agl-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        shutil.copy2(ROOT / "pyproject.toml", src / "pyproject.toml")
        shutil.copy2(ROOT / "README.md", src / "README.md")
        shutil.copytree(ROOT / "agl", src / "agl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        proc = subprocess.run([*cmd, "--quiet", "-w", str(out), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"--bundle: building agl's wheel failed:\n{proc.stderr[-3000:]}")
    return next(out.glob("agl-*.whl"))


INSTALL_SH = """#!/bin/sh
# Offline install of the wheels beside this file (written by scripts/gpu_smoke.py --bundle).
# sh install.sh            installs into the environment of $PYTHON (default python3)
# sh install.sh /tmp/site  installs into /tmp/site instead: then export PYTHONPATH=/tmp/site
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
if [ -n "$1" ]; then TARGET="--target $1"; else TARGET=""; fi
"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --find-links "$HERE" $TARGET "$HERE"/*.whl
if [ -n "$1" ]; then export PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}"; fi
"$PYTHON" "$HERE/check.py"
"""
# install.sh's last step: the runtime path imports, and every bundled package's requirements are met by
# what is installed (a too-old image package is named rather than failing later inside a part)
CHECK_PY = """import importlib, importlib.metadata as md, sys
from packaging.requirements import Requirement
NAMES = {names!r}
for module in {imports!r}:
    importlib.import_module(module)
unmet = []
for name in NAMES:
    for line in md.distribution(name).requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({{"extra": ""}}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{{name}} needs {{req}}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{{name}} needs {{req}}, have {{have}}")
for line in unmet:
    print("agl bundle: warning:", line, file=sys.stderr)
print(f"agl bundle: {{len(NAMES)}} packages installed; {{len(unmet)}} unmet requirements")
"""
CHECK_IMPORTS = ("agl.gateway.app", "agl.trainer", "agl.asgi_server", "openai", "uvicorn", "orjson")


def write_bundle(out: Path, python: str = "3.12", limit: int = LIMIT_BYTES) -> dict[str, object]:
    """Write the wheels and ``install.sh`` into ``out`` and return what it holds; fails over ``limit``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # one version of each: two would make the install fail
        old.unlink()
    pins = required_packages(python)
    _download(list(pins.values()), out, python)
    agl_wheel = _agl_wheel(out)
    wheels = sorted(out.glob("*.whl"))
    names = [canonical(w.name.split("-")[0]) for w in wheels]
    (out / "check.py").write_text(CHECK_PY.format(names=names, imports=list(CHECK_IMPORTS)))
    (out / "install.sh").write_text(INSTALL_SH)
    (out / "install.sh").chmod(0o755)
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"bundle: {len(wheels)} wheels for CPython {python}, {total / 2**20:.2f} MiB in {out}")
    if total > limit:
        raise SystemExit(
            f"--bundle: {total / 2**20:.2f} MiB is over the {limit / 2**20:.0f} MiB a device call carries"
        )
    return {"dir": str(out), "wheels": [w.name for w in wheels], "bytes": total, "agl": agl_wheel.name}


__all__ = ["IMAGE_PACKAGES", "LIMIT_BYTES", "canonical", "required_packages", "write_bundle"]
