"""The trained policy out as a standard Hugging Face folder that transformers, vLLM and ``agl engine serve`` load.

One folder holds config, safetensors weights, tokenizer, chat template and generation config; LoRA is
merged into the base (the adapter can be kept beside it). Every folder is written to a temporary
sibling and renamed into place, so a crash never leaves a half-written ``model/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agl.compute.thread import run_compute

log = logging.getLogger(__name__)

MODEL_DIR, BEST_DIR, ADAPTER_DIR = "model", "model-best", "model-adapter"
INFO_FILE = "agl_export.json"  # what was exported and why (step, validation reward); loaders ignore it
_BASE_FILES = ("chat_template.jinja", "generation_config.json")  # copied from the base when not re-created


@dataclass(frozen=True)
class Exported:
    """Where an export went: the merged model folder and, when asked for, the LoRA adapter folder."""

    model_path: Path
    adapter_path: Path | None = None


def write_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a fresh temporary folder beside ``folder``, then swap it in for ``folder``.

    A reader sees the old folder or the complete new one, never a partial one. Leftovers of an
    export that crashed earlier (``.NAME.tmp-*``, ``.NAME.old-*``) are removed first.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in (*folder.parent.glob(f".{folder.name}.tmp-*"), *folder.parent.glob(f".{folder.name}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        write(tmp)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        os.replace(folder, old / folder.name)  # a rename: the target is gone only between two renames
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def _fsync_tree(folder: Path) -> None:
    """Flush the files to disk before the rename publishes them (a power cut must not leave empty files)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _unwrap(policy: Any) -> Any:
    """The in-process Policy (a data-parallel handle keeps rank 0's as ``.policy``; a sharded one
    gathers the weights into an unsharded copy)."""
    gathered = getattr(type(policy), "gathered_policy", None)
    if gathered is not None:
        return gathered(policy)
    inner = getattr(policy, "policy", None)
    return inner if inner is not None and hasattr(inner, "model") else policy


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


@contextlib.contextmanager
def _merged(model: Any) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The plain model and its state dict with LoRA merged in, without a second copy of the weights.

    The adapter is merged into the base weights in place and unmerged afterwards (the same
    round trip GRPO makes for every weight sync), so training can go on after a mid-run export.
    """
    if not _is_peft(model):
        yield model, {}
        return
    base = model.get_base_model()
    model.merge_adapter()
    try:
        state = {
            k.replace("base_layer.", ""): v.detach() for k, v in base.state_dict().items() if "lora_" not in k
        }
        yield base, state
    finally:
        model.unmerge_adapter()


def _write_model(policy: Any, out: Path, base_path: str | None, info: dict[str, Any]) -> None:
    model, tokenizer = policy.model, policy.tokenizer
    with _merged(model) as (plain, state):
        plain.save_pretrained(str(out), state_dict=state or None, safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if base_path is not None:  # the base's chat template / generation config when saving made none
        for name in _BASE_FILES:
            if (Path(base_path) / name).is_file() and not (out / name).exists():
                shutil.copy2(Path(base_path) / name, out / name)
    if not (out / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(plain.config).save_pretrained(str(out))
    if getattr(tokenizer, "chat_template", None) is None and not (out / "chat_template.jinja").exists():
        log.warning("the exported tokenizer has no chat template: chat APIs will not render prompts for it")
    (out / INFO_FILE).write_text(json.dumps({"base_model": base_path, **info}, indent=1, default=str))


def _write_adapters(
    policy: Any, out: Path, adapters: tuple[str, ...], base_path: str | None, info: dict[str, Any]
) -> None:
    """A policy with one LoRA adapter per agent: ``out/<agent>/``, the base with that adapter merged in."""
    active = policy.adapter
    try:
        for name in adapters:
            policy.use_adapter(name)
            _write_model(policy, out / name, base_path, {**info, "adapter": name})
    finally:
        if active is not None:
            policy.use_adapter(active)
    (out / INFO_FILE).write_text(
        json.dumps({"base_model": base_path, "adapters": list(adapters), **info}, indent=1, default=str)
    )


def export_policy(
    policy: Any,
    folder: str | Path,
    *,
    adapter_folder: str | Path | None = None,
    base_path: str | None = None,
    info: dict[str, Any] | None = None,
) -> Exported:
    """Write ``policy`` (an ``agl`` Policy: ``.model`` full or PEFT LoRA, ``.tokenizer``) to ``folder``.

    Args:
        policy: the trained policy; LoRA is merged into the base weights of the written model (with an
            adapter per agent, one model per agent in ``folder/<agent>/``).
        folder: the target, replaced atomically when it exists.
        adapter_folder: also write the bare LoRA adapter (PEFT format) here; ignored for full fine-tuning.
        base_path: the model trained from, whose chat template and generation config fill gaps.
        info: recorded in ``agl_export.json`` inside the folder (step, validation reward, ...).
    """
    policy = _unwrap(policy)
    started = time.perf_counter()
    adapters = tuple(getattr(getattr(policy, "config", None), "adapters", ()) or ())
    if adapters:
        model_path = write_atomically(
            Path(folder), lambda out: _write_adapters(policy, out, adapters, base_path, info or {})
        )
    else:
        model_path = write_atomically(
            Path(folder), lambda out: _write_model(policy, out, base_path, info or {})
        )
    adapter_path = None
    if adapter_folder is not None and _is_peft(policy.model):

        def write_adapter(out: Path) -> None:
            with warnings.catch_warnings():  # peft asks transformers a deprecated checkpointing question
                warnings.simplefilter("ignore", FutureWarning)
                policy.model.save_pretrained(str(out))
            policy.tokenizer.save_pretrained(str(out))

        adapter_path = write_atomically(Path(adapter_folder), write_adapter)
    size = sum(p.stat().st_size for p in model_path.rglob("*") if p.is_file())
    log.info(
        "exported the policy to %s (%.1f s, %.0f MB)", model_path, time.perf_counter() - started, size / 2**20
    )
    return Exported(model_path, adapter_path)


class BestExport:
    """Keeps ``OUT/model-best`` the policy with the best validation reward so far, written when it improves.

    Nothing is held in memory: each improvement is written to disk at once. A folder left by an
    earlier run (resume) sets the score to beat.
    """

    def __init__(self, folder: str | Path, *, enabled: bool = True, base_path: str | None = None) -> None:
        self.folder, self.enabled, self.base_path = Path(folder), enabled, base_path
        self.best = -math.inf
        self.path: Path | None = None
        recorded = self.folder / INFO_FILE
        if enabled and recorded.is_file():
            score = json.loads(recorded.read_text()).get("val_reward")
            if isinstance(score, int | float) and math.isfinite(score):
                self.best, self.path = float(score), self.folder

    def offer(self, policy: Any, val_reward: float, **info: Any) -> bool:
        """Write ``policy`` when ``val_reward`` beats the best so far; returns whether it did."""
        if not self.enabled or not math.isfinite(val_reward) or val_reward <= self.best:
            return False
        export_policy(policy, self.folder, base_path=self.base_path, info={"val_reward": val_reward, **info})
        self.best, self.path = val_reward, self.folder
        log.info("new best validation reward %.4f: policy written to %s", val_reward, self.folder)
        return True


class ExportSettings(Protocol):
    """The config fields the end-of-run export reads (``GRPOConfig`` and ``SFTConfig`` have them)."""

    @property
    def export_model(self) -> bool: ...
    @property
    def export_adapter(self) -> bool: ...
    @property
    def model_path(self) -> str: ...


async def export_trained(
    policy: Any,
    cfg: ExportSettings,
    out_dir: str | Path,
    *,
    best: BestExport | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, str | None]:
    """At the end of a run, write the final policy to ``OUT/model`` (and ``OUT/model-adapter``) as ``cfg`` says.

    The writing runs on a worker thread. Returns the result fields a run adds: ``model_path``, ``best_model_path``,
    ``adapter_path`` (None for what was not written).
    """
    out = Path(out_dir)
    exported = None
    if cfg.export_model and policy is not None:
        exported = await run_compute(
            export_policy,
            policy,
            out / MODEL_DIR,
            adapter_folder=out / ADAPTER_DIR if cfg.export_adapter else None,
            base_path=cfg.model_path,
            info=info,
        )
    best_path = best.path if best is not None and best.enabled else None
    return {
        "model_path": None if exported is None else str(exported.model_path),
        "best_model_path": None if best_path is None else str(best_path),
        "adapter_path": None
        if exported is None or exported.adapter_path is None
        else str(exported.adapter_path),
    }


__all__ = [
    "ADAPTER_DIR",
    "BEST_DIR",
    "MODEL_DIR",
    "BestExport",
    "ExportSettings",
    "Exported",
    "export_policy",
    "export_trained",
    "write_atomically",
]
