"""Rewards for tasks without labels: ``agl.rewards.Judge`` scores a GRPO group's trajectories side by side.

``GRPOConfig(judge=agl.rewards.Judge(endpoint, rubric, model=...))`` gives every rollout that returned no
reward the judge's score (see :mod:`agl.rewards.judge` and :mod:`agl.rewards.rollouts`).
"""

from agl.rewards.judge import Judge, JudgeScore, Verdict
from agl.rewards.rollouts import Judged, judge_rollouts, trajectory_text

__all__ = ["Judge", "JudgeScore", "Judged", "Verdict", "judge_rollouts", "trajectory_text"]
