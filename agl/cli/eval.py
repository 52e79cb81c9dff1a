"""``agl eval``: ``agl.evaluate_models`` from the shell, with a table, ``eval.json`` and ``eval.png``.

The agent is imported as ``agl train --agent`` does and the tasks are a JSONL file; bad input exits 2 with
one line naming the problem (the file and line of a bad task).
"""

from __future__ import annotations

from pathlib import Path

import typer

EXAMPLE = (
    "Example: agl eval --agent my_agents:solve --tasks test.jsonl --model tiny --model results/grpo-run/model "
    "-k 4 --compare tiny results/grpo-run/model --out results/eval. "
    "A model is 'tiny' or 'smollm2' (built in), a local model folder (a fit run's folder or its model/), "
    "or an OpenAI-compatible endpoint URL#MODEL_NAME (key from OPENAI_API_KEY)."
)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"agl eval: error: {message}", err=True, fg="red")
    return typer.Exit(2)


def eval_command(
    agent: str = typer.Option(
        ...,
        help="module:attr of the agent, as for agl train (the working directory is importable).",
        show_default=False,
    ),
    tasks_file: Path = typer.Option(
        ..., "--tasks", help="The tasks: a JSONL file, one task (any JSON value) a line.", show_default=False
    ),
    models: list[str] = typer.Option(  # noqa: B006 (typer's repeatable option)
        ...,
        "--model",
        "-m",
        metavar="MODEL",
        help="A model to evaluate (repeatable): tiny, smollm2, a model folder, or URL#MODEL_NAME.",
        show_default=False,
    ),
    k: int = typer.Option(1, "-k", help="Samples per task (each task runs k times).", min=1),
    pass_k: int | None = typer.Option(
        None, "--pass-k", help="The k of pass@k (1..k; default k).", show_default=False
    ),
    pass_threshold: float = typer.Option(1.0, help="A sample passes when its reward is at least this."),
    compare: tuple[str, str] | None = typer.Option(
        None,
        "--compare",
        metavar="A B",
        help="Two of the --model values: list the tasks whose mean reward changed from A to B, and the "
        "mean change with its CI.",
        show_default=False,
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Write eval.json, eval.png and the rollouts' store.db here.", show_default=False
    ),
    store: str | None = typer.Option(
        None,
        help="Store URL for the rollouts (default: OUT/store.db, or a temporary one).",
        show_default=False,
    ),
    n_runners: int = typer.Option(4, help="Rollouts run at once.", min=1),
    temperature: float | None = typer.Option(
        None, help="Sampling temperature (default: agl.Serving's, 0.7).", show_default=False
    ),
    seed: int | None = typer.Option(None, help="Seed the rollouts' sampling.", show_default=False),
) -> None:
    """Evaluate an agent under one or more models: mean reward, mean@k and pass@k with CIs.

    Each task runs k times per model; failed rollouts are counted by class (infra/agent/reward), never
    scored. CIs are percentile bootstraps over tasks.
    """
    from agl.cli.runner import load_agent
    from agl.cli.train import ConfigProblem, read_jsonl
    from agl.errors import AglError, ConfigError
    from agl.trainer.eval_report import print_result, write_json, write_plot
    from agl.trainer.evaluation import evaluate_models
    from agl.trainer.serving import Serving

    try:
        tasks = read_jsonl(tasks_file, "--tasks")
        if not tasks:
            raise ConfigProblem(f"--tasks {tasks_file}: no tasks in the file")
        lit_agent = load_agent(agent)
    except (ConfigProblem, ValueError) as exc:
        raise _fail(str(exc)) from None
    serving = Serving() if temperature is None else Serving(sampling={"temperature": temperature})
    try:
        result = evaluate_models(
            lit_agent,
            tasks,
            models,
            k=k,
            pass_k=pass_k,
            pass_threshold=pass_threshold,
            compare=compare,
            store=store,
            output_dir=out,
            serving=serving,
            n_runners=n_runners,
            sampling_seed=seed,
        )
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except AglError as exc:
        typer.secho(f"agl eval: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    print_result(result)
    if out is not None:
        typer.echo(f"agl eval: wrote {write_json(result, out)} and {write_plot(result, out)}")
