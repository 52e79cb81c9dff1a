"""The Engine on the tiny model: template, sampling params, batching, token fidelity, weight updates."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from agl.engines.builtin import Engine, SamplingParams
from agl.errors import ConfigError, InvalidRequestError
from tests.support.waiting import until

from .conftest import TOOL_MESSAGES, TOOL_REPLY, TOOLS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> Engine:
    # these tests compare runs of one prompt with each other: with the prefix cache the later runs would
    # reuse the earlier ones' keys and values, whose bf16 rounding differs from a whole prefill's (tested apart)
    return Engine(tiny_path, max_batch_size=8, prefix_cache_share=0)


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def _recompute(engine: Engine, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_chat_template_is_applied(engine: Engine) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "you"}]}
    ]
    ids = engine.encode_chat(messages, TOOLS)
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n# Tools") and '"get_weather"' in text
    assert text.endswith("<|im_start|>user\nHello you<|im_end|>\n<|im_start|>assistant\n")


async def test_max_tokens_seed_and_n(engine: Engine) -> None:
    ids = _chat(engine, "What is 2 + 2?")
    gen = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=7, seed=11, n=3))
    assert gen.prompt_token_ids == ids and len(gen.choices) == 3
    assert [c.index for c in gen.choices] == [0, 1, 2]
    for c in gen.choices:
        assert c.finish_reason in {"length", "stop"}
        assert len(c.token_ids) == len(c.logprobs) <= 7
    assert any(c.finish_reason == "length" and len(c.token_ids) == 7 for c in gen.choices)
    again = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=7, seed=11, n=3))
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in gen.choices]
    assert len({tuple(c.token_ids) for c in gen.choices}) > 1  # choices get different seeds
    other = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=7, seed=12))
    assert other.choices[0].token_ids != gen.choices[0].token_ids


async def test_stop_string_truncates_text_and_keeps_completing_token(engine: Engine) -> None:
    ids = _chat(engine, "Say something long")
    full = (await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=24, seed=5))).choices[0]
    stop = full.text[6:9]
    assert len(stop) == 3 and stop.strip()
    cut = (
        await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=24, seed=5, stop=[stop]))
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    # the last id is the one that completed the stop string, not before it
    assert stop in engine.tokenizer.decode(cut.token_ids)
    assert stop not in engine.tokenizer.decode(cut.token_ids[:-1])


async def test_concurrent_requests_batch_and_match_solo(engine: Engine) -> None:
    prompts = [_chat(engine, "Count " + "to ten " * i) for i in range(6)]
    # seeded sampling: the tiny random model's greedy output is mostly newlines, too easy to match
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8 + 3 * i) for i in range(6)]
    solo = [
        (await engine.generate(p, sp)).choices[0].token_ids for p, sp in zip(prompts, params, strict=True)
    ]
    together = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
    assert [g.choices[0].token_ids for g in together] == solo


async def test_equal_prompts_are_prefilled_once_and_sample_as_alone(engine: Engine) -> None:
    """A GRPO group's rollouts send one prompt together: one prefill row serves them all."""
    prompt = _chat(engine, "Name a colour")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6) for i in range(4)]
    solo = [(await engine.generate(prompt, sp)).choices[0] for sp in params]
    shapes: list[tuple[int, ...]] = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _o: shapes.append(tuple(args[0].shape))
    )
    try:
        together = await asyncio.gather(*(engine.generate(prompt, sp) for sp in params))
    finally:
        hook.remove()
    assert [s for s in shapes if s[1] > 1] == [(1, len(prompt))]  # decode steps feed one token per row
    for gen, alone in zip(together, solo, strict=True):
        assert gen.choices[0].token_ids == alone.token_ids
        assert gen.choices[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


async def test_token_fidelity_recomputed_logprobs_match(engine: Engine) -> None:
    prompts = [_chat(engine, "Tell me " + "a story " * i) for i in range(4)]
    gens = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(temperature=1.0, max_tokens=16, seed=i))
            for i, p in enumerate(prompts)
        )
    )
    for gen in gens:
        choice = gen.choices[0]
        ref = _recompute(engine, gen.prompt_token_ids, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, choice.logprobs, strict=True)) < 1e-4


async def test_streaming_deltas_add_up(engine: Engine) -> None:
    ids = _chat(engine, "Stream this")
    full = (await engine.generate(ids, GREEDY)).choices[0]
    texts, tokens, final = [], [], None
    async for item in engine.stream(ids, GREEDY):
        if hasattr(item, "choices"):
            final = item
        else:
            texts.append(item.text)
            tokens.extend(item.token_ids)
    assert final is not None and final.choices[0].token_ids == full.token_ids
    assert "".join(texts) == full.text and tokens == full.token_ids


async def test_eos_and_tool_calls(tool_model_path: Path) -> None:
    engine = Engine(tool_model_path)
    ids = engine.encode_chat(TOOL_MESSAGES, TOOLS)
    choice = (
        await engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=60), tools=TOOLS)
    ).choices[0]
    assert choice.text == TOOL_REPLY
    assert choice.token_ids[-1] == engine.tokenizer.eos_token_id  # the generated EOS is reported
    assert choice.finish_reason == "tool_calls" and choice.content is None
    assert choice.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    plain = (await engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=60))).choices[0]
    assert plain.finish_reason == "stop" and plain.tool_calls == []


async def test_full_weight_update_drains_and_bumps_version(tiny_path: Path, tool_model_path: Path) -> None:
    engine = Engine(tiny_path)
    ids = engine.encode_chat(TOOL_MESSAGES, TOOLS)
    before = await engine.generate(ids, GREEDY)
    assert before.model_version == "v0"
    in_flight = asyncio.ensure_future(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=200)))
    while not in_flight.done() and (engine._pending or engine._task is None):  # wait until it is decoding
        await asyncio.sleep(0)
    assert not in_flight.done()
    version = await engine.update_weights(tool_model_path)
    assert version == "v1" == engine.model_version
    old = await in_flight
    assert old.model_version == "v0" and old.choices[0].token_ids[:24] == before.choices[0].token_ids
    after = await engine.generate(ids, GREEDY)
    assert after.model_version == "v1" and after.choices[0].token_ids != before.choices[0].token_ids
    assert after.choices[0].text.startswith("<tool_call>")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert await engine.update_weights(base, version="base-again") == "base-again"
    assert (await engine.generate(ids, GREEDY)).choices[0].token_ids == before.choices[0].token_ids


async def test_released_weights_hold_requests_until_a_full_update_fills_them(
    tiny_path: Path, tmp_path: Path
) -> None:
    """What a synchronous trainer does around its update: the weights go, a request made meanwhile waits,
    and the next full-weight push serves it; an adapter or bad weights never run on the freed storage."""
    from transformers import AutoModelForCausalLM

    engine = Engine(tiny_path)
    ids = _chat(engine, "release test")
    before = await engine.generate(ids, GREEDY)
    await engine.release_weights()
    assert sum(p.numel() for p in engine.model.parameters()) == 0
    waiting = asyncio.ensure_future(engine.generate(ids, GREEDY))
    scoring = asyncio.ensure_future(engine.prompt_logprobs(ids))
    await asyncio.sleep(0.2)
    assert not waiting.done() and not scoring.done()

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="released for a full-weight update"):
        await engine.update_weights(tmp_path / "adapter")
    state = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    with pytest.raises(ConfigError, match="missing keys"):
        await engine.update_weights({k: v for k, v in state.items() if "norm" not in k})
    with pytest.raises(ConfigError, match="released for a full-weight update"):
        await engine.update_weights(tmp_path / "adapter")  # after a failed load too: no base to merge into
    await asyncio.sleep(0.2)
    assert not waiting.done() and not scoring.done()  # the failed loads left no weights to run on

    assert await engine.update_weights(state) == "v1"
    after = await asyncio.wait_for(waiting, 60)
    assert after.model_version == "v1" and after.choices[0].token_ids == before.choices[0].token_ids
    assert len(await asyncio.wait_for(scoring, 60)) == len(ids) - 1


async def test_lora_update_applies_to_base(tiny_path: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    engine = Engine(tiny_path)
    ids = _chat(engine, "LoRA test")
    base = (await engine.generate(ids, GREEDY)).choices[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    assert await engine.update_weights(tmp_path / "adapter") == "v1"
    first = await engine.generate(ids, GREEDY)
    assert first.model_version == "v1" and first.choices[0].token_ids != base
    await engine.update_weights(tmp_path / "adapter", lora=True)  # applied to the base again, not stacked
    assert (await engine.generate(ids, GREEDY)).choices[0].token_ids == first.choices[0].token_ids


async def test_bad_input_raises_clear_errors(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        await engine.generate([], GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        await engine.generate([5] * (engine.max_model_len + 1), GREEDY)
    with pytest.raises(InvalidRequestError) as info:
        engine.encode_prompt([10**9])
    assert info.value.param == "prompt"
    with pytest.raises(ConfigError, match="not a folder"):
        await engine.update_weights(tmp_path / "missing")
    with pytest.raises(ConfigError, match="unexpected keys"):
        await engine.update_weights({"nope": torch.zeros(1)})
    with pytest.raises(ConfigError, match="no config.json"):
        Engine(tmp_path)
    assert engine.model_version == "v0"


async def test_cancelled_request_stops_decoding(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _chat(engine, "Cancel me")
    tokens = 0
    on_token = engine._on_token

    def counting(seq: Any) -> None:  # called on the decoding thread, once per token of each sequence
        nonlocal tokens
        tokens += 1
        on_token(seq)

    monkeypatch.setattr(engine, "_on_token", counting)  # the scheduler started below takes this one
    task = asyncio.ensure_future(
        engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=2000, seed=0))
    )
    await until(lambda: tokens >= 3, "the request to be decoding")
    assert not task.done()
    task.cancel()
    start = asyncio.get_running_loop().time()
    while engine._task is not None:  # the scheduler drops the aborted row and goes idle
        await asyncio.sleep(0.01)
    assert asyncio.get_running_loop().time() - start < 2.0
    done = await engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=3))
    assert len(done.choices[0].token_ids) == 3


async def test_stream_consumer_leaving_early_aborts(engine: Engine) -> None:
    ids = _chat(engine, "Stream and leave")
    stream = engine.stream(ids, SamplingParams(temperature=1.0, max_tokens=2000, seed=1))
    async for _item in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    for _ in range(200):
        if engine._task is None:
            break
        await asyncio.sleep(0.01)
    assert engine._task is None


async def test_next_turn_reuses_the_finished_turns_keys_and_values(tiny_path: Path) -> None:
    """A conversation's second call sends the first call's prompt and reply again: with the prefix cache it
    prefills only what is new, and samples exactly what an engine without the cache samples."""
    # fp32: reused keys and values equal recomputed ones to rounding, so the samples match exactly
    cached = Engine(tiny_path, precision="fp32")
    plain = Engine(tiny_path, precision="fp32", prefix_cache_share=0)
    assert cached.prefix_cache is not None and plain.prefix_cache is None
    widths: list[int] = []
    hook = cached.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _o: widths.append(int(args[0].shape[1]))
    )
    first = _chat(cached, "Plan a trip " * 4)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12)
    reply = (await cached.generate(first, params)).choices[0]
    assert reply.token_ids == (await plain.generate(first, params)).choices[0].token_ids
    # the next turn: the first turn whole, a tool result, and two siblings that share only the first turn
    turn = first + reply.token_ids + _chat(cached, "The tool said 42.")[1:]
    sibling = first[:-3] + [(first[-3] + 1) % 512] + _chat(cached, "Another question")
    widths.clear()
    got = await asyncio.gather(*(cached.generate(p, params) for p in (turn, sibling)))
    want = await asyncio.gather(*(plain.generate(p, params) for p in (turn, sibling)))
    hook.remove()
    new = len(turn) - len(first) - len(reply.token_ids) + 1  # the unfed last reply token, then the rest
    assert widths[0] == max(new, len(sibling) - len(first) + 3)  # one prefill of the new tokens only
    assert widths[1:] == [1] * (len(widths) - 1)
    for g, w in zip(got, want, strict=True):
        assert g.choices[0].token_ids == w.choices[0].token_ids
        assert g.choices[0].logprobs == pytest.approx(w.choices[0].logprobs, abs=2e-3)
    assert cached.prefix_cache.hit_tokens >= 2 * (len(first) - 3)


async def test_prefix_cache_is_emptied_by_a_weight_update(tiny_path: Path) -> None:
    engine = Engine(tiny_path)
    assert engine.prefix_cache is not None
    await engine.generate(_chat(engine, "Say something long " * 3), GREEDY)
    assert len(engine.prefix_cache) == 1
    await engine.update_weights({k: v.clone() for k, v in engine.model.state_dict().items()})
    assert len(engine.prefix_cache) == 0


def test_prefix_cache_keeps_the_longest_match_within_its_budget() -> None:
    from agl.engines.builtin.prefix_cache import PrefixCache

    cache = PrefixCache(max_tokens=100, min_tokens=4)
    kv = torch.zeros((2, 2, 1, 40, 4))
    cache.put(list(range(40)), kv)
    cache.put(list(range(30)) + [99] * 10, kv)
    entry, n = cache.lookup(list(range(50)))
    assert n == 40 and entry is not None and entry.ids.tolist() == list(range(40))
    assert cache.lookup(list(range(40)))[1] == 39  # the last prompt token is always computed
    assert cache.lookup([7] * 20) == (None, 0)
    cache.put([5] * 40, kv)  # 120 tokens > 100: the least recently used entry goes
    assert len(cache) == 2 and cache.lookup(list(range(30)) + [99] * 12)[1] == 30  # its own match: gone
    assert cache.lookup(list(range(50)))[1] == 40
