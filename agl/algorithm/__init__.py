"""Algorithms: GRPO, APO and SFT, and the ``Algorithm`` base for your own. Heavy parts import lazily."""

from agl.algorithm.base import (
    Algorithm,
    Evaluation,
    FunctionAlgorithm,
    PendingRollouts,
    PublishedPolicy,
    TrainingContext,
    as_algorithm,
    evaluate,
)

__all__ = [
    "Algorithm",
    "Evaluation",
    "FunctionAlgorithm",
    "PendingRollouts",
    "PublishedPolicy",
    "TrainingContext",
    "as_algorithm",
    "evaluate",
]
