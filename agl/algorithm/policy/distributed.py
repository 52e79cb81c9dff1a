"""Data-parallel policy steps over torch.distributed: samples sharded across ranks, gradients summed.

Rank 0 is the process that runs ``Trainer.fit`` (store, engine, gateway, runners, the GRPO loop); ranks
1..N-1 only train. Each step rank 0 broadcasts the batch; every rank computes the loss's aggregation
weights over the *whole* batch, backpropagates only its own shard of samples with those weights, and
the gradients are summed (all-reduce SUM): the sum of the shards' gradients is the single-process
gradient, for every aggregation. Every rank then clips and steps the same gradient, so the parameters
stay identical without another broadcast. Gradients are reduced once per step rather than by DDP's
per-backward hooks, because ranks run different numbers of micro-batches (shards differ in length).

With ``sharding="fsdp"`` the same ranks start, and each then shards its policy with FSDP2
(:mod:`agl.algorithm.policy.sharding`): parameters, gradients and optimizer state are 1/N per rank, and the
gathering calls (weights for the engine, checkpoints, exports) run on every rank through ``("call", ...)``
messages.

Two ways to start it: ``GRPOConfig(world_size=N)`` makes rank 0 spawn N-1 local worker processes
(gloo on CPU, nccl with ``device="cuda"``); under ``torchrun`` every rank > 0 calls :func:`serve_worker`
and rank 0 runs ``Trainer.fit`` with ``GRPOConfig(world_size=N)``, joining the group from the
environment.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agl.adapter.trajectory import Sample
from agl.algorithm.policy.collective import (
    backend_for,
)
from agl.algorithm.policy.loss import LossConfig
from agl.algorithm.policy.model import Policy
from agl.errors import ConfigError

log = logging.getLogger(__name__)

_WORKER_TIMEOUT = datetime.timedelta(days=7)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Init:
    policy: Any  # PolicyConfig
    loss: LossConfig
    optimizer_from: str | None  # a checkpoint folder whose optimizer.pt (or sharded state) to load
    sharding: str = "none"  # "fsdp": every rank shards its policy (agl.algorithm.policy.sharding)


def _rank_device(device: str, rank: int) -> str:
    """One GPU per rank on CUDA (``cuda`` -> ``cuda:<rank>``); CPU ranks share the CPU."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return f"cuda:{rank}"
    return device


def serve_worker(
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    backend: str | None = None,
) -> None:
    """Run a training-only rank until rank 0 says stop; under torchrun call it with no arguments
    (``backend="nccl"`` when rank 0 trains on ``device="cuda"``). The model and loss come from rank 0.
    """
    if not dist.is_initialized():
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        backend = backend or os.environ.get("AGL_DIST_BACKEND", "gloo")
        # a worker waits for rank 0 through whole rollout phases: no short collective timeout
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=_WORKER_TIMEOUT
        )
    rank = dist.get_rank()
    message = _receive()
    init: _Init = message[1]
    device = _rank_device(init.policy.device, rank)
    policy = Policy(_with_device(init.policy, device), init.loss)
    policy.data_parallel = True
    if init.optimizer_from:
        policy.load_optimizer(Path(init.optimizer_from))
    _sync_state(policy)
    policy = _prepare(policy, init.sharding, init.optimizer_from)
    log.info("rank %d/%d ready (%s)", rank, dist.get_world_size(), device)
    try:
        while True:
            message = _receive()
            if message[0] == "step":
                policy.step(*message[1:])
            elif message[0] == "digest":
                dist.all_gather_object([None] * dist.get_world_size(), _digest(policy))
            elif message[0] == "call":  # a collective method of the sharded policy
                _, name, args, gather = message
                result = getattr(policy, name)(*args)
                if gather:
                    dist.all_gather_object([None] * dist.get_world_size(), result)
            else:
                break
    finally:
        dist.destroy_process_group()


def _with_device(config: Any, device: str) -> Any:
    import dataclasses

    return dataclasses.replace(config, device=device)


def _receive() -> Any:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _send(message: tuple[Any, ...]) -> None:
    dist.broadcast_object_list([message], src=0)


def _sync_state(policy: Any) -> None:
    """Rank 0's parameters and optimizer state everywhere (covers warm starts and resumed optimizers)."""
    with torch.no_grad():
        for p in policy.model.parameters():
            dist.broadcast(p.data, src=0)
    box = [policy.optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        policy.optimizer.load_state_dict(box[0])


def _prepare(policy: Any, sharding: str, checkpoint: str | None) -> Any:
    """After the ranks hold the same state: shard it (FSDP2) or mark it for summed gradients."""
    if sharding == "fsdp":
        from agl.algorithm.policy.sharding import ShardedPolicy

        return ShardedPolicy.adopt(policy, checkpoint)
    policy.data_parallel = True
    return policy


def _digest(policy: Any) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in policy.model.parameters()))


#: set while rank 0 spawns ranks: a spawned rank that re-imports an unguarded script and reaches
#: ``Trainer.fit`` sees it and raises (``agl.trainer.trainer.refuse_in_spawned_rank``)
SPAWNED_RANK_ENV = "AGL_SPAWNED_RANK"

MAIN_GUARD_FIX = (
    'call Trainer.fit under `if __name__ == "__main__":` in the script that starts training: with '
    "GRPOConfig(world_size > 1) the other ranks are spawned Python processes that re-import that script"
)


def _spawned(rank: int, world_size: int, init_method: str, backend: str, ready: Any) -> None:
    ready.put(rank)  # the main script is imported: this rank got past the point where a missing guard fails
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    serve_worker(rank, world_size, init_method, backend)


def _spawn_ranks(world_size: int, init_method: str, backend: str) -> list[Any]:
    """Start ranks 1..N-1 and wait until each has imported the main script; a rank that dies first
    (an unguarded script re-running ``fit``) raises here instead of leaving rank 0 waiting forever."""
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    processes: list[Any] = []
    previous = os.environ.get(SPAWNED_RANK_ENV)
    os.environ[SPAWNED_RANK_ENV] = "1"
    try:
        for rank in range(1, world_size):
            proc = ctx.Process(
                target=_spawned, args=(rank, world_size, init_method, backend, ready), daemon=True
            )
            proc.start()
            processes.append(proc)
    finally:
        if previous is None:
            os.environ.pop(SPAWNED_RANK_ENV, None)
        else:
            os.environ[SPAWNED_RANK_ENV] = previous
    pending = dict(enumerate(processes, start=1))
    while pending:
        try:
            pending.pop(ready.get(timeout=0.1), None)
            continue
        except queue.Empty:
            pass
        dead = {rank: p.exitcode for rank, p in pending.items() if p.exitcode is not None}
        if dead:
            for proc in processes:
                proc.terminate()
            for proc in processes:
                proc.join(timeout=10)
            rank, code = next(iter(dead.items()))
            raise ConfigError(
                f"rank {rank} of {world_size} exited (code {code}) before it started; if its error above "
                f"says Trainer.fit ran in a spawned rank: {MAIN_GUARD_FIX}"
            )
    ready.close()
    return processes


class DistributedPolicy:
    """Rank 0's handle: a Policy whose ``step`` runs on every rank; other methods act on rank 0's copy.

    ``DistributedPolicy.start(policy, world_size)`` spawns the other ranks (or joins a torchrun group).
    """

    def __init__(self, policy: Any, processes: list[Any], sharding: str = "none") -> None:
        self.policy = policy
        self.sharding = sharding
        self._processes = processes
        self._closed = False

    @classmethod
    def start(
        cls, policy: Any, world_size: int, optimizer_from: str | None = None, sharding: str = "none"
    ) -> DistributedPolicy:
        """Bring up ``world_size`` ranks around ``policy`` (this process is rank 0).

        ``sharding="fsdp"``: every rank shards the policy (FSDP2); ``optimizer_from`` may then be a
        checkpoint with a sharded state. ``"none"``: every rank keeps the full model (data parallel).
        """
        from agl.algorithm.policy.sharding import check_sharding

        check_sharding(sharding, world_size, "DistributedPolicy.start")
        if world_size < 2:
            raise ConfigError(f"DistributedPolicy needs world_size >= 2, got {world_size}")
        backend = backend_for(policy.config.device)
        if backend == "nccl":
            _rank_device(policy.config.device, 0)
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ConfigError(
                f"world_size={world_size} on CUDA needs that many GPUs, found {torch.cuda.device_count()}"
            )
        processes: list[Any] = []
        if not dist.is_initialized():
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: the other ranks exist
                if int(os.environ["WORLD_SIZE"]) != world_size or int(os.environ["RANK"]) != 0:
                    raise ConfigError(
                        f"GRPOConfig(world_size={world_size}) under torchrun needs WORLD_SIZE={world_size} and "
                        f"Trainer.fit on RANK 0 only (got WORLD_SIZE={os.environ['WORLD_SIZE']}, "
                        f"RANK={os.environ['RANK']}); call agl.algorithm.policy.distributed.serve_worker() "
                        "on the other ranks"
                    )
                dist.init_process_group(backend, init_method="env://")
            else:
                init_method = f"tcp://127.0.0.1:{_free_port()}"
                processes = _spawn_ranks(world_size, init_method, backend)
                dist.init_process_group(backend, init_method=init_method, rank=0, world_size=world_size)
        elif dist.get_world_size() != world_size or dist.get_rank() != 0:
            raise ConfigError(
                f"a process group of {dist.get_world_size()} ranks (this is rank {dist.get_rank()}) is "
                f"already up; world_size={world_size} must match it and run on rank 0"
            )
        _send(("init", _Init(policy.config, policy.loss_config, optimizer_from, sharding)))
        _sync_state(policy)
        policy = _prepare(policy, sharding, optimizer_from)
        log.info(
            "%s training on %d ranks (%s)",
            "sharded (FSDP2)" if sharding == "fsdp" else "data-parallel",
            world_size,
            backend,
        )
        return cls(policy, processes, sharding)

    @property
    def sharded(self) -> bool:
        return self.sharding == "fsdp"

    def collective(self, name: str, *args: Any, gather: bool = False) -> Any:
        """Call the policy's ``name(*args)`` on every rank (the sharded policy's gathering methods, or
        e.g. ``"peak_memory"`` with ``gather=True``); returns rank 0's result, or every rank's in a list."""
        _send(("call", name, args, gather))
        result = getattr(self.policy, name)(*args)
        if not gather:
            return result
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        return results

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One SFT step on every rank (sharded only: data-parallel ranks would train rank 0 alone)."""
        if not self.sharded:
            raise ConfigError("SFT over several ranks needs sharding='fsdp'")
        return dict(self.collective("sft_step", list(samples)))

    def engine_weights(self, adapter: str | None = None) -> dict[str, torch.Tensor]:
        """The full weights for the engine (gathered from the shards when sharded)."""
        if adapter is not None:
            raise ConfigError(
                "a data-parallel policy trains one adapter: LoRA adapters per agent train on one rank"
            )
        if self.sharded:
            return dict(self.collective("engine_weights"))
        return dict(self.policy.engine_weights())

    def save(self, path: Path) -> None:
        """A checkpoint (sharded: every rank writes its shards, rank 0 a Hugging Face folder too)."""
        if self.sharded:
            self.collective("save", Path(path))
        else:
            self.policy.save(path)

    def gathered_policy(self) -> Any:
        """An unsharded policy for an export (``agl.algorithm.export``): rank 0's own or a gathered copy."""
        return self.collective("gathered_policy") if self.sharded else self.policy

    def memory_bytes(self) -> list[dict[str, int]]:
        """Every rank's bytes of parameters, gradients and optimizer state (sharded only)."""
        if not self.sharded:
            raise ConfigError("memory_bytes reports the shards of sharding='fsdp'")
        return list(self.collective("memory_bytes", gather=True))

    def step(
        self, samples: Sequence[Sample], advantages: Sequence[float], rollout_index: Sequence[int]
    ) -> dict[str, float]:
        _send(("step", list(samples), list(advantages), list(rollout_index)))
        return dict(self.policy.step(samples, advantages, rollout_index))

    def check_in_sync(self) -> list[float]:
        """Every rank's parameter checksum; raises when a rank's parameters drifted from rank 0's."""
        if self.sharded:
            raise ConfigError("check_in_sync compares full copies: sharded ranks hold different shards")
        _send(("digest",))
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, _digest(self.policy))
        if any(abs(d - digests[0]) > 1e-6 * max(1.0, abs(digests[0])) for d in digests):
            raise RuntimeError(f"data-parallel ranks drifted apart: parameter checksums {digests}")
        return [float(d) for d in digests]

    def close(self, graceful: bool = True) -> None:
        """Stop the other ranks and leave the process group (idempotent).

        ``graceful=False`` (after an error, when ranks may sit in different collectives) sends nothing:
        it leaves the group and terminates the spawned ranks; torchrun ranks end at their group timeout.
        """
        if self._closed:
            return
        self._closed = True
        self.policy.data_parallel = False
        try:
            if graceful and self.sharded:  # rank 0 keeps a plain policy holding the trained state
                model_state, optim_state = self.collective("gather", True)
                self.policy = self.policy.unshard(model_state, optim_state)
            if graceful:
                _send(("stop",))
        finally:
            dist.destroy_process_group()
            for proc in self._processes:
                proc.join(timeout=30 if graceful else 0)
                if proc.is_alive():
                    log.warning("rank process %s did not stop; terminating it", proc.pid)
                    proc.terminate()

    def __getattr__(self, name: str) -> Any:  # engine_weights, save, load_optimizer, model, ...
        return getattr(self.policy, name)
