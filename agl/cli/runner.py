"""``agl runner``: attach runners on this machine to a store served elsewhere (``agl store serve``).

Each worker is a process with its own ``Runner`` (``--concurrency`` attempts at once), so CPU-bound
sync agents scale past the GIL. SIGINT/SIGTERM stop claiming; in-flight attempts get ``--grace``
seconds to finish and report, then are failed so the store can hand them to another runner.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import typer

from agl.cli.tokens import non_empty

app = typer.Typer(subcommand_metavar="", add_completion=False)  # a leaf: no COMMAND in its usage
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _WorkerArgs:
    store: str
    agent: str
    token: str | None
    concurrency: int
    max_rollouts: int | None
    poll_interval: float
    grace: float
    store_retries: int
    log_level: str


def load_attr(spec: str, what: str, *, example: str) -> Any:
    """The object ``module:attr`` names (``attr`` may be dotted: ``agl:Teacher.calls_a_tool``), the working
    directory importable as for ``python -m``.

    Raises:
        ValueError: ``spec`` is not ``module:attr``, the module does not import, or it lacks the attribute;
            the message starts with ``what`` (the flag or config key).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} wants module:attr (e.g. {example}), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec}: cannot import {module_name!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {spec}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def load_agent(spec: str) -> Any:
    """The ``LitAgent`` that ``module:attr`` names: an ``@agl.rollout`` function, a LitAgent or LitAgent class.

    A plain function is wrapped as ``@agl.rollout`` would. The working directory is importable, as for
    ``python -m``.
    """
    from agl.agent.base import LitAgent, rollout

    target = load_attr(spec, "--agent", example="my_agents:solve")
    if inspect.isclass(target) and issubclass(target, LitAgent):
        try:
            target = target()
        except TypeError as exc:
            raise ValueError(
                f"--agent {spec}: the class cannot be built without arguments ({exc}); "
                "name an instance instead"
            ) from exc
    if isinstance(target, LitAgent):
        return target
    if callable(target) and not inspect.isclass(target):
        return rollout(target)
    raise ValueError(
        f"--agent {spec} is a {type(target).__name__}; name an @agl.rollout function, "
        "a LitAgent instance or a LitAgent class"
    )


def _run_worker(args: _WorkerArgs) -> int:
    """One worker process: a Runner on the remote store until stopped or ``max_rollouts`` are done."""
    import asyncio

    from agl.runner.runner import Runner
    from agl.schemas import AttemptStatus
    from agl.store.client import LightningStoreClient

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_http_logs(args.log_level)
    agent = load_agent(args.agent)
    store = LightningStoreClient(args.store, token=args.token, retries=args.store_retries)
    runner = Runner(
        agent,
        store,
        max_concurrency=args.concurrency,
        poll_interval_s=args.poll_interval,
        shutdown_grace_s=args.grace,
    )

    async def main() -> list[Any]:
        try:
            return await runner.run(args.max_rollouts)
        finally:
            runner.close()
            await store.aclose()

    outcomes = asyncio.run(main())
    ok = sum(o.status == AttemptStatus.SUCCEEDED for o in outcomes)
    print(
        f"agl runner {runner.worker_id}: {len(outcomes)} attempts, {ok} succeeded, "
        f"{len(outcomes) - ok} not; {runner.outage.outages} store outages ridden out",
        flush=True,
    )
    return 0


#: loggers that write a line per HTTP request (every poll of the queue): shown only at --log-level debug
CHATTY_LOGGERS = ("httpx", "httpcore", "aiohttp.access", "aiohttp.client", "urllib3")


def quiet_http_logs(level: str) -> None:
    """Keep per-request logs of the HTTP clients out of the runner's log unless it runs at debug level;
    the runner itself logs state changes (store outages, failures), not polls."""
    if level.upper() != "DEBUG":
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def _worker_entry(args: _WorkerArgs) -> None:
    sys.exit(_run_worker(args))


_EXAMPLE = (
    "Example, on each runner machine: agl runner --store http://trainer-host:4747 "
    "--agent my_agents:solve --workers 4 --token $AGL_STORE_TOKEN. The trainer side runs "
    "Trainer(n_runners=0, store='http://...', serving=agl.Serving(host='0.0.0.0')) or agl store serve."
)


@app.callback(invoke_without_command=True, epilog=_EXAMPLE)
def runner(
    store: str = typer.Option(
        ..., envvar="AGL_STORE_URL", help="The store server's URL, e.g. http://10.0.0.5:4747."
    ),
    agent: str = typer.Option(
        ...,
        help="module:attr of the agent: an @agl.rollout function, a LitAgent instance or class "
        "(the working directory is importable).",
    ),
    workers: int = typer.Option(1, min=1, help="Runner processes to start on this machine."),
    concurrency: int = typer.Option(1, min=1, help="Attempts each worker runs at once."),
    token: str | None = typer.Option(
        None,
        envvar="AGL_STORE_TOKEN",
        callback=non_empty,
        help="Bearer token of the store (agl store serve --token).",
    ),
    max_rollouts: int | None = typer.Option(
        None, min=1, help="Each worker exits after claiming this many rollouts (default: run until stopped)."
    ),
    poll_interval: float = typer.Option(
        0.05, min=0.001, help="First wait in seconds between polls of an empty queue (doubles up to 1s)."
    ),
    grace: float = typer.Option(
        10.0, min=0.0, help="On SIGINT/SIGTERM, seconds in-flight attempts may take to finish."
    ),
    store_retries: int = typer.Option(
        5,
        min=0,
        help="Per-request retries of the store client; past them the runner keeps retrying with "
        "backoff until the store is back.",
    ),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Run an agent on the rollouts of a remote store, on as many workers as asked.

    Example: agl runner --store http://trainer-host:4747 --agent my_agents:solve --workers 4
    """
    try:
        load_agent(agent)  # fail fast, with the reason, before any worker starts
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--agent") from exc
    args = _WorkerArgs(
        store, agent, token, concurrency, max_rollouts, poll_interval, grace, store_retries, log_level
    )
    typer.echo(f"agl runner: {workers} worker(s) x {concurrency} running {agent} on {store}")
    if workers == 1:
        raise typer.Exit(_run_worker(args))
    raise typer.Exit(_run_workers(args, workers))


def _run_workers(args: _WorkerArgs, workers: int) -> int:
    """Start the worker processes, pass SIGINT/SIGTERM on to them, wait for all; non-zero if any failed."""
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=_worker_entry, args=(args,), name=f"agl-runner-{i}") for i in range(workers)
    ]
    for proc in procs:
        proc.start()

    def forward(sig: int, frame: FrameType | None) -> None:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for proc in procs:
        proc.join()
    failed = [p.name for p in procs if p.exitcode != 0]
    if failed:
        typer.secho(f"agl runner: workers {failed} exited with an error", err=True, fg="red")
        return 1
    return 0
