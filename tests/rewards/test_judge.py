"""``agl.rewards.Judge`` against a real OpenAI-compatible HTTP server on loopback (the judge stands for a paid
API, scripted here): good JSON, a malformed reply retried, always malformed (no reward, never 0), and the
verdict written to a real store as reward spans that adapters read and training never samples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import agl
from agl import semconv as sc
from agl.adapter import final_reward, llm_calls, to_messages
from agl.algorithm.base import Evaluation, rollout_spans
from agl.algorithm.grpo import GRPOConfig, build_batch
from agl.algorithm.grpo.judging import judge_evaluation
from agl.algorithm.health import Failures
from agl.cli.train import ConfigProblem, merge, plan
from agl.errors import ConfigError, JudgeError
from agl.rewards import Judge, judge_rollouts, trajectory_text
from agl.rewards.judge import MalformedReply, parse_scores
from agl.schemas import AttemptStatus, Rollout, RolloutCreate, Span
from agl.store import InMemoryLightningStore
from tests.adapter.spans import SpanMaker
from tests.support.openai_upstream import OpenAIUpstream, ScriptedReply


def scores(*values: float) -> str:
    return json.dumps(
        {"scores": [{"trajectory": i, "score": v, "reason": f"reason {i}"} for i, v in enumerate(values, 1)]}
    )


@pytest.fixture
def upstream() -> Iterator[OpenAIUpstream]:
    with OpenAIUpstream(model="judge-model", api_key="sk-judge") as up:
        yield up


def make_judge(up: OpenAIUpstream, **kw: Any) -> Judge:
    return Judge(
        up.base_url, "Correct and short answers score high.", model="judge-model", api_key="sk-judge", **kw
    )


def test_parse_scores_accepts_the_asked_json_and_names_each_problem() -> None:
    got = parse_scores("```json\n" + scores(0.25, 1) + "\n```", 2)
    assert [(s.score, s.reason) for s in got] == [(0.25, "reason 1"), (1.0, "reason 2")]
    shuffled = '{"scores": [{"trajectory": 2, "score": 0, "reason": "b"}, {"trajectory": 1, "score": 1, "reason": "a"}]}'
    assert [s.reason for s in parse_scores(shuffled, 2)] == ["a", "b"]  # by trajectory number
    for text, problem in [
        ("sure, the first is better", "no JSON"),
        ("{'scores': [}", "not valid JSON"),
        (scores(0.5), "1 scores for 2"),
        (scores(0.5, 1.5), "outside 0-1"),
        (scores(0.5, float("nan")).replace("NaN", '"x"'), "not a number"),
        (
            '{"scores": [{"trajectory": 1, "score": 1, "reason": "a"}, {"trajectory": 1, "score": 0, "reason": "b"}]}',
            "expected each of 1..2 once",
        ),
        ('{"scores": [{"score": 1}, {"score": 0, "reason": "b"}]}', "has no reason"),
    ]:
        with pytest.raises(MalformedReply, match=problem):
            parse_scores(text, 2)


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="endpoint"):
        Judge("api.openai.com", "rubric", model="m")
    with pytest.raises(ConfigError, match="rubric"):
        Judge("http://127.0.0.1:1/v1", " ", model="m")
    with pytest.raises(ConfigError, match="max_tries"):
        Judge("http://127.0.0.1:1/v1", "rubric", model="m", max_tries=0)
    with pytest.raises(ConfigError, match="judge"):
        GRPOConfig(model_path="unused", judge="gpt-4o")  # type: ignore[arg-type]


async def test_one_call_scores_the_group_side_by_side(upstream: OpenAIUpstream) -> None:
    upstream.script(scores(0.9, 0.1))
    verdict = await make_judge(upstream).score("2+2?", ["user: 2+2?\nFinal answer: 4", "Final answer: 5"])
    assert [s.score for s in verdict.scores] == [0.9, 0.1] and len(verdict.replies) == 1
    (request,) = upstream.requests
    assert request.headers["authorization"] == "Bearer sk-judge"
    body = request.body
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    system, user = body["messages"]
    assert (
        "Correct and short answers score high." in system["content"]
        and "exactly 2 entries" in system["content"]
    )
    assert "Task:\n2+2?" in user["content"]
    assert "=== Trajectory 1 ===\nuser: 2+2?\nFinal answer: 4" in user["content"]
    assert "=== Trajectory 2 ===\nFinal answer: 5" in user["content"]


async def test_a_malformed_reply_is_retried_with_the_problem_named(upstream: OpenAIUpstream) -> None:
    upstream.script(scores(0.5, 1.2), scores(0.5, 1.0))
    verdict = await make_judge(upstream).score("task", ["a", "b"])
    assert [s.score for s in verdict.scores] == [0.5, 1.0] and len(verdict.replies) == 2
    retry = upstream.requests[1].body["messages"]
    assert retry[-2] == {"role": "assistant", "content": scores(0.5, 1.2)}
    assert "outside 0-1" in retry[-1]["content"]


async def test_always_malformed_raises_after_max_tries(upstream: OpenAIUpstream) -> None:
    upstream.script("not json", scores(0.5), "still not json", "unused")
    with pytest.raises(JudgeError, match="no usable scores in 3 tries") as caught:
        await make_judge(upstream).score("task", ["a", "b"], group_id="g1")
    assert caught.value.group_id == "g1" and caught.value.replies == [
        "not json",
        scores(0.5),
        "still not json",
    ]
    assert len(upstream.requests) == 3
    assert isinstance(caught.value, agl.errors.AglError)


async def test_an_endpoint_error_is_a_judge_error(upstream: OpenAIUpstream) -> None:
    upstream.script(ScriptedReply(status=400))
    with pytest.raises(JudgeError, match="BadRequestError"):
        await make_judge(upstream, http_retries=0).score("task", ["a"])


async def _group(
    store: InMemoryLightningStore, group: str, answers: list[str], reward: float | None = None
) -> list[Rollout]:
    """Succeeded rollouts of one group, each one model call (with token ids) that answers ``answers[i]``."""
    out = []
    for answer in answers:
        started = await store.start_rollout(RolloutCreate(input={"q": "capital of France?"}, group_id=group))
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        m = SpanMaker(rid, aid)
        messages = [{"role": "user", "content": "capital of France?"}]
        call = m.call(
            [1, 2, 3],
            [4, 5],
            attrs={
                sc.LLM_REQUEST_MESSAGES: messages,
                sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": answer},
            },
        )
        spans = [call] + ([] if reward is None else [m.reward(reward)])
        await store.add_spans([s.model_copy(update={"sequence_id": None}) for s in spans])
        await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
        out.append(await store.get_rollout(rid))
    return out


async def test_verdicts_become_reward_spans_and_a_failed_group_gets_none(upstream: OpenAIUpstream) -> None:
    async with InMemoryLightningStore() as store:
        good = await _group(store, "g-good", ["Paris", "Lyon"])
        bad = await _group(store, "g-bad", ["Paris", "Rome"])
        labelled = await _group(store, "g-labelled", ["Paris", "Nice"], reward=0.3)
        rollouts = good + bad + labelled
        spans = {r.rollout_id: await rollout_spans(store, r.rollout_id) for r in rollouts}
        assert (
            trajectory_text(spans[good[0].rollout_id])
            == "user: capital of France?\nassistant: Paris\nFinal answer: Paris"
        )
        # the two groups are judged concurrently: whichever asks first gets the good reply, the other fails twice
        upstream.script(scores(1.0, 0.2), "no", "no")
        judged = await judge_rollouts(store, make_judge(upstream, max_tries=2), rollouts, spans)
        assert (judged.groups, judged.failures) == (2, 1) and len(upstream.requests) == 3
        scored = [g for g in (good, bad) if not {r.rollout_id for r in g} & judged.dropped]
        (winner,) = scored
        loser = bad if winner is good else good
        assert judged.dropped == {r.rollout_id for r in loser}
        for r, value in zip(winner, [1.0, 0.2], strict=True):
            stored = await rollout_spans(store, r.rollout_id)
            assert final_reward(stored) == value == final_reward(judged.spans[r.rollout_id])
            reward = next(s for s in stored if s.name == sc.SPAN_REWARD)
            judge_span = next(s for s in stored if s.name == sc.SPAN_JUDGE)
            assert reward.attributes[sc.TAGS] == ["judge"] and reward.parent_id == judge_span.span_id
            assert reward.attributes[sc.REWARD_REASON].startswith("reason ")
            assert judge_span.attributes[sc.JUDGE_ROLLOUT_IDS] == [x.rollout_id for x in winner]
        for r in loser:  # no reward at all, not a 0; the judge span says why
            stored = await rollout_spans(store, r.rollout_id)
            assert final_reward(stored) is None
            failed = next(s for s in stored if s.name == sc.SPAN_JUDGE)
            assert "no usable scores in 2 tries" in failed.attributes[sc.JUDGE_ERROR]
            assert failed.attributes[sc.JUDGE_REPLIES] == ["no", "no"]
        for r in labelled:  # a returned reward is kept, and its group is not shown to the judge
            assert final_reward(await rollout_spans(store, r.rollout_id)) == 0.3
        digests = {d.rollout_id: d.reward for d in (await store.query_digests()).items}
        assert [digests[r.rollout_id] for r in winner] == [1.0, 0.2]  # what the dashboard lists


def _with_judge_call(spans: list[Span], rid: str) -> list[Span]:
    """The spans plus a judge span shaped like a model call with token ids (the worst case)."""
    m = SpanMaker(rid, spans[0].attempt_id)
    m.seq = max(s.sequence_id or 0 for s in spans)
    fake = m.call([7, 8, 9], [10, 11], response_id=f"{rid}-judge")
    return [*spans, fake.model_copy(update={"name": sc.SPAN_JUDGE})]


def test_judge_spans_are_never_trained_on_nor_read_as_the_agents_calls() -> None:
    spans: dict[str, list[Span]] = {}
    rollouts = []
    for i, reward in enumerate([1.0, 0.0]):
        rid = f"r{i}"
        m = SpanMaker(rid)
        spans[rid] = [m.call([1, 2], [3, 4 + i], response_id=f"{rid}-a"), m.reward(reward)]
        rollouts.append(
            Rollout(rollout_id=rid, group_id="g", status="succeeded", created_at=0.0, updated_at=0.0)
        )
    config = GRPOConfig(model_path="unused", group_size=2)
    plain = build_batch(rollouts, spans, config)
    judged = {rid: _with_judge_call(s, rid) for rid, s in spans.items()}
    assert all(len(llm_calls(s)) == 1 for s in judged.values())
    assert to_messages(llm_calls(judged["r0"])) == to_messages(llm_calls(spans["r0"]))
    with_judge = build_batch(rollouts, judged, config)
    assert with_judge.samples == plain.samples and len(plain.samples) == 2
    assert all(7 not in s.input_ids for s in with_judge.samples)


def test_agl_train_config_builds_the_judge_and_keeps_its_key_out_of_the_saved_config() -> None:
    judge = "{endpoint: 'http://127.0.0.1:9/v1', rubric: 'short is good', model: critic, api_key: sk-secret}"
    run = plan(merge(None, {"algorithm": "grpo"}, ["grpo.model_path=m", f"grpo.judge={judge}"]))
    built = run.algorithm_config.judge
    assert isinstance(built, Judge) and (built.model, built.api_key) == ("critic", "sk-secret")
    assert (
        run.resolved["grpo"]["judge"]["api_key"] is None
        and run.resolved["grpo"]["judge"]["model"] == "critic"
    )
    with pytest.raises(ConfigProblem, match="rubric"):
        plan(
            merge(
                None,
                {"algorithm": "grpo"},
                ["grpo.model_path=m", "grpo.judge={endpoint: 'http://x/v1', model: m}"],
            )
        )


@pytest.mark.parametrize("checker_last", [True, False])
def test_a_trajectory_shows_each_agents_messages_tool_calls_and_final_answer(checker_last: bool) -> None:
    m = SpanMaker("r1")
    ask: list[dict[str, Any]] = [{"role": "user", "content": "weather in Oslo?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    first: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    second_ask: list[dict[str, Any]] = [
        *ask,
        first,
        {"role": "tool", "tool_call_id": "c1", "content": "rain, 4C"},
    ]
    said = {"role": "assistant", "content": "Rainy, 4C."}
    check = [{"role": "user", "content": "check: Rainy, 4C."}]
    ok = {"role": "assistant", "content": "ok"}

    def planner(request: list[dict[str, Any]], reply: dict[str, Any]) -> Span:
        attrs = {sc.LLM_REQUEST_MESSAGES: request, sc.LLM_RESPONSE_MESSAGE: reply, sc.AGENT_NAME: "planner"}
        return m.call([1], [2], attrs=attrs)

    def checker() -> Span:
        attrs = {sc.LLM_REQUEST_MESSAGES: check, sc.LLM_RESPONSE_MESSAGE: ok, sc.AGENT_NAME: "checker"}
        return m.call([9], [8], attrs=attrs)

    if checker_last:  # the spans in the order the calls were made
        spans = [planner(ask, first), planner(second_ask, said), checker()]
    else:
        spans = [planner(ask, first), checker(), planner(second_ask, said)]
    assert trajectory_text(spans).splitlines() == [
        "[agent planner]",
        "user: weather in Oslo?",
        'assistant calls weather({"city": "Oslo"})',
        "tool c1: rain, 4C",
        "assistant: Rainy, 4C.",
        "[agent checker]",
        "user: check: Rainy, 4C.",
        "assistant: ok",
        f"Final answer: {'ok' if checker_last else 'Rainy, 4C.'}",  # the last call's agent's last words
    ]
    assert trajectory_text([]) == "(no model calls recorded)\nFinal answer: (none)"


async def test_validation_judges_each_rollout_alone_and_leaves_a_failed_one_out(
    upstream: OpenAIUpstream,
) -> None:
    async with InMemoryLightningStore() as store:
        rollouts = await _group(store, "val", ["Paris", "Rome"])  # one group id, still judged one by one
        results = [(r, await rollout_spans(store, r.rollout_id)) for r in rollouts]
        upstream.script(scores(0.8), "no", "no")
        judge = make_judge(upstream, max_tries=2)
        got = await judge_evaluation(store, judge, Evaluation(0.0, Failures(0, 2), results))
        assert got.score == 0.8 and len(got.results) == 1  # not (0.8 + 0) / 2
        assert all("=== Trajectory 2 ===" not in r.body["messages"][1]["content"] for r in upstream.requests)
        assert final_reward(got.results[0][1]) == 0.8
