"""Online training end to end on the tiny model, every part real: the built-in engine over HTTP, the
gateway with ``record_unattributed`` in front of it writing to SQLite, openai-SDK calls as production,
late rewards through ``agl.post_reward``, then ``agl train --online --once`` rounds that train on the
rewarded conversations only (unrewarded and stale ones counted), evaluate the current and the candidate
model on held-out tasks as ``agl eval`` does, and publish to the engine or refuse; ``agl model rollback``
serves the earlier version again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import agl
from agl.algorithm.grpo import GRPOConfig
from agl.algorithm.grpo.online import read_online, staleness, version_number
from agl.cli import app
from agl.engines.builtin.server import EngineServer
from agl.errors import ConfigError
from agl.gateway import Gateway, GatewayConfig, UpstreamConfig
from agl.gateway.online import session_rollout_id
from agl.models import tiny_model
from agl.store import SqliteLightningStore, open_store
from agl.trainer.online import OnlineSettings, gate, rollback, run_round, run_schedule, served_version
from tests.tiny_agents import scored_agent

REWARD = "reward-token-0123456789"
# the held-out agent scores by task, whichever model answers: both models tie, so only the gate decides
HELD_OUT = [{"id": 0, "rewards": [0.5]}, {"id": 1, "rewards": [1.0]}]


@pytest.fixture
def production(tmp_path: Path) -> Iterator[tuple[EngineServer, Gateway, str]]:
    db = tmp_path / "production.db"
    with EngineServer(tiny_model(), max_batch_size=4) as engine:
        store = SqliteLightningStore(db)
        upstream = UpstreamConfig(url=engine.base_url, kind="agl")
        config = GatewayConfig(record_unattributed=True, health_interval_s=0.1)
        with Gateway(store, [upstream], config, reward_token=REWARD) as gw:
            yield engine, gw, f"sqlite:///{db}"


def _talk(gw: Gateway, sessions: list[str]) -> list[str]:
    """One production call per session, as a user's app makes it; returns the versions that answered."""
    client = openai.OpenAI(base_url=gw.base_url, api_key="sk-user", max_retries=0)
    versions = []
    for session in sessions:
        reply = client.chat.completions.create(
            model="my-agent",
            messages=[{"role": "user", "content": f"hello from {session}"}],
            max_tokens=4,
            extra_headers={"x-agl-session-id": session},
        )
        versions.append(str(reply.model_extra.get("model_version") if reply.model_extra else None))
    client.close()
    return versions


def _flush(gw: Gateway) -> None:
    asyncio.run(gw.flush())  # the gateway runs it on its own loop


def _reward(gw: Gateway, rewards: dict[str, float]) -> None:
    for session, value in rewards.items():
        assert agl.post_reward(gw.url, value, session_id=session, token=REWARD)["finished"]


def test_online_rounds_train_on_rewarded_traffic_gate_publish_and_roll_back(
    production: tuple[EngineServer, Gateway, str], tmp_path: Path
) -> None:
    engine, gw, store = production
    out = tmp_path / "online"
    config = GRPOConfig(model_path=str(tiny_model()), lr=1e-4)
    settings = OnlineSettings(
        store=store,
        engine=engine.url,
        output_dir=out,
        agent=scored_agent,
        held_out=HELD_OUT,
        max_version_lag=0,
        n_runners=2,
    )

    assert _talk(gw, ["a", "b", "c", "d"]) == ["v0"] * 4
    _reward(gw, {"a": 1.0, "b": 0.0, "c": 1.0})  # d's verdict has not come in
    first = run_round(config, settings)
    assert first.decision == "published", first
    assert first.counts["rewarded_new"] == 3 and first.counts["trained_rollouts"] == 3
    assert first.counts["unrewarded"] == 1 and first.counts["stale"] == 0
    assert first.current_score == first.candidate_score == 0.75  # both scored, the tie passes min_gain 0
    assert first.served == "v1" == served_version(engine.url)
    assert _talk(gw, ["e"]) == ["v1"]  # production is answered by the new version at once
    trained, base = (
        load_file(out / "versions" / "v1" / "model.safetensors"),
        load_file(tiny_model() / "model.safetensors"),
    )
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the step moved the weights
    assert (out / "versions" / "v1" / "optimizer.pt").is_file()  # the next round's Adam moments

    # d was answered by v0, one version behind: with max_version_lag=0 it is stale when its reward arrives
    _talk(gw, ["f"])
    _reward(gw, {"d": 1.0, "e": 1.0, "f": 0.0})
    _flush(gw)
    code = _cli(
        "train",
        "--online",
        "--once",
        "--agent",
        "tests.tiny_agents:scored_agent",
        "--val",
        str(_jsonl(tmp_path / "held_out.jsonl", HELD_OUT)),
        "--from-store",
        store,
        "--engine",
        engine.url,
        "--max-version-lag",
        "0",
        "--min-gain",
        "0.5",
        "--set",
        f"grpo.model_path={config.model_path}",
        "--set",
        "grpo.lr=1e-4",
        "--set",
        f"trainer.output_dir={out}",
        "--set",
        "trainer.n_runners=2",
    )
    assert code[0] == 0, code
    assert "round 2: refused: candidate 0.750 vs current 0.750 (v1)" in code[1]
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    second = rounds[-1]
    assert second["decision"] == "refused" and second["served"] == "v1" == served_version(engine.url)
    assert second["counts"]["rewarded_new"] == 3 and second["counts"]["stale"] == 1
    assert second["counts"]["trained_rollouts"] == 2 and second["counts"]["unrewarded"] == 0
    assert any(why.startswith("stale: recorded under v0") for why in second["skipped"].values())
    # round 2 continued v1's optimizer: its Adam state counts two steps, not a fresh first one
    moments = torch.load(out / "candidates" / "round-2" / "optimizer.pt", weights_only=True)["state"]
    assert {float(s["step"]) for s in moments.values()} == {2.0}
    assert second["trained"] == sorted([session_rollout_id("e"), session_rollout_id("f")])  # d was stale

    # nothing new: a round reads past the watermark only
    third = run_round(config, settings)
    assert third.decision == "nothing to train" and third.counts["rewarded_new"] == 0

    # the earlier version is one command away
    code = _cli("model", "rollback", "--out", str(out), "--to", "v0", "--engine", engine.url)
    assert code[0] == 0 and "serves v0 again" in code[1], code
    assert served_version(engine.url) == "v0" and _talk(gw, ["g"]) == ["v0"]
    assert rollback(out, "v1", engine.url) == "v1"
    code = _cli("model", "rollback", "--out", str(out), "--to", "v9", "--engine", engine.url)
    assert code[0] == 2 and "--to 'v9': no such version" in code[2]
    code = _cli("model", "versions", "--out", str(out))
    assert code[0] == 0 and [line.split("\t")[0] for line in code[1].splitlines()] == ["v0", "v1"]

    # the schedule: a round as soon as one new rewarded rollout is in (alone it has no baseline to beat)
    _talk(gw, ["h"])
    _reward(gw, {"h": 1.0})
    (fourth,) = run_schedule(config, settings, every_rollouts=1, every_minutes=None, poll_s=0.1, rounds=1)
    assert fourth.round == 4 and fourth.counts["rewarded_new"] == 1 and fourth.decision == "nothing to train"
    with pytest.raises(ConfigError, match="--every-rollouts N and/or --every-minutes T"):
        run_schedule(config, settings, every_rollouts=None, every_minutes=None)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), prog_name="agl")
    return result.exit_code, result.stdout, result.stderr


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_staleness_and_the_gate_are_explicit() -> None:
    assert version_number("v12") == 12 and version_number("policy") is None
    assert staleness("v3", "v5", 2) is None and staleness("v2", "v5", None) is None
    assert "3 versions behind v5 (max 2)" in str(staleness("v2", "v5", 2))
    assert "rolled back" in str(staleness("v6", "v5", 2))
    assert "cannot be ordered" in str(staleness(None, "v5", 2))
    assert gate(0.5, 0.5, 0.0)[0] and not gate(0.5, 0.5, 0.01)[0] and not gate(0.5, float("nan"), 0)[0]
    assert gate(float("nan"), 0.1, 0.0)[0]


def test_bad_online_input_names_the_flag(tmp_path: Path) -> None:
    held = str(_jsonl(tmp_path / "h.jsonl", HELD_OUT))
    base = [
        "train",
        "--online",
        "--once",
        "--agent",
        "tests.tiny_agents:scored_agent",
        "--set",
        "grpo.model_path=tiny",
    ]
    code = _cli(*base, "--val", held, "--engine", "http://127.0.0.1:1")
    assert code[0] == 2 and "--online needs --from-store URL" in code[2]
    code = _cli(*base, "--val", held, "--from-store", "sqlite:///x.db")
    assert code[0] == 2 and "--online needs --engine URL" in code[2]
    code = _cli(*base, "--from-store", "sqlite:///x.db", "--engine", "http://127.0.0.1:1")
    assert code[0] == 2 and "give --val FILE.jsonl" in code[2]
    code = _cli(*base, "--val", held, "--from-store", "sqlite:///x.db", "--engine", "http://127.0.0.1:1")
    assert code[0] == 2 and "set trainer.output_dir" in code[2]
    code = _cli("train", "--once", "--set", "grpo.model_path=tiny")
    assert code[0] == 2 and "add --online" in code[2]
    with pytest.raises(ConfigError, match="max_version_lag must be >= 0"):
        asyncio.run(_read_negative(tmp_path))
    team = GRPOConfig(model_path="x", agents=("solver", "checker"), lora_rank=4)
    settings = OnlineSettings(store="sqlite:///x.db", engine="http://127.0.0.1:1", output_dir=tmp_path,
                              agent=scored_agent, held_out=HELD_OUT)  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"online rounds serve one model: GRPOConfig.agents \('solver', 'checker'\)"
    ):
        run_round(team, settings)


async def _read_negative(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    try:
        await read_online(store, GRPOConfig(model_path="x"), current_version="v0", max_version_lag=-1)
    finally:
        await store.aclose()
