"""SFT: sample construction and masks, selection, JSONL export, no gradient through tool output, learning."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

import agl
from agl import semconv as sc
from agl.algorithm.policy.logprobs import token_logprobs
from agl.algorithm.policy.loss import LossConfig
from agl.algorithm.policy.model import Policy, PolicyConfig, collate, sft_loss
from agl.algorithm.sft import SFT, SFTConfig, export_jsonl, samples_from_messages, select_rollouts
from agl.algorithm.sft.samples import conversations_from_spans, tools_from_spans
from agl.engines.builtin.prompts import render_chat_text
from agl.models import tiny_model
from agl.schemas import Rollout, RolloutStatus, Span
from tests.tiny_agents import digits_agent

TOOLS = [
    {
        "type": "function",
        "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}},
    }
]


def conversation(answer: str = "42") -> list[dict]:  # type: ignore[type-arg]
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "40 + 2"}'},
    }
    return [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 40 plus 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "TOOL-OUTPUT-42"},
        {"role": "assistant", "content": f"Answer: {answer}"},
    ]


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy(PolicyConfig(model_path=str(tiny_model()), lr=1e-3), LossConfig())


def test_samples_mask_only_the_assistant_turns(policy: Policy) -> None:
    tok = policy.tokenizer
    first, second = samples_from_messages(tok, [conversation()], TOOLS)
    for sample in (first, second):
        masked_text = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
        context_text = tok.decode(
            [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
        )
        assert "TOOL-OUTPUT" not in masked_text and "What is 40 plus 2" in context_text
    assert "<tool_call>" in tok.decode(
        [t for t, m in zip(first.input_ids, first.loss_mask, strict=True) if m]
    )
    assert "Answer: 42" in tok.decode(
        [t for t, m in zip(second.input_ids, second.loss_mask, strict=True) if m]
    )
    assert "TOOL-OUTPUT-42" in tok.decode(list(second.input_ids))
    assert second.input_ids[-1] == tok.eos_token_id and second.loss_mask[-1] == 1


# A template that renders tool calls itself, in its own markup (newlines around the JSON), as Qwen's does
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_call_turns_take_the_templates_own_markup(policy: Policy) -> None:
    """Where the template renders ``tool_calls``, the trained turn is the template's rendering of it, so
    the prompt plus the target is the conversation as the template writes it (later turns' prompts)."""
    tok = policy.tokenizer
    saved = tok.chat_template
    tok.chat_template = TOOL_TEMPLATE
    try:
        first, _ = samples_from_messages(tok, [conversation()], TOOLS)
        target = [t for t, m in zip(first.input_ids, first.loss_mask, strict=True) if m]
        assert target[-1] == tok.eos_token_id
        text = tok.decode(target[:-1])
        assert (
            text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "40 + 2"}}\n</tool_call>'
        )
        whole = render_chat_text(tok, conversation()[:3], TOOLS, add_generation_prompt=False)
        assert whole.startswith(str(tok.decode(list(first.input_ids))))
    finally:
        tok.chat_template = saved


def test_tool_output_tokens_carry_no_gradient(policy: Policy) -> None:
    """Changing what the tool returned changes no gradient coming from the loss at those positions:
    the logits at masked positions receive exactly zero gradient."""
    (_, sample) = samples_from_messages(policy.tokenizer, [conversation()], TOOLS)
    batch = collate([sample], [0.0], [0], policy.pad_id)
    captured: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: tuple, output: object) -> None:  # type: ignore[type-arg]
        logits = output.logits  # type: ignore[attr-defined]
        logits.retain_grad()
        captured["logits"] = logits

    handle = policy.model.register_forward_hook(keep)
    logprobs, _ = token_logprobs(policy.model, batch.input_ids, batch.attention)
    handle.remove()
    sft_loss(logprobs, batch.mask).backward()
    logits_grad = captured["logits"].grad
    assert logits_grad is not None
    grad = logits_grad[0, :-1]  # (T-1, V): position t predicts token t+1
    masked = batch.mask[0] == 0
    assert torch.count_nonzero(grad[masked]) == 0
    assert torch.count_nonzero(grad[~masked]) > 0
    policy.model.zero_grad(set_to_none=True)


def test_sft_steps_lower_the_loss(policy: Policy) -> None:
    samples = samples_from_messages(policy.tokenizer, [conversation(str(n)) for n in range(4)], TOOLS)
    losses = [policy.sft_step(samples)["sft_loss"] for _ in range(15)]
    assert losses[-1] < losses[0] * 0.8


def _rollout(rid: str, group: str, status: RolloutStatus = RolloutStatus.SUCCEEDED) -> Rollout:
    return Rollout(rollout_id=rid, group_id=group, status=status, created_at=0, updated_at=0)


def _reward(rid: str, value: float) -> list[Span]:
    return [Span.new(rid, "at", sc.SPAN_REWARD, {sc.REWARD_VALUE: value})]


def test_select_by_threshold_and_top_k() -> None:
    rollouts = [
        _rollout("a", "g1"),
        _rollout("b", "g1"),
        _rollout("c", "g2"),
        _rollout("d", "g2", RolloutStatus.FAILED),
    ]
    spans = {"a": _reward("a", 1.0), "b": _reward("b", 0.2), "c": _reward("c", 0.5), "d": _reward("d", 1.0)}
    assert [r.rollout_id for r in select_rollouts(rollouts, spans, min_reward=0.5)] == ["a", "c"]
    assert sorted(r.rollout_id for r in select_rollouts(rollouts, spans, top_k_per_task=1)) == ["a", "c"]


def test_export_openai_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    assert export_jsonl([conversation(), conversation("7")], path) == 2
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["messages"][2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert lines[1]["messages"][-1]["content"] == "Answer: 7"


def test_each_exported_conversation_carries_the_tools_its_agent_declared(tmp_path: Path) -> None:
    def call(rid: str, tools: list[dict] | None) -> Span:  # type: ignore[type-arg]
        request = {"messages": [{"role": "user", "content": "q"}], **({"tools": tools} if tools else {})}
        reply = {"role": "assistant", "content": "a"}
        attrs = {sc.LLM_API: "chat.completions", sc.LLM_REQUEST: request, sc.LLM_RESPONSE_MESSAGE: reply}
        return Span.new(rid, "at", sc.SPAN_LLM_CALL, {**attrs, sc.LLM_REQUEST_MESSAGES: request["messages"]})

    rollouts = [_rollout("a", "g1"), _rollout("b", "g2")]
    spans = {"a": [call("a", TOOLS)], "b": [call("b", None)]}
    path = tmp_path / "sft.jsonl"
    export_jsonl(conversations_from_spans(rollouts, spans), path, tools=tools_from_spans(rollouts, spans))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["tools"] == TOOLS and "tools" not in lines[1]
    assert lines[1]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_run_shows_steps_and_writes_a_loss_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = SFTConfig(
        model_path=str(tiny_model()),
        iterations=1,
        samples_per_task=2,
        tasks_per_iteration=2,
        min_reward=None,
        top_k_per_task=1,
        batch_size=1,
        lr=1e-3,
    )
    agl.Trainer(algorithm=SFT(config), n_runners=2, output_dir=str(tmp_path)).fit(
        digits_agent, ["a", "b"], ["c"]
    )
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    losses = [float(r["sft_loss"]) for r in rows if r.get("sft_loss")]
    assert losses and all(loss > 0 for loss in losses)  # a row per gradient step
    assert rows[-1]["val_reward"] != ""
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert "SFT step 1: iteration=" in err and "sft_loss=" in err  # visible without logging setup
