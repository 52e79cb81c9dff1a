"""The token options of the ``agl`` commands, ``agl store stats --token`` and the leaf commands' usage lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agl.cli import app
from tests.runner.store_process import StoreProcess

NO_ENV = {"AGL_STORE_TOKEN": None, "AGL_ENGINE_TOKEN": None, "AGL_GATEWAY_TOKEN": None}


@pytest.mark.parametrize(
    "argv",
    [
        ["store", "serve", "--token", ""],
        ["store", "stats", "http://127.0.0.1:9", "--token", ""],
        [
            "runner",
            "--store",
            "http://127.0.0.1:9",
            "--agent",
            "tests.runner.store_process:llm_caller",
            "--token",
            "",
        ],
        ["engine", "serve", "--model", "tiny", "--token", " "],
        ["gateway", "serve", "--upstream", "http://127.0.0.1:9/v1", "--token", ""],
        ["gateway", "serve", "--upstream", "http://127.0.0.1:9/v1", "--client-token", ""],
        ["dashboard", "--store", "http://127.0.0.1:9", "--token", ""],
    ],
    ids=lambda argv: " ".join(a for a in argv[:2] if not a.startswith(("-", "http"))),
)
def test_an_empty_token_refuses_to_start_instead_of_running_open(argv: list[str]) -> None:
    result = CliRunner().invoke(app, argv, env=NO_ENV)
    assert result.exit_code == 2, result.output
    assert "empty" in result.output and "unset variable" in result.output


@pytest.mark.parametrize("command", ["runner", "dashboard"])
def test_leaf_commands_have_no_subcommand_in_their_usage(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    assert usage.split()[-2:] == [command, "[OPTIONS]"], usage  # no COMMAND [ARGS]... after it


def test_store_stats_takes_a_token(tmp_path: Path) -> None:
    token = "stats-token-0123456789"
    server = StoreProcess(tmp_path / "store.db", token=token).start()
    try:
        ok = CliRunner().invoke(app, ["store", "stats", server.url, "--token", token], env=NO_ENV)
        refused = CliRunner().invoke(app, ["store", "stats", server.url], env=NO_ENV)
    finally:
        server.stop()
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["rollouts_by_status"] == {}
    assert refused.exit_code == 1 and "--token" in refused.output and "bearer token" in refused.output
