"""Replaying a recorded model call through the dashboard's API: a real agent's call, recorded through a
real gateway, resent to that gateway (the default) or to another OpenAI-compatible server, with edited
sampling settings; bad input is a 422 naming the field, a failing endpoint a 502 saying what it answered."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import agl
from agl.asgi_server import BackgroundServer
from agl.dashboard import mount_dashboard, replay
from agl.gateway import Gateway, GatewayConfig
from agl.schemas import LLM, PromptTemplate, RolloutCreate
from agl.store import SqliteLightningStore
from agl.store.client import LightningStoreClient
from agl.store.server import create_app
from tests.dashboard.conftest import TOKEN, TOOLS, Filled, shop_agent
from tests.support.openai_upstream import OpenAIUpstream

AUTH = {"Authorization": f"Bearer {TOKEN}"}
RECORDED_KEY = "sk-recorded-key"


@dataclass
class Live:
    """A dashboard over a store whose one rollout was recorded through a gateway that still runs."""

    http: httpx.Client
    upstream: OpenAIUpstream
    gateway_url: str
    rollout_id: str
    resources_id: str
    bare_resources_id: str  # a version without an LLM resource


async def _record(url: str, endpoint: str) -> tuple[str, str, str]:
    store = LightningStoreClient(url, token=TOKEN, retries=0)
    llm = LLM(endpoint=endpoint, model="shop-model", api_key=RECORDED_KEY)
    version = await store.add_resources({"llm": llm, "prompt": PromptTemplate(template="Be brief.")})
    bare = await store.add_resources({"prompt": PromptTemplate(template="no model here")})
    (rollout,) = await store.enqueue_rollouts(
        [
            RolloutCreate(
                input={"question": "use the lookup tool: fig", "reward": 1.0},
                resources_id=version.resources_id,
            )
        ]
    )
    await agl.Runner(shop_agent, store, poll_interval_s=0.01).run(max_rollouts=1)
    await store.aclose()
    return rollout.rollout_id, version.resources_id, bare.resources_id


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    inner = SqliteLightningStore(str(tmp_path_factory.mktemp("replay") / "store.db"))
    app = mount_dashboard(create_app(inner, token=TOKEN), inner, token=TOKEN)
    with (
        BackgroundServer(app) as server,
        OpenAIUpstream() as upstream,
        Gateway(inner, [upstream.base_url], GatewayConfig(health_interval_s=0.1)) as gateway,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http,
    ):
        rollout_id, resources_id, bare = asyncio.run(_record(server.url, gateway.endpoint_template))
        yield Live(http, upstream, gateway.url, rollout_id, resources_id, bare)


def _calls(live: Live) -> list[dict[str, Any]]:
    spans = live.http.get(f"/ui/api/rollouts/{live.rollout_id}").json()["spans"]
    return [s for s in spans if s["category"] == "llm"]


def _replay(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/ui/api/replay", json=body)


def test_a_call_replays_through_its_gateway_with_edited_settings_and_is_not_recorded(live: Live) -> None:
    first = _calls(live)[0]  # the call that answered with a tool call
    spans_before = len(live.http.get(f"/ui/api/rollouts/{live.rollout_id}").json()["spans"])
    live.upstream.script("a replayed answer")
    answer = _replay(
        live.http, rollout_id=live.rollout_id, span_id=first["span_id"], temperature=0.2, max_tokens=7
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["recorded"]["message"]["tool_calls"][0]["name"] == "lookup"
    assert body["replayed"]["message"] == {"role": "assistant", "content": "a replayed answer"}
    assert body["replayed"]["endpoint"] == f"{live.gateway_url}/v1"  # the gateway, unscoped
    assert body["replayed"]["request"] == {"model": "shop-model", "temperature": 0.2, "max_tokens": 7}
    assert body["tools"] == ["lookup"]
    sent = live.upstream.requests[-1]
    assert [m["content"] for m in sent.body["messages"]] == ["Be brief.", "use the lookup tool: fig"]
    assert sent.body["tools"] == TOOLS
    assert (sent.body["temperature"], sent.body["max_tokens"]) == (0.2, 7)
    assert all(TOKEN not in v for r in live.upstream.requests for v in r.headers.values())
    after = live.http.get(f"/ui/api/rollouts/{live.rollout_id}").json()["spans"]
    assert len(after) == spans_before  # the replay went through the unattributed route: not recorded


def test_a_call_replays_to_another_endpoint_and_model_with_its_key(live: Live) -> None:
    second = _calls(live)[1]  # the call after the tool result
    with OpenAIUpstream(api_key="sk-other") as other:
        other.script("another model's answer")
        answer = _replay(
            live.http,
            rollout_id=live.rollout_id,
            span_id=second["span_id"],
            endpoint=other.base_url + "/",
            model="other-model",
            api_key="sk-other",
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["replayed"]["message"]["content"] == "another model's answer"
        assert answer.json()["recorded"]["message"]["content"].startswith("tool result:")
        sent = other.requests[-1]
        assert sent.body["model"] == "other-model" and sent.headers["authorization"] == "Bearer sk-other"
        assert [m["role"] for m in sent.body["messages"]] == ["system", "user", "assistant", "tool"]
        # the recorded key goes only to the recorded endpoint: here none is sent, and the server says so
        refused = _replay(
            live.http, rollout_id=live.rollout_id, span_id=second["span_id"], endpoint=other.base_url
        )
        assert refused.status_code == 502, refused.text
        message = refused.json()["error"]["message"]
        assert "HTTP 401" in message and "missing or wrong API key" in message
        assert RECORDED_KEY not in other.requests[-1].headers.get("authorization", "")


def test_a_policy_version_is_chosen_by_its_resources_id(live: Live) -> None:
    first = _calls(live)[0]
    live.upstream.script("the version's answer")
    answer = _replay(
        live.http, rollout_id=live.rollout_id, span_id=first["span_id"], resources_id=live.resources_id
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["replayed"]["message"]["content"] == "the version's answer"
    bare = _replay(
        live.http, rollout_id=live.rollout_id, span_id=first["span_id"], resources_id=live.bare_resources_id
    )
    assert bare.status_code == 422 and bare.json()["error"]["field"] == "resources_id"


def test_a_failing_or_silent_endpoint_is_a_502_saying_what_happened(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    span_id = _calls(live)[0]["span_id"]
    with OpenAIUpstream() as other:
        other.fail("500")
        failed = _replay(live.http, rollout_id=live.rollout_id, span_id=span_id, endpoint=other.base_url)
        assert failed.status_code == 502 and "HTTP 500" in failed.json()["error"]["message"]
        assert "scripted failure 500" in failed.json()["error"]["message"]
        monkeypatch.setattr(replay, "REPLAY_TIMEOUT_S", 0.5)
        other.fail("hang")
        silent = _replay(live.http, rollout_id=live.rollout_id, span_id=span_id, endpoint=other.base_url)
        assert (
            silent.status_code == 502 and "did not answer within 0.5 s" in silent.json()["error"]["message"]
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # bound, never listening: refused
        gone = _replay(live.http, rollout_id=live.rollout_id, span_id=span_id, endpoint=closed)
    assert gone.status_code == 502 and "could not reach" in gone.json()["error"]["message"]


def test_bad_replay_input_names_the_field(live: Live, filled: Filled) -> None:
    calls = _calls(live)
    span_id = calls[0]["span_id"]
    base = {"rollout_id": live.rollout_id, "span_id": span_id}
    for extra, field in (
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"endpoint": "ftp://host/v1"}, "endpoint"),
        ({"endpoint": 3}, "endpoint"),
        ({"span_id": ""}, "span_id"),
        ({"rollout_id": None}, "rollout_id"),
        ({"resources_id": "rs-nope"}, "resources_id"),
    ):
        answer = _replay(live.http, **{**base, **extra})
        assert answer.status_code == 422, (extra, answer.text)
        assert answer.json()["error"]["field"] == field, (extra, answer.text)
    spans = live.http.get(f"/ui/api/rollouts/{live.rollout_id}").json()["spans"]
    reward = next(s for s in spans if s["category"] == "reward")
    not_a_call = _replay(live.http, rollout_id=live.rollout_id, span_id=reward["span_id"])
    assert not_a_call.status_code == 422 and "no model call" in not_a_call.json()["error"]["message"]
    assert _replay(live.http, rollout_id=live.rollout_id, span_id="sp-nope").status_code == 404
    assert live.http.get("/ui/api/replay").status_code == 404  # POST only
    assert (
        httpx.post(str(live.http.base_url).rstrip("/") + "/ui/api/replay", json=base).status_code == 401
    )  # no token
    with httpx.Client(base_url=filled.url, headers=AUTH) as other:  # a Responses-API call is not resent
        spans = other.get(f"/ui/api/rollouts/{filled.responses_rollout}").json()["spans"]
        call = next(s for s in spans if s["category"] == "llm")
        answer = _replay(other, rollout_id=filled.responses_rollout, span_id=call["span_id"])
        assert answer.status_code == 422 and answer.json()["error"]["field"] == "span_id"
        assert "responses" in answer.json()["error"]["message"]


def test_unscoped_strips_only_an_agl_gateway_rollout_scope() -> None:
    assert replay.unscoped("http://gw:1/rollout/{rollout_id}/attempt/{attempt_id}/v1") == "http://gw:1/v1"
    assert replay.unscoped("http://gw:1/rollout/ro-1/attempt/at-2/agent/writer/v1/") == "http://gw:1/v1"
    assert replay.unscoped("http://vllm:8000/v1") == "http://vllm:8000/v1"
