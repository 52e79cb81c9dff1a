"""``agl train``: ``Trainer(...).fit`` from the shell.

The agent is imported as ``agl runner --agent`` does, the datasets are JSONL files (one task a line),
and the config is YAML or TOML whose sections are the config dataclasses (``grpo:`` -> ``GRPOConfig``,
``sft:``, ``apo:``) and ``Trainer``'s keyword arguments (``trainer:``), with ``--set KEY=VALUE``
overrides on top. Valid keys come from the dataclass fields and Trainer's signature, so they never
drift from the code. Bad input exits 2 with one line naming the problem. ``--online`` trains in rounds on
the production traffic a gateway recorded instead (:mod:`agl.trainer.online`; ``agl model`` rolls back).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import importlib
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import typer

from agl.errors import AglError, ConfigError

# section -> (module, config class, algorithm class); imported only once the section is used
ALGORITHMS: dict[str, tuple[str, str, str]] = {
    "grpo": ("agl.algorithm.grpo", "GRPOConfig", "GRPO"),
    "sft": ("agl.algorithm.sft", "SFTConfig", "SFT"),
    "apo": ("agl.algorithm.apo", "APOConfig", "APO"),
}
RUN_KEYS = ("algorithm", "agent", "train", "val")  # top-level keys the command-line flags override
SECRETS = frozenset({"api_key", "token", "admin_token"})  # never printed or saved

EXAMPLE = (
    "Example: agl train --agent my_agents:solve --train train.jsonl --val val.jsonl --algorithm grpo "
    "--config run.yaml --set grpo.lr=2e-5 --set trainer.n_runners=8. "
    "run.yaml: 'grpo: {model_path: tiny, steps: 10, group_size: 4}' and 'trainer: {output_dir: results/run}' "
    "(TOML: \\[grpo] and \\[trainer] tables). model_path 'tiny' or 'smollm2' names a built-in model."
)


class ConfigProblem(Exception):
    """Bad input of ``agl train``: reported as one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One configurable key: its type (Any when it cannot be resolved) and whether it must be given."""

    hint: Any
    required: bool


def load_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file; parse errors name the line."""
    if not path.is_file():
        raise ConfigProblem(f"config file {path} does not exist")
    text = path.read_text()
    suffix = path.suffix.lower()
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli as tomllib
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigProblem(f"{path}: not valid TOML: {exc}") from exc
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigProblem(f"{path}: not valid YAML{where}: {problem}") from exc
    else:
        raise ConfigProblem(f"{path}: unknown config format {suffix!r}; use .yaml, .yml or .toml")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigProblem(f"{path}: the config must be a mapping of sections, got a {type(data).__name__}")
    return data


def apply_override(config: dict[str, Any], text: str) -> None:
    """Apply one ``--set section.key=value`` (dotted path; the value parsed as YAML) to ``config``."""
    import yaml

    path, sep, raw = text.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise ConfigProblem(f"--set {text!r}: want SECTION.KEY=VALUE, e.g. --set grpo.lr=2e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigProblem(f"--set {text!r}: the value is not valid YAML: {exc}") from exc
    node = config
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigProblem(f"--set {text!r}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def _resolve(annotation: Any, namespace: Mapping[str, Any]) -> Any:
    """A field's type from its (usually string) annotation; Any when a name in it cannot be resolved."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, dict(namespace))  # annotations are code of agl's own modules
    except Exception:
        return Any


def _namespace(module_name: str) -> dict[str, Any]:
    """A module's globals plus agl names its annotations use under ``TYPE_CHECKING``."""
    from agl.engines.launch import EngineSpec
    from agl.store.base import LightningStore

    return {"LightningStore": LightningStore, "EngineSpec": EngineSpec, **vars(sys.modules[module_name])}


def fields_of(target: Any) -> dict[str, Field] | None:
    """The keys a dataclass, pydantic model or function/class signature takes; None for anything else."""
    from pydantic import BaseModel

    if dataclasses.is_dataclass(target) and isinstance(target, type):
        namespace = _namespace(target.__module__)
        return {
            f.name: Field(
                _resolve(f.type, namespace),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(target)
            if f.init
        }
    if isinstance(target, type) and issubclass(target, BaseModel):
        return {
            name: Field(info.annotation, info.is_required()) for name, info in target.model_fields.items()
        }
    if callable(target):
        namespace = _namespace(target.__module__)
        params = inspect.signature(target).parameters.values()
        return {
            p.name: Field(_resolve(p.annotation, namespace), p.default is inspect.Parameter.empty)
            for p in params
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
        }
    return None


def _structured(hint: Any) -> list[Any]:
    """The dataclasses and pydantic models in ``hint`` (itself, or the members of a union)."""
    if typing.get_origin(hint) is typing.Annotated:
        return _structured(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(hint) for t in _structured(arg)]
    from pydantic import BaseModel

    if isinstance(hint, type) and (dataclasses.is_dataclass(hint) or issubclass(hint, BaseModel)):
        return [hint]
    return []


def check_keys(value: Mapping[str, Any], fields: Mapping[str, Field], where: str) -> None:
    """Every key of ``value`` is a field; an unknown one names the closest valid key and lists all."""
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {where}.{close[0]}?)" if close else ""
            raise ConfigProblem(
                f"unknown key {where}.{key}{hint}; valid keys of {where}: {', '.join(fields)}"
            )


def _pydantic_problem(exc: Any, where: str) -> ConfigProblem:
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in (where, *first["loc"]))
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ConfigProblem(f"{loc}: {first['msg']}, got {first.get('input')!r}{more}")


def build(hint: Any, value: Any, where: str) -> Any:
    """``value`` (parsed YAML/TOML) as an instance of ``hint``: dataclasses key by key (unknown keys and
    missing required ones named), everything else validated by pydantic."""
    from pydantic import BaseModel, ConfigDict, PydanticUserError, TypeAdapter, ValidationError

    targets = _structured(hint)
    if value is None and targets and type(None) in typing.get_args(hint):  # warm_start: null
        return None
    if isinstance(value, str) and _takes_a_function(hint):  # keep: agl:Teacher.calls_a_tool
        return _function(value, where)
    if isinstance(value, dict) and targets:
        fields: dict[str, Field] = {}
        for target in targets:  # a union of several: keys of any member
            fields.update(fields_of(target) or {})
        check_keys(value, fields, where)
        # a union of dataclasses (WarmStart | Teacher): the first member that takes these keys
        taking = [t for t in targets if _takes(t, value)] if len(targets) > 1 else []
        target = taking[0] if taking else targets[0]
        if (len(targets) == 1 or taking) and dataclasses.is_dataclass(target) and isinstance(target, type):
            return construct(target, build_kwargs(fields_of(target) or {}, value, where), where)
        if len(targets) == 1 and issubclass(target, BaseModel):
            hint = target
    try:
        adapter: TypeAdapter[Any] = TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))
    except PydanticUserError:  # a dataclass or model brings its own config
        adapter = TypeAdapter(hint)
    try:
        return adapter.validate_python(value)
    except PydanticUserError:  # a union member pydantic cannot build from this value
        names = " or ".join(t.__name__ for t in targets) or str(hint)
        raise ConfigProblem(f"{where}: expected the keys of {names}, got {value!r}") from None
    except ValidationError as exc:
        raise _pydantic_problem(exc, where) from exc
    except (ConfigError, ValueError, TypeError) as exc:
        raise ConfigProblem(f"{where}: {exc}") from exc


def _takes_a_function(hint: Any) -> bool:
    """Whether ``hint`` is a ``Callable`` (or a union with one): a config names it as ``module:attr``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_takes_a_function(arg) for arg in typing.get_args(hint))
    return hint is collections.abc.Callable or typing.get_origin(hint) is collections.abc.Callable


def _function(spec: str, where: str) -> Any:
    """The function a config's ``module:attr`` names (imported as ``--agent`` is)."""
    from agl.cli.runner import load_attr

    try:
        target = load_attr(spec, where, example="agl:Teacher.calls_a_tool")
    except ValueError as exc:
        raise ConfigProblem(str(exc)) from exc
    if not callable(target) or isinstance(target, type):
        raise ConfigProblem(f"{where}: {spec} is a {type(target).__name__}, not a function")
    return target


def _takes(target: Any, value: Mapping[str, Any]) -> bool:
    """Whether the dataclass ``target`` has every key of ``value`` and gets all its required fields."""
    if not (dataclasses.is_dataclass(target) and isinstance(target, type)):
        return False
    fields = fields_of(target) or {}
    return all(k in fields for k in value) and all(k in value for k, f in fields.items() if f.required)


def build_kwargs(fields: Mapping[str, Field], value: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Each key of ``value`` built to its field's type; a missing required field is named."""
    check_keys(value, fields, where)
    built = {key: build(fields[key].hint, item, f"{where}.{key}") for key, item in value.items()}
    missing = [name for name, f in fields.items() if f.required and name not in value]
    if missing:
        raise ConfigProblem(
            f"{where}.{missing[0]} is required (set it in the config or --set {where}.{missing[0]}=...)"
        )
    return built


def construct(factory: Callable[..., Any], kwargs: Mapping[str, Any], where: str) -> Any:
    """``factory(**kwargs)``; its own checks (``__post_init__``) become a problem naming ``where``."""

    try:
        return factory(**kwargs)
    except (ConfigError, ValueError, TypeError) as exc:
        raise ConfigProblem(f"{where}: {exc}") from exc


def plain(value: Any) -> Any:
    """``value`` as YAML-safe data (dataclasses and models as mappings), secrets left out."""
    from pydantic import BaseModel

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return {str(k): None if k in SECRETS and v is not None else plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if inspect.isfunction(value) and "<" not in value.__qualname__:  # as a config names it: module:attr
        return f"{value.__module__}:{value.__qualname__}"
    return str(value)


def read_jsonl(path: Path, flag: str) -> list[Any]:
    """The tasks of a JSONL file, one JSON value a line (blank lines skipped); bad lines are named."""
    if not path.is_file():
        raise ConfigProblem(f"{flag} {path}: no such file")
    tasks = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    tasks.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigProblem(f"{flag} {path}, line {number}: not JSON ({exc.msg})") from exc
    return tasks


def merge(
    config: Path | None, flags: Mapping[str, Any], overrides: list[str], from_store: str | None = None
) -> dict[str, Any]:
    """The config file's settings, then the command-line flags, ``--from-store`` and ``--set`` on top."""
    settings = load_config_file(config) if config is not None else {}
    settings.update({k: str(v) for k, v in flags.items() if v is not None})
    if from_store is not None:
        section = settings.setdefault("sft", {})
        if not isinstance(section, dict):
            raise ConfigProblem(f"config.sft must be a mapping of keys, got {section!r}")
        section["from_store"] = from_store  # SFTConfig.from_store: offline SFT on that store's rollouts
    for override in overrides:
        apply_override(settings, override)
    if from_store is not None and settings.get("algorithm", "sft") != "sft":
        raise ConfigProblem("--from-store trains SFT offline: use it with --algorithm sft")
    return settings


def _algorithm_name(config: Mapping[str, Any]) -> str:
    name = config.get("algorithm")
    if name is None:
        present = [n for n in ALGORITHMS if n in config]
        if len(present) != 1:
            raise ConfigProblem(
                "say which algorithm: --algorithm grpo|sft|apo (or one grpo:, sft: or apo: section in the config)"
            )
        name = present[0]
    if name not in ALGORITHMS:
        close = difflib.get_close_matches(str(name), list(ALGORITHMS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigProblem(f"unknown algorithm {name!r}{hint}; choose grpo, sft or apo")
    return str(name)


def _model_path(section: dict[str, Any]) -> None:
    """``model_path: tiny`` / ``smollm2``: the built-in models' local folders."""
    name = section.get("model_path")
    if name == "tiny":
        from agl.models import tiny_model

        section["model_path"] = str(tiny_model())
    elif name == "smollm2":
        from agl.models import smollm2

        section["model_path"] = str(smollm2())


@dataclasses.dataclass
class Plan:
    """What ``agl train`` runs: the built objects and the resolved config that is printed and saved."""

    algorithm_name: str
    agent_spec: str | None
    train_path: str | None
    val_path: str | None
    trainer_kwargs: dict[str, Any]
    algorithm_config: Any
    resolved: dict[str, Any]


def plan(config: dict[str, Any]) -> Plan:
    """Check and build everything the config (file, flags and overrides merged) asks for."""
    from agl.trainer import Serving, Trainer

    check_keys(config, {k: Field(Any, False) for k in (*RUN_KEYS, *ALGORITHMS, "trainer")}, "config")
    name = _algorithm_name(config)
    for key in ("agent", "train", "val"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ConfigProblem(f"config.{key} must be a string, got {config[key]!r}")
    sections = {}
    for section in (*ALGORITHMS, "trainer"):
        values = config.get(section) or {}
        if not isinstance(values, dict):
            raise ConfigProblem(f"config.{section} must be a mapping of keys, got {values!r}")
        sections[section] = dict(values)
    module_name, class_name, _ = ALGORITHMS[name]
    config_class = getattr(importlib.import_module(module_name), class_name)
    for other in ALGORITHMS:  # a run file may carry several algorithms' sections: check them all
        if other != name and sections[other]:
            other_module, other_class, _ = ALGORITHMS[other]
            other_fields = fields_of(getattr(importlib.import_module(other_module), other_class)) or {}
            check_keys(sections[other], other_fields, other)
    trainer_fields = {k: v for k, v in (fields_of(Trainer.__init__) or {}).items() if k != "algorithm"}
    trainer_kwargs = build_kwargs(trainer_fields, sections["trainer"], "trainer")
    _model_path(sections[name])
    algorithm_config = build(config_class, sections[name], name)
    resolved = {
        "algorithm": name,
        "agent": config.get("agent"),
        "train": config.get("train"),
        "val": config.get("val"),
        name: plain(algorithm_config),
        "trainer": plain({k: trainer_kwargs.get(k, _default(Trainer.__init__, k)) for k in trainer_fields}),
    }
    if resolved["trainer"].get("serving") is None:  # the saved config shows the serving defaults it ran with
        resolved["trainer"]["serving"] = plain(Serving())
    return Plan(
        name,
        config.get("agent"),
        config.get("train"),
        config.get("val"),
        trainer_kwargs,
        algorithm_config,
        resolved,
    )


def _default(function: Callable[..., Any], name: str) -> Any:
    default = inspect.signature(function).parameters[name].default
    return None if default is inspect.Parameter.empty else default


def _result_outputs(result: Any, trainer: Any) -> list[tuple[str, Any]]:
    """Where fit put things, for the closing lines: the run folder and any model export it reports."""
    found: list[tuple[str, Any]] = [("outputs", getattr(trainer, "run_dir", None) or trainer.output_dir)]
    for key in ("model_path", "best_model_path", "adapter_path"):
        value = result.get(key) if isinstance(result, Mapping) else getattr(result, key, None)
        if value:
            found.append((key, value))
    return found


def _fail(message: str) -> typer.Exit:
    typer.secho(f"agl train: error: {message}", err=True, fg="red")
    return typer.Exit(2)


def train(
    agent: str | None = typer.Option(
        None,
        help="module:attr of the agent: an @agl.rollout function, a LitAgent instance or class "
        "(the working directory is importable).",
        show_default=False,
    ),
    train_file: Path | None = typer.Option(
        None,
        "--train",
        help="Training tasks: a JSONL file, one task (any JSON value) a line.",
        show_default=False,
    ),
    val_file: Path | None = typer.Option(
        None, "--val", help="Validation tasks, JSONL like --train (optional).", show_default=False
    ),
    algorithm: str | None = typer.Option(
        None,
        help="grpo, sft or apo (default: the config's algorithm key, or its only algorithm section).",
        show_default=False,
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="YAML or TOML file with sections grpo/sft/apo (the config dataclasses' fields) and trainer "
        "(agl.Trainer's keyword arguments); a saved OUTPUT_DIR/config.yaml reruns a run.",
        show_default=False,
    ),
    overrides: list[str] = typer.Option(  # noqa: B006 (typer's repeatable option)
        [],
        "--set",
        metavar="SECTION.KEY=VALUE",
        help="Override one key, the value parsed as YAML (e.g. --set grpo.lr=2e-5, "
        "--set grpo.loss.clip_high=0.28, --set 'trainer.trackers=\\[tensorboard, wandb]'); repeatable.",
        show_default=False,
    ),
    from_store: str | None = typer.Option(
        None,
        "--from-store",
        help="With --algorithm sft: train offline on the succeeded rollouts already in this store "
        "(a URL, e.g. sqlite:///results/run/store.db); --train is then not needed. With --online: the "
        "store the gateway records production traffic to.",
        show_default=False,
    ),
    online: bool = typer.Option(
        False,
        "--online",
        help="GRPO on the rewarded production traffic in --from-store, in rounds: "
        "train, evaluate on --val, publish to --engine only if not worse (see agl model rollback).",
    ),
    once: bool = typer.Option(False, "--once", help="With --online: one round, then exit."),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="With --online: the serving engine's URL (agl engine serve), which takes "
        "each published version.",
        show_default=False,
    ),
    engine_token: str | None = typer.Option(
        None, "--engine-token", envvar="AGL_ENGINE_TOKEN", help="The engine's --token.", show_default=False
    ),
    every_rollouts: int | None = typer.Option(
        None,
        "--every-rollouts",
        help="With --online: a round per N new rewarded rollouts.",
        show_default=False,
    ),
    every_minutes: float | None = typer.Option(
        None,
        "--every-minutes",
        help="With --online: a round every T minutes (when any new one is rewarded).",
        show_default=False,
    ),
    min_gain: float = typer.Option(
        0.0, "--min-gain", help="With --online, the gate: publish when candidate >= current + this on --val."
    ),
    max_version_lag: int = typer.Option(
        2, "--max-version-lag", min=0, help="With --online: skip rollouts recorded this many versions back."
    ),
) -> None:
    """Train an agent with GRPO, SFT or APO: Trainer(...).fit from the shell.

    Prints the resolved config and saves it as OUTPUT_DIR/config.yaml; metrics and model go there too.
    With --online, trains in rounds on production traffic instead (agl/trainer/online.py).
    """
    flags = {"algorithm": algorithm, "agent": agent, "train": train_file, "val": val_file}
    if online:
        options = OnlineFlags(
            from_store, engine, engine_token, once, every_rollouts, every_minutes, min_gain, max_version_lag
        )
        run_online(config, flags, overrides, options)
        return
    if once or engine or every_rollouts is not None or every_minutes is not None:
        raise _fail("--once, --engine, --every-rollouts and --every-minutes train online: add --online")
    _fit(config, flags, overrides, from_store)


def _fit(config: Path | None, flags: dict[str, Any], overrides: list[str], from_store: str | None) -> None:
    """``agl train`` without ``--online``: plan, save the config, ``Trainer.fit``, name the outputs."""
    try:
        run = plan(merge(config, flags, overrides, from_store))
        offline = (
            run.algorithm_name == "sft" and getattr(run.algorithm_config, "from_store", None) is not None
        )
        if run.train_path is None and not offline:
            raise ConfigProblem("no training tasks: give --train FILE.jsonl (or train: in the config)")
        train_tasks = read_jsonl(Path(run.train_path), "--train") if run.train_path else []
        val_tasks = read_jsonl(Path(run.val_path), "--val") if run.val_path else []
        lit_agent = _agent(run.agent_spec, offline and not val_tasks)
        trainer = make_trainer(run)
    except ConfigProblem as exc:
        raise _fail(str(exc)) from None
    _show_and_save(run, trainer)
    try:
        result = trainer.fit(lit_agent, train_tasks, val_tasks)
    except ConfigError as exc:  # a setting fit or the algorithm refuses: a message, not a traceback
        raise _fail(str(exc)) from None
    except AglError as exc:  # the run itself failed (every rollout failed, say): the message says why
        typer.secho(f"agl train: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.secho("agl train: interrupted; runners, gateway and engine were stopped", err=True)
        raise typer.Exit(130) from None
    for label, where in _result_outputs(result, trainer):
        typer.echo(f"agl train: {label}: {where}")


def _agent(spec: str | None, optional: bool) -> Any:
    """The agent ``spec`` names; with nothing to run (offline SFT, no validation) one that never runs."""
    from agl.cli.runner import load_agent

    if spec is None:
        if not optional:
            raise ConfigProblem("no agent: give --agent module:attr (or agent: in the config)")
        from agl.agent.base import rollout

        def unused(task: Any) -> float:  # offline SFT without --val enqueues no rollout
            raise RuntimeError("agl train --from-store without --val runs no rollout")

        return rollout(unused)
    try:
        return load_agent(spec)
    except ValueError as exc:
        raise ConfigProblem(str(exc)) from exc


def make_trainer(run: Plan) -> Any:
    """The Trainer, its output folder fixed now so the config can be saved there before ``fit``."""
    from agl.trainer import Trainer

    module_name, _, class_name = ALGORITHMS[run.algorithm_name]
    algorithm_class = getattr(importlib.import_module(module_name), class_name)
    trainer = construct(
        Trainer, {"algorithm": algorithm_class(run.algorithm_config), **run.trainer_kwargs}, "trainer"
    )
    out = trainer.new_run_dir()  # fit writes here too: output_dir, or a new results/<algorithm>-<time>
    trainer.output_dir = str(out)
    run.resolved["trainer"]["output_dir"] = str(out)
    if run.algorithm_name == "apo" and run.algorithm_config.output_dir is None:  # metrics beside the config
        config = dataclasses.replace(run.algorithm_config, output_dir=str(out))
        trainer.algorithm = algorithm_class(config)
        run.resolved["apo"]["output_dir"] = str(out)
    return trainer


def _show_and_save(run: Plan, trainer: Any) -> None:
    """Print the resolved config (rich) and write it to ``OUTPUT_DIR/config.yaml``."""
    import yaml
    from rich.console import Console
    from rich.syntax import Syntax

    out = Path(trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(run.resolved, sort_keys=False, allow_unicode=True)
    (out / "config.yaml").write_text(text)
    console = Console(stderr=True)
    console.rule(f"agl train: resolved config, saved to {out / 'config.yaml'}")
    console.print(Syntax(text, "yaml", background_color="default"))
    console.rule()


@dataclasses.dataclass(frozen=True)
class OnlineFlags:
    """``agl train``'s ``--online`` options."""

    store: str | None
    engine: str | None
    engine_token: str | None
    once: bool
    every_rollouts: int | None
    every_minutes: float | None
    min_gain: float
    max_version_lag: int


def _plan_online(
    config: Path | None, flags: dict[str, Any], overrides: list[str], options: OnlineFlags
) -> tuple[Any, Any]:
    """The GRPO config and the round's settings from the merged config and flags; problems name the flag."""
    from agl.trainer.online import OnlineSettings

    settings = merge(config, flags, overrides)
    settings.setdefault("algorithm", "grpo")
    if settings["algorithm"] != "grpo":
        raise ConfigProblem(f"--online trains with GRPO, not {settings['algorithm']!r}: use --algorithm grpo")
    if options.store is None:
        raise ConfigProblem("--online needs --from-store URL: the store the gateway records production to")
    if options.engine is None:
        raise ConfigProblem("--online needs --engine URL: the serving engine that takes published versions")
    if settings.get("train") is not None:
        raise ConfigProblem("--online trains on production traffic: --train does not go with it")
    run = plan(settings)
    if run.val_path is None:
        raise ConfigProblem("--online gates each version on held-out tasks: give --val FILE.jsonl")
    output_dir = run.trainer_kwargs.get("output_dir")
    if not output_dir:
        raise ConfigProblem(
            "--online keeps its versions and watermark in one folder: set trainer.output_dir "
            "(e.g. --set trainer.output_dir=results/online)"
        )
    held_out = read_jsonl(Path(run.val_path), "--val")
    online = OnlineSettings(
        store=options.store,
        engine=options.engine,
        output_dir=Path(output_dir),
        agent=_agent(run.agent_spec, False),
        held_out=held_out,
        engine_token=options.engine_token,
        min_gain=options.min_gain,
        max_version_lag=options.max_version_lag,
        seed=run.algorithm_config.seed,
        n_runners=run.trainer_kwargs.get("n_runners", 4),
        serving=run.trainer_kwargs.get("serving"),
    )
    _show_and_save(run, types.SimpleNamespace(output_dir=str(output_dir)))
    return run.algorithm_config, online


def run_online(
    config: Path | None, flags: dict[str, Any], overrides: list[str], options: OnlineFlags
) -> None:
    """One round (``--once``) or rounds on a schedule; each prints its decision."""
    from agl.trainer.online import run_round, run_schedule

    try:
        grpo, settings = _plan_online(config, flags, overrides, options)
        if options.once:
            typer.echo(f"agl train: {run_round(grpo, settings).line()}")
            return
        run_schedule(
            grpo,
            settings,
            every_rollouts=options.every_rollouts,
            every_minutes=options.every_minutes,
            report=lambda r: typer.echo(f"agl train: {r.line()}"),
        )
    except (ConfigProblem, ConfigError) as exc:
        raise _fail(str(exc)) from None
    except AglError as exc:
        typer.secho(f"agl train: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
