"""What ``fit`` serves is guarded: the gateway's tokens, and where its outputs go."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

import agl
from agl.algorithm.base import Algorithm, TrainingContext
from agl.models import tiny_model
from agl.trainer.fit import gateway_client_token

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@agl.rollout
async def keyed_agent(task: str, llm: agl.LLM) -> float:
    """An agent as the README writes it: its key is the one fit published."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=0)
    reply = await client.chat.completions.create(model=llm.model, messages=USER, max_tokens=2)
    await client.close()
    return 1.0 if reply.choices else 0.0


class ProbeTheGateway(Algorithm):
    """Tries the served gateway over real HTTP with and without its tokens, then runs the agent."""

    def model_spec(self) -> agl.ModelSpec:
        return agl.ModelSpec(str(tiny_model()))

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> dict[str, Any]:
        assert ctx.llm is not None
        resources_id = await ctx.publish({"llm": ctx.llm})
        root = ctx.llm.endpoint.split("/rollout/")[0]
        base = f"{root}/v1"  # unattributed calls are proxied, not recorded
        body = {"model": "policy", "messages": USER, "max_tokens": 2}
        key = {"Authorization": f"Bearer {ctx.llm.api_key}"}
        async with httpx.AsyncClient(timeout=60) as http:
            codes = {
                "call_without_token": (await http.post(f"{base}/chat/completions", json=body)).status_code,
                "call_wrong_token": (
                    await http.post(
                        f"{base}/chat/completions", json=body, headers={"Authorization": "Bearer guess"}
                    )
                ).status_code,
                "call_with_token": (
                    await http.post(f"{base}/chat/completions", json=body, headers=key)
                ).status_code,
                "metrics_without_token": (await http.get(f"{root}/metrics")).status_code,
                "metrics_with_client_token": (await http.get(f"{root}/metrics", headers=key)).status_code,
                "pause_without_token": (await http.post(f"{root}/admin/pause")).status_code,
            }
        done = await ctx.rollouts(train, resources_id=resources_id, timeout_s=120)
        return {"codes": codes, "api_key": ctx.llm.api_key, "rewards": [r.status.value for r, _ in done]}


_FIT_ON_A_STORE_SERVER = """
import json
import agl
from tests.trainer.test_serving import ProbeTheGateway, keyed_agent

if __name__ == "__main__":
    serving = agl.Serving(host="0.0.0.0", public_host="127.0.0.1")  # beyond loopback, no token given
    trainer = agl.Trainer(algorithm=ProbeTheGateway(), n_runners=2, store={url!r}, output_dir={out!r}, serving=serving)
    print("RESULT", json.dumps(trainer.fit(keyed_agent, ["a", "b"])))
"""


@pytest.mark.slow  # a store server, the tiny engine and a fit in a child process
@pytest.mark.timeout(180)
def test_fit_guards_its_gateway_beyond_loopback_and_closes_every_client(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.runner.store_process import ROOT, StoreProcess, child_env

    token = "closing-token-0123456789"
    server = StoreProcess(tmp_path / "store.db", token=token).start()
    script = tmp_path / "fit.py"
    script.write_text(_FIT_ON_A_STORE_SERVER.format(url=server.url, out=str(tmp_path / "out")))
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            env=child_env(PYTHONDEVMODE="1", AGL_STORE_TOKEN=token),  # dev mode reports unclosed clients
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=150,
        )
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    generated = result["api_key"]
    assert generated and len(generated) >= 24
    assert f"fit made one: {generated}" in done.stderr  # printed once, so the user can use it
    assert result["codes"] == {
        "call_without_token": 401,
        "call_wrong_token": 401,
        "call_with_token": 200,
        "metrics_without_token": 401,
        "metrics_with_client_token": 401,  # an agent's key is not the admin's
        "pause_without_token": 401,
    }
    assert result["rewards"] == ["succeeded", "succeeded"]  # agents using llm.api_key work unchanged
    assert "Loading weights" not in done.stderr  # the engine's load stays off the console
    assert "Unclosed" not in done.stderr and "ResourceWarning" not in done.stderr, done.stderr[-3000:]


def test_serving_settings_choose_the_client_token_and_keep_it_out_of_repr() -> None:
    assert gateway_client_token(agl.Serving()) is None  # loopback: model routes stay open, as before
    assert gateway_client_token(agl.Serving(host="::1")) is None
    assert gateway_client_token(agl.Serving(host="localhost", token="t")) == "t"  # chosen: on loopback too
    assert gateway_client_token(agl.Serving(host="10.1.2.3", token="mine")) == "mine"
    assert not agl.Serving(host="trainer.lan").loopback
    assert "token" not in repr(agl.Serving(token="secret-value")).replace("token=", "")
    assert "secret-value" not in repr(agl.Serving(token="secret-value"))


class WriteOne(Algorithm):
    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> str:
        (Path(ctx.output_dir) / "marker.txt").write_text("x")
        return ctx.output_dir


def test_each_fit_writes_to_its_own_named_run_folder_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = agl.Trainer(algorithm=WriteOne(), n_runners=1)
    first = trainer.fit(agl.rollout(lambda task: 1.0), [])
    assert trainer.run_dir == Path(first)
    assert f"writes to {first}/" in capsys.readouterr().err  # the user is told where the run went
    second = trainer.fit(agl.rollout(lambda task: 1.0), [])
    assert first != second  # a rerun never piles into the same store.db
    for run in (first, second):
        assert Path(run).parent == Path("results") and Path(run).name.startswith("writeone-")
        assert sorted(os.listdir(run)) == ["marker.txt", "store.db"]
    explicit = agl.Trainer(algorithm=WriteOne(), n_runners=1, output_dir=str(tmp_path / "mine"))
    assert explicit.fit(agl.rollout(lambda task: 1.0), []) == str(tmp_path / "mine")


def test_fit_quiets_transformers_bars_and_the_harmless_warning_only() -> None:
    import logging

    from transformers.utils import logging as hf_logging

    from agl.trainer.quiet import quiet_transformers

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    logger = hf_logging.get_logger("transformers.utils.generic")  # where the use_cache warning comes from
    seen = Collect()
    logger.addHandler(seen)
    harmless = "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
    try:
        assert hf_logging.is_progress_bar_enabled()
        with quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled()  # "Loading weights" / "Writing model shards"
            logger.warning(harmless)
            logger.warning("a warning that matters")
        assert seen.messages == ["a warning that matters"]
        assert hf_logging.is_progress_bar_enabled()  # restored
        logger.warning(harmless)
        assert seen.messages[-1] == harmless  # narrowly: only during fit
    finally:
        logger.removeHandler(seen)


def test_the_examples_tiny_runs_never_write_over_the_demo_run(tmp_path: Path) -> None:
    from examples.calc.train import default_out, fresh_store

    assert default_out("calc", "smollm2") == Path("results/calc")  # what make demo writes (README)
    assert default_out("calc", "tiny") == Path("results/calc-tiny")
    assert default_out("sft", "tiny") != default_out("sft", "smollm2")
    (tmp_path / "store.db").write_text("the last run")
    (tmp_path / "summary.json").write_text("{}")
    fresh_store(tmp_path)  # a rerun starts with an empty store, not on top of the last one
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]
