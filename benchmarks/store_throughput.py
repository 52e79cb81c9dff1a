"""Store throughput: N concurrent simulated runners against one LightningStore backend.

Each runner loops: dequeue; 1-6 rounds (an agent span with two nested child spans carrying ~6 KB of
nested attributes, plus a reward span in half the rounds), then a final span and reward, then
finish the attempt. Attributes come from a pre-generated pool so the store is measured, not the
random generator. Prints one JSON line; ``--json PATH`` also writes it to a file.

    python benchmarks/store_throughput.py --backend memory
    python benchmarks/store_throughput.py --backend sqlite --rollouts 1024 --runners 32
    python benchmarks/store_throughput.py --http --backend sqlite --processes 4   # server + runner processes
    python benchmarks/store_throughput.py --http --backend postgresql://postgres@127.0.0.1:5432/test?schema=bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import secrets
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl.schemas import AttemptStatus, RolloutCreate, Span  # noqa: E402
from agl.store import (  # noqa: E402
    InMemoryLightningStore,
    LightningStore,
    SqliteLightningStore,
    StoreWithReadModel,
    open_store,
)
from benchmarks import _results  # noqa: E402


def attribute_pool(n: int, seed: int, target_bytes: int = 6000) -> list[dict[str, Any]]:
    """Random nested attribute dicts of about ``target_bytes`` each."""
    rng = random.Random(seed)
    pool = []
    for _ in range(n):
        attrs: dict[str, Any] = {}
        size = 0
        while size < target_bytes:
            key = f"k{rng.randrange(10**6)}"
            value = {
                "text": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=rng.randrange(50, 200))),
                "n": rng.random(),
                "list": [rng.randrange(1000) for _ in range(rng.randrange(1, 10))],
            }
            attrs[key] = value
            size += len(json.dumps(value)) + len(key)
        pool.append(attrs)
    return pool


class Timings:
    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = defaultdict(list)

    async def timed(self, name: str, coro: Any) -> Any:
        start = time.perf_counter()
        result = await coro
        self.ms[name].append((time.perf_counter() - start) * 1000)
        return result

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, values in sorted(self.ms.items()):
            values.sort()
            out[name] = {
                "p50_ms": round(statistics.median(values), 3),
                "p99_ms": round(values[min(len(values) - 1, int(len(values) * 0.99))], 3),
                "count": len(values),
            }
        return out


async def runner(
    store: LightningStore,
    name: str,
    pool: list[dict[str, Any]],
    rng: random.Random,
    sleep_s: float,
    t: Timings,
    batch: str = "round",
) -> tuple[int, int]:
    rollouts = spans = 0
    while True:
        claimed = await t.timed("dequeue", store.dequeue(name))
        if claimed is None:
            return rollouts, spans
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        trace = secrets.token_hex(16)
        pending: list[Span] = []
        for round_no in range(rng.randint(1, 6)):
            agent = Span.new(rid, aid, "agent.step", {"round": round_no}, trace_id=trace)
            round_spans = [agent]
            for child in ("llm.call", "tool.call"):
                round_spans.append(
                    Span.new(
                        rid,
                        aid,
                        child,
                        pool[rng.randrange(len(pool))],
                        trace_id=trace,
                        parent_id=agent.span_id,
                    )
                )
            if rng.random() < 0.5:
                round_spans.append(
                    Span.new(rid, aid, "agl.reward", {"agl.reward.value": rng.random()}, trace_id=trace)
                )
            if sleep_s:
                await asyncio.sleep(sleep_s)
            if batch == "round":
                await t.timed("add_spans", store.add_spans(round_spans))
            else:
                pending += round_spans
            spans += len(round_spans)
        final = pending + [
            Span.new(rid, aid, "agent.final", {"answer": "42"}, trace_id=trace),
            Span.new(rid, aid, "agl.reward", {"agl.reward.value": 1.0}, trace_id=trace),
        ]
        await t.timed("add_spans", store.add_spans(final))
        spans += 2
        await t.timed("update_attempt", store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED))
        rollouts += 1


def make_store(backend: str, workdir: str) -> StoreWithReadModel:
    if backend == "memory":
        return InMemoryLightningStore()
    if backend == "sqlite":
        return SqliteLightningStore(Path(workdir) / "bench.db")
    if backend.startswith("postgres"):
        return open_store(backend)
    raise SystemExit(f"unknown --backend {backend!r}; use memory, sqlite or postgresql://...")


def backend_url(backend: str, workdir: str) -> str:
    return {"memory": "memory://", "sqlite": f"sqlite:///{workdir}/bench.db"}.get(backend, backend)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pool = attribute_pool(64, args.seed)
    with tempfile.TemporaryDirectory() as workdir:
        store = make_store(args.backend, workdir)
        await store.enqueue_rollouts([RolloutCreate(input={"i": i}) for i in range(args.rollouts)])
        timings = Timings()
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                runner(
                    store, f"runner-{i}", pool, random.Random(args.seed + i), args.sleep, timings, args.batch
                )
                for i in range(args.runners)
            )
        )
        elapsed = time.perf_counter() - start
        stats = await store.statistics()
        await store.aclose()
    rollouts = sum(r for r, _ in results)
    spans = sum(s for _, s in results)
    assert rollouts == args.rollouts and stats.spans == spans, (rollouts, spans, stats)
    return {
        "benchmark": "store_throughput",
        "mode": "in-process",
        "batch": args.batch,
        "backend": args.backend,
        "rollouts": rollouts,
        "runners": args.runners,
        "sleep_s": args.sleep,
        "seconds": round(elapsed, 3),
        "rollouts_per_s": round(rollouts / elapsed, 1),
        "spans_per_s": round(spans / elapsed, 1),
        "span_bytes": stats.span_bytes,
        "latency": timings.summary(),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _runner_process(
    url: str, first: int, count: int, seed: int, sleep_s: float, batch: str, out: Any, go: Any
) -> None:
    """One runner process: ``count`` async runners against the server; reports counts and latencies.

    It imports, connects and says ready first, then waits for ``go``: the clock measures the store,
    not Python's start-up (reported apart as ``startup_s``).
    """
    from agl.store.client import LightningStoreClient

    async def go_() -> None:
        client = LightningStoreClient(url)
        pool = attribute_pool(64, seed)
        timings = Timings()
        await client.health()
        out.put({"ready": True})
        await asyncio.to_thread(go.wait)
        cpu_at_go = _cpu_s()
        results = await asyncio.gather(
            *(
                runner(
                    client,
                    f"runner-{first + i}",
                    pool,
                    random.Random(seed + first + i),
                    sleep_s,
                    timings,
                    batch,
                )
                for i in range(count)
            )
        )
        await client.aclose()
        out.put(
            {
                "rollouts": sum(r for r, _ in results),
                "spans": sum(s for _, s in results),
                "ms": dict(timings.ms),
                "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "cpu_s": _cpu_s() - cpu_at_go,
            }
        )

    asyncio.run(go_())


async def run_http(args: argparse.Namespace) -> dict[str, Any]:
    import socket
    import subprocess

    import psutil

    from agl.store.client import LightningStoreClient

    with tempfile.TemporaryDirectory() as workdir:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agl",
                "store",
                "serve",
                "--backend",
                backend_url(args.backend, workdir),
                "--port",
                str(port),
            ],
            cwd=Path(__file__).resolve().parents[1],
        )
        client = LightningStoreClient(url, retries=50, backoff_s=0.1)
        while not await client.health():
            await asyncio.sleep(0.1)
        server_proc = psutil.Process(server.pid)
        waves: list[dict[str, Any]] = []
        began = time.perf_counter()
        while True:  # one wave, or waves until --duration-s has passed (memory must stay flat)
            waves.append(await _wave(client, url, args, server_proc))
            if time.perf_counter() - began >= args.duration_s:
                break
        stats = await client.statistics()
        await client.aclose()
        server.terminate()
        server.wait()
    reports = [r for wave in waves for r in wave["reports"]]
    elapsed = sum(wave["seconds"] for wave in waves)
    timings = Timings()
    for report in reports:
        for name, values in report["ms"].items():
            timings.ms[name] += values
    rollouts = sum(r["rollouts"] for r in reports)
    spans = sum(r["spans"] for r in reports)
    assert rollouts == args.rollouts * len(waves) and stats.spans == spans, (rollouts, spans, stats)
    peak_server_rss = max(wave["server_peak_rss_mb"] for wave in waves)
    return {
        "benchmark": "store_throughput",
        "mode": "http",
        "backend": args.backend,
        "rollouts": rollouts,
        "runners": args.runners,
        "processes": args.processes,
        "batch": args.batch,
        "sleep_s": args.sleep,
        "seconds": round(elapsed, 3),
        "rollouts_per_s": round(rollouts / elapsed, 1),
        "spans_per_s": round(spans / elapsed, 1),
        "latency": timings.summary(),
        "server_peak_rss_mb": round(peak_server_rss, 1),
        "runners_rss_mb_total": round(sum(r["rss_mb"] for r in waves[-1]["reports"]), 1),
        "runner_startup_s": round(max(wave["startup_s"] for wave in waves), 2),
        "server_cpu_s": round(sum(wave["server_cpu_s"] for wave in waves), 2),
        "runners_cpu_s": round(sum(r["cpu_s"] for r in reports), 2),
        "waves": len(waves),
        "server_rss_mb_by_wave": [round(w["server_peak_rss_mb"], 1) for w in waves],
        "rollouts_per_s_by_wave": [round(args.rollouts / w["seconds"], 1) for w in waves],
    }


async def _wave(client: Any, url: str, args: argparse.Namespace, server_proc: Any) -> dict[str, Any]:
    """Enqueue ``--rollouts``, run the runner processes until the queue is empty, report."""
    import multiprocessing as mp

    await client.enqueue_rollouts([RolloutCreate(input={"i": i}) for i in range(args.rollouts)])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Event()
    per = [
        args.runners // args.processes + (1 if i < args.runners % args.processes else 0)
        for i in range(args.processes)
    ]
    procs = [
        ctx.Process(
            target=_runner_process,
            args=(url, sum(per[:i]), n, args.seed, args.sleep, args.batch, out, go),
        )
        for i, n in enumerate(per)
    ]
    launched = time.perf_counter()
    for proc in procs:
        proc.start()
    for _ in procs:
        await asyncio.to_thread(out.get, True, 120)
    peak = 0.0
    cpu_before = sum(server_proc.cpu_times()[:2])
    start = time.perf_counter()
    go.set()
    reports: list[dict[str, Any]] = []
    while len(reports) < len(procs):
        try:
            reports.append(await asyncio.to_thread(out.get, True, 0.5))
        except Exception:
            pass
        peak = max(peak, server_proc.memory_info().rss / 2**20)
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join()
    server_cpu = sum(server_proc.cpu_times()[:2]) - cpu_before
    return {
        "reports": reports,
        "seconds": elapsed,
        "startup_s": start - launched,
        "server_peak_rss_mb": peak,
        "server_cpu_s": server_cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="memory", help="memory, sqlite or postgresql://...")
    parser.add_argument(
        "--http", action="store_true", help="run a store server and runner processes over HTTP"
    )
    parser.add_argument("--processes", type=int, default=4, help="runner processes (with --http)")
    parser.add_argument(
        "--duration-s",
        type=float,
        default=0.0,
        help="with --http: repeat waves this long and report RSS per wave",
    )
    parser.add_argument(
        "--batch",
        choices=["round", "rollout"],
        default="round",
        help="send each round's spans at once, or a rollout's spans in one batch at its end (as agl's Runner does)",
    )
    parser.add_argument("--rollouts", type=int, default=1024)
    parser.add_argument("--runners", type=int, default=32)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds an agent sleeps per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON line(s) here")
    _results.add_arguments(parser, repeat=True)
    args = parser.parse_args()
    recorder = _results.Recorder("store_throughput", args)
    runs = []
    for _ in range(args.repeat):
        result = asyncio.run(run_http(args) if args.http else run(args))
        print(json.dumps(result), flush=True)
        runs.append(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("".join(json.dumps(r) + "\n" for r in runs))
    recorder.save(
        metric="rollouts_per_s",
        unit="rollouts/s",
        values=[r["rollouts_per_s"] for r in runs],
        runs=runs,
        variant=("http-" if args.http else "") + _results.backend_name(args.backend),
    )


if __name__ == "__main__":
    main()
