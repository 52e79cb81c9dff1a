"""``agl gateway serve``: run the OpenAI-compatible LLM gateway in front of one or more model servers.

Beside the rollouts a trainer queues, it records production traffic with ``--record-unattributed`` (each
conversation a rollout of mode ``online``) and takes late rewards at ``POST /v1/agl/rewards``.
"""

from __future__ import annotations

import typer

from agl.cli.tokens import non_empty

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command()
def serve(
    upstream: list[str] = typer.Option(
        ..., help="Upstream base URL (http://host:port/v1); repeat for replicas."
    ),
    store: str = typer.Option("sqlite:///agl-store.db", help="Store URL: memory://, sqlite:///path.db, ..."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8100, help="Port to bind."),
    kind: str = typer.Option("vllm", help="Upstream kind: vllm, agl (ask for token ids) or openai (do not)."),
    api_key: str | None = typer.Option(
        None,
        envvar="AGL_GATEWAY_UPSTREAM_API_KEY",
        callback=non_empty,
        help="Key sent upstream, e.g. the engine's AGL_ENGINE_TOKEN (prefer the environment variable).",
    ),
    token: str | None = typer.Option(
        None,
        envvar="AGL_GATEWAY_TOKEN",
        callback=non_empty,
        help="Require 'Authorization: Bearer TOKEN' on /admin/* and /metrics (prefer the env variable).",
    ),
    client_token: str | None = typer.Option(
        None,
        envvar="AGL_GATEWAY_CLIENT_TOKEN",
        callback=non_empty,
        help="Also require a bearer token on model calls (agents' api_key); it is not forwarded upstream.",
    ),
    reward_token: str | None = typer.Option(
        None,
        envvar="AGL_GATEWAY_REWARD_TOKEN",
        callback=non_empty,
        help="A token that may only POST /v1/agl/rewards (late rewards); it cannot call models or /admin. "
        "The --token admin token may post rewards too.",
    ),
    record_unattributed: bool = typer.Option(
        False,
        help="Record calls that name no rollout (production traffic): each conversation, named by the "
        "x-agl-session-id header or the OpenAI 'user' field (else each call alone), becomes a rollout of "
        "mode 'online'; an unreachable store never holds a call up.",
    ),
    max_attempts: int = typer.Option(3, help="Tries per call across replicas."),
) -> None:
    """Proxy /v1 and /rollout/<id>/attempt/<id>/v1 to UPSTREAM, recording each call in STORE.

    POST /v1/agl/rewards {"reward": 1.0, "response_id" | "session_id" | "rollout_id": "..."} records a
    reward that arrives later (idempotent per target and name, or per "idempotency_key").
    """
    import uvicorn
    from pydantic import ValidationError

    from agl.gateway import Gateway, GatewayConfig, UpstreamConfig
    from agl.store import open_store

    try:
        upstreams = [UpstreamConfig(url=u, kind=kind, api_key=api_key) for u in upstream]  # type: ignore[arg-type]
        config = GatewayConfig(record_unattributed=record_unattributed, max_attempts=max_attempts)
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        typer.secho(
            f"warning: serving on {host} without --token lets anyone on the network pause the gateway",
            err=True,
            fg="yellow",
        )
    gateway = Gateway(
        open_store(store),
        upstreams,
        config,
        token=token,
        client_token=client_token,
        reward_token=reward_token,
    )
    typer.echo(f"agl gateway on http://{host}:{port}/v1 -> {', '.join(upstream)} (store {store})")
    uvicorn.run(
        gateway.app, host=host, port=port, log_level="warning", interface="asgi3", proxy_headers=False
    )
