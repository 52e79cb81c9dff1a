"""The dashboard's JSON API against a real store server holding real rollouts, spans and resources."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.adapter import llm_calls
from agl.adapter.behaviour import rollout_behaviour
from agl.asgi_server import BackgroundServer
from agl.dashboard import create_dashboard, standalone_app
from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import InMemoryLightningStore
from agl.testing import free_port, wait_http
from tests.dashboard.conftest import API_KEY, CRITIQUE, PROMPT_V1, TOKEN, Filled

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def http(filled: Filled) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=filled.url, headers=AUTH, timeout=30) as client:
        yield client


def get(http: httpx.Client, path: str, **params: Any) -> Any:
    response = http.get(f"/ui/api/{path}", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_loads_without_a_token_but_the_data_needs_it(filled: Filled) -> None:
    with httpx.Client(base_url=filled.url) as anon:
        page = anon.get("/ui/")
        assert page.status_code == 200 and "static/app.js" in page.text
        assert anon.get("/ui/static/app.js").status_code == 200
        redirect = anon.get("/ui?token=abc")
        assert redirect.status_code == 307 and redirect.headers["location"] == "/ui/?token=abc"
        for path in ("summary", "rollouts", "resources", "curves", "metrics"):
            denied = anon.get(f"/ui/api/{path}")
            assert denied.status_code == 401 and denied.json()["error"]["type"] == "UnauthorizedError"
        wrong = anon.get("/ui/api/rollouts", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert anon.get("/health").status_code == 200  # the store's routes are untouched


def test_rollouts_filter_by_status_and_mode_and_page(http: httpx.Client, filled: Filled) -> None:
    everything = get(http, "rollouts")["items"]
    assert {r["rollout_id"] for r in everything} == set(filled.rewards)
    assert [r["created_at"] for r in everything] == sorted(
        (r["created_at"] for r in everything), reverse=True
    )
    for r in everything:
        assert r["reward"] == filled.rewards[r["rollout_id"]], r
    failed = get(http, "rollouts", status="failed")["items"]
    assert [(r["rollout_id"], r["num_attempts"]) for r in failed] == [(filled.failed, 2)]
    assert [r["rollout_id"] for r in get(http, "rollouts", status="queuing")["items"]] == [filled.queued]
    both = get(http, "rollouts", status="failed,queuing")["items"]
    assert {r["rollout_id"] for r in both} == {filled.failed, filled.queued}
    val = get(http, "rollouts", mode="val", status="succeeded")["items"]
    assert sorted(r["reward"] for r in val) == [0.3, 0.9]
    seen: list[str] = []
    cursor = ""
    while True:
        page = get(http, "rollouts", limit=3, cursor=cursor)
        assert len(page["items"]) <= 3
        seen += [r["rollout_id"] for r in page["items"]]
        if not (cursor := page["next_cursor"]):
            break
    assert sorted(seen) == sorted(filled.rewards) and len(seen) == len(set(seen))


@pytest.mark.parametrize(
    ("params", "field"),
    [({"status": "done"}, "status"), ({"limit": "many"}, "limit"), ({"limit": "0"}, "limit")],
)
def test_bad_query_parameters_are_named(http: httpx.Client, params: dict[str, str], field: str) -> None:
    response = http.get("/ui/api/rollouts", params=params)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == field


def test_bad_cursor_and_unknown_things_are_4xx(http: httpx.Client, filled: Filled) -> None:
    assert http.get("/ui/api/rollouts", params={"cursor": "garbage"}).status_code == 400
    missing = http.get("/ui/api/rollouts/ro-nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    bad_attempt = http.get(f"/ui/api/rollouts/{filled.tool_rollout}", params={"attempt_id": "at-nope"})
    assert bad_attempt.status_code == 422 and bad_attempt.json()["error"]["field"] == "attempt_id"
    assert http.get(f"/ui/api/resources/{filled.v2}/diff", params={"against": "rs-nope"}).status_code == 404
    assert http.get("/ui/api/nothing-here").status_code == 404


def test_a_rollout_shows_its_trace_messages_tool_calls_and_reward(http: httpx.Client, filled: Filled) -> None:
    data = get(http, f"rollouts/{filled.tool_rollout}")
    assert data["rollout"]["reward"] == 0.8 and data["rollout"]["status"] == "succeeded"
    assert len(data["attempts"]) == 1 and data["attempt_id"] == data["attempts"][0]["attempt_id"]
    assert data["spans_truncated"] is False
    spans = data["spans"]
    by_category: dict[str, list[Any]] = {}
    for span in spans:
        by_category.setdefault(span["category"], []).append(span)
    first_call, second_call = by_category["llm"]
    # the client's tracer recorded the same two calls: each is one row, the gateway's record in the client
    # span's place (its name and id kept), so no llm_trace row and no call at the root out of time order
    assert "llm_trace" not in by_category
    for call in (first_call, second_call):
        assert call["twin_span_id"] and call["twin_name"] and call["depth"] > 0
        assert call["attributes"][sc.LLM_SOURCE] == "gateway"
    assert (
        len({s["span_id"] for s in spans} | {c["twin_span_id"] for c in (first_call, second_call)})
        == len(spans) + 2
    )
    assert first_call["detail"]["messages"][0] == {"role": "system", "content": filled_prompt_v2()}
    assert first_call["detail"]["messages"][1]["content"] == "use the lookup tool: apple"
    assert first_call["detail"]["tool_calls"][0]["name"] == "lookup"
    assert second_call["detail"]["messages"][-1]["role"] == "tool"
    assert "3 dollars" in second_call["detail"]["messages"][-1]["content"]
    assert second_call["detail"]["response"]["content"].startswith("tool result:")
    solve, lookup = sorted(by_category["operation"], key=lambda s: s["depth"])
    assert solve["detail"]["name"] == "solve"
    assert solve["detail"]["input"] == {"question": "use the lookup tool: apple"}
    assert lookup["detail"]["name"] == "lookup" and "3 dollars" in lookup["detail"]["output"]
    assert lookup["parent_id"] == solve["span_id"] and lookup["depth"] == solve["depth"] + 1
    assert by_category["message"][0]["parent_id"] == solve["span_id"]
    assert [s["detail"]["value"] for s in by_category["reward"]] == [0.8]
    assert by_category["message"][0]["detail"]["text"] == "answered: use the lookup tool: apple"
    # tree order: every span comes after its parent, one level deeper
    position = {s["span_id"]: i for i, s in enumerate(spans)}
    for span in spans:
        if span["parent_id"] in position:
            parent = spans[position[span["parent_id"]]]
            assert position[span["parent_id"]] < position[span["span_id"]]
            assert span["depth"] == parent["depth"] + 1
        else:
            assert span["depth"] == 0
    assert all(s["end_ns"] >= s["start_ns"] for s in spans)


def filled_prompt_v2() -> str:
    from tests.dashboard.conftest import PROMPT_V2

    return PROMPT_V2


def test_a_failed_rollout_lists_both_attempts_and_each_attempts_spans(
    http: httpx.Client, filled: Filled
) -> None:
    data = get(http, f"rollouts/{filled.failed}")
    assert [a["status"] for a in data["attempts"]] == ["failed", "failed"]
    assert data["rollout"]["reward"] is None
    exceptions = [s for s in data["spans"] if s["category"] == "exception"]
    assert exceptions and exceptions[0]["detail"]["type"] == "ValueError"
    first = data["attempts"][0]["attempt_id"]
    older = get(http, f"rollouts/{filled.failed}", attempt_id=first)
    assert older["attempt_id"] == first and older["spans"]
    assert {s["span_id"] for s in older["spans"]}.isdisjoint({s["span_id"] for s in data["spans"]})


def test_resources_versions_hide_secrets_and_carry_apo_scores(http: httpx.Client, filled: Filled) -> None:
    response = http.get("/ui/api/resources")
    assert API_KEY not in response.text
    items = response.json()["items"]
    assert [v["resources_id"] for v in items] == [filled.v2, filled.v1]
    v2, v1 = items
    assert v2["resources"]["llm"]["api_key"] == "***"
    assert v2["apo"] == {"parent_id": filled.v1, "round": 1, "critique": CRITIQUE}
    assert v2["diff_parent_id"] == filled.v1 and v1["diff_parent_id"] is None
    assert v1["val_reward"] == pytest.approx(0.3) and v2["val_reward"] == pytest.approx(0.9)
    assert v1["train_reward"] == pytest.approx(0.3) and v2["train_reward"] == pytest.approx(0.7)
    for path in (f"rollouts/{filled.tool_rollout}", "rollouts", f"resources/{filled.v2}/diff"):
        assert API_KEY not in http.get(f"/ui/api/{path}").text


def test_the_prompt_diff_against_the_apo_parent(http: httpx.Client, filled: Filled) -> None:
    data = get(http, f"resources/{filled.v2}/diff")
    assert data["against"] == filled.v1
    diff = {d["name"]: d for d in data["diff"]}
    assert diff["llm"]["changed"] is False
    assert diff["prompt"]["lines"] == [
        {"op": " ", "text": "You are a shop assistant."},
        {"op": "+", "text": "Use the lookup tool for every price."},
        {"op": " ", "text": "Answer briefly."},
    ]
    first = get(http, f"resources/{filled.v1}/diff")
    assert first["against"] is None
    prompt = next(d for d in first["diff"] if d["name"] == "prompt")
    assert [line["text"] for line in prompt["lines"]] == PROMPT_V1.splitlines()
    assert {line["op"] for line in prompt["lines"]} == {"+"}
    backwards = get(http, f"resources/{filled.v1}/diff", against=filled.v2)
    ops = [(line["op"], line["text"]) for line in backwards["diff"][1]["lines"]]
    assert ("-", "Use the lookup tool for every price.") in ops


def test_curves_give_the_mean_reward_per_version_and_mode(http: httpx.Client, filled: Filled) -> None:
    data = get(http, "curves")
    rows = {r["resources_id"]: r for r in data["by_version"]}
    assert rows[filled.v1]["version"] < rows[filled.v2]["version"]
    assert rows[filled.v1]["train_mean"] == pytest.approx(0.3) and rows[filled.v1]["train_count"] == 2
    assert rows[filled.v2]["train_mean"] == pytest.approx(0.7) and rows[filled.v2][
        "val_mean"
    ] == pytest.approx(0.9)
    rewarded = {rid: w for rid, w in filled.rewards.items() if w is not None}
    assert {p["rollout_id"]: p["reward"] for p in data["points"]} == rewarded
    times = [p["t"] for p in data["points"]]
    assert times == sorted(times)


async def test_a_teachers_version_shows_its_own_train_and_held_out_means() -> None:
    """A teacher warm start's rollouts (modes ``teacher`` and ``teacher_val``) score its resources version."""
    store = InMemoryLightningStore(watchdog_interval_s=0)
    teacher = await store.add_resources({}, metadata={"role": "teacher"})
    student = await store.add_resources({})
    for version, mode, reward in [
        (teacher, "teacher", 1.0),
        (teacher, "teacher", 0.5),
        (teacher, "teacher_val", 0.25),
        (student, "train", 0.0),
        (student, "val", 0.5),
    ]:
        started = await store.start_rollout(
            RolloutCreate(input=mode, mode=mode, resources_id=version.resources_id)
        )
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        await store.add_spans([Span.new(rid, aid, sc.SPAN_REWARD, {sc.REWARD_VALUE: reward})])
        await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
    transport = httpx.ASGITransport(create_dashboard(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://ui") as http:
        rows = {r["version"]: r for r in (await http.get("/ui/api/curves")).json()["by_version"]}
        listed = {v["version"]: v for v in (await http.get("/ui/api/resources")).json()["items"]}
    assert (rows[1]["train_mean"], rows[1]["train_count"], rows[1]["val_mean"]) == (0.75, 2, 0.25)
    assert (rows[2]["train_mean"], rows[2]["val_mean"]) == (0.0, 0.5)
    assert (listed[1]["train_reward"], listed[1]["val_reward"]) == (0.75, 0.25)
    await store.aclose()


def test_metrics_csv_files_become_series(http: httpx.Client, filled: Filled) -> None:
    (run,) = get(http, "metrics")["runs"]
    assert run["name"] == "grpo" and {"step", "reward_mean", "loss"} <= set(run["columns"])
    assert [row["step"] for row in run["rows"]] == [1, 2, 3, 4, 5]
    assert run["rows"][-1]["reward_mean"] == pytest.approx(0.5)
    summary = get(http, "summary")
    assert summary["metrics"] is True and summary["latest_resources_id"] == filled.v2
    assert sum(summary["statistics"]["rollouts_by_status"].values()) >= len(filled.rewards)


def test_standalone_dashboard_reads_a_remote_store(filled: Filled) -> None:
    app = standalone_app(filled.client(), token=TOKEN)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/", follow_redirects=False).headers["location"] == "/ui/"
        assert client.get("/ui/api/rollouts").status_code == 401
        items = client.get("/ui/api/rollouts", headers=AUTH).json()["items"]
        assert {r["rollout_id"] for r in items} >= set(filled.rewards)
        metrics = client.get("/ui/api/metrics", headers=AUTH).json()
        assert metrics == {"runs": [], "configured": False}


@pytest.mark.slow  # two CLI processes start (~15 s on a busy machine)
def test_agl_store_serve_and_agl_dashboard_commands_serve_the_ui(tmp_path: Any) -> None:
    store_port, ui_port = free_port(), free_port()
    store_url = f"http://127.0.0.1:{store_port}"
    serve = [
        sys.executable,
        "-m",
        "agl",
        "store",
        "serve",
        "--port",
        str(store_port),
        "--backend",
        "memory://",
    ]
    serve += ["--token", TOKEN, "--metrics-dir", str(tmp_path)]
    dashboard = [sys.executable, "-m", "agl", "dashboard", "--store", store_url, "--port", str(ui_port)]
    env = {**os.environ, "AGL_STORE_TOKEN": TOKEN}
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        for c in (serve, dashboard)
    ]
    try:
        for url in (store_url, f"http://127.0.0.1:{ui_port}"):
            wait_http(f"{url}/health")
            assert httpx.get(f"{url}/ui/").status_code == 200
            assert httpx.get(f"{url}/ui/api/summary").status_code == 401
        metrics = httpx.get(f"{store_url}/ui/api/metrics", headers=AUTH).json()
        assert metrics == {"runs": [], "configured": True}
        httpx.post(
            f"{store_url}/v1/agl/rollouts", json={"rollouts": [{"input": 1}]}, headers=AUTH
        ).raise_for_status()
        items = httpx.get(f"http://127.0.0.1:{ui_port}/ui/api/rollouts", headers=AUTH).json()["items"]
        assert [r["input"] for r in items] == [1] and items[0]["status"] == "queuing"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def test_search_sort_and_filters(http: httpx.Client, filled: Filled) -> None:
    by_id = get(http, "rollouts", q=filled.tool_rollout[3:11])["items"]
    assert [r["rollout_id"] for r in by_id] == [filled.tool_rollout]
    by_input = get(http, "rollouts", q="LOOKUP TOOL: PEAR")["items"]  # input text, any case
    assert [r["input"]["question"] for r in by_input] == ["use the lookup tool: pear"]
    by_output = get(http, "rollouts", q="COSTS 3 DOLLARS")["items"]  # only in the last model reply
    assert {r["rollout_id"] for r in by_output} >= {filled.tool_rollout}
    assert all(r["input"]["question"].startswith("use the lookup tool") for r in by_output)
    ranked = get(http, "rollouts", sort="reward", status="succeeded", mode="train")["items"]
    assert [r["reward"] for r in ranked] == [0.8, 0.6, 0.4, 0.2]
    rising = get(http, "rollouts", sort="reward", order="asc", mode="train", status="succeeded")["items"]
    assert [r["reward"] for r in rising] == [0.2, 0.4, 0.6, 0.8]
    slow = get(http, "rollouts", sort="duration", status="succeeded")["items"]
    durations = [r["duration_s"] for r in slow]
    assert durations == sorted(durations, reverse=True) and all(d >= 0 for d in durations)
    v1 = get(http, "rollouts", resources_id=filled.v1)["items"]
    assert {r["rollout_id"] for r in v1} == {rid for rid, v in filled.versions.items() if v == filled.v1}
    errors = get(http, "rollouts", error="ValueError")["items"]
    assert [r["rollout_id"] for r in errors] == [filled.failed]
    shell = get(http, "rollouts", agent="shell-agent")["items"]
    assert [(r["rollout_id"], r["agent"]) for r in shell] == [(filled.command_rollout, "shell-agent")]
    pages, cursor = [], ""
    while True:
        page = get(http, "rollouts", sort="reward", limit=2, cursor=cursor)
        pages += [r["rollout_id"] for r in page["items"]]
        if not (cursor := page["next_cursor"]):
            break
    assert sorted(pages) == sorted(get(http, "rollouts", limit=1000)["items"] and pages)
    assert len(pages) == len(set(pages)) == page["total"]
    for params, field in (
        ({"sort": "size"}, "sort"),
        ({"order": "up"}, "order"),
        ({"q": "x", "cursor": "5"}, "cursor"),
    ):
        bad = http.get("/ui/api/rollouts", params=params)
        assert bad.status_code == 422 and bad.json()["error"]["field"] == field


async def _behaviour(filled: Filled, rollout_ids: list[str]) -> dict[str, tuple[int, int, int]]:
    """(calls, tool calls, completion tokens) of each rollout's latest attempt, as the behaviour metrics
    read them from its spans (tool calls: those its replies asked for)."""
    store = filled.client()
    out = {}
    for rid in rollout_ids:
        spans = (await store.query_spans(rollout_id=rid, attempt_id="latest", limit=1000)).items
        did = rollout_behaviour(spans)
        tools = sum(
            len(c.tool_calls or (c.response_message or {}).get("tool_calls") or []) for c in llm_calls(spans)
        )
        out[rid] = (int(did["calls"]), tools, int(did["completion_tokens"]))
    await store.aclose()
    return out


def test_each_rollout_lists_its_calls_tool_calls_and_completion_tokens(
    http: httpx.Client, filled: Filled
) -> None:
    """Every call is recorded twice (the gateway and the openai tracer): the list counts it once, as the
    spans read by the training adapters do; the calls filter and sort read the same counts."""
    listed = {r["rollout_id"]: r for r in get(http, "rollouts", limit=1000)["items"]}
    want = asyncio.run(_behaviour(filled, list(listed)))
    got = {rid: (r["calls"], r["tool_calls"], r["completion_tokens"]) for rid, r in listed.items()}
    assert got == want
    assert got[filled.tool_rollout][:2] == (2, 1) and got[filled.queued] == (0, 0, 0)
    searched = {
        r["rollout_id"]: r["calls"] for r in get(http, "rollouts", q="lookup tool", limit=1000)["items"]
    }
    assert searched and all(calls == got[rid][0] for rid, calls in searched.items())
    for low, high in ((2, None), (1, 1), (0, 0), (3, None)):
        bounds = {"calls_min": low, **({} if high is None else {"calls_max": high})}
        found = [r["rollout_id"] for r in get(http, "rollouts", limit=1000, **bounds)["items"]]
        assert set(found) == {
            rid for rid, (calls, _, _) in got.items() if calls >= low and (high is None or calls <= high)
        }
    ranked = [r["calls"] for r in get(http, "rollouts", sort="calls", limit=1000)["items"]]
    assert ranked == sorted(ranked, reverse=True) and ranked[0] == 2
    for params, field in (
        ({"calls_min": "-1"}, "calls_min"),
        ({"calls_min": "two"}, "calls_min"),
        ({"calls_max": "1.5"}, "calls_max"),
        ({"calls_max": str(10**16)}, "calls_max"),
    ):
        bad = http.get("/ui/api/rollouts", params=params)
        assert bad.status_code == 422 and bad.json()["error"]["field"] == field, bad.text


def test_an_unnamed_agent_is_listed_by_its_function_name(http: httpx.Client, filled: Filled) -> None:
    listed = {r["rollout_id"]: r["agent"] for r in get(http, "rollouts", limit=1000)["items"]}
    assert listed[filled.tool_rollout] == "shop_agent"  # @agl.rollout without a name
    assert listed[filled.responses_rollout] == listed[filled.empty_rollout] == "edge_agent"
    assert listed[filled.command_rollout] == "shell-agent"  # a given name wins
    shop = get(http, "rollouts", agent="shop_agent")["items"]
    assert len(shop) == 6 and filled.tool_rollout in {r["rollout_id"] for r in shop}
    assert get(http, f"rollouts/{filled.tool_rollout}")["rollout"]["agent"] == "shop_agent"


def test_responses_usage_command_span_and_a_span_in_full(http: httpx.Client, filled: Filled) -> None:
    spans = get(http, f"rollouts/{filled.responses_rollout}")["spans"]
    (call,) = [s for s in spans if s["category"] == "llm"]
    usage = call["detail"]["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0  # from input/output_tokens
    assert call["detail"]["settings"]["temperature"] == 0.3
    (command,) = [
        s for s in get(http, f"rollouts/{filled.command_rollout}")["spans"] if s["category"] == "command"
    ]
    assert command["detail"]["exit_code"] == 0 and "warming up the shell agent" in command["detail"]["stderr"]
    tool_spans = get(http, f"rollouts/{filled.tool_rollout}")["spans"]
    first = next(s for s in tool_spans if s["category"] == "llm")
    assert first["detail"]["tools"] == ["lookup"]
    full = get(http, f"rollouts/{filled.tool_rollout}/spans/{first['span_id']}")["span"]
    assert full["attributes"][sc.LLM_REQUEST]["tools"][0]["function"]["name"] == "lookup"
    assert API_KEY not in str(full)
    missing = http.get(f"/ui/api/rollouts/{filled.tool_rollout}/spans/nope")
    assert missing.status_code == 404


def test_a_version_without_a_parent_is_diffed_against_the_previous_one(
    http: httpx.Client, filled: Filled
) -> None:
    assert get(http, f"resources/{filled.v2}/diff", against=filled.v1)["against"] == filled.v1
    group = http.get("/ui/api/groups/gr-nope")
    assert group.status_code == 404
    assert http.get("/ui/api/groups").status_code == 422
    assert http.get("/ui/api/groups", params={"step": "two"}).json()["error"]["field"] == "step"


def test_search_sees_new_rollouts_and_status_changes(http: httpx.Client, filled: Filled) -> None:
    get(http, "rollouts", q="anything")  # a search before the change: nothing of it may be kept
    body = {"rollouts": [{"input": {"question": "a zebra-crossing question"}, "mode": "test"}]}
    created = http.post("/v1/agl/rollouts", json=body).raise_for_status().json()[0]["rollout_id"]
    filled.rewards[created], filled.modes[created] = None, "test"  # other tests count every rollout
    try:
        found = get(http, "rollouts", q="ZEBRA-CROSSING")["items"]
        assert [(r["rollout_id"], r["status"]) for r in found] == [(created, "queuing")]
    finally:
        http.patch(f"/v1/agl/rollouts/{created}", json={"status": "cancelled"}).raise_for_status()
    assert [r["status"] for r in get(http, "rollouts", q="zebra-crossing")["items"]] == ["cancelled"]
    assert [r["rollout_id"] for r in get(http, "rollouts", q="zebra", status="cancelled")["items"]] == [
        created
    ]


def test_a_rollouts_duration_runs_from_its_first_attempts_start_to_its_end(
    http: httpx.Client, filled: Filled
) -> None:
    """From the claim: stores written before the store stamped ``Rollout.started_at`` at the claim (it did at
    the first span, often at the very end) read the first attempt's start."""
    listed = {r["rollout_id"]: r for r in get(http, "rollouts", limit=100)["items"]}
    searched = {r["rollout_id"]: r for r in get(http, "rollouts", sort="reward", limit=100)["items"]}
    for rollout_id in (filled.tool_rollout, filled.failed, filled.command_rollout):
        one = get(http, f"rollouts/{rollout_id}")
        first = one["attempts"][0]
        r = one["rollout"]
        expected = r["ended_at"] - first["started_at"]
        assert expected >= one["attempts"][-1]["ended_at"] - one["attempts"][-1]["started_at"]
        assert r["duration_s"] == pytest.approx(expected)
        assert listed[rollout_id]["duration_s"] == pytest.approx(expected)
        assert searched[rollout_id]["duration_s"] == pytest.approx(expected)
        assert r["duration_s"] == pytest.approx(
            r["ended_at"] - r["started_at"], abs=0.05
        )  # claimed is started
    assert listed[filled.queued]["duration_s"] is None  # not ended


def test_error_types_seen_and_a_bad_run_name(http: httpx.Client, filled: Filled) -> None:
    seen = get(http, "error_types")
    assert {"error_type": "ValueError", "rollouts": 1} in seen["items"] and seen["partial"] is False
    for run in ("nope", "../grpo", "/etc"):
        bad = http.get("/ui/api/groups", params={"step": 1, "run": run})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "run", bad.text
    mine = get(http, "groups", step=1, run="grpo")  # a run without a store.db of its own: this store's
    assert mine["elsewhere"] is None and mine["run"] == "grpo"
