"""Result files and BENCHMARKS.md: the committed page is what the committed files give, and a benchmark's
writer produces a file the page's generator accepts (command, commit, machine, every repeat)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import _results

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_md", ROOT / "scripts" / "benchmarks_md.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


md = _script()


def test_benchmarks_md_is_what_the_committed_result_files_give() -> None:
    assert (ROOT / "BENCHMARKS.md").read_text() == md.render(), "run: python scripts/benchmarks_md.py"


def test_every_committed_result_file_is_valid_and_filed_by_date_and_commit() -> None:
    paths = sorted((ROOT / "benchmarks" / "results").glob("*/*.json"))
    assert paths, "no committed result files"
    for path in paths:
        record = md.load(path)
        assert path.name.startswith(f"{record['date'][:10]}-{record['commit']['sha']}"), path
        assert (ROOT / "benchmarks" / f"{record['benchmark']}.py").exists(), path


def test_the_writer_records_command_commit_machine_and_every_repeat(tmp_path: Path) -> None:
    args = argparse.Namespace(results_dir=tmp_path, no_save=False)
    recorder = _results.Recorder("store_throughput", args)
    runs = [{"rollouts_per_s": v, "seconds": 1.0} for v in (10.0, 30.0, 20.0)]
    path = recorder.save(
        metric="rollouts_per_s", unit="rollouts/s", values=[10, 30, 20], runs=runs, variant="memory"
    )
    assert path is not None and path.parent == tmp_path / "store_throughput"
    record = md.load(path)
    assert path.name == f"{record['date'][:10]}-{record['commit']['sha']}-memory.json"
    assert record["values"] == [10.0, 30.0, 20.0] and record["median"] == 20.0
    assert record["runs"] == runs and record["summary"] == {"rollouts_per_s": 20.0, "seconds": 1.0}
    machine = record["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and len(machine["load_before"]) == 3
    assert set(record["versions"]) == {"python", "torch", "transformers", "agl"}
    assert record["versions"]["agl"]
    assert record["commit"]["sha"] != "unknown" and isinstance(record["commit"]["dirty"], bool)
    line = md.row(path, record)
    assert "| store_throughput (memory) |" in line and "rollouts_per_s: 20.0 rollouts/s" in line
    assert "| 10.0-30.0 | 3 |" in line


def test_no_save_writes_nothing_and_bad_input_is_named(tmp_path: Path) -> None:
    recorder = _results.Recorder("tracing_overhead", argparse.Namespace(results_dir=tmp_path, no_save=True))
    assert recorder.save(metric="m", unit="ms", values=[1.0], runs=[{}]) is None
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="no values of 'm'"):
        recorder.save(metric="m", unit="ms", values=[], runs=[])
    with pytest.raises(ValueError, match="benchmark name 'Bad Name'"):
        _results.Recorder("Bad Name", argparse.Namespace())


def test_a_file_missing_a_field_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "tracing_overhead"
    folder.mkdir()
    path = folder / "2026-01-01-abc1234.json"
    path.write_text(json.dumps({"benchmark": "tracing_overhead", "variant": ""}))
    with pytest.raises(md.ResultError, match="field 'command' missing"):
        md.load(path)


@pytest.mark.timeout(240)
def test_a_small_benchmark_run_writes_a_file_the_page_shows(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "store_throughput.py"), "--rollouts", "16"]
    command += ["--runners", "4", "--repeat", "2", "--results-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines()]  # stdout: one JSON line per repeat
    assert [p["rollouts"] for p in printed] == [16, 16]
    (path,) = (tmp_path / "store_throughput").glob("*.json")
    record = md.load(path)
    assert record["values"] == [p["rollouts_per_s"] for p in printed]
    assert record["command"].startswith("python benchmarks/store_throughput.py --rollouts 16")
    assert record["variant"] == "memory" and len(record["runs"]) == 2
    assert f"[{path.name}](" in md.render(tmp_path)


def test_the_docs_point_at_benchmarks_md_and_known_issues_and_no_longer_at_notes() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "BENCHMARKS.md" in readme and "KNOWN_ISSUES.md" in readme
    assert (ROOT / "KNOWN_ISSUES.md").exists() and not (ROOT / "NOTES.md").exists()
    sources = [ROOT / "README.md", *(ROOT / "agl").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    sources += [*(ROOT / "scripts").glob("*"), *(ROOT / "examples").rglob("*.py"), ROOT / "Makefile"]
    assert [p for p in sources if p.is_file() and "NOTES" + ".md" in p.read_text()] == []


def test_every_known_issue_names_a_file_that_exists() -> None:
    items = [line for line in (ROOT / "KNOWN_ISSUES.md").read_text().splitlines() if line.startswith("- ")]
    assert items
    for item in items:
        named = item.split("`")[1].split("::")[0]
        assert (ROOT / named).exists(), f"KNOWN_ISSUES.md names {named}, which is not there: {item[:80]}"
