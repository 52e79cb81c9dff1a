"""Embeddings through the gateway: the openai SDK, the real gateway, the built-in engine on the tiny model.

The call is recorded as an ``agl.llm.embeddings`` span (usage and shape, no vectors) that no adapter
turns into a training sample.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from agl import semconv as sc
from agl.adapter import llm_calls, to_messages, to_samples
from agl.engines.builtin.server import EngineServer
from agl.gateway import Gateway, UpstreamConfig
from agl.schemas.rollout import RolloutCreate
from agl.store import open_store
from agl.store.base import LightningStore
from tests.support.openai_upstream import OpenAIUpstream

from ..engines.conftest import tiny_path  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> Iterator[EngineServer]:  # noqa: F811
    with EngineServer(tiny_path, max_batch_size=4) as srv:
        yield srv


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LightningStore]:
    s = open_store(f"sqlite:///{tmp_path}/gw.db")
    yield s
    await s.aclose()


@pytest.fixture
def gateway(store: LightningStore, engine: EngineServer) -> Iterator[Gateway]:
    with Gateway(store, [UpstreamConfig(url=engine.base_url, kind="agl")]) as gw:
        yield gw


async def _client(gw: Gateway, store: LightningStore) -> tuple[str, openai.AsyncOpenAI]:
    started = await store.start_rollout(RolloutCreate(input="task"))
    rid = started.rollout.rollout_id
    url = gw.rollout_base_url(rid, started.attempt.attempt_id)
    return rid, openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)


async def test_embeddings_are_unit_vectors_stable_per_text_and_distinct_across_texts(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    _, client = await _client(gateway, store)
    texts = ["what is the answer", "the weather in paris is sunny today", "what is the answer"]
    got = await client.embeddings.create(model="policy", input=texts)  # the SDK asks for base64 by default
    vectors = np.array([d.embedding for d in got.data])
    hidden = engine.engine.model.config.hidden_size
    assert vectors.shape == (3, hidden) and [d.index for d in got.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6)
    assert float(vectors[0] @ vectors[1]) < 0.999

    alone = await client.embeddings.create(model="policy", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(alone.data[0].embedding, vectors[0], atol=1e-5)  # batch-mates do not matter
    ids = engine.engine.encode_prompt(texts[1])
    as_tokens = await client.embeddings.create(model="policy", input=[ids], encoding_format="float")
    np.testing.assert_allclose(as_tokens.data[0].embedding, vectors[1], atol=1e-5)
    assert (
        got.usage.prompt_tokens
        == got.usage.total_tokens
        == sum(len(engine.engine.encode_prompt(t)) for t in texts)
    )


async def test_the_call_is_recorded_and_never_becomes_a_training_sample(
    gateway: Gateway, store: LightningStore
) -> None:
    rid, client = await _client(gateway, store)
    await client.embeddings.create(model="policy", input=["what is the answer", "hello"])
    reply = await client.chat.completions.create(
        model="policy", max_tokens=4, messages=[{"role": "user", "content": "hello"}]
    )
    await gateway.flush()
    spans = (await store.query_spans(rollout_id=rid)).items
    (embedding,) = [s for s in spans if s.name == sc.SPAN_EMBEDDINGS]
    a = embedding.attributes
    assert a[sc.LLM_API] == "embeddings" and a[sc.LLM_STATUS_CODE] == 200 and a[sc.LLM_HAS_TOKEN_IDS] is False
    assert (
        a[sc.LLM_REQUEST]["input"] == ["what is the answer", "hello"] and a[sc.LLM_USAGE]["prompt_tokens"] > 0
    )
    assert a[sc.LLM_RESPONSE]["count"] == 2 and a[sc.LLM_RESPONSE]["dimensions"] > 0
    assert "data" not in a[sc.LLM_RESPONSE]  # the vectors are not stored
    assert sc.LLM_PROMPT_TOKEN_IDS not in a and sc.LLM_COMPLETION_TOKEN_IDS not in a

    calls = llm_calls(spans)
    assert [c.response_id for c in calls] == [reply.id]  # only the chat call is a model call
    samples, report = to_samples(calls, 1.0)
    assert len(samples) == 1 and report.calls == 1 and report.skipped_no_token_ids == 0
    assert to_messages(calls)[-1]["role"] == "assistant"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": [[1, 2], [10**9]]}, "input[1]"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [{"text": "x"}]}, "input"),  # refused by the gateway before it goes upstream
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    gateway: Gateway, store: LightningStore, kwargs: dict[str, object], param: str
) -> None:
    _, client = await _client(gateway, store)
    with pytest.raises(openai.BadRequestError) as info:
        await client.embeddings.create(model="policy", **kwargs)  # type: ignore[arg-type]
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


async def test_a_separate_embeddings_upstream_gets_only_embeddings(
    store: LightningStore, engine: EngineServer
) -> None:
    with OpenAIUpstream() as chat_only:
        upstreams = [
            UpstreamConfig(url=chat_only.base_url, kind="openai", apis=["chat.completions"]),
            UpstreamConfig(url=engine.base_url, kind="agl", apis=["embeddings"]),
        ]
        with Gateway(store, upstreams) as gw:
            _, client = await _client(gw, store)
            got = await client.embeddings.create(model="any", input=["hello"] * 3)
            reply = await client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}]
            )
            with pytest.raises(openai.NotFoundError) as info:  # no replica serves completions
                await client.completions.create(model="any", prompt="hi")
    assert len(got.data) == 3 and len(got.data[0].embedding) == engine.engine.model.config.hidden_size
    assert reply.choices[0].message.content == "echo: hi"
    assert chat_only.paths() == ["/v1/chat/completions"]
    assert "completions" in info.value.body["message"]  # type: ignore[index]
