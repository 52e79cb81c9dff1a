"""Token options shared by the ``agl`` commands: an empty token is refused, never taken as "no token"."""

from __future__ import annotations

import typer


def non_empty(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """Refuse ``--token ""`` (usually ``--token "$VAR"`` with ``VAR`` unset), which would start an open
    server or an unauthenticated client without a word; exits 2 naming the option."""
    if value is not None and not value.strip():
        name = param.opts[0] if param.opts else str(param.name)
        env = f" or ${param.envvar}" if isinstance(param.envvar, str) else ""
        raise typer.BadParameter(
            f'empty (an unset variable in {name} "$VAR"?): give the token{env}, or leave {name} out '
            "to run without one",
            ctx=ctx,
            param_hint=name,
        )
    return value
