"""Agents: ``@agl.rollout`` functions, ``agl.LitAgent`` classes and ``agl.CommandAgent`` external programs."""

from agl.agent.base import FunctionAgent, LitAgent, RolloutResult, rollout, scoped_llm
from agl.agent.clients import openai_client
from agl.agent.command import CommandAgent

__all__ = [
    "CommandAgent",
    "FunctionAgent",
    "LitAgent",
    "RolloutResult",
    "openai_client",
    "rollout",
    "scoped_llm",
]
