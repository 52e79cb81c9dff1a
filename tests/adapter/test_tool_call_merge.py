"""A tool-calling trajectory stays one training sample when the next prompt re-renders the model's tool call.

The tiny model is taught to write its tool call as compact JSON; the engine parses it into ``tool_calls``,
the openai-SDK agent sends them back, and the chat template re-renders them with ``json.dumps`` spacing.
The adapter must train the model's own compact tokens, not the re-rendering, and mask the tool result.
The same rule is checked on SmolLM2's real BPE tokenizer and template, for three spellings of a call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from agl import semconv as sc
from agl.adapter import llm_calls, to_samples
from agl.adapter.trajectory import MergeReport
from agl.engines.builtin.server import EngineServer
from agl.gateway import Gateway, UpstreamConfig
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.store import open_store
from agl.store.base import LightningStore

from ..engines.conftest import TOOL_MESSAGES, TOOLS, tiny_path  # noqa: F401 (fixtures)

COMPACT_CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
TOOL_RESULT = "18C and sunny"
ANSWER = "It is 18C and sunny in Paris."
ROLLOUTS = 8


def _after_tool(call_id: str) -> list[dict[str, Any]]:
    """The history the agent sends back: the question, the parsed tool call, and the tool's result."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    return [
        *TOOL_MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT},
    ]


@pytest.fixture(scope="module")
def engine(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:  # noqa: F811
    from tests.support.overfit import overfit_replies

    examples = [(TOOL_MESSAGES, COMPACT_CALL), (_after_tool("call_x"), ANSWER)]
    path = overfit_replies(tiny_path, tmp_path_factory.mktemp("compact-tool-model"), examples, TOOLS)
    with EngineServer(path, max_batch_size=4) as srv:
        yield srv


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LightningStore]:
    s = open_store(f"sqlite:///{tmp_path}/gw.db")
    yield s
    await s.aclose()


async def _rollout(gw: Gateway, store: LightningStore, seed: int) -> list[LLMCall]:
    """One agent run: a tool call, the answer after the tool's result, and a short reply to a thank-you."""
    started = await store.start_rollout(RolloutCreate(input="weather"))
    rid = started.rollout.rollout_id
    client = openai.AsyncOpenAI(
        base_url=gw.rollout_base_url(rid, started.attempt.attempt_id), api_key="sk-agent", max_retries=0
    )
    messages: list[Any] = list(TOOL_MESSAGES)
    sampling: dict[str, Any] = {"model": "policy", "temperature": 0.5, "seed": seed, "tools": TOOLS}
    first = (await client.chat.completions.create(messages=messages, **sampling)).choices[0]
    messages.append(first.message.model_dump(exclude_none=True))
    for call in first.message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
    second = (await client.chat.completions.create(messages=messages, **sampling)).choices[0]
    messages += [second.message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
    await client.chat.completions.create(messages=messages, max_tokens=4, **sampling)
    await gw.flush()
    return llm_calls((await store.query_spans(rollout_id=rid)).items)


async def test_a_re_rendered_tool_call_merges_with_the_models_own_tokens_trained(
    engine: EngineServer, store: LightningStore
) -> None:
    tok = engine.engine.tokenizer
    total = MergeReport()
    with Gateway(store, [UpstreamConfig(url=engine.base_url, kind="agl")]) as gw:
        for seed in range(ROLLOUTS):
            calls = await _rollout(gw, store, seed)
            assert len(calls) == 3 and all(c.has_token_ids for c in calls)
            first, second, _ = calls
            # the model wrote compact JSON; the next prompt holds the template's spaced re-rendering
            assert tok.decode(first.completion_token_ids, skip_special_tokens=True) == COMPACT_CALL
            assert json.loads(first.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
            p1, r1, p2 = (
                first.prompt_token_ids or [],
                first.completion_token_ids or [],
                second.prompt_token_ids,
            )
            assert p2 is not None and p2[: len(p1)] == p1 and p2[: len(p1) + len(r1)] != p1 + r1
            assert '{"city": "Paris"}' in tok.decode(p2[len(p1) :])

            samples, report = to_samples(calls, 1.0)
            total.add(report)
            (sample,) = samples
            assert report.reconciled_calls == 1 and not report.mismatches
            a, b = sample.call_spans[0]
            assert list(sample.input_ids[:a]) == p1 and list(sample.input_ids[a:b]) == r1
            assert list(sample.old_logprobs or [])[a:b] == pytest.approx(first.logprobs)
            text = tok.decode(list(sample.input_ids))
            assert COMPACT_CALL in text and '{"city": "Paris"}' not in text  # the model's own call only
            # the tool result sits between the two replies, masked; each reply's tokens are trained
            (c, d), (e, f) = sample.call_spans[1:]
            assert TOOL_RESULT in tok.decode(list(sample.input_ids[b:c])) and not any(sample.loss_mask[b:c])
            assert all(sample.loss_mask[c:d]) and all(sample.loss_mask[e:f])
            assert sum(sample.loss_mask) == sum(len(x.completion_token_ids or []) for x in calls)
            assert tok.decode(list(sample.input_ids[c:d]), skip_special_tokens=True) == ANSWER
    before = (total.merged_calls - total.reconciled_calls) / (total.calls - total.rollouts)
    print(
        f"merged share over {ROLLOUTS} rollouts: {before:.2f} by prefix alone, {total.merged_fraction:.2f} now"
    )
    assert total.merged_fraction == 1.0 and total.samples == ROLLOUTS


@pytest.mark.parametrize(
    "spelling",
    [
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',  # compact
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # Qwen's newlines
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city":  "Paris"}}</tool_call>',
    ],
)
def test_a_real_bpe_tokenizer_and_template_reconcile_each_spelling(spelling: str) -> None:
    """SmolLM2's tokenizer and ChatML template (no tools in it: the engine folds the calls back into
    Hermes markup), with the prompts the engine itself renders; only the tokenizer, no model run."""
    from transformers import AutoTokenizer

    from agl.engines.builtin.prompts import normalise_messages, render_chat
    from agl.models import smollm2
    from tests.adapter.spans import SpanMaker

    tok: Any = AutoTokenizer.from_pretrained(smollm2())

    def encode(messages: list[dict[str, Any]]) -> list[int]:
        rendered = render_chat(tok, normalise_messages(messages), TOOLS)
        return (
            list(rendered)
            if isinstance(rendered, list)
            else tok(rendered, add_special_tokens=False)["input_ids"]
        )

    p1 = encode(TOOL_MESSAGES)
    reply = tok(spelling, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    history = _after_tool("call_1")
    history[1]["content"] = "Let me check." if spelling.startswith("Let") else None
    p2 = encode(history)
    assert p2[: len(p1)] == p1 and p2[: len(p1) + len(reply)] != p1 + reply
    m = SpanMaker()
    spans = [m.call(p1, reply, attrs={sc.LLM_FINISH_REASON: "tool_calls"}), m.call(p2, [tok.eos_token_id])]
    (sample,), report = to_samples(llm_calls(spans), 1.0)
    assert report.reconciled_calls == 1
    tail = tok.decode(list(sample.input_ids[len(p1) + len(reply) :]))
    assert tail == f"\n<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n<|im_end|>"
    assert list(sample.input_ids[: len(p1) + len(reply)]) == p1 + reply
