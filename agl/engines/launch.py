"""Serving engines for ``Trainer.fit``: which engine serves the policy, how many replicas, how weights reach them.

``agl.Serving(engine=BuiltinEngine())`` (the default) or ``agl.Serving(engine=VllmEngine(replicas=2))``.
:func:`start_engines` starts the replicas (here, or through a :class:`Placer` such as Ray actors) and
returns :class:`ServedEngines`: the gateway's upstreams plus ``sync``, which pushes a :class:`WeightSource`
(the trainer's policy) after a step and returns the version the next responses carry. vLLM replicas get a
LoRA hot-load when started with ``lora_rank > 0`` and a full restart on saved weights otherwise; the gateway
is paused and drained around either, so each response's ``model_version`` names the weights that made it.
With ``adapters`` (one LoRA adapter per agent) vLLM serves each as a LoRA of its name (multi-LoRA) and the
built-in engine starts one more engine per adapter, holding the base with that adapter merged in; the base
keeps serving ``policy``. Engines know nothing of the algorithm: the trainer passes the LoRA rank, the
algorithm the weights.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agl.compute.thread import run_compute
from agl.engines.vllm import check_cpu_list
from agl.errors import ConfigError
from agl.gateway.config import UpstreamConfig

logger = logging.getLogger(__name__)

POLICY = "policy"  # the model name agents call; vLLM serves the base under it, the adapter as policy@vN
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True)
class BuiltinEngine:
    """The built-in engine, in the trainer's process (the default). ``options`` go to ``EngineServer``."""

    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VllmEngine:
    """``replicas`` vLLM servers (data parallel) behind the gateway.

    ``python`` is a Python with vllm (default: ``.venv-vllm`` from ``scripts/setup_vllm.sh``, or env
    ``AGL_VLLM_PYTHON``). ``max_lora_rank`` defaults to the trained policy's ``lora_rank`` rounded up to a
    rank vLLM accepts. ``extra_args`` are appended to the server command line (e.g. GPU flags such as
    ``("--gpu-memory-utilization", "0.4")``); ``enforce_eager=False`` keeps CUDA graphs on a GPU.
    ``cuda_devices`` gives replica ``i`` ``CUDA_VISIBLE_DEVICES=cuda_devices[i]`` (e.g. ``("0", "1")``).
    ``cpu_cores`` gives replica ``i`` the CPUs ``cpu_cores[i]`` (e.g. ``("1",)``, ``("2-3", "4-5")``) for all its
    processes and OpenMP threads, so that on a CPU it generates beside a trainer on the other cores instead of
    sharing them (start the trainer on the rest: ``taskset -c 0 python train.py``).
    ``gpu_memory_gb`` is each replica's share of a GPU it shares with the trainer: it becomes vLLM's
    ``--gpu-memory-utilization`` (the share of the GPU's total), so engine and trainer stay within it.
    """

    replicas: int = 1
    python: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    max_lora_rank: int | None = None
    extra_args: tuple[str, ...] = ()
    enforce_eager: bool = True
    cuda_devices: tuple[str, ...] = ()
    cpu_cores: tuple[str, ...] = ()
    gpu_memory_gb: float | None = None
    start_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"VllmEngine.replicas must be >= 1, got {self.replicas}")
        if self.cuda_devices and len(self.cuda_devices) != self.replicas:
            raise ConfigError(
                f"VllmEngine.cuda_devices needs one entry per replica ({self.replicas}), got {self.cuda_devices}"
            )
        if self.cpu_cores and len(self.cpu_cores) != self.replicas:
            raise ConfigError(
                f"VllmEngine.cpu_cores needs one entry per replica ({self.replicas}), got {self.cpu_cores}"
            )
        for i, cpus in enumerate(self.cpu_cores):
            check_cpu_list(cpus, f"VllmEngine.cpu_cores[{i}]", here=False)  # a replica may run elsewhere
        if self.max_model_len < 16:
            raise ConfigError(f"VllmEngine.max_model_len must be >= 16, got {self.max_model_len}")
        if self.max_lora_rank is not None and self.max_lora_rank not in _VLLM_LORA_RANKS:
            raise ConfigError(
                f"VllmEngine.max_lora_rank must be one of {_VLLM_LORA_RANKS}, got {self.max_lora_rank}"
            )


EngineSpec = BuiltinEngine | VllmEngine


class BuiltinReplica(Protocol):
    """A running built-in engine (``EngineServer`` or a remote handle to one)."""

    @property
    def base_url(self) -> str: ...
    def update_weights(self, source: dict[str, Any]) -> str: ...
    def drop_prefix_cache(self) -> None: ...
    def release_weights(self) -> None: ...
    def stop(self) -> None: ...


class VllmReplica(Protocol):
    """A running vLLM server (``VllmServer`` or a remote handle to one)."""

    @property
    def base_url(self) -> str: ...
    def restart(
        self, model: str | Path | None = None, timeout_s: float = 300.0, *, model_version: str | None = None
    ) -> Any: ...
    def load_lora(self, name: str, path: str | Path) -> None: ...
    def unload_lora(self, name: str, *, missing_ok: bool = False) -> None: ...
    def set_model_version(self, version: str, aliases: dict[str, str] | None = None) -> None: ...
    def stop(self) -> None: ...


class Placer(Protocol):
    """Where replicas run: ``LocalPlacer`` (this process) or e.g. ``agl.trainer.ray.RayPlacer``."""

    def builtin(self, model_path: str, options: Mapping[str, Any]) -> BuiltinReplica: ...
    def vllm(self, server_options: dict[str, Any], timeout_s: float) -> VllmReplica: ...


class LocalPlacer:
    """Replicas in (or, for vLLM, as subprocesses of) the trainer's process."""

    def builtin(self, model_path: str, options: Mapping[str, Any]) -> BuiltinReplica:
        from agl.engines.builtin.server import EngineServer

        return EngineServer(model_path, **options).start()

    def vllm(self, server_options: dict[str, Any], timeout_s: float) -> VllmReplica:
        from agl.engines.vllm import VllmServer

        return VllmServer(**server_options).start(timeout_s)


class WeightSource(Protocol):
    """New weights for the engines (the trainer's policy): full weights, or its LoRA adapter as a folder.

    Engines started with ``adapters`` (one LoRA adapter per agent) ask for each adapter by name.
    """

    def engine_weights(self, adapter: str | None = None) -> dict[str, Any]:
        """The full state dict the engine loads (LoRA merged in; ``adapter``'s, when named)."""
        ...

    def save_adapter(self, folder: Path, adapter: str | None = None) -> None:
        """Write the LoRA adapter (``adapter``, when named) as a PEFT folder (vLLM hot-loads it); raises
        when there is none."""
        ...


class StateDict:
    """A bare state dict as a :class:`WeightSource`: full weights, no adapter."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)

    def engine_weights(self, adapter: str | None = None) -> dict[str, Any]:
        if adapter is not None:
            raise ConfigError(
                f"these engines serve LoRA adapters per agent and asked for {adapter!r}; bare weights have "
                "none: push the policy itself (ctx.publish_policy(policy))"
            )
        return self.state

    def save_adapter(self, folder: Path, adapter: str | None = None) -> None:
        raise ConfigError(
            "these engines hot-load LoRA adapters (lora_rank > 0) and got bare weights: push the policy "
            "itself (ctx.publish_policy(policy)), or start the engines with lora_rank=0"
        )


def weight_source(source: WeightSource | Mapping[str, Any]) -> WeightSource:
    """``source``, or a state dict wrapped as one."""
    return StateDict(source) if isinstance(source, Mapping) else source


class Pausable(Protocol):
    """The gateway's drain control (``agl.gateway.Gateway``)."""

    async def pause(self, timeout_s: float | None = None) -> dict[str, float]: ...
    async def resume(self) -> None: ...


class ServedEngines:
    """Running replicas: ``upstreams`` for the gateway, ``sync`` for new weights, ``stop``."""

    def __init__(self, replicas: list[Any], upstreams: list[UpstreamConfig]) -> None:
        self.replicas = replicas
        self.upstreams = upstreams

    async def sync(self, source: WeightSource | Mapping[str, Any], gateway: Pausable | None = None) -> str:
        """Push ``source``'s weights (a policy, or a bare state dict) to every replica; returns the new
        model version."""
        raise NotImplementedError

    async def free_for_update(self) -> None:
        """Free what a synchronous trainer's update is about to replace, so its peak can use the memory;
        a ``sync`` must follow. Engines that keep nothing in the trainer's memory do nothing."""

    def stop(self) -> None:
        for replica in self.replicas:
            try:
                replica.stop()
            except Exception:  # one replica failing to stop must not leave the others running
                logger.exception("stopping engine replica %s failed", replica.base_url)


class _BuiltinEngines(ServedEngines):
    """One built-in engine; with ``adapters``, one more per adapter, serving the base with that adapter
    merged in under the adapter's name (the first serves the base alone, and any other model name)."""

    def __init__(self, replicas: list[Any], upstreams: list[UpstreamConfig], adapters: list[str]) -> None:
        super().__init__(replicas, upstreams)
        self.adapters = adapters

    async def sync(self, source: WeightSource | Mapping[str, Any], gateway: Pausable | None = None) -> str:
        # the built-in engine swaps weights between batches and stamps versions itself: no pause needed
        source = weight_source(source)
        if not self.adapters:
            state = await run_compute(source.engine_weights)
            versions = await asyncio.gather(
                *(asyncio.to_thread(r.update_weights, state) for r in self.replicas)
            )
            return str(versions[0])
        versions = []
        for name, replica in zip(self.adapters, self.replicas[1:], strict=True):  # one merged copy at a time
            state = await run_compute(source.engine_weights, name)
            versions.append(await asyncio.to_thread(replica.update_weights, state))
            del state
        return str(versions[0])

    async def free_for_update(self) -> None:
        """Cached prefixes and, where the next sync pushes full weights to every replica, the weights."""
        if self.adapters:  # the first replica keeps serving the base: no sync replaces its weights
            await asyncio.gather(*(asyncio.to_thread(r.drop_prefix_cache) for r in self.replicas))
        else:
            await asyncio.gather(*(asyncio.to_thread(r.release_weights) for r in self.replicas))


class _VllmEngines(ServedEngines):
    def __init__(
        self,
        replicas: list[Any],
        spec: VllmEngine,
        model_path: Path,
        work_dir: Path,
        lora: bool,
        adapters: list[str] | None = None,
    ) -> None:
        # name: a Ray replica's URL#ray-node=ID, recorded as each call's backend
        upstreams = [
            UpstreamConfig(url=r.base_url, kind="vllm", name=getattr(r, "backend_name", None))
            for r in replicas
        ]
        super().__init__(replicas, upstreams)
        self.spec, self.model_path, self.work_dir = spec, model_path, work_dir
        self.lora = lora
        self.adapters = adapters or []  # one LoRA per agent, each served under its own name
        self.updates = 0
        self._previous: Path | None = None

    async def sync(self, source: WeightSource | Mapping[str, Any], gateway: Pausable | None = None) -> str:
        source = weight_source(source)
        self.updates += 1
        version = f"v{self.updates}"
        lora = self.lora
        folder = self.work_dir / ("lora" if lora else "weights") / version
        if self.adapters:
            for name in self.adapters:
                await run_compute(source.save_adapter, folder / name, name)
        elif lora:
            await run_compute(source.save_adapter, folder)
        else:
            state = await run_compute(source.engine_weights)
            await run_compute(save_model_folder, state, self.model_path, folder)
        try:  # a drain that times out also resumes: the error, not a stuck gateway, ends the run
            if gateway is not None:
                await gateway.pause(self.spec.drain_timeout_s)
            await asyncio.gather(
                *(asyncio.to_thread(self._update, r, folder, version) for r in self.replicas)
            )
        finally:
            if gateway is not None:
                await gateway.resume()
        if self._previous is not None:  # the servers have what they need from it
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = folder
        logger.info("vLLM replicas now serve %s (%s)", version, "LoRA hot-load" if lora else "restart")
        return version

    def _update(self, replica: VllmReplica, folder: Path, version: str) -> None:
        if self.adapters:  # the new adapters load beside the old, then requests switch to them at once
            for name in self.adapters:
                replica.load_lora(f"{name}@{version}", folder / name)
            replica.set_model_version(version, {name: f"{name}@{version}" for name in self.adapters})
            for name in self.adapters if self.updates > 1 else ():
                replica.unload_lora(f"{name}@v{self.updates - 1}")
        elif self.lora:
            adapter = f"{POLICY}@{version}"
            replica.load_lora(adapter, folder)
            replica.set_model_version(version, {POLICY: adapter})  # requests for policy now use it
            if self.updates > 1:
                replica.unload_lora(f"{POLICY}@v{self.updates - 1}")
        else:
            replica.restart(folder, self.spec.start_timeout_s, model_version=version)


def save_model_folder(state: dict[str, Any], base: Path, out: Path) -> Path:
    """A servable HF folder: ``state`` as safetensors plus ``base``'s config and tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_FILES):
            shutil.copy2(item, out / item.name)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # tied weights share storage; safetensors refuses shared tensors
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _replica_options(spec: VllmEngine, work_dir: Path, i: int) -> dict[str, Any]:
    env = {"CUDA_VISIBLE_DEVICES": spec.cuda_devices[i]} if spec.cuda_devices else {}
    cpus = {"cpus": spec.cpu_cores[i]} if spec.cpu_cores else {}
    return {"log_path": work_dir / f"vllm-{i}.log", "env": env, **cpus}


async def start_engines(
    spec: EngineSpec | None,
    model_path: str,
    *,
    lora_rank: int = 0,
    precision: str = "auto",
    work_dir: Path,
    placer: Placer | None = None,
    adapters: Mapping[str, int] | None = None,
) -> ServedEngines:
    """Start the replicas ``spec`` names for ``model_path`` (in parallel) and return them running.

    ``lora_rank``: the rank of the LoRA adapters the trainer will push (0: full weights); vLLM replicas
    then hot-load adapters of up to that rank instead of restarting. ``precision``: the trained policy's,
    which the built-in engine takes unless its options set one (so sampling and training logprobs agree).
    ``adapters``: one LoRA adapter per agent (name -> rank), each served under its name beside the base
    (``policy``) and starting as the base: vLLM's multi-LoRA, or one built-in engine per adapter.
    """
    spec = spec or BuiltinEngine()
    placer = placer or LocalPlacer()
    names = list(adapters or {})
    if isinstance(spec, BuiltinEngine):
        return await _start_builtin(spec, model_path, precision, placer, names)
    if not isinstance(spec, VllmEngine):
        raise ConfigError(f"engine must be BuiltinEngine(...) or VllmEngine(...), got {type(spec).__name__}")
    rank = max(adapters.values()) if adapters else lora_rank
    max_rank = spec.max_lora_rank or next((r for r in _VLLM_LORA_RANKS if r >= rank), rank)
    if rank > max_rank:
        raise ConfigError(f"the policy's lora_rank={rank} exceeds VllmEngine.max_lora_rank={max_rank}")
    work_dir.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {
        "model": model_path,
        "python": spec.python,
        "served_model_name": POLICY,
        "max_model_len": spec.max_model_len,
        "dtype": spec.dtype,
        "kv_cache_gib": spec.kv_cache_gib,
        "enable_lora": rank > 0,
        "max_lora_rank": max_rank,
        "max_loras": 2 * max(1, len(names)),  # each new adapter loads before the old one is dropped
        "extra_args": list(spec.extra_args),
        "enforce_eager": spec.enforce_eager,
        "gpu_memory_gb": spec.gpu_memory_gb,
    }
    started = await asyncio.gather(
        *(
            asyncio.to_thread(
                placer.vllm, {**options, **_replica_options(spec, work_dir, i)}, spec.start_timeout_s
            )
            for i in range(spec.replicas)
        ),
        return_exceptions=True,
    )
    replicas = [r for r in started if not isinstance(r, BaseException)]
    errors = [r for r in started if isinstance(r, BaseException)]
    if not errors and names:  # until the first push, each adapter's name serves the base
        aliases = dict.fromkeys(names, POLICY)
        done = await asyncio.gather(
            *(asyncio.to_thread(r.set_model_version, "v0", aliases) for r in replicas),
            return_exceptions=True,
        )
        errors = [r for r in done if isinstance(r, BaseException)]
    if errors:
        ServedEngines(replicas, []).stop()
        raise errors[0]
    return _VllmEngines(replicas, spec, Path(model_path), work_dir, lora=rank > 0, adapters=names)


async def _start_builtin(
    spec: BuiltinEngine, model_path: str, precision: str, placer: Placer, adapters: list[str]
) -> ServedEngines:
    """One built-in engine, plus one per adapter (its copy of the weights, served under its name); the
    default KV cache budget is shared out among them."""
    engine_options: dict[str, Any] = {"precision": precision, **spec.options}
    if adapters and "kv_cache_gb" not in spec.options:
        from agl.compute.memory import ENGINE_SHARE, GB, budget_bytes

        share = ENGINE_SHARE * budget_bytes(str(engine_options.get("device", "cpu")), None) / GB
        engine_options["kv_cache_gb"] = share / (len(adapters) + 1)
    served: list[str | None] = [None, *adapters]
    replicas: list[Any] = []
    try:
        for name in served:
            options = engine_options if name is None else {**engine_options, "model_name": name}
            replicas.append(await run_compute(placer.builtin, model_path, options))
    except BaseException:
        ServedEngines(replicas, []).stop()
        raise
    key = spec.options.get("token")  # EngineServer(token=...): the gateway sends it upstream
    upstreams = [
        UpstreamConfig(
            url=replica.base_url,
            kind="agl",
            api_key=key,
            name=getattr(replica, "backend_name", None),  # e.g. a Ray replica's URL#ray-node=ID
            models=None if name is None else [name],
        )
        for replica, name in zip(replicas, served, strict=True)
    ]
    return _BuiltinEngines(replicas, upstreams, adapters)


__all__ = [
    "POLICY",
    "BuiltinEngine",
    "EngineSpec",
    "LocalPlacer",
    "Placer",
    "ServedEngines",
    "StateDict",
    "VllmEngine",
    "WeightSource",
    "save_model_folder",
    "start_engines",
]
