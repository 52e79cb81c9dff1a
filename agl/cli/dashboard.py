"""``agl dashboard``: serve the web dashboard for a store running elsewhere (``agl store serve`` has it at /ui)."""

from __future__ import annotations

import typer

from agl.cli.tokens import non_empty

app = typer.Typer(subcommand_metavar="", add_completion=False)  # a leaf: no COMMAND in its usage


@app.callback(invoke_without_command=True)
def dashboard(
    store: str = typer.Option(..., help="URL of a running store server, e.g. http://127.0.0.1:4747."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind; the default keeps it off the network."),
    port: int = typer.Option(4748, help="TCP port."),
    token: str | None = typer.Option(
        None,
        envvar="AGL_STORE_TOKEN",
        callback=non_empty,
        help="The store's bearer token; the dashboard's own API then requires it too (open /ui/?token=...).",
    ),
    metrics_dir: str | None = typer.Option(
        None, help="A training output directory whose metrics.csv files are charted."
    ),
) -> None:
    """Serve the dashboard at http://HOST:PORT/ui/, reading the store at --store over HTTP."""
    import uvicorn

    from agl.asgi_server import tune_gc_for_serving
    from agl.dashboard import standalone_app
    from agl.store.client import LightningStoreClient

    if not store.startswith(("http://", "https://")):
        raise typer.BadParameter(f"--store must be an http(s) URL of a store server, got {store!r}")
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        typer.secho(
            f"warning: serving on {host} without --token shows the store to anyone on the network",
            err=True,
            fg="yellow",
        )
    client = LightningStoreClient(store, token=token, retries=1)
    application = standalone_app(client, token=token, metrics_dir=metrics_dir)
    typer.echo(f"agl dashboard for {store} on http://{host}:{port}/ui/")
    tune_gc_for_serving()
    uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False)
