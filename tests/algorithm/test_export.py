"""The trained model comes out: ``fit`` writes OUT/model (and model-best, model-adapter) as Hugging Face folders.

One real LoRA GRPO ``fit`` on the tiny model (validated every step) feeds most tests; offline SFT on its
store gives a full fine-tuning export. Exported folders are loaded with plain transformers / PEFT and
served by ``agl engine serve`` in a subprocess, and must give the in-process policy's logits.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

import agl
from agl.algorithm.base import TrainingContext
from agl.algorithm.export import INFO_FILE, BestExport, export_policy, export_trained, write_atomically
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.algorithm.policy.loss import LossConfig
from agl.algorithm.policy.model import Policy, PolicyConfig
from agl.algorithm.sft import SFT, SFTConfig, train_from_store
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.store.memory import InMemoryLightningStore
from agl.testing import free_port
from tests.tiny_agents import digits_agent

LOGITS_ATOL = 1e-5  # fp32 export vs the in-process fp32 policy; LoRA merged observed ~7e-7, full 0.0
PROMPT = [5, 17, 99, 300, 12, 7, 8, 41, 2, 600]
HF_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "chat_template.jinja",
    "generation_config.json",
}


def _logits(model: Any, ids: list[int] = PROMPT) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=torch.tensor([ids])).logits[0].float()
    model.train(was_training)
    return out


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)  # plain defaults, as a user would call it


def _base_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _load(tiny_model()).state_dict().items()}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[GRPO, dict[str, Any], Path]:
    """A LoRA GRPO fit, validated before training and after every step, with the adapter kept."""
    out = tmp_path_factory.mktemp("grpo-export")
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=2,
        group_size=4,
        lr=2e-2,
        lora_rank=4,
        eval_every=1,
        export_adapter=True,
    )
    grpo = GRPO(config)
    result = agl.Trainer(algorithm=grpo, n_runners=8, output_dir=str(out)).fit(
        digits_agent, ["1 2", "3 4", "5 6"], ["7 8", "9 0"]
    )
    return grpo, result, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_fit_exports_the_merged_lora_policy(grpo_run: tuple[GRPO, dict[str, Any], Path]) -> None:
    grpo, result, out = grpo_run
    assert result["model_path"] == str(out / "model")
    assert result["adapter_path"] == str(out / "model-adapter")
    assert {p.name for p in (out / "model").iterdir()} >= HF_FILES
    assert not list(out.glob(".model*"))  # no temporary folder left behind
    exported = _load(out / "model")
    diff = float((_logits(exported) - _logits(grpo.policy.model)).abs().max())
    print(f"max abs logit diff, exported merged LoRA vs in-process PEFT policy: {diff:.2e}")
    assert diff < LOGITS_ATOL
    base = _base_state()
    state = exported.state_dict()
    assert all("lora" not in k for k in state)  # merged: a plain model, no adapter weights
    changed = [k for k, v in state.items() if k in base and not torch.equal(v, base[k])]
    assert changed, "the exported weights equal the base model's: training did not reach the export"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    info = json.loads((out / "model" / INFO_FILE).read_text())
    assert info["algorithm"] == "GRPO" and info["base_model"] == str(tiny_model())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_adapter_folder_loads_with_peft_on_the_base(grpo_run: tuple[GRPO, dict[str, Any], Path]) -> None:
    from peft import PeftModel

    grpo, _, out = grpo_run
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (out / "model-adapter").iterdir()
    }
    with_adapter = PeftModel.from_pretrained(_load(tiny_model()), out / "model-adapter")
    assert float((_logits(with_adapter) - _logits(grpo.policy.model)).abs().max()) < LOGITS_ATOL


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_best_validation_policy_is_written_when_validation_improves(
    grpo_run: tuple[GRPO, dict[str, Any], Path],
) -> None:
    grpo, result, out = grpo_run
    assert result["best_model_path"] == str(out / "model-best")
    scores = [result["val_reward_before"]] + [row["val_reward"] for row in grpo.history]
    info = json.loads((out / "model-best" / INFO_FILE).read_text())
    assert info["val_reward"] == max(scores)
    assert info["step"] == scores.index(max(scores))  # the first policy that reached the best score
    assert {p.name for p in (out / "model-best").iterdir()} >= HF_FILES
    if info["step"] == len(scores) - 1:  # the final policy was the best: both folders hold it
        assert torch.allclose(
            _logits(_load(out / "model-best")), _logits(grpo.policy.model), atol=LOGITS_ATOL
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agl_engine_serve_serves_the_exported_model(grpo_run: tuple[GRPO, dict[str, Any], Path]) -> None:
    """A real chat completion through the openai SDK: its logprobs are the trained policy's."""
    from agl.algorithm.policy.logprobs import token_logprobs

    grpo, _, out = grpo_run
    port = free_port()
    cmd = [sys.executable, "-m", "agl", "engine", "serve", "--model", str(out / "model"), "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "agl engine serve did not come up within 120 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "1 2"}],
            max_tokens=6,
            temperature=0.0,
            logprobs=True,
        )
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    data = reply.model_dump()
    prompt, completion = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    served = torch.tensor([e["logprob"] for e in data["choices"][0]["logprobs"]["content"]])
    assert len(completion) == len(served) > 0
    model = grpo.policy.model
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + completion])
        mine, _ = token_logprobs(model, ids, torch.ones_like(ids))
    model.train()
    diff = float((mine[0, len(prompt) - 1 :] - served).abs().max())
    print(f"max abs logprob diff, agl engine serve on OUT/model vs in-process policy: {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_exports_its_full_fine_tuned_policy(
    grpo_run: tuple[GRPO, dict[str, Any], Path], tmp_path: Path
) -> None:
    """SFT (offline, on the GRPO run's store) writes OUT/model; plain transformers gives its logits."""
    _, _, run_dir = grpo_run
    config = SFTConfig(
        model_path=str(tiny_model()),
        from_store=f"sqlite:///{run_dir / 'store.db'}",
        min_reward=None,
        top_k_per_task=None,
        lr=1e-3,
        epochs=2,
        progress=False,
    )
    sft = SFT(config)

    async def main() -> dict[str, Any]:
        async with InMemoryLightningStore() as store:  # offline SFT never touches the context's store
            return await sft.run(TrainingContext(store=store, output_dir=str(tmp_path)), [], [])

    result = asyncio.run(main())
    assert result["model_path"] == str(tmp_path / "model") and result["adapter_path"] is None
    assert result["best_model_path"] is None  # nothing was validated
    exported = _load(tmp_path / "model")
    assert float((_logits(exported) - _logits(sft.policy.model)).abs().max()) < LOGITS_ATOL
    base = _base_state()
    assert any(not torch.equal(v, base[k]) for k, v in exported.state_dict().items() if k in base)
    assert json.loads((tmp_path / "model" / INFO_FILE).read_text())["algorithm"] == "SFT"


# ----- the export itself, without a fit ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy() -> Policy:
    p = Policy(PolicyConfig(model_path=str(tiny_model())), LossConfig())
    with torch.no_grad():
        for param in p.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return p


def test_full_fine_tuning_export_is_exact(policy: Policy, tmp_path: Path) -> None:
    exported = export_policy(policy, tmp_path / "model", adapter_folder=tmp_path / "adapter")
    assert exported.adapter_path is None and not (tmp_path / "adapter").exists()  # no LoRA: no adapter
    assert torch.equal(_logits(_load(exported.model_path)), _logits(policy.model))


def test_a_failed_export_keeps_the_previous_folder(policy: Policy, tmp_path: Path) -> None:
    target = tmp_path / "model"
    export_policy(policy, target, info={"step": 1})

    def crash(out: Path) -> None:
        (out / "config.json").write_text("{half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, crash)
    assert json.loads((target / INFO_FILE).read_text())["step"] == 1  # the old, complete folder is intact
    assert torch.equal(_logits(_load(target)), _logits(policy.model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the temporary folder is gone
    export_policy(policy, target, info={"step": 2})  # replacing a folder works, and leaves nothing beside it
    assert json.loads((target / INFO_FILE).read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_best_export_writes_only_on_improvement_and_resumes_from_disk(policy: Policy, tmp_path: Path) -> None:
    best = BestExport(tmp_path / "model-best")
    assert not best.offer(policy, float("nan"), step=0)  # no validation: nothing to compare
    assert best.offer(policy, 0.5, step=1) and best.path == tmp_path / "model-best"
    assert not best.offer(policy, 0.5, step=2) and not best.offer(policy, 0.25, step=3)
    assert json.loads((tmp_path / "model-best" / INFO_FILE).read_text())["step"] == 1
    again = BestExport(tmp_path / "model-best")  # a resumed run must beat the recorded score
    assert again.best == 0.5 and not again.offer(policy, 0.4, step=4)
    assert again.offer(policy, 0.75, step=5)
    off = BestExport(tmp_path / "off", enabled=False)
    assert not off.offer(policy, 1.0) and not (tmp_path / "off").exists()


async def test_export_can_be_switched_off(policy: Policy, tmp_path: Path) -> None:
    cfg = GRPOConfig(model_path="m", export_model=False, export_adapter=True)
    paths = await export_trained(policy, cfg, tmp_path)
    assert paths == {"model_path": None, "best_model_path": None, "adapter_path": None}
    assert list(tmp_path.iterdir()) == []


def test_train_from_store_needs_a_store(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="from_store"):
        train_from_store(SFTConfig(model_path=str(tiny_model())), tmp_path)
