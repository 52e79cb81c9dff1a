"""The agent interface the runner drives: ``LitAgent`` for classes; ``@rollout`` builds one from a function."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from agl.schemas import LLM, PromptTemplate, Resource, Rollout

#: what an agent may return: None, a reward, or spans it built itself
RolloutResult = Any


def scoped_llm(llm: LLM, rollout_id: str, attempt_id: str) -> LLM:
    """The LLM resource with its endpoint scoped to this rollout when the endpoint is an agl gateway URL."""
    endpoint = llm.base_url(rollout_id, attempt_id)
    return llm if endpoint == llm.endpoint else llm.model_copy(update={"endpoint": endpoint})


class LitAgent:
    """Subclass and implement :meth:`rollout` (sync or async); ``training_rollout`` and
    ``validation_rollout`` override it for ``mode="train"`` / ``mode="val"`` rollouts.

    Each method receives ``(task, resources, rollout)`` where ``resources`` maps names to resources,
    with LLM endpoints already scoped to the rollout.
    """

    #: tags the agent's spans (``agl.agent.name``) so a multi-agent system can train only some agents
    name: str | None = None

    def rollout(self, task: Any, resources: dict[str, Resource], rollout: Rollout) -> RolloutResult:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout(task, resources, rollout)")

    def training_rollout(self, task: Any, resources: dict[str, Resource], rollout: Rollout) -> RolloutResult:
        return self.rollout(task, resources, rollout)

    def validation_rollout(
        self, task: Any, resources: dict[str, Resource], rollout: Rollout
    ) -> RolloutResult:
        return self.rollout(task, resources, rollout)

    def _method_for(self, mode: str) -> Callable[..., Any]:
        """The mode's method when any class in the MRO overrides it (not only the leaf), else ``rollout``."""
        name = {"train": "training_rollout", "val": "validation_rollout"}.get(mode)
        if name is not None and getattr(type(self), name) is not getattr(LitAgent, name):
            return getattr(self, name)  # type: ignore[no-any-return]
        return self.rollout

    async def execute(
        self, rollout: Rollout, resources: dict[str, Resource], executor: Executor | None = None
    ) -> RolloutResult:
        """Run the method for the rollout's mode; a sync one runs on ``executor`` in a copy of the context."""
        method = self._method_for(rollout.mode)
        if _is_async(method):
            return await method(rollout.input, resources, rollout)
        context = contextvars.copy_context()
        call = functools.partial(context.run, method, rollout.input, resources, rollout)
        result = await asyncio.get_running_loop().run_in_executor(executor, call)
        if inspect.isawaitable(result):
            result = await result
        return result


def _is_async(fn: Callable[..., Any]) -> bool:
    target = getattr(fn, "__func__", fn)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "fn", None))


class FunctionAgent(LitAgent):
    """A LitAgent around one function; its parameters are filled by name and type (see :func:`rollout`)."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        self.fn = fn
        self.name = name
        self._signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def _arguments(self, task: Any, resources: dict[str, Resource], rollout: Rollout) -> dict[str, Any]:
        args: dict[str, Any] = {}
        for pname, param in self._signature.parameters.items():
            ann = param.annotation
            if pname == "task":
                args[pname] = task
            elif pname == "rollout":
                args[pname] = rollout
            elif pname == "resources":
                args[pname] = resources
            elif pname in resources:
                args[pname] = resources[pname]
            elif pname == "llm" or ann in (LLM, "LLM", "agl.LLM"):
                args[pname] = _first(resources, LLM, pname, param)
            elif pname == "prompt" or ann in (PromptTemplate, "PromptTemplate", "agl.PromptTemplate"):
                args[pname] = _first(resources, PromptTemplate, pname, param)
            elif param.default is inspect.Parameter.empty:
                raise TypeError(
                    f"{self.fn.__qualname__}() needs {pname!r}, which agl cannot inject: use task, llm, prompt, "
                    f"resources, rollout or a resource name ({sorted(resources)})"
                )
        return args

    def rollout(self, task: Any, resources: dict[str, Resource], rollout: Rollout) -> RolloutResult:
        return self.fn(**self._arguments(task, resources, rollout))

    async def execute(
        self, rollout: Rollout, resources: dict[str, Resource], executor: Executor | None = None
    ) -> RolloutResult:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**self._arguments(rollout.input, resources, rollout))
        return await super().execute(rollout, resources, executor)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _first(resources: dict[str, Resource], kind: type, pname: str, param: inspect.Parameter) -> Any:
    for value in resources.values():
        if isinstance(value, kind):
            return value
    if param.default is not inspect.Parameter.empty:
        return param.default
    raise TypeError(
        f"parameter {pname!r} wants a {kind.__name__} resource but the rollout's resources have none "
        f"({sorted(resources)}); add one with store.add_resources"
    )


def rollout(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Turn a function (sync or async) into an agent.

    Parameters are injected by name and type: ``task`` (the rollout input), ``llm: agl.LLM``,
    ``prompt: agl.PromptTemplate``, ``resources`` (all of them), ``rollout`` (the Rollout), or any
    resource by its name. Return None, a float reward, or a list of spans.
    """
    if fn is None:
        return lambda f: FunctionAgent(f, name=name)
    return FunctionAgent(fn, name=name)
