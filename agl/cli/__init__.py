"""The ``agl`` command line: one sub-command group per component (store, gateway, engine, ...), and
``agl train`` and ``agl eval``, single commands.

Each group lives in its own module and is imported only when that group runs, so ``agl --help``
stays fast.
"""

from __future__ import annotations

import importlib
import sys

import typer

app = typer.Typer(
    name="agl",
    help="agl: train any AI agent with RL, prompt optimization and SFT.",
    no_args_is_help=True,
    add_completion=False,
)

# group name -> (module, help); modules expose a ``app: typer.Typer``
_GROUPS: dict[str, tuple[str, str]] = {
    "store": ("agl.cli.store", "Run or inspect a LightningStore."),
    "gateway": ("agl.cli.gateway", "Run the OpenAI-compatible LLM gateway."),
    "engine": ("agl.cli.engine", "Serve a local Hugging Face model over the OpenAI protocol."),
    "dashboard": ("agl.cli.dashboard", "Serve the web dashboard for a remote store."),
    "runner": ("agl.cli.runner", "Attach runners on this machine to a remote store."),
    "model": ("agl.cli.model", "The versions agl train --online published: list them, roll back."),
}

for _name, (_module, _help) in _GROUPS.items():
    try:
        _sub = importlib.import_module(_module).app
    except ModuleNotFoundError as exc:
        if exc.name != _module:
            raise
        continue
    app.add_typer(_sub, name=_name, help=_help)

# single commands: name -> (module, function)
_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("agl.cli.train", "train"),
    "eval": ("agl.cli.eval", "eval_command"),
}

for _name, (_module, _function) in _COMMANDS.items():
    _command = getattr(importlib.import_module(_module), _function)
    app.command(name=_name, epilog=getattr(sys.modules[_module], "EXAMPLE", None))(_command)


def main() -> None:
    app()
