"""Auto-instrumentation: the maintained OpenInference instrumentors, wired to agl's TracerProvider."""

from __future__ import annotations

import importlib
import logging
import threading

from agl.errors import ConfigError, missing_extra
from agl.tracer.otel import tracer_provider

log = logging.getLogger(__name__)

_INSTRUMENTORS = {
    "openai": (
        "openinference.instrumentation.openai",
        "OpenAIInstrumentor",
        "openinference-instrumentation-openai",
    ),
    "langchain": (
        "openinference.instrumentation.langchain",
        "LangChainInstrumentor",
        "openinference-instrumentation-langchain",
    ),
    "openai-agents": (
        "openinference.instrumentation.openai_agents",
        "OpenAIAgentsInstrumentor",
        "openinference-instrumentation-openai-agents",
    ),
    "litellm": (
        "openinference.instrumentation.litellm",
        "LiteLLMInstrumentor",
        "openinference-instrumentation-litellm",
    ),
}
_lock = threading.Lock()
_active: dict[str, object] = {}


def instrument(*libraries: str, required: bool = False, set_global: bool = False) -> list[str]:
    """Instrument the named libraries (default: every one installed); returns those now instrumented.

    agl records through its own TracerProvider; ``set_global`` also makes it OpenTelemetry's global
    provider (only do this if the application has none of its own).

    Raises:
        ConfigError: ``required`` and an instrumentor (or its library) is not installed.
    """
    names = libraries or tuple(_INSTRUMENTORS)
    if set_global:
        from opentelemetry import trace

        trace.set_tracer_provider(tracer_provider())
    done = []
    with _lock:
        for name in names:
            if name in _active:
                done.append(name)
                continue
            if name not in _INSTRUMENTORS:
                raise ValueError(f"unknown library {name!r}; agl instruments {sorted(_INSTRUMENTORS)}")
            module, cls, package = _INSTRUMENTORS[name]
            try:
                instrumentor = getattr(importlib.import_module(module), cls)()
                conflict = _missing_library(instrumentor)
                if conflict is None:
                    instrumentor.instrument(tracer_provider=tracer_provider())
            except ImportError as exc:
                if required:
                    raise missing_extra(package, "integrations") from exc
                log.debug("not instrumenting %s: %s", name, exc)
                continue
            if conflict is not None:  # the instrumentor is there, the library it wraps is not (or too old)
                if required:
                    raise ConfigError(f"{name} is not installed ({conflict}): pip install {name}")
                log.debug("not instrumenting %s: %s", name, conflict)
                continue
            _active[name] = instrumentor
            done.append(name)
    return done


def _missing_library(instrumentor: object) -> str | None:
    """Why the instrumentor would do nothing (its library absent or too old), or None; asked before it logs."""
    from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

    conflict = get_dependency_conflicts(instrumentor.instrumentation_dependencies())  # type: ignore[attr-defined]
    return (
        None
        if conflict is None
        else f"the instrumentor needs {conflict.required}, found {conflict.found or 'none'}"
    )


def uninstrument() -> None:
    """Undo :func:`instrument` (tests use it to measure the overhead)."""
    with _lock:
        for instrumentor in _active.values():
            instrumentor.uninstrument()  # type: ignore[attr-defined]
        _active.clear()
