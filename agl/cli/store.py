"""``agl store``: serve a LightningStore over HTTP, or print a store's statistics."""

from __future__ import annotations

import asyncio

import typer

from agl.cli.tokens import non_empty
from agl.errors import AglError, UnauthorizedError
from agl.store import DEFAULT_STORE_URL, open_store

app = typer.Typer(no_args_is_help=True)


@app.command()
def serve(
    host: str = typer.Option(
        "127.0.0.1", help="Interface to bind; the default keeps the store off the network."
    ),
    port: int = typer.Option(4747, help="TCP port."),
    backend: str = typer.Option(
        DEFAULT_STORE_URL,
        help="memory://, sqlite:///path.db (the default, in the working directory) or postgresql://...",
    ),
    token: str | None = typer.Option(
        None,
        envvar="AGL_STORE_TOKEN",
        callback=non_empty,
        help="Require 'Authorization: Bearer TOKEN' on every route but /health.",
    ),
    max_body_mb: int = typer.Option(64, help="Largest request body accepted, in MiB (413 beyond)."),
    metrics_dir: str | None = typer.Option(
        None, help="A training output directory whose metrics.csv files the dashboard charts."
    ),
) -> None:
    """Serve the whole LightningStore API under /v1/agl (OpenAPI at /openapi.json, OTLP at /v1/traces)
    and the dashboard at /ui."""
    import uvicorn

    from agl.asgi_server import tune_gc_for_serving
    from agl.dashboard import mount_dashboard
    from agl.store.server import create_app

    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        typer.secho(
            f"warning: serving on {host} without --token lets anyone on the network in", err=True, fg="yellow"
        )
    store = open_store(backend)
    application = create_app(store, token=token, max_body_bytes=max_body_mb * 1024 * 1024)
    # mounted here, not in agl.store.server: the store layer must not import the dashboard
    application = mount_dashboard(application, store, token=token, metrics_dir=metrics_dir)
    typer.echo(f"agl store serving {backend} on http://{host}:{port} (dashboard: /ui/)")
    tune_gc_for_serving()
    uvicorn.run(
        application,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


@app.command()
def stats(
    url: str = typer.Argument(DEFAULT_STORE_URL, help="Store URL (memory://, sqlite:///..., http://...)."),
    token: str | None = typer.Option(
        None,
        envvar="AGL_STORE_TOKEN",
        callback=non_empty,
        help="Bearer token of a store server (agl store serve --token); prefer the env variable.",
    ),
) -> None:
    """Print counts by status, spans and workers of a store."""

    async def run() -> None:
        store = open_store(url, **({"token": token} if url.startswith("http") and token else {}))
        try:
            typer.echo((await store.statistics()).model_dump_json(indent=2))
        finally:
            await store.aclose()

    try:
        asyncio.run(run())
    except AglError as exc:
        hint = "; pass --token (or set AGL_STORE_TOKEN)" if isinstance(exc, UnauthorizedError) else ""
        typer.secho(f"agl store stats {url}: {exc}{hint}", err=True, fg="red")
        raise typer.Exit(1) from exc
