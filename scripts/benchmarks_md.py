"""Write BENCHMARKS.md from the newest result file of each benchmark under benchmarks/results/.

One row per (benchmark, variant): its command, median and spread of its headline figure, runs, date, commit
and machine, and a link to the file; then each benchmark's one-sentence description from its docstring.

    python scripts/benchmarks_md.py            # rewrite BENCHMARKS.md
    python scripts/benchmarks_md.py --check    # exit 1 when BENCHMARKS.md is not what the files give
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
OUT = ROOT / "BENCHMARKS.md"

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "benchmark": str,
    "variant": str,
    "command": str,
    "commit": dict,
    "date": str,
    "machine": dict,
    "versions": dict,
    "metric": dict,
    "values": list,
    "runs": list,
    "summary": dict,
}


class ResultError(ValueError):
    """A result file that lacks a field or holds one of the wrong kind (the message names both)."""


def load(path: Path) -> dict[str, Any]:
    """One result file, checked: every field BENCHMARKS.md reads is there and of the right kind."""
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(record, dict):
        raise ResultError(f"{path}: a result file holds one JSON object")
    for field, kind in _REQUIRED.items():
        if not isinstance(record.get(field), kind):
            raise ResultError(f"{path}: field {field!r} missing or not a {getattr(kind, '__name__', kind)}")
    for field, keys in (
        ("commit", ("sha", "dirty")),
        ("machine", ("cpu", "cores")),
        ("metric", ("name", "unit")),
    ):
        for key in keys:
            if key not in record[field]:
                raise ResultError(f"{path}: field '{field}.{key}' missing")
    values = record["values"]
    if not values or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ResultError(f"{path}: field 'values' must be a non-empty list of numbers")
    try:
        datetime.datetime.fromisoformat(record["date"])
    except ValueError as exc:
        raise ResultError(f"{path}: field 'date' is not an ISO date: {record['date']!r}") from exc
    if path.parent.name != record["benchmark"]:
        raise ResultError(f"{path}: benchmark {record['benchmark']!r} filed under {path.parent.name!r}")
    return dict(record)


def newest(results: Path = RESULTS) -> list[tuple[Path, dict[str, Any]]]:
    """The newest result of each (benchmark, variant), by the date it started, in name order."""
    best: dict[tuple[str, str], tuple[Path, dict[str, Any]]] = {}
    for path in sorted(results.glob("*/*.json")):
        record = load(path)
        key = (record["benchmark"], record["variant"])
        if key not in best or (record["date"], path.name) > (best[key][1]["date"], best[key][0].name):
            best[key] = (path, record)
    return [best[key] for key in sorted(best)]


def description(name: str) -> str:
    """The first sentence of ``benchmarks/<name>.py``'s docstring, on one line."""
    path = BENCHMARKS / f"{name}.py"
    if not path.exists():
        return "(no benchmarks/{name}.py)"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    found = re.match(r"(.+?\.)(\s|$)", paragraph)
    return found.group(1) if found else paragraph


def _number(value: float) -> str:
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 0.1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _machine(machine: dict[str, Any]) -> str:
    cpu = re.sub(r"\((R|TM|tm)\)|\bCPU\b|\bProcessor\b", "", str(machine["cpu"]))
    cpu = re.sub(r"\s*@.*$", "", " ".join(cpu.split()))
    text = f"{cpu}, {machine['cores']} cores"
    if machine.get("memory_gb"):
        text += f", {machine['memory_gb']:g} GB"
    before, after = machine.get("load_before"), machine.get("load_after")
    if before and after:
        text += f"; load {before[0]:g} -> {after[0]:g}"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(path: Path, record: dict[str, Any]) -> str:
    values = [float(v) for v in record["values"]]
    metric = record["metric"]
    name = record["benchmark"] + (f" ({record['variant']})" if record["variant"] else "")
    sha = record["commit"]["sha"] + ("+dirty" if record["commit"]["dirty"] else "")
    cells = [
        name,
        f"`{record['command']}`",
        f"{metric['name']}: {_number(_median(values))} {metric['unit']}",
        f"{_number(min(values))}-{_number(max(values))}",
        str(len(values)),
        record["date"][:10],
        sha,
        _machine(record["machine"]),
        f"[{path.name}]({path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()})",
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render(results: Path = RESULTS) -> str:
    """BENCHMARKS.md's text from the files under ``results``."""
    found = newest(results)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python scripts/benchmarks_md.py` from the newest result file of each benchmark (and variant)",
        "under `benchmarks/results/`; do not edit it by hand. Each benchmark writes its file when it runs",
        "(`--no-save` to skip, `--results-dir` elsewhere): the command, commit, machine, load, versions and every",
        "repeat. Median and spread are over the runs of the headline figure named in the column; the file has the",
        "rest. Figures from a shared or loaded machine (see its load) are noisy; compare runs on one machine.",
        "",
        "| benchmark | command | median | spread (min-max) | runs | date | commit | machine | result |",
        "|---|---|---|---|---:|---|---|---|---|",
        *(row(path, record) for path, record in found),
        "",
        "## What each measures",
        "",
    ]
    measured = {record["benchmark"] for _, record in found}
    for script in sorted(BENCHMARKS.glob("[a-z]*.py")):
        name = script.stem
        missing = "" if name in measured else " No result committed yet."
        lines.append(f"- `{name}`: {description(name)}{missing}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when BENCHMARKS.md differs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    try:
        text = render(args.results_dir)
    except ResultError as exc:
        raise SystemExit(str(exc)) from exc
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            raise SystemExit(
                f"{args.out} is not what the result files give: run python scripts/benchmarks_md.py"
            )
        return
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines)", file=sys.stderr)


if __name__ == "__main__":
    main()
