"""A benchmark's result file: what ran, where, on what, every repeat and the summary, as one JSON file.

Each benchmark writes ``benchmarks/results/<name>/<YYYY-mm-dd>-<shortsha>[-<variant>].json`` unless
``--no-save``; ``scripts/benchmarks_md.py`` builds ``BENCHMARKS.md`` from the newest file of each
(benchmark, variant), so every published figure has its command, commit and machine beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# A result written beside uncommitted results or a regenerated BENCHMARKS.md is still the commit's code.
_NOT_CODE = (":(exclude)benchmarks/results", ":(exclude)BENCHMARKS.md")


#: what a ``/usr/bin/time -v`` log says of a finished command, read by :func:`timed_run`
_TIME_FIELDS = {
    "user_s": r"User time \(seconds\): ([\d.]+)",
    "system_s": r"System time \(seconds\): ([\d.]+)",
    "peak_rss_kb": r"Maximum resident set size \(kbytes\): (\d+)",
    "exit_status": r"Exit status: (\d+)",
}


def timed_run(log_path: Path, *, failed_ok: bool = False) -> dict[str, float]:
    """A finished run's CPU seconds (``cpu_s``) and peak RSS (``peak_rss_gb``) from its ``/usr/bin/time -v``
    log; exits naming the log when the lines are missing or the run failed (unless ``failed_ok``)."""
    log = log_path.read_text()
    found = {k: re.search(p, log) for k, p in _TIME_FIELDS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise SystemExit(f"{log_path} has no /usr/bin/time -v lines {missing}")
    times = {k: float(m.group(1)) for k, m in found.items() if m is not None}
    if times["exit_status"] != 0 and not failed_ok:
        raise SystemExit(f"the run failed (exit {times['exit_status']:.0f}): see {log_path}")
    return {
        "cpu_s": round(times["user_s"] + times["system_s"], 1),
        "peak_rss_gb": round(times["peak_rss_kb"] / 1024**2, 2),
    }


def spread(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """The mean (4 places), min and max of ``key`` over the runs that have a number for it; None if none do."""
    values = [float(r[key]) for r in runs if isinstance(r.get(key), int | float)]
    if not values:
        return None
    return {"mean": round(statistics.fmean(values), 4), "min": min(values), "max": max(values)}


def add_arguments(parser: argparse.ArgumentParser, *, repeat: bool = False) -> None:
    """``--no-save`` and ``--results-dir`` (and ``--repeat N``: run the whole measurement N times)."""
    parser.add_argument("--no-save", action="store_true", help="write no result file")
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS, help="result files go under DIR/<benchmark>/"
    )
    if repeat:
        parser.add_argument("--repeat", type=int, default=1, help="run the measurement N times")


def backend_name(backend: str) -> str:
    """A store backend as a variant name: ``memory``, ``sqlite``, ``postgresql`` (a URL's scheme)."""
    return re.split(r"[:+]", backend, maxsplit=1)[0].lower() or "memory"


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> dict[str, Any]:
    """The short sha of HEAD and whether tracked code differs from it (``unknown`` outside a clone)."""
    sha = _git("rev-parse", "--short=7", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", *_NOT_CODE))
    return {"sha": sha, "dirty": dirty}


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else platform.machine()


def _memory_gb() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemTotal:\s*(\d+) kB", text, re.MULTILINE)
    return round(int(found.group(1)) / 2**20, 1) if found else None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


class Recorder:
    """Started before the measurement (the date and load average then), saved after it."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        if not re.fullmatch(r"[a-z0-9_]+", name):
            raise ValueError(f"benchmark name {name!r}: use lower-case letters, digits and '_'")
        self.name = name
        self.args = args
        self.started = datetime.datetime.now(datetime.UTC)
        self.load_before = _load()
        script = Path(sys.argv[0]).resolve()
        shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
        self.command = shlex.join(["python", str(shown), *sys.argv[1:]])

    def save(
        self,
        *,
        metric: str,
        unit: str,
        values: list[float],
        runs: list[dict[str, Any]],
        summary: dict[str, Any] | None = None,
        variant: str = "",
        better: str = "higher",
    ) -> Path | None:
        """Write the result file (unless ``--no-save``) and return its path.

        ``values`` are the headline ``metric`` of each repeat (the table's median and spread), ``runs`` each
        repeat's full result, ``summary`` the benchmark's own summary (by default the medians of ``runs``).
        """
        if not values:
            raise ValueError(f"{self.name}: no values of {metric!r} to save")
        if better not in ("higher", "lower"):
            raise ValueError(f"better must be 'higher' or 'lower', not {better!r}")
        if getattr(self.args, "no_save", False):
            return None
        record = build_record(self, metric, unit, values, runs, summary, variant, better)
        results_dir: Path = getattr(self.args, "results_dir", RESULTS)
        stem = f"{self.started:%Y-%m-%d}-{record['commit']['sha']}" + (f"-{variant}" if variant else "")
        path = results_dir / self.name / f"{stem}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"result: {_shown(path)}", file=sys.stderr)
        return path


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def build_record(
    rec: Recorder,
    metric: str,
    unit: str,
    values: list[float],
    runs: list[dict[str, Any]],
    summary: dict[str, Any] | None,
    variant: str,
    better: str,
) -> dict[str, Any]:
    """The result file's content (see the module's doc)."""
    if variant and not re.fullmatch(r"[a-z0-9][a-z0-9_.+-]*", variant):
        raise ValueError(f"variant {variant!r}: use lower-case letters, digits and '_.+-'")
    return {
        "benchmark": rec.name,
        "variant": variant,
        "command": rec.command,
        "commit": commit(),
        "date": rec.started.isoformat(timespec="seconds"),
        "seconds": round((datetime.datetime.now(datetime.UTC) - rec.started).total_seconds(), 1),
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_gb": _memory_gb(),
            "load_before": rec.load_before,
            "load_after": _load(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "agl": _version("agl") or _agl_version(),
        },
        "metric": {"name": metric, "unit": unit, "better": better},
        "values": [float(v) for v in values],
        "median": statistics.median(values),
        "runs": runs,
        "summary": summary if summary is not None else medians(runs),
    }


def _agl_version() -> str | None:
    found = re.search(r'__version__ = "([^"]+)"', (ROOT / "agl" / "__init__.py").read_text())
    return found.group(1) if found else None


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every top-level number the runs share (the one run's numbers when there is one)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    out: dict[str, Any] = {}
    for key in keys:
        got = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        if len(got) == len(runs):
            out[key] = statistics.median(got)
    return out
