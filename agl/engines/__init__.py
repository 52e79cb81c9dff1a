"""Inference engines: the built-in engine (``agl.engines.builtin``) and a vLLM launcher (``agl.engines.vllm``).

``BuiltinEngine`` and ``VllmEngine`` choose the engine ``Trainer.fit`` serves the policy with
(``Trainer(serving=agl.Serving(engine=agl.engines.VllmEngine(replicas=2)))``); see :mod:`agl.engines.launch`.
Nothing heavy is imported here; import the submodule you need.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BuiltinEngine", "VllmEngine"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agl.engines import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'agl.engines' has no attribute {name!r}")
