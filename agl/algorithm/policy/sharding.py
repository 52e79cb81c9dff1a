"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank holds 1/N of the model.

``GRPOConfig(world_size=N, sharding="fsdp")`` (and ``SFTConfig``) start the same ranks as data-parallel
training (:mod:`agl.algorithm.policy.distributed`), then every rank shards its policy in place
(:meth:`ShardedPolicy.adopt`): each decoder layer and the whole model become FSDP2 units, so parameters,
gradients and AdamW state are ``DTensor`` shards, 1/N per rank. A forward all-gathers one unit at a
time; a backward reduce-scatters its gradient (summed, not averaged: each rank's share of the loss is
already weighted over the whole batch, so the sum is the single-process gradient). On CUDA the units
compute in bf16 and reduce in fp32 (``MixedPrecisionPolicy``); parameters and optimizer state stay fp32.

Every collective must run on every rank in the same order, so a step plans its micro-batches first: the
ranks agree on the token limit and the number of micro-batches, and a rank with fewer runs zero-weight
passes. Weights for the engine, exports and the state kept after training are gathered to rank 0
(``get_model_state_dict(full_state_dict=True)``); checkpoints are sharded (``torch.distributed.checkpoint``)
plus a Hugging Face folder of the gathered weights, so ``GRPOConfig(resume=True)`` finds them as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from agl.adapter.trajectory import Sample
from agl.algorithm.policy import collective
from agl.algorithm.policy.model import Policy, _next_group, enable_activation_checkpointing, padded_tokens
from agl.compute.memory import checkpointing_for, release_free_memory
from agl.errors import ConfigError

log = logging.getLogger(__name__)

Sharding = Literal["none", "fsdp"]
SHARDINGS: tuple[str, ...] = ("none", "fsdp")
SHARDED_DIR = "sharded"  # inside a checkpoint folder: the torch.distributed.checkpoint files of every rank

# token_logprobs slices the model's output (a view) and never writes to it in place, which is what
# this FSDP2 warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def check_sharding(sharding: object, world_size: int, owner: str) -> None:
    """Raise ConfigError naming the field unless ``sharding`` is known and has ranks to shard over."""
    if sharding not in SHARDINGS:
        raise ConfigError(f"{owner}(sharding=...) must be one of {SHARDINGS}, got {sharding!r}")
    if sharding == "fsdp" and world_size < 2:
        raise ConfigError(
            f'{owner}(sharding="fsdp") shards over ranks: set world_size >= 2 (got world_size={world_size})'
        )


def _fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: the HF model's ``_no_split_modules`` (its decoder layers)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ConfigError(
            f"{type(base).__name__} names no decoder layer class (_no_split_modules): sharding='fsdp' "
            "needs a Hugging Face transformer model"
        )
    return units


def _shard_module(model: torch.nn.Module, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for unit in _fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # a sum (each rank's loss share is weighted over the whole batch), with ReduceOp.SUM only:
            # gloo has neither AVG nor PREMUL_SUM
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _by_name(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An id-keyed ``optimizer.state_dict()`` of a plain model re-keyed by parameter name."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _by_id(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_by_name`: a name-keyed optimizer state for a plain model's optimizer."""
    index = {n: i for i, (n, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)}
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def _local_bytes(tensors: Sequence[Any]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _state_options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


# not peft's merge_adapter: that merges modules in place (FSDP shards here); this merges the gathered dict
def merge_lora(state: dict[str, torch.Tensor], scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict as the plain model's weights: W + scaling * B @ A per adapted layer.

    ``scaling``: each adapted layer's name (``...q_proj``) to its LoRA scaling (alpha / r).
    """
    prefix = "base_model.model."
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if "lora_" in key:
            continue
        name = key[len(prefix) :] if key.startswith(prefix) else key
        layer = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        if layer is not None and key.endswith(".base_layer.weight") and layer in scaling:
            a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
            value = value + (b.to(torch.float32) @ a.to(torch.float32)).to(value.dtype) * scaling[layer]
        out[name.replace("base_layer.", "")] = value
    return out


class ShardedPolicy(Policy):
    """A :class:`Policy` whose model and optimizer are FSDP2 shards; made by :meth:`adopt` on every rank.

    ``step`` and ``sft_step`` are collectives (every rank calls them with the same batch), as are
    ``engine_weights``, ``save``, ``load_sharded``, ``gather`` and ``memory_bytes``.
    """

    _with_reference = True  # whether this step's micro-batches run the frozen reference (GRPO with KL)

    @classmethod
    def adopt(cls, policy: Policy, checkpoint: str | None = None) -> ShardedPolicy:
        """Shard ``policy`` in place (every rank, same weights and optimizer state on each beforehand).

        ``checkpoint``: a folder with a sharded ``torch.distributed.checkpoint`` state to resume from.
        """
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not (dist.is_available() and dist.is_initialized()):  # one rank is allowed: bf16 FSDP on one GPU
            raise ConfigError("sharding='fsdp' needs a torch.distributed process group (world_size >= 2)")
        named = _by_name(policy.model, policy.optimizer.state_dict())
        _shard_module(policy.model, policy.device)
        if policy.reference is not None:  # frozen: sharded too, gathered for its forward only
            _shard_module(policy.reference, policy.device)
        policy.__class__ = cls  # as fully_shard does to the modules: same object, sharded behaviour
        sharded: ShardedPolicy = policy  # type: ignore[assignment]
        sharded.data_parallel = False  # FSDP reduces the gradients itself
        # a shared prefix is a second forward pass, so a second round of all-gathers that ranks without
        # one would not join: every rank runs whole samples
        sharded.share_prefixes = False
        params = [p for p in sharded.model.parameters() if p.requires_grad]
        sharded.optimizer = torch.optim.AdamW(
            params, lr=policy.config.lr, weight_decay=policy.config.weight_decay
        )
        if named["state"]:  # a warm-started or resumed optimizer: each rank keeps its slice of it
            set_optimizer_state_dict(
                sharded.model, sharded.optimizer, named, options=_state_options(full_state_dict=True)
            )
        if checkpoint is not None and (Path(checkpoint) / SHARDED_DIR).is_dir():
            sharded.load_sharded(checkpoint)
        log.info(
            "rank %d: policy sharded with FSDP2 over %d ranks (%s)",
            dist.get_rank(),
            dist.get_world_size(),
            "bf16 compute, fp32 reduce" if policy.device.type == "cuda" else "fp32",
        )
        return sharded

    # ---- training: the same Policy code, with collective-safe micro-batches -------------------------

    def _agree(self, value: int, op: Any) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def _backprop(
        self,
        samples: Sequence[Sample],
        mine: Sequence[int],
        work: Callable[[list[int]], None],
        restart: Callable[[], None],
    ) -> None:
        """Policy's micro-batch loop over this rank's shard of ``mine``, in lock-step with the other ranks.

        The ranks agree on the token limit and on the number of micro-batches (a rank with fewer runs
        zero-weight passes, which gather and reduce like real ones); after each micro-batch they agree
        whether any went over the memory budget, and all restart with smaller micro-batches if one did.
        """
        lengths = [len(s.input_ids) for s in samples]
        everyone = list(mine)
        shards = collective.shard([lengths[i] for i in everyone], dist.get_world_size())
        own = sorted((everyone[i] for i in shards[dist.get_rank()]), key=lambda i: lengths[i])
        cuda = self.device.type == "cuda"
        while True:
            release_free_memory()
            self.sizer.check_base(torch.cuda.memory_allocated(self.device) if cuda else self.monitor.sample())
            limit = self._agree(self.sizer.limit, dist.ReduceOp.MIN)
            groups: list[list[int]] = []
            order = own
            while order:
                groups.append(_next_group(order, padded_tokens(lengths), limit))
                order = order[len(groups[-1]) :]
            passes = self._agree(len(groups), dist.ReduceOp.MAX)
            self._computed_tokens = 0
            restart()
            self._update_peak = over = alone = 0
            for k in range(passes):
                mine_over = 0
                if k < len(groups):
                    group = groups[k]
                    tokens = padded_tokens(lengths)(group)
                    self._computed_tokens += tokens
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(self.device)
                        base = torch.cuda.memory_allocated(self.device)
                    else:
                        base = self.monitor.window()
                    work(group)
                    self._reshard_reference()
                    peak = (
                        torch.cuda.max_memory_allocated(self.device) if cuda else self.monitor.window_peak()
                    )
                    if cuda:
                        self.monitor.note_vram(peak)
                    self._update_peak = max(self._update_peak, peak)
                    if not self.sizer.observe(tokens, base, peak):
                        mine_over, alone = tokens, int(len(group) == 1)
                else:
                    self._idle_pass()
                over = self._agree(mine_over, dist.ReduceOp.MAX)
                if over:
                    break
            if not over:
                return
            self.optimizer.zero_grad(set_to_none=True)
            # every rank takes the same decision: halve to the micro-batch that went over, or raise
            # MemoryBudgetError everywhere when it was one sample (nothing smaller to try)
            alone = self._agree(alone, dist.ReduceOp.MAX)
            self.sizer.back_off(over, alone=bool(alone))
            log.warning("a micro-batch of %d tokens went over the memory budget on a rank: retrying", over)

    def _idle_pass(self) -> None:
        """A forward and backward with zero loss: this rank's part of the collectives of a micro-batch."""
        from agl.algorithm.policy.logprobs import token_logprobs
        from agl.compute.precision import autocast

        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        attention = torch.ones_like(ids)
        with autocast(self.precision, self.device):
            logprobs, _ = token_logprobs(self.model, ids, attention)
        if self.reference is not None and self._with_reference:
            with torch.no_grad(), autocast(self.precision, self.device):
                token_logprobs(self.reference, ids, attention)
            self._reshard_reference()
        (logprobs.sum() * 0.0).backward()

    def _reshard_reference(self) -> None:
        if self.reference is not None and hasattr(self.reference, "reshard"):
            self.reference.reshard()  # the root unit stays gathered after a forward with no backward

    def step(
        self, samples: Sequence[Sample], advantages: Sequence[float], rollout_index: Sequence[int]
    ) -> dict[str, float]:
        """Policy.step on this rank's shard of the batch; the loss metrics are summed over the ranks."""
        self._with_reference = True
        metrics = super().step(samples, advantages, rollout_index)
        return collective.all_reduce_metrics(metrics, self.device)

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Policy.sft_step on this rank's shard of the batch; the loss is summed over the ranks."""
        self._with_reference = False
        metrics = super().sft_step(samples)
        total = torch.tensor([metrics["sft_loss"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return {**metrics, "sft_loss": float(total.item())}

    # ---- gathering, checkpoints, memory -------------------------------------------------------------

    def gather(self, optimizer: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """The full model state dict (and optimizer state, by parameter name) on rank 0, on the CPU;
        empty dicts on the other ranks."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        options = _state_options(full_state_dict=True, cpu_offload=True)
        model: dict[str, Any] = get_model_state_dict(self.model, options=options)
        optim: dict[str, Any] = (
            get_optimizer_state_dict(self.model, self.optimizer, options=options) if optimizer else {}
        )
        return model, optim

    def engine_weights(self, adapter: str | None = None) -> dict[str, torch.Tensor]:
        """Rank 0: the full weights for the engine (LoRA merged), gathered; other ranks: {}."""
        if adapter is not None:
            raise ConfigError(
                "a sharded policy trains one adapter: LoRA adapters per agent train on one rank"
            )
        state, _ = self.gather()
        if dist.get_rank() != 0:
            return {}
        if self.config.lora_rank > 0:
            return merge_lora(state, self._lora_scaling())
        return state

    def _lora_scaling(self) -> dict[str, float]:
        return {
            name: float(module.scaling["default"])
            for name, module in self.model.named_modules()
            if hasattr(module, "lora_A") and "default" in getattr(module, "scaling", {})
        }

    def gathered_policy(self) -> Any:
        """Rank 0: an unsharded copy of the policy on the CPU (model and tokenizer, for an export)."""
        state, _ = self.gather()
        if dist.get_rank() != 0:
            return None
        return GatheredPolicy(_plain_model(self.config, state), self.tokenizer, self.config)

    def save(self, path: Path) -> None:
        """A checkpoint: every rank's shards of model and optimizer (``SHARDED_DIR``), plus on rank 0 a
        Hugging Face folder of the gathered weights and the tokenizer."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        path = Path(path)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / SHARDED_DIR))
        full, _ = self.gather()
        if dist.get_rank() == 0:
            plain = _plain_model(self.config, full)
            plain.save_pretrained(str(path))
            self.tokenizer.save_pretrained(str(path))
        dist.barrier()

    def load_sharded(self, path: str | Path) -> None:
        """Load the shards of a checkpoint written by :meth:`save` (any number of ranks wrote it)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp_load({"model": model_state, "optim": optim_state}, checkpoint_id=str(Path(path) / SHARDED_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        log.info("rank %d: resumed the sharded state of %s", dist.get_rank(), path)

    def peak_memory(self) -> int:
        """This rank's peak bytes so far: allocated VRAM on CUDA, the process's resident set on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state (its local shards)."""
        params = list(self.model.parameters())
        optim = [v for s in self.optimizer.state.values() for v in s.values()]
        return {
            "parameters": _local_bytes(params),
            "gradients": _local_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": _local_bytes(optim),
        }

    def unshard(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> Policy:
        """Rank 0, after training: make this a plain Policy again from the gathered state (the group
        may go away after this); weights and optimizer state carry over."""
        model = _plain_model(self.config, model_state, device=self.device)
        if checkpointing_for(self.config.activation_checkpointing, self.device):
            enable_activation_checkpointing(model)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        if optim_state.get("state"):
            optimizer.load_state_dict(_by_id(model, optim_state))
        self.reference = _reference(self.config, self.device) if self.reference is not None else None
        self.model, self.optimizer = model, optimizer
        self.data_parallel = False
        self.__class__ = Policy  # type: ignore[assignment]
        return self


@dataclasses.dataclass
class GatheredPolicy:
    """What an export needs of a policy: the unsharded model (full or PEFT LoRA) and the tokenizer."""

    model: Any
    tokenizer: Any
    config: Any


def _plain_model(config: Any, state: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> Any:
    """The policy's model unsharded (PEFT-wrapped for LoRA, as Policy builds it) holding ``state``."""
    from transformers import AutoModelForCausalLM

    model: Any
    with torch.random.fork_rng(devices=[]):  # LoRA's init draws random numbers: leave the run's RNG alone
        model = AutoModelForCausalLM.from_pretrained(
            config.model_path, local_files_only=True, dtype=torch.float32
        )
        if config.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules="all-linear")
            model = get_peft_model(model, lora)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embedding
    if missing or unexpected:
        raise RuntimeError(
            f"gathered state does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    return model.to(device)


def _reference(config: Any, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        config.model_path, local_files_only=True, dtype=torch.float32
    ).eval()
    return reference.to(device)


__all__ = [
    "SHARDED_DIR",
    "SHARDINGS",
    "GatheredPolicy",
    "ShardedPolicy",
    "Sharding",
    "check_sharding",
    "merge_lora",
]
