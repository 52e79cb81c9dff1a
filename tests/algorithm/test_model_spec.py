"""The model contract between Trainer.fit and an algorithm: ``Algorithm.model_spec()`` -> ``agl.ModelSpec``.

GRPO, SFT and APO declare theirs; a custom algorithm's spec is what fit serves; a wrong field fails by
name when the spec is made; what fit does not serve yet (a teacher on vLLM) fails by name in fit, before
anything starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import agl
from agl.algorithm import AdapterSpec, ModelSpec, TeacherSpec
from agl.algorithm.apo import APO, APOConfig
from agl.algorithm.base import Algorithm, TrainingContext
from agl.engines import VllmEngine
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import LLM, ModelWeights
from agl.trainer.fit import served_model


@agl.rollout
async def echo_agent(task: int) -> float:
    await asyncio.sleep(0)
    return float(task)


def wrong(value: object) -> Any:
    """``value`` as a type checker lets it through, to pass a field a value of the wrong type."""
    return value


class Declares(Algorithm):
    """Declares ``spec``; run records what fit handed it."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.seen: dict[str, Any] = {}

    def model_spec(self) -> ModelSpec | None:
        return self.spec  # type: ignore[no-any-return]

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        assert ctx.engines is not None and ctx.llm is not None
        published = await ctx.publish_policy()
        latest = await ctx.store.get_latest_resources()
        assert latest is not None
        self.seen = {
            "model_path": ctx.model_path,
            "precision": ctx.engines.replicas[0].engine.precision,  # type: ignore[attr-defined]
            "llm_model": ctx.llm.model,
            "weights": latest.resources["weights"],
            "resources_id": published.resources_id,
        }


def test_grpo_sft_and_apo_declare_their_models() -> None:
    grpo = agl.GRPO(agl.GRPOConfig(model_path="m", lora_rank=8, precision="fp32", device="cuda:1"))
    assert grpo.model_spec() == ModelSpec("m", lora_rank=8, precision="fp32", device="cuda:1")
    sft = agl.SFT(agl.SFTConfig(model_path="s", lora_rank=4, precision="bf16"))
    assert sft.model_spec() == ModelSpec("s", lora_rank=4, precision="bf16", device="cpu")
    llm = LLM(endpoint="http://127.0.0.1:1/v1", model="m")
    apo = APO(APOConfig(critic=llm, editor=llm))
    assert apo.model_spec() is None and served_model(apo) is None  # a hosted task LLM: nothing to serve

    async def fn(ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> None:
        return None

    assert served_model(fn) is None and served_model(agl.as_algorithm(fn)) is None


def test_a_spec_holds_adapters_per_agent_and_a_teacher_read_only() -> None:
    adapters = {"planner": AdapterSpec("planner-lora", 8), "critic": AdapterSpec("critic-lora", 16)}
    teacher = TeacherSpec("/models/teacher", precision="bf16", engine=VllmEngine())
    spec = ModelSpec("/models/base", adapters=adapters, teacher=teacher)
    assert spec.adapters["critic"].rank == 16 and spec.teacher == teacher
    adapters.clear()  # the spec keeps its own copy
    assert list(spec.adapters) == ["planner", "critic"]
    with pytest.raises(TypeError):
        spec.adapters["coder"] = AdapterSpec("coder-lora", 8)  # type: ignore[index]
    shared = {"a": AdapterSpec("shared", 8), "b": AdapterSpec("shared", 8)}  # two agents, one adapter
    assert ModelSpec("/m", adapters=shared).adapters["b"].name == "shared"


def test_the_precisions_a_spec_takes_are_the_policys() -> None:
    from agl.algorithm import spec
    from agl.compute.precision import PRECISIONS

    assert spec._PRECISIONS == PRECISIONS


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ModelSpec(""), "ModelSpec.path must be a non-empty string, got ''"),
        (lambda: ModelSpec(wrong(Path("/m"))), "ModelSpec.path must be a non-empty string"),
        (lambda: ModelSpec("/m", lora_rank=-1), "ModelSpec.lora_rank must be an integer >= 0, got -1"),
        (
            lambda: ModelSpec("/m", lora_rank=wrong(True)),
            "ModelSpec.lora_rank must be an integer >= 0, got True",
        ),
        (
            lambda: ModelSpec("/m", precision=wrong("fp16")),
            r"ModelSpec.precision must be one of \['auto', 'fp32'",
        ),
        (lambda: ModelSpec("/m", device="GPU 0"), "ModelSpec.device must be a torch device"),
        (
            lambda: ModelSpec("/m", adapters=wrong([AdapterSpec("a", 8)])),
            "ModelSpec.adapters must map agent names",
        ),
        (
            lambda: ModelSpec("/m", adapters=wrong({"planner": 8})),
            r"ModelSpec.adapters\['planner'\] must be an AdapterSpec",
        ),
        (lambda: ModelSpec("/m", adapters={"": AdapterSpec("a", 8)}), "ModelSpec.adapters' agent name"),
        (
            lambda: ModelSpec("/m", adapters={"a": AdapterSpec("x", 8), "b": AdapterSpec("x", 16)}),
            "adapter 'x' with ranks 8 and 16",
        ),
        (
            lambda: ModelSpec("/m", lora_rank=8, adapters={"a": AdapterSpec("x", 8)}),
            "leave lora_rank at 0",
        ),
        (
            lambda: ModelSpec("/m", teacher=wrong("/t")),
            "ModelSpec.teacher must be an agl.algorithm.TeacherSpec",
        ),
        (lambda: AdapterSpec("a", 0), "AdapterSpec.rank must be an integer >= 1, got 0"),
        (lambda: AdapterSpec(" ", 8), "AdapterSpec.name must be a non-empty string"),
        (lambda: AdapterSpec("policy", 8), "AdapterSpec.name 'policy' is the base model's endpoint name"),
        (lambda: TeacherSpec(""), "TeacherSpec.path must be a non-empty string"),
        (lambda: TeacherSpec("/t", precision=wrong("half")), "TeacherSpec.precision must be one of"),
        (
            lambda: TeacherSpec("/t", engine=wrong({"replicas": 2})),
            "TeacherSpec.engine must be agl.engines.BuiltinEngine",
        ),
    ],
)
def test_a_wrong_field_fails_by_name(make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/m", r"Declares.model_spec\(\) must return an agl.ModelSpec or None, got a str"),
    ],
)
def test_fit_refuses_what_it_does_not_serve_before_anything_starts(
    tmp_path: Path, spec: Any, message: str
) -> None:
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        agl.Trainer(algorithm=Declares(spec), n_runners=1, output_dir=str(out)).fit(echo_agent, [1])
    assert not out.exists()  # no store, engine or runner was started


def test_an_algorithm_that_still_names_model_path_fails_when_defined() -> None:
    with pytest.raises(TypeError, match="defines model_path, which Trainer.fit does not read"):

        class Old(Algorithm):
            @property
            def model_path(self) -> str:
                return "/m"

    class Both(Algorithm):  # a model_path beside a model_spec is its own business
        model_path = "/m"

        def model_spec(self) -> ModelSpec:
            return ModelSpec(self.model_path)

    assert Both().model_spec() == ModelSpec("/m")


@pytest.mark.timeout(120)
def test_fit_serves_the_model_a_custom_algorithm_declares(tmp_path: Path) -> None:
    path = str(tiny_model())
    # the suite pins "auto" to fp32: bf16 is the spec's
    algorithm = Declares(ModelSpec(path, precision="bf16"))
    agl.Trainer(algorithm=algorithm, n_runners=1, output_dir=str(tmp_path)).fit(echo_agent, [])
    seen = algorithm.seen
    assert seen["model_path"] == path and seen["precision"] == "bf16" and seen["llm_model"] == "policy"
    assert seen["weights"] == ModelWeights(uri=path, version="v0")


def test_fit_refuses_a_vllm_teacher_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = ModelSpec("/m", teacher=TeacherSpec("/t", engine=VllmEngine()))
    with pytest.raises(NotImplementedError, match=r"declares a teacher \(/t\) served by vLLM"):
        agl.Trainer(algorithm=Declares(spec), n_runners=1, output_dir=str(out)).fit(echo_agent, [1])
    assert not out.exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TeacherSpec(), "exactly one of path"),
        (lambda: TeacherSpec("/t", endpoint="http://x/v1"), "exactly one of path"),
        (lambda: TeacherSpec(endpoint="ftp://x"), "TeacherSpec.endpoint must be an http"),
        (lambda: TeacherSpec("/t", model="policy"), "TeacherSpec.model 'policy'"),
    ],
)
def test_a_teacher_spec_is_a_folder_or_an_endpoint(make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()
