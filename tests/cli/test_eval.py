"""``agl eval``: its help, bad input named by file and line (exit 2), and a real run on the tiny model that
writes eval.json and eval.png and compares two models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agl.cli import app

AGENT = "tests.tiny_agents:scored_agent"


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["eval", *args], prog_name="agl")
    return result.exit_code, result.stdout, result.stderr


def test_help_names_every_option_and_gives_an_example() -> None:
    code, out, _ = _invoke("--help")
    assert code == 0 and "Usage: agl eval [OPTIONS]" in out
    for option in (
        "--agent",
        "--tasks",
        "--model",
        "-k",
        "--pass-k",
        "--pass-threshold",
        "--compare",
        "--out",
    ):
        assert option in out, option
    assert "Example: agl eval --agent my_agents:solve --tasks test.jsonl" in out


@pytest.fixture
def files(tmp_path: Path) -> Path:
    tasks = [
        {"id": 0, "rewards": [1, 0], "rewards_tiny": [1, 1]},
        {"id": 1, "rewards": [0.5, 0.5], "rewards_tiny": [0.5, 0.5]},
        {"id": 2, "fail": "agent"},
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (tmp_path / "bad.jsonl").write_text('{"id": 0}\n\n{"id": 1,\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "missing.jsonl", "-m", "tiny"], "--tasks missing.jsonl: no such file"),
        (["--tasks", "{d}/bad.jsonl", "-m", "tiny"], "--tasks {d}/bad.jsonl, line 3: not JSON"),
        (["--tasks", "{d}/empty.jsonl", "-m", "tiny"], "--tasks {d}/empty.jsonl: no tasks in the file"),
        (["--tasks", "{d}/tasks.jsonl", "-m", "{d}"], "model '{d}': not a Hugging Face model folder"),
        (
            ["--tasks", "{d}/tasks.jsonl", "-m", "tiny", "--compare", "tiny", "x"],
            "compare: no model labelled 'x'",
        ),
        (
            ["--tasks", "{d}/tasks.jsonl", "-m", "tiny", "-k", "2", "--pass-k", "3"],
            "pass_k must be a whole number",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_problem(files: Path, args: list[str], message: str) -> None:
    code, _, err = _invoke("--agent", AGENT, *(a.format(d=files) for a in args))
    assert code == 2, err
    assert f"agl eval: error: {message.format(d=files)}" in err


def test_a_bad_agent_is_named(files: Path) -> None:
    code, _, err = _invoke(
        "--agent", "tests.tiny_agents:nope", "--tasks", f"{files}/tasks.jsonl", "-m", "tiny"
    )
    assert code == 2 and "has no attribute 'nope'" in err


def test_a_run_writes_eval_json_and_png_and_compares(files: Path) -> None:
    from agl.trainer.dev import serve_model

    out = files / "eval"
    with serve_model("tiny") as llm:
        endpoint = f"{llm.endpoint}#tiny"
        code, stdout, err = _invoke(
            "--agent", AGENT, "--tasks", f"{files}/tasks.jsonl", "-m", "tiny", "-m", endpoint,
            "-k", "2", "--compare", "tiny", endpoint, "--out", str(out), "--pass-threshold", "0.5",
        )  # fmt: skip
    assert code == 0, err
    assert "mean@2" in stdout and "pass@2" in stdout and "1 tasks changed" in stdout
    data = json.loads((out / "eval.json").read_text())
    assert (data["k"], data["pass_k"], data["pass_threshold"]) == (2, 2, 0.5)
    assert data["ci_method"].startswith("percentile bootstrap over tasks")
    tiny, other = data["models"]
    assert tiny["label"] == "tiny" and tiny["mean_at_k"] == pytest.approx(0.5)
    assert tiny["pass_at_k"] == pytest.approx(1.0)  # each task has a sample at or above 0.5
    assert tiny["failed_by_class"] == {"agent": 2} and tiny["rollouts"] == 6
    assert other["mean_at_k"] == pytest.approx(0.75)
    assert data["comparison"]["mean_diff"] == pytest.approx(0.25)
    assert [t["index"] for t in data["comparison"]["changed"]] == [0]
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "store.db").is_file()
