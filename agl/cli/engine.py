"""``agl engine serve``: serve a local Hugging Face model folder over the OpenAI protocol."""

from __future__ import annotations

import typer

from agl.cli.tokens import non_empty

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command()
def serve(
    model: str = typer.Option(
        ..., help="Local HF model folder, or 'tiny' / 'smollm2' for the built-in models."
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, help="Port to bind (0: a free port)."),
    device: str = typer.Option("cpu", help="Torch device, e.g. cpu or cuda:0."),
    dtype: str = typer.Option("float32", help="Weights dtype: float32, bfloat16 or float16."),
    precision: str = typer.Option(
        "auto",
        help="auto (bf16 weights on a CPU with native bf16, else --dtype), fp32 (keep --dtype) or bf16. "
        "Match the trainer's GRPOConfig.precision so sampling and training logprobs agree.",
    ),
    max_batch_size: int = typer.Option(32, help="Most sequences decoded together."),
    served_model_name: str | None = typer.Option(None, help="Name reported by /v1/models."),
    token: str | None = typer.Option(
        None,
        envvar="AGL_ENGINE_TOKEN",
        callback=non_empty,
        help="Require 'Authorization: Bearer TOKEN' on every route but /health (prefer the env variable).",
    ),
) -> None:
    """Serve MODEL on HOST:PORT until interrupted."""
    import uvicorn

    from agl.engines.builtin.engine import Engine
    from agl.engines.builtin.server import build_app

    if model == "tiny":
        from agl.models import tiny_model

        model = str(tiny_model())
    elif model == "smollm2":
        from agl.models import smollm2

        model = str(smollm2())
    engine = Engine(
        model,
        device=device,
        dtype=dtype,
        precision=precision,
        max_batch_size=max_batch_size,
        model_name=served_model_name,
    )
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        typer.secho(
            f"warning: serving on {host} without --token lets anyone on the network use the model and "
            "replace its weights",
            err=True,
            fg="yellow",
        )
    uvicorn.run(build_app(engine, token), host=host, port=port, log_level="info")
