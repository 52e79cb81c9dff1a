"""Moved to :mod:`agl.algorithm.policy.model` (the policy is shared by GRPO and SFT); this name stays an alias of that module."""

import sys

import agl.algorithm.policy.model

sys.modules[__name__] = agl.algorithm.policy.model
