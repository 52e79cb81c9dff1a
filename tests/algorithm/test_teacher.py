"""A teacher as the warm start: the unchanged agent runs against it through the gateway, its good rollouts
(by reward) are re-rendered in the student's template and trained on, never mixed into GRPO groups.

The hosted teacher is a scripted OpenAI-compatible HTTP server (a paid API in real use); the local one is a
second tiny model that fit serves with its own built-in engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl import semconv as sc
from agl.adapter import llm_calls
from agl.algorithm import teacher as teacher_module
from agl.algorithm.grpo import GRPO, GRPOConfig, WarmStart
from agl.algorithm.grpo import algorithm as grpo_module
from agl.algorithm.sft import SFT, SFTConfig, export_jsonl, samples_from_store
from agl.errors import ConfigError
from agl.gateway.config import UpstreamConfig
from agl.gateway.upstreams import UpstreamPool
from agl.models import tiny_model
from agl.schemas import Rollout, Span
from agl.store.sqlite import SqliteLightningStore
from tests.tiny_agents import digits_agent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@agl.rollout
async def calculator_agent(task: str, llm: agl.LLM) -> float:
    """Reward 1 when the model calls the calculator and then answers; the same code for student and teacher."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    try:
        first = await client.chat.completions.create(
            model=llm.model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=8,
        )
        reply = first.choices[0].message
        if not reply.tool_calls:
            return 0.0
        messages.append(reply.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in reply.tool_calls]
        second = await client.chat.completions.create(
            model=llm.model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=8,
        )
        return 1.0 if (second.choices[0].message.content or "").startswith("Answer") else 0.0
    finally:
        await client.close()


class ScriptedTeacher:
    """An OpenAI-compatible chat endpoint over real HTTP: it calls the calculator on tasks that say
    "good", answers after a tool result, and gives up otherwise."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def _send(self, body: dict[str, Any], status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": "stub-teacher", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                outer.auth.append(self.headers.get("Authorization"))
                if self.headers.get("Authorization") != "Bearer sk-teacher":
                    self._send({"error": {"message": "Incorrect API key provided"}}, status=401)
                    return
                self._send(outer.reply(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        message: dict[str, Any] = {"role": "assistant", "content": "I cannot tell."}
        finish = "stop"
        if last["role"] == "tool":
            message["content"] = f"Answer: {last['content']}"
        elif "good" in str(last.get("content")):
            call = {"name": "calculator", "arguments": json.dumps({"expression": "40 + 2"})}
            n = len(self.requests)
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"call-{n}", "type": "function", "function": call}],
            }
            finish = "tool_calls"
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted() -> Iterator[ScriptedTeacher]:
    server = ScriptedTeacher()
    yield server
    server.close()


def _stored(path: Path) -> tuple[list[Rollout], dict[str, list[Span]], dict[str, Any]]:
    """Every rollout in the run's store, their spans, and the resources versions by id."""

    async def read() -> tuple[list[Rollout], dict[str, list[Span]], dict[str, Any]]:
        store = SqliteLightningStore(path)
        try:
            rollouts = (await store.query_rollouts(limit=1000)).items
            spans = {
                r.rollout_id: (await store.query_spans(rollout_id=r.rollout_id, limit=1000)).items
                for r in rollouts
            }
            resources = {v.resources_id: v for v in (await store.query_resources(limit=1000)).items}
            return rollouts, spans, resources
        finally:
            await store.aclose()

    return asyncio.run(read())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_endpoint_teacher_warm_starts_grpo_and_stays_out_of_its_groups(
    tmp_path: Path,
    scripted: ScriptedTeacher,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agl.algorithm.grpo.algorithm")
    batched: list[list[Rollout]] = []
    real_build = grpo_module.build_batch

    def spy_build(rollouts: list[Rollout], *args: Any, **kwargs: Any) -> Any:
        batched.append(list(rollouts))
        return real_build(rollouts, *args, **kwargs)

    trained: list[Any] = []
    real_steps = teacher_module.sft_steps

    def spy_steps(policy: Any, samples: list[Any], **kwargs: Any) -> Any:
        trained.append((policy.tokenizer, samples))
        return real_steps(policy, samples, **kwargs)

    monkeypatch.setattr(grpo_module, "build_batch", spy_build)
    monkeypatch.setattr(teacher_module, "sft_steps", spy_steps)
    teacher = agl.Teacher(
        scripted.url,
        model="stub-teacher",
        api_key="sk-teacher",
        samples_per_task=2,
        min_reward=1.0,
        top_k=1,
        steps=2,
        batch_size=2,
        lr=1e-3,
    )
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=1,
        tasks_per_step=2,
        group_size=2,
        eval_every=1,
        warm_start=teacher,
        export_model=False,
    )
    out = tmp_path / "run"
    train, val = ["good 1", "bad 1", "good 2"], ["good 3", "bad 2"]
    result = agl.Trainer(algorithm=GRPO(config), n_runners=4, output_dir=str(out)).fit(
        calculator_agent, train, val
    )

    # the summary: the teacher's own held-out score beside the student's three
    phases = result["phases"]
    assert set(phases) == {"teacher", "base", "after_warm_start", "after_grpo"}
    assert phases["teacher"] == 0.5  # "good 3" passes, "bad 2" does not
    assert result["teacher"]["teacher_rollouts"] == 6 and result["teacher"]["teacher_kept"] == 2
    assert len(result["warm_start"]) == 2  # the schedule's two SFT steps
    summary = [r.getMessage() for r in caplog.records if "after_grpo" in r.getMessage()]
    assert summary == [
        "held-out reward: "
        + ", ".join(f"{k} {phases[k]:.3f}" for k in ("base", "teacher", "after_warm_start", "after_grpo"))
    ]

    # the endpoint got every call with its key and model name, none with the student's
    assert scripted.requests and {r["model"] for r in scripted.requests} == {"stub-teacher"}
    assert set(scripted.auth) == {"Bearer sk-teacher"}
    assert all(r.get("tools") == TOOLS for r in scripted.requests)

    # the store holds the teacher's rollouts under their own mode and resources version
    rollouts, spans, resources = _stored(out / "store.db")
    teacher_runs = [r for r in rollouts if r.mode == "teacher"]
    assert len(teacher_runs) == 6 and len([r for r in rollouts if r.mode == "teacher_val"]) == 2
    teacher_ids = {r.rollout_id for r in rollouts if r.mode.startswith("teacher")}
    for r in teacher_runs:
        version = resources[r.resources_id or ""]
        assert version.metadata["role"] == "teacher"
        assert version.resources["llm"].model == "stub-teacher"  # type: ignore[union-attr]
        calls = llm_calls(spans[r.rollout_id])
        assert calls and all(c.source == "gateway" and c.model == "stub-teacher" for c in calls)

    # GRPO's groups: only the student's train rollouts, never a teacher's
    grouped = [r for batch in batched for r in batch]
    assert grouped and all(r.mode == "train" for r in grouped)
    assert not teacher_ids & {r.rollout_id for r in grouped}

    # the warm start trained on the kept conversations in the student's template, tool calls included
    ((tokenizer, samples),) = trained
    assert {s.rollout_id for s in samples} == {"teacher-trace-0", "teacher-trace-1"}
    targets = [
        tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]) for s in samples
    ]
    assert any("<tool_call>" in t and "calculator" in t for t in targets)
    assert any("Answer: 42" in t for t in targets)
    assert all(s.old_logprobs is None for s in samples)  # rendered, not the teacher's own token ids

    # the traces as a dataset: OpenAI chat format with the declared tools, read back by WarmStart
    lines = [json.loads(x) for x in (out / "teacher_traces.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["tools"] == TOOLS for line in lines)
    for line in lines:
        roles = [m["role"] for m in line["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert line["messages"][0]["content"].startswith("good")
        assert line["messages"][1]["tool_calls"][0]["function"]["name"] == "calculator"
    warm = WarmStart.from_jsonl(out / "teacher_traces.jsonl", steps=3, lr=1e-4)
    assert warm.tools == TOOLS and [list(c) for c in warm.conversations] == [x["messages"] for x in lines]
    assert (warm.steps, warm.lr) == (3, 1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("key", "tasks", "val", "error"),
    [
        # every rollout fails: the error names the first failure
        ("sk-wrong", ["good 1", "good 2"], [], r"kept none, 2 failed \(the first: .*401.*Incorrect API key"),
        # every rollout succeeds and scores 0: the error says so, with the teacher's own held-out score
        (
            "sk-teacher",
            ["bad 1", "bad 2"],
            ["bad 3"],
            r"2 train tasks kept none .*its own held-out score 0\.000",
        ),
    ],
    ids=["every-rollout-fails", "cannot-do-the-task"],
)
def test_a_teacher_that_keeps_nothing_stops_the_run_saying_why(
    tmp_path: Path, scripted: ScriptedTeacher, key: str, tasks: list[str], val: list[str], error: str
) -> None:
    teacher = agl.Teacher(scripted.url, model="stub-teacher", api_key=key, samples_per_task=1)
    config = GRPOConfig(model_path=str(tiny_model()), steps=0, warm_start=teacher, export_model=False)
    trainer = agl.Trainer(algorithm=GRPO(config), n_runners=2, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=error):
        trainer.fit(calculator_agent, tasks, val)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_local_teacher_folder_is_served_by_fit_on_its_own_engine(tmp_path: Path) -> None:
    config = SFTConfig(
        model_path=str(tiny_model()),
        iterations=1,
        samples_per_task=2,
        tasks_per_iteration=2,
        min_reward=None,
        batch_size=2,
        lr=1e-3,
        teacher=agl.Teacher(
            path=str(tiny_model(seed=1)), samples_per_task=2, min_reward=None, top_k=1, steps=1
        ),
    )
    out = tmp_path / "run"
    result = agl.Trainer(algorithm=SFT(config), n_runners=4, output_dir=str(out)).fit(
        digits_agent, ["a", "b"], ["c"]
    )
    assert set(result["phases"]) == {"teacher", "base", "after_warm_start", "after_sft"}
    assert result["teacher"]["teacher_rollouts"] == 4 and result["teacher"]["teacher_kept"] == 2
    rollouts, spans, _ = _stored(out / "store.db")
    by_mode: dict[str, list[Any]] = {}
    for r in rollouts:
        for call in llm_calls(spans[r.rollout_id]):
            by_mode.setdefault(r.mode, []).append(call)
    teacher_calls = by_mode["teacher"] + by_mode["teacher_val"]
    assert all(c.model == "teacher" for c in teacher_calls)
    assert all(str(c.attributes[sc.LLM_BACKEND]).startswith("teacher:") for c in teacher_calls)
    student = by_mode["train"] + by_mode["val"]
    assert student and not any(str(c.attributes[sc.LLM_BACKEND]).startswith("teacher:") for c in student)

    # an offline SFT over this store later takes the student's rollouts, never the teacher's token ids
    async def offline() -> Any:
        async with SqliteLightningStore(out / "store.db") as store:
            return await samples_from_store(store)

    selected = {s.rollout_id for s in asyncio.run(offline()).samples}
    teacher_ids = {r.rollout_id for r in rollouts if r.mode.startswith("teacher")}
    assert selected and teacher_ids and not selected & teacher_ids
    # no tools declared: the exported lines are plain chat
    lines = [json.loads(x) for x in (out / "teacher_traces.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(
        "tools" not in x and x["messages"][-1]["role"] == "assistant" for x in lines
    )


@agl.rollout
async def any_way_agent(task: str, llm: agl.LLM) -> float:
    """Reward 1 for any answer, whether or not the calculator was called first: the way a right answer
    can be reached without the tool."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    try:
        for _ in range(2):
            reply = (
                (
                    await client.chat.completions.create(
                        model=llm.model,
                        messages=messages,  # type: ignore[arg-type]
                        tools=TOOLS,  # type: ignore[arg-type]
                        max_tokens=8,
                    )
                )
                .choices[0]
                .message
            )
            if not reply.tool_calls:
                return 1.0 if reply.content else 0.0
            messages.append(reply.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in reply.tool_calls]
        return 0.0
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("keep", [None, agl.Teacher.calls_a_tool])
def test_a_keep_test_drops_right_answers_reached_without_the_tool(
    tmp_path: Path, scripted: ScriptedTeacher, keep: Any
) -> None:
    teacher = agl.Teacher(
        scripted.url, model="stub-teacher", api_key="sk-teacher", samples_per_task=1, keep=keep, steps=1
    )
    config = SFTConfig(
        model_path=str(tiny_model()),
        iterations=1,
        samples_per_task=1,
        tasks_per_iteration=2,
        min_reward=None,
        batch_size=2,
        teacher=teacher,
    )
    out = tmp_path / "run"
    result = agl.Trainer(algorithm=SFT(config), n_runners=4, output_dir=str(out)).fit(
        any_way_agent, ["good 1", "plain 1", "good 2", "plain 2"], ["good 3"]
    )
    counts = result["teacher"]
    lines = [json.loads(x) for x in (out / "teacher_traces.jsonl").read_text().splitlines()]
    with_tool = [x for x in lines if any(m.get("tool_calls") for m in x["messages"])]
    if keep is None:  # every rollout scored 1: all four are kept, two of them never call the tool
        assert counts["teacher_kept"] == 4 and len(lines) == 4 and len(with_tool) == 2
        assert "teacher_failed_keep" not in counts
    else:
        assert counts["teacher_kept"] == 2 and counts["teacher_failed_keep"] == 2
        assert len(lines) == 2 and len(with_tool) == 2


TEACHER_PROBES: list[tuple[str, bool]] = []


@agl.rollout
async def teacher_probing_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    """``digits_agent``; as the student it first asks the teacher's model name too, and notes whether the
    teacher still answers."""
    if llm.model == "policy":
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=0)
        try:
            await client.chat.completions.create(
                model="teacher", messages=[{"role": "user", "content": task}], max_tokens=2
            )
            TEACHER_PROBES.append((rollout.mode, True))
        except openai.APIError:
            TEACHER_PROBES.append((rollout.mode, False))
        finally:
            await client.close()
    return float(await digits_agent(task, llm))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_local_teacher_is_stopped_once_its_traces_are_in(tmp_path: Path) -> None:
    """Its engine's memory goes to the student's training: before the warm start (the base score) the
    teacher answers; in the student's training after it, the teacher's name no longer reaches a model."""
    TEACHER_PROBES.clear()
    config = SFTConfig(
        model_path=str(tiny_model()),
        iterations=1,
        samples_per_task=2,
        tasks_per_iteration=2,
        min_reward=None,
        batch_size=2,
        lr=1e-3,
        teacher=agl.Teacher(path=str(tiny_model(seed=1)), samples_per_task=1, min_reward=None, steps=1),
    )
    agl.Trainer(algorithm=SFT(config), n_runners=2, output_dir=str(tmp_path / "run")).fit(
        teacher_probing_agent, ["a", "b"], ["c"]
    )
    answered = {mode: [ok for m, ok in TEACHER_PROBES if m == mode] for mode in ("val", "train")}
    assert answered["val"][0] is True  # the base score, before the teacher's traces
    assert answered["train"] and not any(answered["train"])  # after them: the teacher's engine is gone


def test_a_teacher_is_an_endpoint_with_a_model_or_a_folder() -> None:
    assert GRPO(GRPOConfig(model_path="/m", warm_start=agl.Teacher(path="/t"))).model_spec().teacher == (
        agl.Teacher(path="/t").spec()
    )
    spec = SFT(
        SFTConfig(model_path="/m", teacher=agl.Teacher("http://h/v1", model="m", api_key="k"))
    ).model_spec()
    assert spec.teacher is not None and (spec.teacher.endpoint, spec.teacher.model) == ("http://h/v1", "m")
    assert "sk-secret" not in repr(agl.Teacher("http://h/v1", model="m", api_key="sk-secret"))
    for make, message in [
        (lambda: agl.Teacher("http://h/v1"), "needs model="),
        (lambda: agl.Teacher(), "exactly one of path"),
        (lambda: agl.Teacher("http://h/v1", model="m", path="/t"), "exactly one of path"),
        (lambda: agl.Teacher(path="/t", samples_per_task=0), "Teacher.samples_per_task must be"),
        (lambda: agl.Teacher(path="/t", top_k=0), "Teacher.top_k must be"),
        (lambda: agl.Teacher(path="/t", keep="tool-calls"), "Teacher.keep must be a function"),  # type: ignore[arg-type]
        (lambda: GRPOConfig(model_path="/m", warm_start="gold.jsonl"), "GRPOConfig.warm_start must be"),  # type: ignore[arg-type]
        (lambda: SFTConfig(model_path="/m", teacher=agl.Teacher(path="/t"), from_store="x.db"), "from_store"),
    ]:
        with pytest.raises(ConfigError, match=message):
            make()


def test_teacher_traces_round_trip_through_jsonl_with_their_tools(tmp_path: Path) -> None:
    call = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    first: list[dict[str, Any]] = [
        {"role": "user", "content": "good"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "42"},
        {"role": "assistant", "content": "Answer: 42"},
    ]
    second: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    path = tmp_path / "traces.jsonl"
    assert export_jsonl([first, second], path, tools=[TOOLS, None]) == 2
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [{"messages": first, "tools": TOOLS}, {"messages": second}]
    warm = WarmStart.from_jsonl(path, steps=2, batch_size=4)
    assert warm.tools == TOOLS and list(warm.conversations) == [first, second] and warm.batch_size == 4

    other = [{**TOOLS[0], "function": {"name": "search", "parameters": {}}}]
    export_jsonl([first, second], path, tools=[TOOLS, other])
    with pytest.raises(ConfigError, match="other tools than the lines before"):
        WarmStart.from_jsonl(path)
    path.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(ConfigError, match=r"traces.jsonl:2 is not JSON"):
        WarmStart.from_jsonl(path)
    path.write_text("")
    with pytest.raises(ConfigError, match="holds no conversation"):
        WarmStart.from_jsonl(path)
    with pytest.raises(ConfigError, match="reads conversations and tools from the file"):
        WarmStart.from_jsonl(path, tools=TOOLS)


def test_the_gateway_routes_the_teachers_name_to_its_replica_only() -> None:
    policy = UpstreamConfig(url="http://policy/v1", kind="agl")
    teacher = UpstreamConfig(url="http://teacher/v1", kind="openai", models=["teacher"])
    pool = UpstreamPool([policy, teacher])
    for key in ("ro-1", "ro-2", "ro-3", None):
        assert [r.config.url for r in pool.candidates("teacher", key)] == ["http://teacher/v1"]
        assert [r.config.url for r in pool.candidates("policy", key)] == ["http://policy/v1"]
        assert [r.config.url for r in pool.candidates(None, key)] == ["http://policy/v1"]
