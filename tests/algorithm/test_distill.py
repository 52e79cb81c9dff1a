"""On-policy distillation: the student samples, a teacher sharing its tokenizer scores those exact tokens,
and each token's advantage gets ``-distill_coef * (log pi_student - log pi_teacher)``.

The loss term is checked against a hand-written reference on the fixed batch of ``test_grpo_loss``; the
end-to-end run distills an SFT-ed copy of the tiny model into the tiny model on a task whose rewards all
tie at 0 for the student, so GRPO alone has nothing to learn from.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

import agl
from agl.adapter.trajectory import Sample
from agl.algorithm.grpo import GRPO, GRPOConfig, LossConfig, build_batch, grpo_loss
from agl.algorithm.health import LearningCheck
from agl.algorithm.policy.distill import EndpointTeacher, check_same_tokenizer, load_teacher
from agl.engines.builtin.server import EngineServer
from agl.errors import ConfigError, TeacherError
from agl.models import tiny_model
from tests.algorithm.test_grpo_learning import _rollout, _simple
from tests.algorithm.test_grpo_loss import ADV, LOGPROBS, MASK, OLD, ROLLOUT, _t

# the teacher's log-probs of the fixed batch's tokens: some above the engine's (those tokens gain), some below
TEACHER = [
    [-0.2, -0.1, -3.0, -0.2, -2.5],
    [-0.5, -0.3, -0.6, -4.0, -0.1],
    [-1.9, -0.2, -0.1, -1.0, -0.8],
    [-0.1, -3.5, -0.5, -0.3, -0.9],
]


def ref_distill_loss_and_grad(coef: float, cfg: LossConfig) -> tuple[float, list[list[float]], float]:
    """PPO-clip with dual-clip TIS, token by token, with each token's advantage A_b - coef * (old - teacher);
    token-mean aggregation. Returns the loss, its gradient w.r.t. each logprob and the mean reverse KL."""
    total = sum(map(sum, MASK))
    loss, grad, kl = 0.0, [], 0.0
    for b in range(len(MASK)):
        row = []
        for t in range(len(MASK[b])):
            if not MASK[b][t]:
                row.append(0.0)
                continue
            k = OLD[b][t] - TEACHER[b][t]  # the reverse-KL estimate of the sampled token
            kl += k / total
            a = ADV[b] - coef * k
            r = math.exp(LOGPROBS[b][t] - OLD[b][t])
            c = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            term, g = (-r * a, -r * a) if r * a <= c * a else (-c * a, 0.0)
            if cfg.tis_cap is not None and a < 0 and term > cfg.tis_cap * -a:
                term, g = cfg.tis_cap * -a, 0.0
            loss += term / total
            row.append(g / total)
        grad.append(row)
    return loss, grad, kl


@pytest.mark.parametrize("coef", [0.5, 2.0])
def test_the_distillation_term_matches_the_hand_reference(coef: float) -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=3.0, distill_coef=coef)
    lp = _t(LOGPROBS).requires_grad_(True)
    loss, metrics = grpo_loss(
        lp,
        _t(OLD),
        _t(ADV),
        _t(MASK),
        cfg,
        teacher_logprobs=_t(TEACHER),
        rollout_index=_t(ROLLOUT, torch.long),
    )
    loss.backward()
    want_loss, want_grad, want_kl = ref_distill_loss_and_grad(coef, cfg)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, _t(want_grad), atol=1e-6, rtol=0)
    assert metrics["distill_kl"] == pytest.approx(want_kl, abs=1e-9)
    # the teacher changes the loss: without it (or at coefficient 0) the plain GRPO loss comes back
    plain, plain_metrics = grpo_loss(_t(LOGPROBS), _t(OLD), _t(ADV), _t(MASK), cfg)
    off, _ = grpo_loss(
        _t(LOGPROBS),
        _t(OLD),
        _t(ADV),
        _t(MASK),
        LossConfig(clip_low=0.2, clip_high=0.28),
        teacher_logprobs=_t(TEACHER),
    )
    assert off.item() == pytest.approx(plain.item()) and abs(plain.item() - loss.item()) > 1e-3
    assert "distill_kl" not in plain_metrics


def test_grpo_config_takes_a_local_or_an_endpoint_teacher() -> None:
    teacher = agl.Teacher(path="/t")
    config = GRPOConfig(model_path="/m", teacher=teacher, distill_coef=0.5)
    assert config.loss.distill_coef == 0.5
    assert (
        GRPOConfig(model_path="/m", loss=LossConfig(distill_coef=0.5)).loss.distill_coef == 0.0
    )  # no teacher
    assert GRPO(config).model_spec().teacher is None  # scored in the trainer, not served
    endpoint = GRPOConfig(model_path="/m", teacher=agl.Teacher("http://h/v1", model="m", api_key="k"))
    assert endpoint.loss.distill_coef == 1.0 and GRPO(endpoint).model_spec().teacher is None
    with pytest.raises(ConfigError, match="GRPOConfig.distill_coef must be > 0"):
        GRPOConfig(model_path="/m", teacher=teacher, distill_coef=0.0)
    with pytest.raises(ConfigError, match="GRPOConfig.teacher must be an agl.Teacher"):
        GRPOConfig(model_path="/m", teacher="/t")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="LossConfig.distill_coef must be >= 0"):
        LossConfig(distill_coef=-1.0)


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_field() -> None:
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(tiny_model(), local_files_only=True)
    other = str(tiny_model(seed=1))  # its tokenizer was trained on another corpus: same size, other ids
    with pytest.raises(ConfigError, match=r"GRPOConfig.teacher: the teacher at .* has another tokenizer"):
        load_teacher(other, student, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"GRPOConfig.teacher: no tokenizer could be read"):
        load_teacher("/nonexistent/teacher", student, torch.device("cpu"))
    check_same_tokenizer(student, AutoTokenizer.from_pretrained(tiny_model(), local_files_only=True), "same")


def _samples(tokenizer: Any) -> list[Sample]:
    """Two samples of a chat prompt and a reply, the reply's tokens in the loss."""
    from agl.engines.builtin.prompts import render_chat

    out = []
    for n, (task, reply) in enumerate([(TASKS[0], "12345678"), (TASKS[1], "it is 42, I think")]):
        prompt = render_chat(tokenizer, [{"role": "user", "content": task}], None)
        completion = tokenizer(reply, add_special_tokens=False)["input_ids"]
        ids = (*prompt, *completion)
        mask = (0,) * len(prompt) + (1,) * len(completion)
        out.append(Sample(f"r{n}", "g", ids, mask, None, 0.0))
    return out


async def test_an_endpoint_teacher_scores_the_students_tokens_as_the_local_teacher_does(
    tmp_path: Path,
) -> None:
    """``agl engine serve``'s prompt_logprobs (vLLM's API), read by EndpointTeacher, give the log-probs the
    trainer computes from the same folder; a teacher whose tokens decode otherwise is refused on its first
    reply, and an endpoint that cannot score is a TeacherError naming it."""
    from transformers import AutoTokenizer

    from agl.algorithm.policy.logprobs import token_logprobs
    from agl.algorithm.policy.model import collate
    from agl.engines.builtin.server import EngineServer

    folder = make_teacher(tmp_path / "teacher")
    student = AutoTokenizer.from_pretrained(tiny_model(), local_files_only=True)
    samples = _samples(student)
    local = load_teacher(str(folder), student, torch.device("cpu"))
    batch = collate(samples, [0.0, 0.0], [0, 1], int(student.pad_token_id))
    want = token_logprobs(local, batch.input_ids, batch.attention, only=batch.mask > 0)[0]
    with EngineServer(folder) as server:
        scored = await EndpointTeacher(server.base_url, "teacher", student).score(samples)
        got = collate(scored, [0.0, 0.0], [0, 1], int(student.pad_token_id)).teacher_logprobs
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert got[batch.mask > 0].lt(0).all() and not got[batch.mask == 0].any()  # model tokens only

        other = AutoTokenizer.from_pretrained(tiny_model(seed=1), local_files_only=True)
        with pytest.raises(ConfigError, match=r"GRPOConfig.teacher: the teacher at .* decodes token ids"):
            await EndpointTeacher(server.base_url, "teacher", other).score(samples)
        with pytest.raises(TeacherError, match="answered 404"):  # not an OpenAI base URL: no /completions
            await EndpointTeacher(server.url, "teacher", student).score(samples)


def test_distilling_trains_the_groups_whose_rewards_tie() -> None:
    rollouts = [_rollout(r, "g") for r in ("a", "b")]
    spans = {"a": _simple("a", 0.0), "b": _simple("b", 0.0)}
    plain = build_batch(rollouts, spans, GRPOConfig(model_path="unused", group_size=2))
    assert plain.samples == [] and plain.metrics["zero_variance_groups"] == 1.0
    config = GRPOConfig(model_path="unused", group_size=2, teacher=agl.Teacher(path="/t"))
    distilled = build_batch(rollouts, spans, config)
    assert [s.rollout_id for s in distilled.samples] == ["a", "b"] and distilled.advantages == [0.0, 0.0]
    assert distilled.metrics["zero_variance_groups"] == 1.0  # still counted: the rewards carry no signal


def test_a_distilling_run_is_not_warned_about_tied_rewards(caplog: pytest.LogCaptureFixture) -> None:
    row = {"rollouts": 8.0, "groups": 2.0, "zero_variance_groups": 2.0, "reward_mean": 0.0, "samples": 8.0}
    with caplog.at_level("WARNING", logger="agl.algorithm.health"):
        check = LearningCheck(distilling=True)
        check.at_start(0.0, {}, agl.algorithm.health.Failures(0, 2))
        check.after_step(1, row, first=True)
    assert not caplog.records
    with caplog.at_level("WARNING", logger="agl.algorithm.health"):
        LearningCheck().after_step(1, row, first=True)
    assert "gave every rollout the same reward" in caplog.records[0].getMessage()


# ----- end to end: a teacher that does the task, a student that scores 0 ------------------------------------

DIGITS = 8  # reward 1: a reply of at least this many digits and nothing else (spaces aside)


@agl.rollout
async def number_agent(task: str, llm: agl.LLM) -> float:
    """Asks for a number; reward 1 for a reply made of digits only, at least DIGITS of them."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=DIGITS
        )
    finally:
        await client.close()
    text = (reply.choices[0].message.content or "").replace(" ", "")
    return float(len(text) >= DIGITS and text.isdigit())


TASKS = [f"what number is {w}?" for w in ("a", "the", "it", "so", "then", "one", "first", "this")]


def digit_tokens(tokenizer: Any) -> torch.Tensor:
    """(V,) True on the tokens made of digits and spaces only (about 40% of the tiny model's vocabulary)."""
    words = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    return torch.tensor([bool(w.strip()) and all(c in "0123456789 " for c in w) for w in words])


def make_teacher(out: Path, steps: int = 6) -> Path:
    """The tiny model trained to answer every task with digit tokens: the same tokenizer, and it does the task.

    Its loss is -log P(a digit token) at each reply position, so it keeps its (near-uniform) spread over the
    digit tokens and gives every other token next to nothing: a teacher whose score of each token the
    student samples says whether that token helps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl.engines.builtin.prompts import render_chat

    path = str(tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    digits = digit_tokens(tokenizer)
    prompts = [render_chat(tokenizer, [{"role": "user", "content": task}], None) for task in TASKS]
    draws = torch.randint(
        int(digits.sum()), (len(TASKS), DIGITS + 2), generator=torch.Generator().manual_seed(0)
    )
    replies = digits.nonzero().squeeze(-1)[draws]
    width = max(map(len, prompts)) + replies.shape[1]
    ids = torch.full((len(TASKS), width), int(tokenizer.pad_token_id))
    attention, mask = torch.zeros_like(ids), torch.zeros(len(TASKS), width - 1)
    for i, prompt in enumerate(prompts):
        row = prompt + replies[i].tolist()
        ids[i, : len(row)], attention[i, : len(row)] = torch.tensor(row), 1
        mask[i, len(prompt) - 1 : len(row) - 1] = 1  # the positions that predict a reply token
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(steps):
        logprobs = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float().log_softmax(-1)
        loss = -(logprobs[..., digits].logsumexp(-1) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["local", "endpoint"])
def test_distillation_teaches_a_student_whose_rewards_all_tie(tmp_path: Path, where: str) -> None:
    """About 30 s on two busy cores: 6 steps of 64 rollouts (a reply of 8 digit tokens is a 1-in-1000 draw
    for the untrained student, so every group of the first step ties at 0; fewer rollouts learn slower).
    The teacher is a local folder the trainer loads, or the same folder served by the built-in engine
    (as ``agl engine serve`` or vLLM would serve it), which scores each step's tokens over HTTP."""
    folder = make_teacher(tmp_path / "teacher")
    with contextlib.ExitStack() as stack:
        if where == "local":
            teacher = agl.Teacher(path=str(folder))
        else:
            server = stack.enter_context(EngineServer(folder))
            teacher = agl.Teacher(server.base_url, model="teacher")
        _distil(tmp_path, teacher)


def _distil(tmp_path: Path, teacher: agl.Teacher) -> None:
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=6,
        tasks_per_step=8,
        group_size=8,
        lr=8e-2,
        eval_every=6,
        teacher=teacher,
        distill_coef=1.0,
        export_model=False,
    )
    result = agl.Trainer(algorithm=GRPO(config), n_runners=8, output_dir=str(tmp_path / "run")).fit(
        number_agent, TASKS, TASKS[:4]
    )
    history = result["history"]
    kl, reward = [r["distill_kl"] for r in history], [r["reward_mean"] for r in history]
    print("distill_kl:", " ".join(f"{x:.2f}" for x in kl), "reward:", " ".join(f"{x:.2f}" for x in reward))
    # GRPO alone: every group of the first step tied at 0, so it would have trained nothing
    first = history[0]
    assert reward[0] == 0.0 and first["zero_variance_groups"] == first["groups"] == 8
    assert first["samples"] == first["rollouts"] == 64  # distilling, every sample trained all the same
    assert kl[-1] < 0.5 * kl[0]  # the student's reverse KL to the teacher fell (5.05 -> 0.90-0.97 in runs)
    assert reward[-1] > 0.3  # and the task's reward rose with it (0.84-0.92 in those runs)
    assert result["val_reward_before"] == 0.0 and result["val_reward_after"] > 0.3
