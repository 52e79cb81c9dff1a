"""``agl model``: the versions ``agl train --online`` published (``OUT/online.json``): list them, and roll
back to one by republishing its folder to the serving engine (:func:`agl.trainer.online.rollback`)."""

from __future__ import annotations

from pathlib import Path

import typer

from agl.cli.tokens import non_empty
from agl.errors import ConfigError

app = typer.Typer(no_args_is_help=True, add_completion=False)

_OUT = typer.Option(..., "--out", help="The online run's folder (agl train --online's trainer.output_dir).")
_ENGINE_TOKEN = typer.Option(
    None, "--engine-token", envvar="AGL_ENGINE_TOKEN", callback=non_empty, help="The engine's --token."
)


@app.command()
def versions(out: Path = _OUT) -> None:
    """List the versions an online run published, oldest first, with their model folders."""
    from agl.trainer.online import STATE_FILE, OnlineState

    if not (out / STATE_FILE).is_file():
        typer.secho(f"agl model: error: no {STATE_FILE} in {out}", err=True, fg="red")
        raise typer.Exit(2)
    for name, path in OnlineState.load(out, "").versions.items():
        typer.echo(f"{name}\t{path}")


@app.command()
def rollback(
    out: Path = _OUT,
    to: str = typer.Option(..., "--to", help="The version to serve again (see agl model versions)."),
    engine: str = typer.Option(..., "--engine", help="The serving engine's URL (agl engine serve)."),
    engine_token: str | None = _ENGINE_TOKEN,
) -> None:
    """Serve an earlier version again: republish its folder to the engine."""
    from agl.trainer.online import rollback as republish

    try:
        served = republish(out, to, engine, engine_token)
    except ConfigError as exc:
        typer.secho(f"agl model: error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None
    typer.echo(f"agl model: {engine} serves {served} again")
