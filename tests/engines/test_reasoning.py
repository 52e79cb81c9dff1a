"""A reasoning model (Qwen3's real chat template) behind the real gateway and built-in engine, over HTTP.

``chat_template_kwargs`` reach the template; a ``<think>`` block comes back as ``reasoning_content`` and is
recorded, while the recorded token ids stay the whole generation; a second turn, whose prompt Qwen3's
template renders without the first turn's thinking, is classified and trained per call; and
``train_thinking=False`` takes exactly the thinking tokens out of the loss. The Responses API returns the
thinking as a ``reasoning`` item, records it the same way, and renders one handed back into the prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from agl import semconv as sc
from agl.adapter import llm_calls, to_samples
from agl.adapter.thinking import mask_thinking, think_token_ids
from agl.engines.builtin.server import EngineServer
from agl.gateway import Gateway, UpstreamConfig
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.store import open_store
from agl.store.base import LightningStore

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
THINKING, ANSWER = "so 2 + 3 = 5", "5"
REPLY = f"<think>\n{THINKING}\n</think>\n\n{ANSWER}"  # as Qwen3 writes a thinking reply


async def ask(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], extra_body: dict[str, Any] | None = None
) -> ChatCompletion:
    """One greedy chat call, as an agent makes it with the openai SDK."""
    return await client.chat.completions.create(
        model="policy",
        messages=cast("list[ChatCompletionMessageParam]", messages),
        temperature=0.0,
        max_tokens=40,
        extra_body=extra_body,
    )


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny thinking model overfitted (a few seconds of Adam) to answer QUESTION with REPLY."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl.models import tiny_model

    base = tiny_model(seed=0, cache_dir=tmp_path_factory.mktemp("models"), thinking=True)
    tok: Any = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    prompt = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tok(REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p_ids + c_ids])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(600):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    out = tmp_path_factory.mktemp("thinking-model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(thinking_model: Path) -> Iterator[EngineServer]:
    with EngineServer(thinking_model, max_batch_size=4) as srv:
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


async def rollout_client(gw: Gateway, store: LightningStore) -> tuple[str, openai.AsyncOpenAI]:
    started = await store.start_rollout(RolloutCreate(input="task"))
    rid = started.rollout.rollout_id
    url = gw.rollout_base_url(rid, started.attempt.attempt_id)
    return rid, openai.AsyncOpenAI(base_url=url, api_key="sk-agent", max_retries=0)


async def recorded(gw: Gateway, store: LightningStore, rid: str) -> list[LLMCall]:
    await gw.flush()
    return llm_calls((await store.query_spans(rollout_id=rid)).items)


def _ids(engine: EngineServer, text: str) -> list[int]:
    return list(engine.engine.tokenizer(text, add_special_tokens=False)["input_ids"])


async def test_enable_thinking_reaches_the_template_and_changes_the_prompt_ids(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    rid, client = await rollout_client(gateway, store)
    await ask(client, QUESTION)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    await ask(client, QUESTION, off)
    thinking, plain = await recorded(gateway, store, rid)
    assert thinking.prompt_token_ids is not None and plain.prompt_token_ids is not None
    # Qwen3 with thinking off closes an empty block in the generation prompt, in the model's own tokens
    assert plain.prompt_token_ids == thinking.prompt_token_ids + _ids(engine, "<think>\n\n</think>\n\n")
    assert plain.attributes[sc.LLM_REQUEST]["chat_template_kwargs"] == {"enable_thinking": False}


async def test_bad_chat_template_kwargs_answer_400_naming_the_field(
    gateway: Gateway, store: LightningStore
) -> None:
    _, client = await rollout_client(gateway, store)
    for bad in ({"chat_template_kwargs": ["enable_thinking"]}, {"chat_template_kwargs": {"tokenize": True}}):
        with pytest.raises(openai.BadRequestError) as caught:
            await ask(client, QUESTION, bad)
        assert "chat_template_kwargs" in str(caught.value)


async def test_reasoning_content_is_returned_and_recorded_with_the_full_token_ids(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    rid, client = await rollout_client(gateway, store)
    reply = await ask(client, QUESTION)
    message = reply.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == THINKING
    assert message.content == ANSWER

    stream = await client.chat.completions.create(
        model="policy",
        messages=cast("list[ChatCompletionMessageParam]", QUESTION),
        temperature=0.0,
        max_tokens=40,
        stream=True,
    )
    deltas = [c.delta async for chunk in stream for c in chunk.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed_reasoning == THINKING and "".join(d.content or "" for d in deltas) == ANSWER

    plain, streamed = await recorded(gateway, store, rid)
    for call in (plain, streamed):
        assert call.reasoning == THINKING and call.attributes[sc.LLM_REASONING] == THINKING
        assert call.response_message is not None and call.response_message["content"] == ANSWER
        assert call.response_message["reasoning_content"] == THINKING
        # the ids are the whole generation, thinking included: exactly what the model sampled
        assert call.completion_token_ids == _ids(engine, REPLY) + [engine.engine.tokenizer.eos_token_id]
    assert streamed.prompt_token_ids == plain.prompt_token_ids
    assert streamed.logprobs == pytest.approx(plain.logprobs)


async def test_second_turn_under_qwen3_is_thinking_stripped_and_trains_per_call(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    rid, client = await rollout_client(gateway, store)
    first = await ask(client, QUESTION)
    said = first.choices[0].message
    history = [
        *QUESTION,
        {"role": "assistant", "content": said.content, **(said.model_extra or {})},  # reasoning_content too
        {"role": "user", "content": "thanks"},
    ]
    await ask(client, history)
    one, two = await recorded(gateway, store, rid)
    assert one.prompt_token_ids is not None and two.prompt_token_ids is not None
    # the template re-rendered the earlier turn as its answer alone: the first prompt is still a prefix,
    # the first completion (with its <think> block) is not
    assert two.prompt_token_ids[: len(one.prompt_token_ids)] == one.prompt_token_ids
    rest = two.prompt_token_ids[len(one.prompt_token_ids) :]
    assert rest[: len(_ids(engine, ANSWER + "<|im_end|>"))] == _ids(engine, ANSWER + "<|im_end|>")

    samples, report = to_samples([one, two], reward=1.0)
    assert report.mismatches == {"thinking_stripped": 1} and report.merged_calls == 0
    assert [list(s.input_ids) for s in samples] == [
        [*c.prompt_token_ids, *c.completion_token_ids]  # type: ignore[misc]
        for c in (one, two)
    ]
    assert [s.num_model_tokens for s in samples] == [len(c.completion_token_ids or []) for c in (one, two)]


async def test_train_thinking_false_masks_exactly_the_think_block(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    rid, client = await rollout_client(gateway, store)
    await ask(client, QUESTION)
    (call,) = await recorded(gateway, store, rid)
    (sample,), _ = to_samples([call], reward=1.0)
    tags = think_token_ids(engine.engine.tokenizer)
    assert tags is not None
    masked, count = mask_thinking(sample, *tags)
    prompt = len(call.prompt_token_ids or [])
    think = len(_ids(engine, f"<think>\n{THINKING}\n</think>"))
    answer = len(call.completion_token_ids or []) - think  # "\n\n5" and the end-of-turn token
    assert count == think
    assert masked.loss_mask == (0,) * prompt + (0,) * think + (1,) * answer
    assert masked.input_ids == sample.input_ids and masked.old_logprobs == sample.old_logprobs


async def test_the_responses_api_returns_records_and_hands_back_the_thinking_as_a_reasoning_item(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    rid, client = await rollout_client(gateway, store)
    asked = {"model": "policy", "input": QUESTION, "temperature": 0.0, "max_output_tokens": 40}
    reply = await client.responses.create(**asked)  # type: ignore[call-overload]
    thought, said = (item.model_dump() for item in reply.output)
    assert thought["type"] == "reasoning" and thought["content"] == [
        {"type": "reasoning_text", "text": THINKING}
    ]
    assert said["type"] == "message" and reply.output_text == ANSWER
    think_tokens = len(_ids(engine, f"<think>\n{THINKING}\n</think>"))
    assert reply.usage is not None and reply.usage.output_tokens_details.reasoning_tokens == think_tokens

    stream = await client.responses.create(**asked, stream=True)  # type: ignore[call-overload]
    events = [event async for event in stream]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER

    # the engine's own thinking handed back before a tool call: Qwen3 renders it after the last user turn
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'}
    history = [*QUESTION, thought, call, {"type": "function_call_output", "call_id": "c1", "output": "5"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    await client.responses.create(**{**asked, "input": history})  # type: ignore[call-overload]
    await client.responses.create(**asked, extra_body=off)  # type: ignore[call-overload]

    plain, streamed, handed_back, thinking_off = await recorded(gateway, store, rid)
    for recorded_call in (plain, streamed):
        assert recorded_call.reasoning == THINKING and recorded_call.attributes[sc.LLM_REASONING] == THINKING
        assert recorded_call.response_message is not None
        assert recorded_call.response_message["content"] == ANSWER
        assert recorded_call.completion_token_ids == _ids(engine, REPLY) + [
            engine.engine.tokenizer.eos_token_id
        ]
    assert handed_back.prompt_token_ids is not None
    assert f"<think>\n{THINKING}\n</think>" in engine.engine.tokenizer.decode(handed_back.prompt_token_ids)
    assert plain.prompt_token_ids is not None and thinking_off.prompt_token_ids is not None
    assert thinking_off.prompt_token_ids == plain.prompt_token_ids + _ids(engine, "<think>\n\n</think>\n\n")
