"""The runner: the claim loop, heartbeats and attempt execution."""

from agl.runner.runner import AttemptOutcome, Runner, RunnerHooks

__all__ = ["AttemptOutcome", "Runner", "RunnerHooks"]
