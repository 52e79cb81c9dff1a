"""The trainer-side policy GRPO and SFT share: a HF causal LM (full or LoRA), its log-probs, the
policy-gradient and SFT steps, and data-parallel / FSDP2 training over ranks (``distributed``, ``sharding``)."""

from agl.algorithm.policy.loss import LossConfig, grpo_loss, token_weights
from agl.algorithm.policy.model import Policy, PolicyConfig, collate, sft_loss

__all__ = ["LossConfig", "Policy", "PolicyConfig", "collate", "grpo_loss", "sft_loss", "token_weights"]
