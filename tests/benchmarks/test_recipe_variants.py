"""benchmarks/recipe_variants.py summarising runs already made (``--logs``): scores from each run's summary,
steps without an update and refill's rollouts from its metrics.csv, CPU and memory from its time log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "recipe_variants.py"
TIME_LOG = """\
\tUser time (seconds): {user}
\tSystem time (seconds): 10.0
\tMaximum resident set size (kbytes): {kb}
\tExit status: {status}
"""


def _run(out: Path, stem: str, after: float, samples: list[int], refill: list[int], status: int = 0) -> None:
    """A run folder as a recipe leaves it, and its ``/usr/bin/time -v`` log beside it."""
    (out / stem).mkdir(parents=True)
    summary: dict[str, object] = {"test_base": 0.0, "test_after_warm_start": 0.5, "test_after_grpo": after}
    summary |= {"test_teacher": None, "precision": "bf16"}  # precision: as the recipe resolved "auto"
    (out / stem / "summary.json").write_text(json.dumps(summary))
    rows = ["step,samples,merged_fraction,refill_rollouts,peak_rss_gb", "0,,,,9.0"]  # step 0: validation only
    rows += [f"{i + 1},{n},1.0,{r},{2 + i}" for i, (n, r) in enumerate(zip(samples, refill, strict=True))]
    (out / stem / "metrics.csv").write_text("\n".join(rows) + "\n")
    (out / f"{stem}.log").write_text(
        "training...\n" + TIME_LOG.format(user=90.0, kb=3 * 1024**2, status=status)
    )


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_runs_already_made_are_summarised_per_variant(tmp_path: Path) -> None:
    _run(tmp_path, "sql-plain-s0", 0.5, [8, 0, 0], [0, 0, 0])
    _run(tmp_path, "sql-plain-s1", 0.75, [8, 8, 0], [0, 0, 0])
    _run(tmp_path, "sql-refill-s0", 0.625, [8, 8, 8], [8, 0, 16])
    _run(tmp_path, "sql-refill-s1", 0.875, [8, 8, 8], [0, 0, 8])
    called = {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}
    (tmp_path / "sql-refill-s1" / "teacher_traces.jsonl").write_text(
        '{"messages": []}\n' * 2 + json.dumps(called) + "\n"
    )
    common = ["--recipe", "sql_agent", "--name", "sql", "--seeds", "0,1", "--logs", str(tmp_path)]
    done = _bench(*common, "--variants", "plain=,refill=--refill", "--results-dir", str(tmp_path / "res"))
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted((tmp_path / "res" / "recipe_variants").glob("*.json"))
    assert [f.name.split("-", 4)[-1] for f in files] == ["sql_agent-plain.json", "sql_agent-refill.json"]
    plain, refill = (json.loads(f.read_text()) for f in files)
    assert plain["values"] == [0.5, 0.75] and refill["values"] == [0.625, 0.875]
    assert [r["steps_without_update"] for r in plain["runs"]] == [2, 1]
    assert [r["refill_rollouts"] for r in refill["runs"]] == [24, 8]
    assert [r["teacher_kept"] for r in refill["runs"]] == [None, 3]  # the kept conversations, when taught
    assert [r["teacher_kept_with_tool_calls"] for r in refill["runs"]] == [None, 1]
    summary = refill["summary"]
    assert summary["plain"]["steps_without_update"] == {"mean": 1.5, "min": 1.0, "max": 2.0}
    assert (
        summary["refill"]["steps_without_update"]["max"] == 0.0 and summary["refill"]["test_teacher"] is None
    )
    assert plain["runs"][0]["cpu_s"] == 100.0 and plain["runs"][0]["peak_rss_gb"] == 3.0
    assert plain["runs"][0]["steps_peak_rss_gb"] == 4.0  # the GRPO steps' highest, not step 0's validation
    assert plain["runs"][0]["precision"] == "bf16" and summary["plain"]["precision"] == ["bf16"]

    _run(tmp_path, "sql-broken-s0", 0.0, [8], [0], status=1)
    failed = _bench(
        *common[:-4], "--seeds", "0", "--logs", str(tmp_path), "--variants", "broken=", "--no-save"
    )
    assert failed.returncode != 0 and "the run failed (exit 1): see" in failed.stderr


def test_a_comma_inside_a_variants_options_stays_there() -> None:
    from benchmarks.recipe_variants import variants_of

    got = variants_of("team=--agents solver,checker --lr 1e-4,solo=--agents solver,plain=")
    assert got == {
        "team": ["--agents", "solver,checker", "--lr", "1e-4"],
        "solo": ["--agents", "solver"],
        "plain": [],
    }


def test_a_run_that_stopped_before_its_summary_is_recorded_as_failed_never_as_zero(tmp_path: Path) -> None:
    _run(tmp_path, "calc-gold-s0", 0.75, [8], [0])
    (tmp_path / "calc-teacher-s0").mkdir()  # the teacher phase raised: no summary.json, no metrics.csv
    error = (
        "agl.errors.ConfigError: the teacher's 128 rollouts on 32 train tasks kept none (mean reward 0.000)"
    )
    log = "INFO agl.algorithm.teacher: teacher: held-out score 0.0312 on 64 tasks\nTraceback ...\n" + error
    (tmp_path / "calc-teacher-s0.log").write_text(
        log + "\n" + TIME_LOG.format(user=290.0, kb=5 * 1024**2, status=1)
    )
    done = _bench(
        *[
            "--recipe",
            "calc",
            "--seeds",
            "0",
            "--logs",
            str(tmp_path),
            "--results-dir",
            str(tmp_path / "res"),
        ],
        *["--variants", "gold=,teacher=--teacher qwen-coder"],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    gold, teacher = (json.loads(f.read_text()) for f in sorted((tmp_path / "res").rglob("*.json")))
    assert gold["metric"]["name"] == "held-out score after GRPO" and gold["values"] == [0.75]
    assert teacher["metric"]["name"] == "share of runs that finished" and teacher["values"] == [0.0]
    (run,) = teacher["runs"]
    assert (
        run["failed"].startswith("ConfigError: the teacher's 128 rollouts") and "test_after_grpo" not in run
    )
    assert (run["test_teacher"], run["cpu_s"], run["peak_rss_gb"]) == (0.0312, 300.0, 5.0)
    assert (
        teacher["summary"]["teacher"]["failed_runs"] == 1 and teacher["summary"]["gold"]["failed_runs"] == 0
    )


def test_seeds_from_an_earlier_result_join_the_summary(tmp_path: Path) -> None:
    common = ["--recipe", "multi_agent", "--name", "team", "--logs", str(tmp_path), "--variants", "solo="]
    _run(tmp_path, "team-solo-s0", 0.5, [8], [0])
    first = _bench(*common, "--seeds", "0", "--results-dir", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr[-2000:]
    (earlier,) = (tmp_path / "first").rglob("*.json")
    _run(tmp_path, "team-solo-s1", 0.75, [8], [8])
    later = ["--seeds", "1,2", "--earlier", str(earlier), "--results-dir", str(tmp_path / "later")]
    _run(tmp_path, "team-solo-s2", 1.0, [8], [0])
    done = _bench(*common, *later)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = (json.loads(f.read_text()) for f in (tmp_path / "later").rglob("*.json"))
    assert result["values"] == [0.5, 0.75, 1.0] and [r["seed"] for r in result["runs"]] == [0, 1, 2]
    assert result["runs"][0]["from"] == str(earlier) and "from" not in result["runs"][1]
    summary = result["summary"]
    assert summary["seeds"] == [0, 1, 2] and summary["earlier"] == [str(earlier)]
    assert summary["solo"]["test_after_grpo"] == {"mean": 0.75, "min": 0.5, "max": 1.0}
