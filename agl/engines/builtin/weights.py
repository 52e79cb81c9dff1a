"""Load new weights into a live model: a full state dict (in memory or a folder) or a PEFT LoRA adapter.

A LoRA adapter is merged into a saved copy of the base weights, so successive adapters (one per RL step)
each apply to the base model rather than stacking.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agl.errors import ConfigError


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in a model folder."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors file in {path}; pass a folder written by save_pretrained "
            "(safe_serialization=True) or a PEFT adapter folder"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def is_lora_dir(path: Path) -> bool:
    """A PEFT adapter folder has an ``adapter_config.json``."""
    return (path / "adapter_config.json").is_file()


def load_full(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``; every parameter must be present (tied lm_head may be left out)."""
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = sorted(k for k in set(own) - set(state) if not (tied and k.startswith("lm_head")))
    if unexpected or missing:
        raise ConfigError(
            f"weights do not match the served model: unexpected keys {unexpected[:5]}, missing keys "
            f"{missing[:5]}; pass the full state dict of the same architecture (or a LoRA adapter folder)"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ConfigError(
                f"weight {key!r} has shape {tuple(tensor.shape)}, the served model expects "
                f"{tuple(own[key].shape)}; pass weights of the same model size"
            )
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor)  # casts as it copies (a .to() first would write the weights twice)


def merge_lora(model: Any, base_state: dict[str, torch.Tensor], path: Path) -> None:
    """Restore ``base_state`` then merge the PEFT adapter at ``path`` into the model's weights in place."""
    from peft import PeftModel

    try:
        json.loads((path / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path}/adapter_config.json is unreadable ({exc}); pass a PEFT adapter folder"
        ) from exc
    load_full(model, base_state)
    peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=False, local_files_only=True)
    # merge_and_unload writes W + BA into the wrapped modules and puts the plain modules back in ``model``
    peft_model.merge_and_unload()
