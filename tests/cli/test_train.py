"""``agl train``: its help, every kind of bad input (exit 2, one line naming the problem), config
resolution (YAML/TOML sections, nested --set values), and a real GRPO run on the tiny model."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import agl
from agl.cli import app
from agl.cli.train import ConfigProblem, apply_override, load_config_file, make_trainer, merge, plan

ROOT = Path(__file__).resolve().parents[2]
AGENT = "tests.tiny_agents:digits_agent"


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["train", *args], prog_name="agl")
    return result.exit_code, result.stdout, result.stderr


def test_help_names_every_option_and_gives_an_example() -> None:
    code, out, _ = _invoke("--help")
    assert code == 0
    assert "Usage: agl train [OPTIONS]" in out and "COMMAND" not in out
    for option in ("--agent", "--train", "--val", "--algorithm", "--config", "--set", "--from-store"):
        assert option in out, option
    assert "Example: agl train --agent my_agents:solve --train train.jsonl" in out
    assert "SECTION.KEY=VALUE" in out and "grpo.lr=2e-5" in out


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text('"a"\n\n{"q": "b"}\n')
    (tmp_path / "run.yaml").write_text(
        "grpo:\n  model_path: some/model\n  steps: 1\ntrainer:\n  n_runners: 2\n"
    )
    (tmp_path / "bad.yaml").write_text("grpo:\n  steps: 2\n  lr: [1e-5\n")
    (tmp_path / "bad.toml").write_text("[grpo]\nsteps = 2\nlr = \n")
    (tmp_path / "bad.jsonl").write_text('"a"\n{not json}\n')
    return tmp_path


BAD_INPUT = [
    (
        ["--set", "grpo.lrr=1"],
        "unknown key grpo.lrr (did you mean grpo.lr?); valid keys of grpo: model_path, steps,",
    ),
    (["--set", "grpo.loss.clip_hi=0.3"], "unknown key grpo.loss.clip_hi (did you mean grpo.loss.clip_high?)"),
    (["--set", "trainer.n_runner=2"], "unknown key trainer.n_runner (did you mean trainer.n_runners?)"),
    (["--set", "gpro.lr=1"], "unknown key config.gpro (did you mean config.grpo?)"),
    (["--set", "grpo.steps=abc"], "grpo.steps: Input should be a valid integer"),
    (["--set", "grpo.level=token"], "grpo.level: Input should be 'trajectory' or 'transition', got 'token'"),
    (["--set", "grpo.group_size=1"], "grpo: group_size must be >= 2"),
    (["--set", "trainer.trackers=[tensorbord]"], "trainer: unknown tracker(s) ['tensorbord']"),
    (["--set", "grpo.model_path="], "grpo.model_path: Input should be a valid string, got None"),
    (["--set", "grpo"], "--set 'grpo': want SECTION.KEY=VALUE"),
    (["--algorithm", "sft"], "sft.model_path is required"),
    (["--algorithm", "gpro"], "unknown algorithm 'gpro' (did you mean grpo?); choose grpo, sft or apo"),
    (["--algorithm", "grpo", "--from-store", "sqlite:///x.db"], "--from-store trains SFT offline"),
    (["--config", "{dir}/missing.yaml"], "config file {dir}/missing.yaml does not exist"),
    (["--config", "{dir}/bad.yaml"], "bad.yaml: not valid YAML at line 4, column 1: expected ',' or ']'"),
    (["--config", "{dir}/bad.toml"], "bad.toml: not valid TOML: Invalid value (at line 3, column 6)"),
    (["--train", "{dir}/bad.jsonl"], "--train {dir}/bad.jsonl, line 2: not JSON"),
    (["--val", "{dir}/none.jsonl"], "--val {dir}/none.jsonl: no such file"),
    (["--agent", "no_such_module:solve"], "--agent no_such_module:solve: cannot import 'no_such_module'"),
    (["--agent", "tests.tiny_agents:nope"], "'tests.tiny_agents' has no attribute 'nope'"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_naming_it(files: Path, args: list[str], message: str) -> None:
    base = {"--agent": AGENT, "--train": str(files / "train.jsonl"), "--config": str(files / "run.yaml")}
    args = [a.format(dir=files) for a in args]
    for flag in args:
        base.pop(flag, None)
    code, out, err = _invoke(*[x for kv in base.items() for x in kv], *args)
    assert code == 2, (out, err)
    assert err.startswith("agl train: error: ") and err.count("\n") == 1, err
    assert message.format(dir=files) in err
    assert "Traceback" not in out + err and out == ""


def test_a_setting_fit_refuses_is_one_line_too(files: Path) -> None:
    out = files / "out"
    args = ["--set", "trainer.n_runners=0", "--set", f"trainer.output_dir={out}"]
    code, _, err = _invoke(
        "--agent", AGENT, "--train", str(files / "train.jsonl"), "--config", str(files / "run.yaml"), *args
    )
    last = err.rstrip("\n").splitlines()[-1]  # after the printed config
    assert code == 2 and last.startswith("agl train: error: Trainer(n_runners=0) starts no runner"), err
    assert "Traceback" not in err
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["n_runners"] == 0


def test_no_training_tasks_is_an_error(files: Path) -> None:
    code, _, err = _invoke("--agent", AGENT, "--config", str(files / "run.yaml"))
    assert code == 2 and "no training tasks: give --train FILE.jsonl" in err


def test_sections_overrides_and_nested_values_resolve(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'algorithm = "grpo"\n[grpo]\nmodel_path = "m"\nlr = 1e-5\n[grpo.loss]\nclip_high = 0.28\n'
        "[trainer]\nn_runners = 3\nserving = { sampling = { temperature = 0.7 } }\n"
    )
    config = load_config_file(path)
    for override in (
        "grpo.lr=2e-5",  # YAML reads 2e-5 as a string; the float field converts it
        "grpo.warm_start={conversations: [[{role: user, content: hi}, {role: assistant, content: '4'}]], steps: 2}",
        "trainer.serving.port=5555",
        "trainer.trackers=[tensorboard, wandb]",
        "trainer.initial_resources={prompt: {resource_type: prompt_template, template: 'Q: {q}'}}",
    ):
        apply_override(config, override)
    run = plan(config)
    cfg = run.algorithm_config
    assert (cfg.lr, cfg.loss.clip_high, cfg.warm_start.steps) == (2e-5, 0.28, 2)
    assert cfg.warm_start.conversations[0][1] == {"role": "assistant", "content": "4"}
    kwargs = run.trainer_kwargs
    assert kwargs["n_runners"] == 3 and kwargs["serving"].sampling == {"temperature": 0.7}
    assert kwargs["serving"].port == 5555 and kwargs["initial_resources"]["prompt"].template == "Q: {q}"
    assert run.resolved["grpo"]["loss"] == {
        **run.resolved["grpo"]["loss"],
        "clip_high": 0.28,
        "clip_low": 0.2,
    }
    assert run.resolved["trainer"]["trackers"] == ["tensorboard", "wandb"]
    # secrets are neither printed nor saved
    apply_override(config, "trainer.serving.token=s3cret")
    assert plan(config).resolved["trainer"]["serving"]["token"] is None


@pytest.mark.parametrize(
    "override", ["trainer.sampling={temperature: 0.5}", "trainer.gateway_port=6000", "trainer.public_host=h"]
)
def test_a_serving_key_directly_under_trainer_is_refused_naming_the_valid_keys(override: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(ConfigProblem, match=f"unknown key {key}; valid keys of trainer: .*serving"):
        plan(merge(None, {"algorithm": "grpo"}, ["grpo.model_path=m", override]))


def test_apo_builds_its_llm_endpoints_and_keeps_their_keys_out_of_the_saved_config(tmp_path: Path) -> None:
    llm = "{endpoint: 'http://127.0.0.1:9/v1', model: critic, api_key: sk-secret}"
    overrides = [
        f"apo.critic={llm}",
        f"apo.editor={llm}",
        "apo.max_rollouts=40",
        f"trainer.output_dir={tmp_path}",
    ]
    run = plan(merge(None, {"algorithm": "apo"}, overrides))
    assert run.algorithm_config.critic.model == "critic" and run.algorithm_config.max_rollouts == 40
    assert (
        run.resolved["apo"]["critic"]["api_key"] is None
        and run.resolved["apo"]["critic"]["model"] == "critic"
    )
    trainer = make_trainer(
        run
    )  # APO's metrics go beside config.yaml unless its own output_dir says otherwise
    assert trainer.algorithm.config.output_dir == str(tmp_path) == run.resolved["apo"]["output_dir"]
    with pytest.raises(
        ConfigProblem, match=r"unknown key apo.critic.modle \(did you mean apo.critic.model\?\)"
    ):
        plan(merge(None, {"algorithm": "apo"}, ["apo.critic={endpoint: x, modle: m}"]))


def test_a_teacher_warm_start_comes_from_the_config_and_keeps_its_key_out_of_it() -> None:
    teacher = "{endpoint: 'http://127.0.0.1:9/v1', model: big, api_key: sk-secret, samples_per_task: 2}"
    run = plan(merge(None, {"algorithm": "grpo"}, ["grpo.model_path=m", f"grpo.warm_start={teacher}"]))
    warm = run.algorithm_config.warm_start
    assert isinstance(warm, agl.Teacher) and (warm.model, warm.samples_per_task, warm.api_key) == (
        "big",
        2,
        "sk-secret",
    )
    assert run.resolved["grpo"]["warm_start"]["api_key"] is None
    run = plan(merge(None, {"algorithm": "sft"}, ["sft.model_path=m", "sft.teacher={path: /models/big}"]))
    assert run.algorithm_config.teacher == agl.Teacher(path="/models/big")
    assert (
        plan(
            merge(None, {"algorithm": "grpo"}, ["grpo.model_path=m", "grpo.warm_start=null"])
        ).algorithm_config.warm_start
        is None
    )
    with pytest.raises(ConfigProblem, match="grpo.warm_start: Teacher\\(endpoint=...\\) needs model="):
        plan(
            merge(
                None,
                {"algorithm": "grpo"},
                ["grpo.model_path=m", "grpo.warm_start={endpoint: 'http://h/v1'}"],
            )
        )


def test_a_config_names_the_teachers_keep_test_as_module_attr_and_saves_it_so() -> None:
    teacher = "{path: /models/big, keep: 'agl:Teacher.calls_a_tool'}"
    run = plan(merge(None, {"algorithm": "grpo"}, ["grpo.model_path=m", f"grpo.warm_start={teacher}"]))
    assert run.algorithm_config.warm_start.keep is agl.Teacher.calls_a_tool
    saved = run.resolved["grpo"]["warm_start"]["keep"]
    assert saved == "agl.algorithm.teacher:Teacher.calls_a_tool"  # the saved config loads back the same
    again = plan(
        merge(
            None,
            {"algorithm": "grpo"},
            ["grpo.model_path=m", f"grpo.warm_start={{path: m, keep: '{saved}'}}"],
        )
    )
    assert again.algorithm_config.warm_start.keep is agl.Teacher.calls_a_tool
    for spec, problem in [
        ("calls_a_tool", "grpo.warm_start.keep wants module:attr"),
        ("no_such_module:f", "cannot import 'no_such_module'"),
        ("agl:Teacher.nope", "'agl' has no attribute 'Teacher.nope'"),
        ("agl:Teacher", "agl:Teacher is a type, not a function"),
    ]:
        with pytest.raises(ConfigProblem, match=problem):
            plan(
                merge(
                    None,
                    {"algorithm": "grpo"},
                    ["grpo.model_path=m", f"grpo.warm_start={{path: m, keep: '{spec}'}}"],
                )
            )


def test_from_store_sets_sfts_offline_field_and_needs_no_train_file() -> None:
    settings = merge(None, {"algorithm": "sft"}, ["sft.model_path=m"], from_store="sqlite:///runs/a/store.db")
    run = plan(settings)
    assert run.algorithm_config.from_store == "sqlite:///runs/a/store.db" and run.train_path is None
    with pytest.raises(ConfigProblem, match="--from-store trains SFT offline"):
        merge(None, {"algorithm": "grpo"}, [], from_store="sqlite:///x.db")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_grpo_run_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('"a"\n"b"\n"c"\n')
    (tmp_path / "val.jsonl").write_text('"a"\n')
    out = tmp_path / "out"
    (tmp_path / "run.toml").write_text(
        '[grpo]\nmodel_path = "tiny"\nsteps = 1\ntasks_per_step = 2\ngroup_size = 2\nlr = 1e-3\n'
        f'eval_every = 0\n[trainer]\nn_runners = 4\noutput_dir = "{out}"\n'
    )
    cmd = [sys.executable, "-m", "agl", "train", "--agent", AGENT, "--algorithm", "grpo"]
    cmd += ["--train", str(tmp_path / "train.jsonl"), "--val", str(tmp_path / "val.jsonl")]
    cmd += [
        "--config",
        str(tmp_path / "run.toml"),
        "--set",
        "grpo.steps=2",
        "--set",
        "trainer.trackers=[tensorboard]",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=220, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["algorithm"] == "grpo" and saved["agent"] == AGENT
    assert saved["grpo"]["steps"] == 2 and saved["grpo"]["lr"] == 1e-3 and saved["grpo"]["group_size"] == 2
    assert Path(saved["grpo"]["model_path"]).is_dir()  # "tiny" resolved to the built model's folder
    assert saved["trainer"]["output_dir"] == str(out) and saved["trainer"]["trackers"] == ["tensorboard"]
    assert "resolved config, saved to" in proc.stderr and "group_size: 2" in proc.stderr
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(float(r["step"])) for r in rows] == [0, 1, 2] and rows[1]["reward_mean"] != ""
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # Trainer(trackers=...) reached GRPO
    assert f"agl train: outputs: {out}" in proc.stdout
    # the saved file is itself a valid config that reproduces the run
    assert plan(load_config_file(out / "config.yaml")).resolved == saved


def test_a_run_whose_every_rollout_fails_exits_1_with_the_error_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('"a"\n"b"\n')
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "agl", "train", "--agent", "tests.tiny_agents:keyless_agent"]
    cmd += ["--algorithm", "grpo", "--train", str(tmp_path / "train.jsonl"), "--set", "grpo.model_path=tiny"]
    cmd += ["--set", "grpo.steps=1", "--set", "grpo.tasks_per_step=2", "--set", "grpo.group_size=2"]
    cmd += ["--set", f"trainer.output_dir={out}"]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=220, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "agl train: RolloutsFailedError: all 4 rollouts" in proc.stderr and "agent bug" in proc.stderr
    assert "Traceback" not in proc.stderr
