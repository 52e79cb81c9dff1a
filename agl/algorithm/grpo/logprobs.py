"""Moved to :mod:`agl.algorithm.policy.logprobs` (the policy is shared by GRPO and SFT); this name stays an alias of that module."""

import sys

import agl.algorithm.policy.logprobs

sys.modules[__name__] = agl.algorithm.policy.logprobs
