"""Algorithms: GRPO, APO and SFT, and the ``Algorithm`` base for your own. Heavy parts import lazily."""

from agl.algorithm.base import (
    Algorithm,
    AlgorithmFn,
    Evaluation,
    FunctionAlgorithm,
    PendingRollouts,
    PublishedPolicy,
    TrainingContext,
    as_algorithm,
    evaluate,
)
from agl.algorithm.spec import AdapterSpec, ModelSpec, TeacherSpec

__all__ = [
    "AdapterSpec",
    "Algorithm",
    "AlgorithmFn",
    "Evaluation",
    "FunctionAlgorithm",
    "ModelSpec",
    "PendingRollouts",
    "PublishedPolicy",
    "TeacherSpec",
    "TrainingContext",
    "as_algorithm",
    "evaluate",
]
