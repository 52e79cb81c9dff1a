"""Moved to :mod:`agl.algorithm.policy.sharding` (the policy is shared by GRPO and SFT); this name stays an alias of that module."""

import sys

import agl.algorithm.policy.sharding

sys.modules[__name__] = agl.algorithm.policy.sharding
