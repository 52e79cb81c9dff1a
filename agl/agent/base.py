"""The agent interface the runner drives: ``LitAgent`` for classes; ``@rollout`` builds one from a function."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Generic, ParamSpec, TypeVar, overload

from agl.schemas import LLM, PromptTemplate, Resource, Rollout

#: what an agent may return: None, a reward, or spans it built itself
RolloutResult = Any

P = ParamSpec("P")
R = TypeVar("R")


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


class FunctionAgent(LitAgent, Generic[P, R]):
    """A LitAgent around one function; its parameters are filled by name and type (see :func:`rollout`).

    Calling it calls the function, with the function's own parameter and return types.
    """

    def __init__(self, fn: Callable[P, R], name: str | None = None) -> None:
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
        fn: Callable[..., Any] = self.fn  # called with injected keyword arguments
        return fn(**self._arguments(task, resources, rollout))

    async def execute(
        self, rollout: Rollout, resources: dict[str, Resource], executor: Executor | None = None
    ) -> RolloutResult:
        fn: Callable[..., Any] = self.fn
        if inspect.iscoroutinefunction(fn):
            return await fn(**self._arguments(rollout.input, resources, rollout))
        return await super().execute(rollout, resources, executor)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
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


@overload
def rollout(fn: Callable[P, R], *, name: str | None = None) -> FunctionAgent[P, R]: ...


@overload
def rollout(
    fn: None = None, *, name: str | None = None
) -> Callable[[Callable[P, R]], FunctionAgent[P, R]]: ...


def rollout(
    fn: Callable[P, R] | None = None, *, name: str | None = None
) -> FunctionAgent[P, R] | Callable[[Callable[P, R]], FunctionAgent[P, R]]:
    """Turn a function (sync or async) into an agent: ``@agl.rollout`` or ``@agl.rollout(name="solver")``.

    Parameters are injected by name and type: ``task`` (the rollout input), ``llm: agl.LLM``,
    ``prompt: agl.PromptTemplate``, ``resources`` (all of them), ``rollout`` (the Rollout), or any
    resource by its name. Return None, a float reward, or a list of spans. The agent keeps the
    function's type: calling it calls the function (an ``async def`` one returns its coroutine).
    """
    if fn is None:

        def decorate(f: Callable[P, R]) -> FunctionAgent[P, R]:
            return FunctionAgent(f, name=name)

        return decorate
    return FunctionAgent(fn, name=name)
