"""Failed rollouts are counted with their first error, and a run that cannot learn says so, once."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl import semconv as sc
from agl.algorithm.apo import APO, APOConfig
from agl.algorithm.base import rollout_spans
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.algorithm.health import (
    Failures,
    LearningCheck,
    RolloutsFailedError,
    check_not_all_failed,
    rollout_failures,
    shorten,
)
from agl.algorithm.sft import SFT, SFTConfig
from agl.errors import AgentError
from agl.models import tiny_model
from agl.schemas import LLM, AttemptStatus, PromptTemplate, RolloutCreate, Span
from agl.store import InMemoryLightningStore
from examples.apo.simulated_lm import SimulatedLM, SimulatedLMServer


@agl.rollout
async def keyless_agent(task: str) -> float:
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1")  # no api_key: the README's old mistake
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task}])
    return float(bool(reply.choices))


@agl.rollout
async def picky_agent(task: str) -> float:
    if task == "bad":
        raise ValueError("no such task: " + "x" * 300)
    return 1.0


async def test_failures_carry_the_first_error_from_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    store = InMemoryLightningStore()
    created = await store.enqueue_rollouts([RolloutCreate(input=t) for t in ("a", "b")])
    await agl.Runner(keyless_agent, store, poll_interval_s=0.01).run(max_rollouts=2)
    rollouts = [await store.get_rollout(r.rollout_id) for r in created]
    spans = {r.rollout_id: await rollout_spans(store, r.rollout_id) for r in rollouts}
    failures = await rollout_failures(store, rollouts, spans)
    assert (failures.failed, failures.total, failures.all_failed) == (2, 2, True)
    assert failures.first_error is not None
    assert failures.first_error.startswith("OpenAIError: Missing credentials")
    assert failures.metrics("val_") == {
        "val_failed_rollouts": 2.0,
        "val_rollouts": 2.0,
        "val_failed_infra": 0.0,
        "val_failed_agent": 2.0,  # a client built without credentials: the agent's code
        "val_failed_reward": 0.0,
    }


async def test_only_failed_rollouts_count_and_unfinished_ones_are_named() -> None:
    store = InMemoryLightningStore()
    created = await store.enqueue_rollouts([RolloutCreate(input=t) for t in ("ok", "bad", "ok")])
    await agl.Runner(picky_agent, store, poll_interval_s=0.01).run(max_rollouts=3)
    waiting = await store.enqueue_rollout("never run")  # no runner takes it
    rollouts = [await store.get_rollout(r.rollout_id) for r in created]
    failures = await rollout_failures(store, rollouts, {})
    assert (failures.failed, failures.total, failures.all_failed) == (1, 3, False)
    assert failures.console()["first_error"].startswith("ValueError: no such task: xxx")
    assert len(failures.console()["first_error"]) == 160 and failures.console()["first_error"].endswith("...")
    assert (await rollout_failures(store, rollouts[:1], {})) == Failures(0, 1)
    unfinished = await rollout_failures(store, [waiting], {})
    assert (
        unfinished.first_error is not None
        and "not finished in time (status queuing)" in unfinished.first_error
    )


async def test_without_an_attempt_error_the_exception_span_names_it() -> None:
    store = InMemoryLightningStore()
    await store.enqueue_rollout("t")
    claimed = await store.dequeue("w")
    assert claimed is not None
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    span = Span(
        rollout_id=rid,
        attempt_id=aid,
        trace_id="0" * 32,
        span_id="1" * 16,
        name=sc.SPAN_EXCEPTION,
        start_time_ns=1,
        end_time_ns=2,
        attributes={sc.EXCEPTION_TYPE: "TimeoutError", sc.EXCEPTION_MESSAGE: "tool took too long"},
    )
    await store.add_spans([span])
    await store.update_attempt(rid, aid, status=AttemptStatus.FAILED)  # a runner that sent no error text
    failed = await store.get_rollout(rid)
    failures = await rollout_failures(store, [failed], {rid: await rollout_spans(store, rid)})
    assert failures.first_error == "TimeoutError: tool took too long"


def test_all_failed_stops_with_the_error_and_what_to_check() -> None:
    failures = Failures(4, 4, "OpenAIError: Missing credentials. Please pass an `api_key`")
    with pytest.raises(RolloutsFailedError) as raised:
        check_not_all_failed(
            failures, "the first step (1)", stop=True, option="GRPOConfig(stop_on_all_failed=False)"
        )
    message = str(raised.value)
    assert isinstance(raised.value, AgentError)
    assert message.startswith(
        "all 4 rollouts of the first step (1) failed; the first error: OpenAIError: Missing"
    )
    assert "api_key" in message and "base_url=llm.endpoint" in message
    assert "GRPOConfig(stop_on_all_failed=False)" in message
    check_not_all_failed(failures, "x", stop=False, option="o")  # the option keeps going
    check_not_all_failed(Failures(3, 4, "E: e"), "x", stop=True, option="o")  # one success is enough
    check_not_all_failed(Failures(0, 0), "x", stop=True, option="o")  # nothing ran (no val set)
    assert shorten("first line\nsecond") == "first line" and shorten(None) == ""


def test_learning_check_warns_once_naming_cause_and_remedies(caplog: pytest.LogCaptureFixture) -> None:
    check = LearningCheck()
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        check.after_step(1, {"groups": 10.0, "zero_variance_groups": 8.0, "rollouts": 40.0}, first=True)
        assert not caplog.records  # 80% flat groups still teach something
        check.after_step(
            2, {"groups": 10.0, "zero_variance_groups": 9.0, "rollouts": 40.0, "samples": 4.0}, first=False
        )
        check.after_step(3, {"groups": 10.0, "zero_variance_groups": 10.0, "rollouts": 40.0}, first=False)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "in step 2, 9 of 10 groups gave every rollout the same reward" in message
    assert "almost nothing" in message
    for remedy in ("warm start", "temperature", "partial credit", "group_size"):
        assert remedy in message


def test_a_step_refill_filled_with_signal_is_not_flat(caplog: pytest.LogCaptureFixture) -> None:
    check = LearningCheck()
    refilled = {"groups": 10.0, "zero_variance_groups": 9.0, "rollouts": 40.0, "samples": 8.0}
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        check.after_step(1, {**refilled, "groups_with_signal": 1.0}, first=True)
        assert not caplog.records  # the flat groups were set aside for one that trained
        check.after_step(
            2, {**refilled, "zero_variance_groups": 10.0, "groups_with_signal": 0.0}, first=False
        )
    assert "in step 2, 10 of 10 groups" in caplog.records[0].getMessage()


def test_flat_groups_at_the_runs_best_reward_say_solved_not_a_fault(caplog: pytest.LogCaptureFixture) -> None:
    check = LearningCheck()
    learning = {
        "groups": 6.0,
        "zero_variance_groups": 3.0,
        "rollouts": 24.0,
        "reward_min": 0.0,
        "reward_max": 1.0,
    }
    solved = {
        "groups": 6.0,
        "zero_variance_groups": 6.0,
        "rollouts": 24.0,
        "reward_min": 1.0,
        "reward_max": 1.0,
    }
    with caplog.at_level(logging.INFO, logger="agl.algorithm.health"):
        check.after_step(1, learning, first=True)
        check.after_step(2, solved, first=False)
        check.after_step(3, solved, first=False)
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # once, and not as a warning
    assert "every rollout got the best reward of this run (1.000)" in caplog.records[0].getMessage()
    assert not check.warned  # a later fault still gets its warning
    flat_first = LearningCheck()  # all alike from the start (partial credit, say): not known to be solved
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        flat_first.after_step(1, {**solved, "reward_min": 0.5, "reward_max": 0.5}, first=True)
    assert flat_first.warned


@pytest.mark.parametrize(
    ("call", "cause"),
    [
        (
            lambda c: c.at_start(0.0, {"base": 0.25, "after_warm_start": 0.0}, Failures(0, 4)),
            "the warm start lowered it from 0.250",
        ),
        (
            lambda c: c.at_start(0.0, {"base": 0.0}, Failures(1, 4, "E: e")),
            "held-out reward is 0.000 before the first GRPO step",
        ),
        (
            lambda c: c.at_start(0.0, {}, Failures(2, 2, "E: e")),
            "all 2 rollouts of the baseline evaluation failed",
        ),
        (
            lambda c: c.after_step(1, {"rollouts": 4.0, "failed_rollouts": 4.0}, first=True),
            "all 4 rollouts of step 1 failed",
        ),
        (
            lambda c: c.after_step(1, {"rollouts": 4.0, "groups": 2.0, "reward_mean": 0.0}, first=True),
            "every rollout of step 1 scored 0",
        ),
    ],
)
def test_each_cause_is_named(call: object, cause: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        call(LearningCheck())  # type: ignore[operator]
    assert len(caplog.records) == 1 and cause in caplog.records[0].getMessage()


def test_no_warning_while_learning(caplog: pytest.LogCaptureFixture) -> None:
    check = LearningCheck()
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        check.at_start(0.4, {"base": 0.0, "after_warm_start": 0.4}, Failures(0, 4))
        check.at_start(float("nan"), {}, Failures(0, 0))  # no validation set
        check.after_step(
            1, {"rollouts": 8.0, "groups": 2.0, "zero_variance_groups": 1.0, "reward_mean": 0.5}, first=True
        )
        check.after_step(
            2, {"rollouts": 8.0, "groups": 2.0, "reward_mean": 0.0}, first=False
        )  # not the start
    assert not caplog.records


def test_the_warning_shows_in_a_fresh_process_without_logging_setup() -> None:
    code = (
        "from agl.algorithm.health import LearningCheck\n"
        "LearningCheck().after_step(3, {'groups': 6.0, 'zero_variance_groups': 6.0, 'rollouts': 24.0}, first=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "GRPO is not learning: in step 3, 6 of 6 groups gave every rollout the same reward" in proc.stderr
    assert proc.stdout == ""


@agl.rollout
async def readme_agent(task: str, llm: agl.LLM) -> float:
    """The README's old agent: an openai client without ``api_key``, so it fails before any call."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task}]
    )
    return float(reply.choices[0].message.content == "42")


def _grpo(**overrides: Any) -> GRPO:
    fields: dict[str, Any] = {
        "model_path": str(tiny_model()),
        "steps": 2,
        "tasks_per_step": 2,
        "group_size": 2,
        "lr": 1e-3,
        "eval_every": 0,
    }
    return GRPO(GRPOConfig(**{**fields, **overrides}))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("val", "where"), [(["v"], "the baseline evaluation"), ([], "the first step (1)")])
def test_fit_stops_when_every_rollout_fails(
    val: list[str], where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    trainer = agl.Trainer(algorithm=_grpo(), n_runners=4, output_dir=str(tmp_path))
    with pytest.raises(RolloutsFailedError) as raised:
        trainer.fit(readme_agent, ["a", "b"], val)
    message = str(raised.value)
    count = 1 if val else 4
    assert message.startswith(
        f"all {count} rollouts of {where} failed; the first error: OpenAIError: Missing"
    )
    assert "api_key" in message and "GRPOConfig(stop_on_all_failed=False)" in message


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fit_keeps_going_with_the_option_and_says_what_fails(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    trainer = agl.Trainer(algorithm=_grpo(stop_on_all_failed=False), n_runners=4, output_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        result = trainer.fit(readme_agent, ["a", "b"], ["v"])
    assert [row["samples"] for row in result["history"]] == [0.0, 0.0]
    err = capsys.readouterr().err
    # no rollout yielded a reward, so there is no score (not 0): the failures are counted apart
    assert "step 0: val_reward=nan  peak_rss_gb=" in err  # the memory peak before the first step
    assert "val_failed=1/1 (agent 1)  first error: OpenAIError: Missing credentials" in err
    for step in (1, 2):
        line = next(x for x in err.splitlines() if f"step {step}: " in x)
        assert (
            "no update" in line
            and "failed=4/4 (agent 4)  first error: OpenAIError: Missing credentials" in line
        )
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GRPO ")]
    assert len(warnings) == 1  # the failures are the cause, not the reward
    assert warnings[0].startswith("GRPO is not learning: all 1 rollouts of the baseline evaluation failed")
    assert "Fix the rollouts' error first" in warnings[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_stops_when_every_rollout_fails_or_keeps_going_with_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = SFTConfig(
        model_path=str(tiny_model()),
        iterations=1,
        samples_per_task=2,
        tasks_per_iteration=2,
    )
    trainer = agl.Trainer(algorithm=SFT(config), n_runners=4, output_dir=str(tmp_path / "stop"))
    with pytest.raises(
        RolloutsFailedError, match=r"all 4 rollouts of the first iteration failed; .*OpenAIError"
    ):
        trainer.fit(readme_agent, ["a", "b"], [])
    keep = dataclasses.replace(config, stop_on_all_failed=False)
    result = agl.Trainer(algorithm=SFT(keep), n_runners=4, output_dir=str(tmp_path / "keep")).fit(
        readme_agent, ["a", "b"], []
    )
    assert result["history"][0]["failed_rollouts"] == 4.0
    line = next(x for x in capsys.readouterr().err.splitlines() if "SFT step 0: " in x)
    assert (
        "no update" in line and "failed=4/4 (agent 4)  first error: OpenAIError: Missing credentials" in line
    )


@agl.rollout
async def exact_match_agent(task: str, llm: agl.LLM) -> float:
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
    )
    await client.close()
    return float(reply.choices[0].message.content == "forty-two")  # the tiny model never says it


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_exact_match_that_never_scores_is_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    trainer = agl.Trainer(algorithm=_grpo(), n_runners=4, output_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="agl.algorithm.health"):
        result = trainer.fit(exact_match_agent, ["a", "b"], [])
    assert [row["zero_variance_groups"] for row in result["history"]] == [2.0, 2.0]
    err = capsys.readouterr().err
    for step in (1, 2):
        line = next(x for x in err.splitlines() if f"step {step}: " in x)
        assert "reward_mean=0.000  no update" in line and "zero_var=2/2 groups" in line
    warnings = [r.getMessage() for r in caplog.records if "GRPO is not learning" in r.getMessage()]
    assert len(warnings) == 1  # once, however many steps idle
    assert "in step 1, 2 of 2 groups gave every rollout the same reward (mean reward 0.000)" in warnings[0]
    assert "partial credit" in warnings[0]


@agl.rollout
async def half_failing_agent(task: dict[str, int], prompt: agl.PromptTemplate) -> float:
    if task["n"]:
        raise RuntimeError(f"tool server down for task {task['n']}")
    return 0.5


async def test_apo_rounds_show_their_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with SimulatedLMServer(SimulatedLM()) as server:
        store = InMemoryLightningStore()
        await store.add_resources({"prompt": PromptTemplate(template="Answer.")})
        runner = agl.Runner(half_failing_agent, store, max_concurrency=4, poll_interval_s=0.01)
        running = asyncio.create_task(runner.run())
        config = APOConfig(
            critic=LLM(endpoint=server.base_url, model="critic"),
            editor=LLM(endpoint=server.base_url, model="editor"),
            rounds=1,
            val_probe=1.0,
            output_dir=str(tmp_path),
        )
        tasks = [{"n": n} for n in range(4)]
        await APO(config).run(store, tasks, tasks)
        runner.stop()
        await running
    round_0 = next(x for x in capsys.readouterr().err.splitlines() if "round 0: " in x)
    assert re.search(r"failed=3/4  first error: RuntimeError: tool server down for task [123]$", round_0)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert rows[0]["failed_rollouts"] == "3"
