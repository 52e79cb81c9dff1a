"""Algorithms: GRPO, APO and SFT, and the ``Algorithm`` base for your own. Heavy parts import lazily."""

from agl.algorithm.base import Algorithm, FunctionAlgorithm, TrainingContext, as_algorithm

__all__ = ["Algorithm", "FunctionAlgorithm", "TrainingContext", "as_algorithm"]
