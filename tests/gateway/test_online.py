"""Production traffic over real HTTP: the openai SDK -> Gateway (uvicorn thread) -> OpenAIUpstream, with
``record_unattributed``. Each conversation becomes an ``online`` rollout of its calls, and late rewards
posted to ``/v1/agl/rewards`` (by response, session or rollout id) land where the adapters read them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

import agl
from agl import semconv as sc
from agl.adapter.rewards import call_rewards, final_reward
from agl.algorithm.sft.offline import samples_from_store
from agl.errors import InvalidRequestError
from agl.gateway import Gateway, GatewayConfig
from agl.gateway.online import session_of, session_rollout_id
from agl.schemas import LLMCall, RolloutStatus, Span
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream, token_ids_of

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is two plus two"}]
ADMIN, REWARD = "admin-token-0123456789", "reward-token-0123456789"


@pytest.fixture
def online(store: InMemoryLightningStore, upstream: OpenAIUpstream) -> Iterator[Gateway]:
    config = GatewayConfig(record_unattributed=True, health_interval_s=0.1)
    with Gateway(store, [upstream.base_url], config, token=ADMIN, reward_token=REWARD) as gw:
        yield gw


async def spans_of(store: InMemoryLightningStore, rollout_id: str, name: str | None = None) -> list[Span]:
    return (await store.query_spans(rollout_id=rollout_id, name=name)).items


async def test_each_conversation_becomes_an_online_rollout_of_its_calls(
    online: Gateway, store: InMemoryLightningStore
) -> None:
    client = openai.AsyncOpenAI(base_url=online.base_url, api_key="sk-user", max_retries=0)
    header = {"x-agl-session-id": "chat-42"}
    for _ in range(3):
        await client.chat.completions.create(model="m", messages=USER, extra_headers=header)
    for _ in range(2):  # the OpenAI user field names the conversation when no header does
        await client.chat.completions.create(model="m", messages=USER, user="user-7")
    loose = [await client.chat.completions.create(model="m", messages=USER) for _ in range(2)]
    await online.flush()

    rollouts = (await store.query_rollouts(mode="online")).items
    assert len(rollouts) == 4  # two conversations, and one rollout per call that names none
    by_session = {r.metadata.get("agl.session_id"): r for r in rollouts}
    assert set(by_session) == {"chat-42", "user-7", None}
    assert by_session["chat-42"].rollout_id == session_rollout_id("chat-42")
    counts = {r.rollout_id: len(await spans_of(store, r.rollout_id, sc.SPAN_LLM_CALL)) for r in rollouts}
    assert counts[session_rollout_id("chat-42")] == 3 and counts[session_rollout_id("user-7")] == 2
    assert sorted(counts.values()) == [1, 1, 2, 3]
    calls = [LLMCall.from_span(s) for s in await spans_of(store, session_rollout_id("chat-42"))]
    assert all(c is not None and c.has_token_ids for c in calls)  # the engine's token ids are recorded
    assert calls[0] is not None and calls[0].completion_token_ids == token_ids_of(
        "echo: what is two plus two"
    )
    loose_ids = {
        s.attributes[sc.LLM_RESPONSE_ID]
        for r in rollouts
        if r.metadata.get("agl.session_id") is None
        for s in await spans_of(store, r.rollout_id)
    }
    assert loose_ids == {c.id for c in loose}
    assert online.stats()["online_rollouts"] == 4


async def test_late_rewards_by_response_session_and_rollout_reach_the_adapter(
    online: Gateway, store: InMemoryLightningStore
) -> None:
    client = openai.AsyncOpenAI(base_url=online.base_url, api_key="sk-user", max_retries=0)
    first = await client.chat.completions.create(model="m", messages=USER, user="alice")
    await client.chat.completions.create(model="m", messages=USER, user="alice")
    other = await client.chat.completions.create(model="m", messages=USER, user="bob")
    alice, bob = session_rollout_id("alice"), session_rollout_id("bob")

    # by response id, at once (the call's span may still be on its way to the store)
    answer = agl.post_reward(online.url, 0.25, response_id=first.id, token=REWARD)
    assert answer["recorded"] and answer["rollout_id"] == alice and not answer["finished"]
    # by session, through the HTTP route itself (what curl sends), with the admin token
    r = httpx.post(
        f"{online.url}/v1/agl/rewards",
        json={"session_id": "alice", "reward": 1.0},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 200 and r.json()["rollout_id"] == alice and r.json()["finished"], r.text
    # by rollout id, a later reward with another name
    answer = agl.post_reward(online.url, 0.5, rollout_id=bob, name="thumbs", token=REWARD)
    assert answer["recorded"] and answer["rollout_id"] == bob
    late = await client.chat.completions.create(model="m", messages=USER, user="alice")  # still recorded
    await online.flush()

    alice_spans, bob_spans = await spans_of(store, alice), await spans_of(store, bob)
    assert call_rewards(alice_spans) == {first.id: 0.25}  # a per-call reward, as emit_reward(response_id=)
    assert final_reward(alice_spans) == 1.0  # the session's reward is the rollout's final reward
    assert final_reward(bob_spans) == 0.5 and call_rewards(bob_spans) == {}
    (reward,) = [s for s in bob_spans if s.name == sc.SPAN_REWARD]
    assert reward.attributes[sc.REWARD_VALUES] == {"thumbs": 0.5}
    assert reward.sequence_id is not None and reward.sequence_id > max(
        s.sequence_id or 0 for s in bob_spans if s.name == sc.SPAN_LLM_CALL
    )
    assert other.id not in call_rewards(bob_spans)
    assert late.id in {s.attributes.get(sc.LLM_RESPONSE_ID) for s in alice_spans}
    # a final reward finished each conversation, so offline SFT selects by it (min_reward)
    assert {r.rollout_id: r.status for r in (await store.query_rollouts(mode="online")).items} == {
        alice: RolloutStatus.SUCCEEDED,
        bob: RolloutStatus.SUCCEEDED,
    }
    selection = await samples_from_store(store, min_reward=1.0)
    assert selection.counts["succeeded"] == 2 and selection.counts["kept_rollouts"] == 1
    assert selection.samples and selection.counts["reward_mean"] == 1.0


async def test_a_reward_is_recorded_once_per_target_and_name_or_per_idempotency_key(
    online: Gateway, store: InMemoryLightningStore
) -> None:
    client = openai.AsyncOpenAI(base_url=online.base_url, api_key="sk-user", max_retries=0)
    await client.chat.completions.create(model="m", messages=USER, user="carol")
    carol = session_rollout_id("carol")
    first = agl.post_reward(online.url, 1.0, session_id="carol", token=REWARD)
    again = agl.post_reward(online.url, 0.0, session_id="carol", token=REWARD)  # a retry: the first stands
    assert first["recorded"] and not first["duplicate"]
    assert again["duplicate"] and not again["recorded"] and again["span_id"] == first["span_id"]
    keyed = [
        agl.post_reward(online.url, 0.3, rollout_id=carol, idempotency_key=k, token=REWARD) for k in "aab"
    ]
    assert [k["recorded"] for k in keyed] == [True, False, True]
    r = httpx.post(  # the Idempotency-Key header works as the body field does
        f"{online.url}/v1/agl/rewards",
        json={"rollout_id": carol, "reward": 0.3},
        headers={"authorization": f"Bearer {REWARD}", "idempotency-key": "b"},
    )
    assert r.status_code == 200 and r.json()["duplicate"] is True
    rewards = await spans_of(store, carol, sc.SPAN_REWARD)
    assert len(rewards) == 3 and final_reward(rewards) == 0.3
    stats = online.stats()
    assert stats["rewards_recorded"] == 3 and stats["rewards_duplicate"] == 3


def test_the_reward_token_posts_rewards_and_nothing_else(online: Gateway) -> None:
    bearer = {"authorization": f"Bearer {REWARD}"}
    client = openai.OpenAI(base_url=online.base_url, api_key=REWARD, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="reward token"):
        client.chat.completions.create(model="m", messages=USER)
    for method, path in (("GET", "/v1/models"), ("GET", "/admin/stats"), ("POST", "/admin/pause")):
        r = httpx.request(method, online.url + path, headers=bearer)
        assert r.status_code == 403 and r.json()["error"]["code"] == "reward_token_only", path
    body = {"session_id": "dave", "reward": 1.0}
    for headers in ({}, {"authorization": "Bearer sk-user"}):
        r = httpx.post(f"{online.url}/v1/agl/rewards", json=body, headers=headers)
        assert r.status_code == 401 and "AGL_GATEWAY_REWARD_TOKEN" in r.json()["error"]["message"]
    assert httpx.get(f"{online.url}/v1/agl/rewards", headers=bearer).status_code == 405


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"response_id": "chatcmpl-nope", "reward": 1}, 404, "response_id", "unknown response_id"),
        ({"session_id": "nobody", "reward": 1}, 404, "session_id", "unknown session_id"),
        ({"rollout_id": "ro-missing", "reward": 1}, 404, "rollout_id", "unknown rollout_id"),
        ({"session_id": "s", "reward": "good"}, 422, "reward", "'reward' must be a finite number"),
        ({"session_id": "s", "reward": True}, 422, "reward", "'reward' must be a finite number"),
        ({"session_id": "s"}, 422, "reward", "'reward' must be a finite number"),
        ({"reward": 1}, 422, "response_id", "response_id, rollout_id or session_id; got none"),
        (
            {"session_id": "s", "rollout_id": "r", "reward": 1},
            422,
            "session_id",
            "got rollout_id and session",
        ),
        ({"session_id": 7, "reward": 1}, 422, "session_id", "'session_id' must be a non-empty string"),
        ({"session_id": "s", "reward": 1, "name": ""}, 422, "name", "'name' must be a non-empty string"),
        ({"session_id": "s", "reward": 1, "score": 2}, 422, "score", "unknown field 'score'"),
    ],
)
def test_bad_rewards_get_a_4xx_naming_the_field(
    online: Gateway, body: dict[str, object], status: int, param: str, words: str
) -> None:
    r = httpx.post(f"{online.url}/v1/agl/rewards", json=body, headers={"authorization": f"Bearer {REWARD}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_post_reward_raises_naming_the_field(online: Gateway) -> None:
    with pytest.raises(InvalidRequestError, match="unknown response_id") as caught:
        agl.post_reward(online.url, 1.0, response_id="chatcmpl-unknown", token=REWARD)
    assert caught.value.param == "response_id"
    with pytest.raises(InvalidRequestError, match="got none") as caught:
        agl.post_reward(f"{online.url}/v1", 1.0, token=REWARD)  # a base URL ending in /v1 works too
    assert caught.value.param == "response_id"


def test_a_calls_session_is_its_header_else_its_user_field() -> None:
    header = {b"x-agl-session-id": b"from-header"}
    assert session_of(header, b'{"user": "from-body"}') == "from-header"
    assert session_of({}, b'{"model": "m", "user": "u-1"}') == "u-1"
    assert session_of({}, b'{"model": "m", "metadata": {"user_id": "claude-user"}}') == "claude-user"
    for raw in (b'{"model": "m"}', b'{"user": ""}', b'{"user": 7}', b'{"user": broken', b'["user"]'):
        assert session_of({}, raw) is None, raw


async def test_streamed_and_anthropic_calls_join_their_conversations(
    online: Gateway, store: InMemoryLightningStore
) -> None:
    import anthropic

    client = openai.AsyncOpenAI(base_url=online.base_url, api_key="sk-user", max_retries=0)
    stream = await client.chat.completions.create(model="m", messages=USER, user="erin", stream=True)
    streamed_id = [chunk.id async for chunk in stream][0]
    claude = anthropic.AsyncAnthropic(base_url=online.url, api_key="sk-user", max_retries=0)
    message = await claude.messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}], metadata={"user_id": "erin"}
    )
    await claude.close()
    await online.flush()
    spans = await spans_of(store, session_rollout_id("erin"), sc.SPAN_LLM_CALL)
    assert [s.attributes[sc.LLM_API] for s in spans] == ["chat.completions", "anthropic.messages"]
    assert spans[0].attributes[sc.LLM_RESPONSE_ID] == streamed_id and message.content
    answer = agl.post_reward(online.url, 1.0, response_id=streamed_id, token=REWARD)
    assert answer["rollout_id"] == session_rollout_id("erin")
