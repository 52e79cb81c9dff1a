"""Keeping training within a memory budget: the budget, peak tracking, micro-batch sizing and back-off.

The budget is what this process may use: an explicit ``memory_budget_gb``, or a fraction of the memory
it could have (CPU: its own RSS plus what the machine has available; CUDA: the device's total). On CPU
an out-of-memory condition is not an exception (the kernel kills the process), so peaks are watched
instead: a sampler thread records the process's RSS, and the trainer checks each micro-batch's peak
against the budget. :class:`MicroBatchSizer` sizes micro-batches from a measured probe (bytes per token
of the first micro-batch) and halves them when a peak goes over; below one sample per micro-batch it
raises :class:`MemoryBudgetError` naming the settings to change.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from typing import TYPE_CHECKING, Any, Literal

import psutil

from agl.errors import ConfigError

if TYPE_CHECKING:  # imported where used: configs import this module, and ``import agl`` stays light
    import torch

GB = 1024**3
DEFAULT_FRACTION = 0.7  # of the memory the process could have: the rest is for the OS and other processes
# The largest micro-batch "auto" picks. On a CPU, tokens/s stops rising well before 2,048 tokens
# (benchmarks/memory_table.py), so bigger micro-batches only cost memory; a GPU gains up to far more.
MAX_AUTO_TOKENS = {"cpu": 2048, "cuda": 16384}
PROBE_TOKENS = 1024  # the first micro-batch of a run, measured to size the others
ENGINE_SHARE = 0.25  # of the budget, the built-in engine's KV cache (it shares the trainer's process)
HEADROOM = 0.85  # size micro-batches for this share of the memory left under the budget
# "auto" checkpointing on a CPU leaves micro-batches of up to this many tokens whole: without recompute they
# peak about as high as the 2,048-token cap does with it, and their forward + backward runs faster
PLAIN_CPU_TOKENS = 1024

MicroBatchTokens = int | Literal["auto"]
Checkpointing = bool | Literal["auto"]


class MemoryBudgetError(ConfigError):
    """Training cannot fit the memory budget even with the smallest micro-batch (one sample)."""


def check_settings(micro_batch_tokens: object, memory_budget_gb: float | None) -> None:
    """Raise ConfigError naming the field unless both memory settings are valid (config construction)."""
    if micro_batch_tokens != "auto" and (
        not isinstance(micro_batch_tokens, int)
        or isinstance(micro_batch_tokens, bool)
        or micro_batch_tokens < 1
    ):
        raise ConfigError(f"micro_batch_tokens must be a positive int or 'auto', got {micro_batch_tokens!r}")
    if memory_budget_gb is not None and not memory_budget_gb > 0:
        raise ConfigError(
            f"memory_budget_gb must be > 0 (or None for a share of free memory), got {memory_budget_gb}"
        )


def device_kind(device: str | torch.device) -> str:
    return str(device).split(":")[0]


def checkpointing_for(setting: Checkpointing, device: str | torch.device) -> bool:
    """``"auto"``: on for CPU (less memory per token: benchmarks/logprob_memory.py measures it), off on CUDA, where the recomputed
    forward costs more compute and the auto micro-batch keeps memory bounded."""
    if setting == "auto":
        return device_kind(device) == "cpu"
    return bool(setting)


def plain_tokens_for(setting: Checkpointing, device: str | torch.device) -> int:
    """Micro-batches of at most this many tokens skip activation checkpointing and the log-prob head's
    recompute: :data:`PLAIN_CPU_TOKENS` for ``"auto"`` on a CPU, else 0 (the setting holds for all)."""
    return PLAIN_CPU_TOKENS if setting == "auto" and device_kind(device) == "cpu" else 0


def process_rss() -> int:
    """This process's resident set size in bytes."""
    return int(psutil.Process().memory_info().rss)


def children_rss() -> int:
    """Resident bytes of this process's descendants (vLLM servers, runner processes)."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += int(child.memory_info().rss)
        except psutil.Error:  # exited meanwhile
            continue
    return total


def _cuda_in_use() -> bool:
    """Whether this process has started CUDA (never imports torch or starts CUDA itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


M_ARENA_MAX = -8  # glibc's mallopt parameter number
ARENAS = 2


@functools.cache
def limit_arenas() -> None:
    """Cap glibc's malloc arenas for threads that have not allocated yet (as ``MALLOC_ARENA_MAX=2``).

    glibc gives threads their own arenas (up to 8 per core); policy steps and engine batches run on
    whichever pool thread is free, and each arena keeps its own copy of the freed peak, so RSS climbed
    step after step (tests/algorithm/test_grpo_memory.py measures it). Called once, by the first policy.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, ARENAS)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
HELD_CHUNK_BYTES = 1 << 30


@functools.cache
def hold_freed_memory() -> None:
    """Let glibc keep freed memory for reuse instead of handing it back to the OS at once.

    By default glibc serves each allocation over a (moving) threshold with its own mmap and unmaps it
    on free, and trims a heap's free top: a SmolLM2 policy step then took minor page faults
    (freshly mapped pages, zeroed by the kernel) for the same tensors every step, a share of its time.
    With allocations up to 1 GB served from the heaps and no automatic trim, a step reuses the last
    step's pages (far fewer faults: only chunks over a thread heap's 64 MB are still mapped). The process's
    RSS stays at its high-water mark between steps, as a caching allocator's would; the policy still
    trims (:func:`release_free_memory`) where its memory sizer needs a true reading. Called once, by the
    first policy on a CPU.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, HELD_CHUNK_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def release_free_memory() -> None:
    """Hand memory that is free but still held by glibc's heaps back to the OS.

    PyTorch frees tensors to glibc, which keeps freed heap pages in the arena of the thread that
    allocated them; without this each arena keeps a step's peak after the step (see :func:`limit_arenas`).
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    if _cuda_in_use():
        import torch

        torch.cuda.empty_cache()


def budget_bytes(
    device: str | torch.device, budget_gb: float | None, fraction: float = DEFAULT_FRACTION
) -> int:
    """The bytes this process may use on ``device``: ``budget_gb``, or ``fraction`` of what it could have."""
    if budget_gb is not None:
        if budget_gb <= 0:
            raise ConfigError(f"memory_budget_gb must be > 0, got {budget_gb}")
        return int(budget_gb * GB)
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        _, total = torch.cuda.mem_get_info(dev)
        return int(total * fraction)
    return int((process_rss() + psutil.virtual_memory().available) * fraction)


def gpu_memory_utilization(budget_gb: float, total_gb: float) -> float:
    """vLLM's ``--gpu-memory-utilization`` for a server that may use ``budget_gb`` of a ``total_gb`` GPU."""
    if budget_gb <= 0 or total_gb <= 0:
        raise ConfigError(
            f"a GPU memory budget needs budget_gb and total_gb > 0, got {budget_gb}, {total_gb}"
        )
    if budget_gb > total_gb:
        raise ConfigError(
            f"the engine's GPU memory budget {budget_gb:.1f} GB exceeds the GPU's {total_gb:.1f} GB"
        )
    return round(budget_gb / total_gb, 3)


class PeakMonitor:
    """A daemon thread sampling this process's RSS (and its children's, and peak VRAM on CUDA).

    ``take()`` returns the peaks since the previous ``take()``; ``window()``/``window_peak()`` bracket a
    shorter span (one micro-batch) without disturbing the step's peaks. ``sample()`` records a reading
    now, for points where the peak is known to be (after a forward pass).
    """

    def __init__(self, interval_s: float = 0.02, children_every: int = 25) -> None:
        self.interval_s, self.children_every = interval_s, children_every
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak = self._window = 0
        self._children = self._vram = 0

    def start(self) -> PeakMonitor:
        if self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="agl-memory-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval_s):
            self.sample(children=n % self.children_every == 0)
            n += 1

    def sample(self, children: bool = False) -> int:
        """Record the RSS now (and the children's when asked); returns it."""
        rss = process_rss()
        kids = children_rss() if children else 0
        with self._lock:
            self._peak = max(self._peak, rss)
            self._window = max(self._window, rss)
            self._children = max(self._children, kids)
        return rss

    def window(self) -> int:
        """Start a window (e.g. one micro-batch); returns the RSS at its start."""
        rss = process_rss()
        with self._lock:
            self._window = rss
            self._peak = max(self._peak, rss)
        return rss

    def window_peak(self) -> int:
        self.sample()
        with self._lock:
            return self._window

    def note_vram(self, peak: int) -> None:
        """Record a VRAM peak measured elsewhere (the trainer resets CUDA's peak per micro-batch)."""
        with self._lock:
            self._vram = max(self._vram, peak)

    def take(self) -> dict[str, float]:
        """Peaks since the last call: ``peak_rss_gb`` (this process, with an in-process engine),
        ``peak_children_rss_gb`` (child processes: vLLM servers, data-parallel ranks), ``peak_vram_gb`` on CUDA."""
        self.sample(children=True)
        with self._lock:
            row = {"peak_rss_gb": self._peak / GB, "peak_children_rss_gb": self._children / GB}
            vram, self._peak, self._children, self._vram = self._vram, 0, 0, 0
        if _cuda_in_use():
            import torch

            row["peak_vram_gb"] = max(vram, torch.cuda.max_memory_allocated()) / GB
            torch.cuda.reset_peak_memory_stats()
        return row


class MicroBatchSizer:
    """The micro-batch token limit: fixed, or (``"auto"``) from a measured probe, within a memory budget.

    ``budget`` is a function so an auto budget follows what the machine has available as other
    processes come and go; a fixed ``memory_budget_gb`` returns a constant.
    """

    def __init__(
        self, setting: MicroBatchTokens, device: str | torch.device, budget_gb: float | None
    ) -> None:
        check_settings(setting, budget_gb)
        import torch

        self.device = torch.device(device)
        self.auto = setting == "auto"
        self.budget_gb = budget_gb
        self.cap = (
            MAX_AUTO_TOKENS.get(self.device.type, MAX_AUTO_TOKENS["cpu"]) if self.auto else int(setting)
        )
        self.limit = min(PROBE_TOKENS, self.cap) if self.auto else self.cap
        self.bytes_per_token = 0.0  # the largest measured
        self.backoffs = 0
        self._budget = budget_bytes(self.device, budget_gb)

    def budget(self) -> int:
        if self.budget_gb is None and self.device.type == "cpu":  # follow the machine's available memory
            self._budget = budget_bytes(self.device, None)
        return self._budget

    def observe(self, tokens: int, base: int, peak: int) -> bool:
        """Record one micro-batch of ``tokens`` (rows x width) that rose from ``base`` to ``peak`` bytes;
        returns False when the peak went over the budget. In auto mode, resizes the limit to fit."""
        if peak > self.budget():
            return False
        if tokens > 0 and peak > base:
            self.bytes_per_token = max(self.bytes_per_token, (peak - base) / tokens)
        if self.auto and self.bytes_per_token > 0:
            room = (self.budget() - base) * HEADROOM / self.bytes_per_token
            self.limit = max(1, min(self.cap, int(room) // 256 * 256 or int(room)))
        elif self.auto:
            self.limit = self.cap
        return True

    def back_off(self, used: int, *, alone: bool) -> None:
        """Halve the limit after a micro-batch of ``used`` tokens went over the budget; raises
        :class:`MemoryBudgetError` when that micro-batch was one sample (nothing smaller to try)."""
        if alone:
            raise MemoryBudgetError(
                f"one sample of {used} tokens does not fit the memory budget of {self.budget() / GB:.1f} GB "
                f"(process RSS {process_rss() / GB:.1f} GB); lower max_sample_tokens or the agent's max "
                "tokens, train LoRA (lora_rank=16) instead of the full model, use a smaller model, lower "
                "group_size or tasks_per_step (less held per step), or raise memory_budget_gb"
            )
        self.backoffs += 1
        self.limit = max(1, used // 2)
        self.cap = min(self.cap, self.limit)  # never grow back past what went over

    def check_base(self, base: int) -> None:
        """Fail before training when the process alone (weights, optimizer, engine) is over the budget."""
        if base > self.budget():
            raise MemoryBudgetError(
                f"the process already uses {base / GB:.1f} GB before any micro-batch, over its memory budget "
                f"of {self.budget() / GB:.1f} GB (model weights, optimizer state, engine); train LoRA "
                "(lora_rank=16), use a smaller model, lower group_size or tasks_per_step, or raise memory_budget_gb"
            )


_MONITOR: PeakMonitor | None = None
_MONITOR_LOCK = threading.Lock()


def shared_monitor() -> PeakMonitor:
    """This process's one RSS sampler, started on first use (by the first policy)."""
    global _MONITOR
    with _MONITOR_LOCK:
        if _MONITOR is None:
            _MONITOR = PeakMonitor().start()
        return _MONITOR


def step_peaks() -> dict[str, float]:
    """Peak memory since the previous call, for a step's metrics row (see :meth:`PeakMonitor.take`)."""
    return shared_monitor().take()


__all__ = [
    "MemoryBudgetError",
    "MicroBatchSizer",
    "PeakMonitor",
    "budget_bytes",
    "checkpointing_for",
    "plain_tokens_for",
    "gpu_memory_utilization",
    "limit_arenas",
    "hold_freed_memory",
    "release_free_memory",
    "shared_monitor",
    "step_peaks",
]
