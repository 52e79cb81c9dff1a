"""APO: prompt optimization by critique-and-edit with beam search."""

from agl.algorithm.apo.apo import APO, APOConfig, APOResult
from agl.algorithm.apo.history import apo_history
from agl.algorithm.apo.search import Candidate
from agl.algorithm.apo.trajectories import Trajectory, load_trajectories, render_trajectories

__all__ = [
    "APO",
    "APOConfig",
    "APOResult",
    "Candidate",
    "Trajectory",
    "apo_history",
    "load_trajectories",
    "render_trajectories",
]
