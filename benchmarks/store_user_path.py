"""The user's path through the store: Agent Lightning's store scenario written the way a user writes it.

1,024 tasks; 32 runners in 4 processes (``agl.Runner`` with ``max_concurrency=8`` each) running an
``@agl.rollout`` agent against ``agl store serve`` over HTTP. Per rollout, 1 to 6 rounds; each round
is an OpenTelemetry span from agl's tracer provider with two child spans, each carrying a freshly
generated nested attribute dict of about 6 KB (flattened to dotted keys, as OTel attributes must
be); then rewards (``agl.emit_reward``) and a final span. Reports rollouts/s and the runner
processes' CPU per OTel span, as one JSON line per run: in all, the agent's own share (the same work
on a bare OTel SDK provider, measured in each runner before the run) and agl's share (the rest).

``--agentlightning`` runs agentlightning 0.3.0 through the same agent work in each repeat, the sides
alternating (``_agentlightning_side.py``: its own ``agl store`` server, client, runner and OTel tracer,
one runner a process as it allows one active trace a process), and reports the ratio of the medians.
``bash scripts/setup_agentlightning.sh`` installs it with the dependencies of its release date.

    python benchmarks/store_user_path.py --backend sqlite
    python benchmarks/store_user_path.py --backend memory --repeat 3
    python benchmarks/store_user_path.py --backend sqlite --repeat 3 --agentlightning
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AGENTLIGHTNING_PYTHON = ROOT / ".venv-agentlightning" / "bin" / "python"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _user_path_agent import cpu_s, free_port, work  # noqa: E402

from agl.schemas import RolloutCreate  # noqa: E402
from benchmarks import _results  # noqa: E402


def _runner_process(url: str, index: int, concurrency: int, out: Any, go: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    import agl
    from agl.store.client import LightningStoreClient
    from agl.tracer import tracer_provider

    tracer = tracer_provider().get_tracer("bench")
    counted = {"otel_spans": 0}

    @agl.rollout
    async def agent(task: dict[str, Any]) -> None:
        # not `counted[...] += await work(...)`: that reads the count before the await and loses updates
        spans = await work(task, tracer, agl.emit_reward)
        counted["otel_spans"] += spans

    async def own_cost(samples: int = 64) -> tuple[float, int]:
        """CPU of the same work on a bare OTel SDK provider, outside agl: what the user's code costs alone."""
        bare = TracerProvider().get_tracer("bare")
        cpu, spans = cpu_s(), 0
        for i in range(samples):
            spans += await work({"i": 10**6 + i}, bare, lambda _: None)
        return cpu_s() - cpu, spans

    async def main() -> None:
        client = LightningStoreClient(url)
        runner = agl.Runner(agent, client, max_concurrency=concurrency, handle_signals=False)
        await client.health()
        await own_cost(8)  # warm up
        own_s, own_spans = await own_cost()
        out.put({"ready": index})
        await asyncio.to_thread(go.wait)
        cpu = cpu_s()
        outcomes = await runner.run(stop_when_idle=True)
        report = {"rollouts": len(outcomes), "cpu_s": cpu_s() - cpu, "own_s": own_s, "own_spans": own_spans}
        out.put({**report, **counted})
        await client.aclose()

    asyncio.run(main())


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    from agl.store.client import LightningStoreClient

    workdir = tempfile.mkdtemp()
    backend = {"memory": "memory://", "sqlite": f"sqlite:///{workdir}/user.db"}.get(
        args.backend, args.backend
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "agl", "store", "serve", "--backend", backend, "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        client = LightningStoreClient(url, retries=100, backoff_s=0.1)
        while not await client.health():
            await asyncio.sleep(0.2)
        await client.enqueue_rollouts([RolloutCreate(input={"i": i}) for i in range(args.tasks)])
        ctx = mp.get_context("spawn")
        out, go = ctx.Queue(), ctx.Event()
        per = args.runners // args.processes
        procs = [
            ctx.Process(target=_runner_process, args=(url, i, per, out, go)) for i in range(args.processes)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            await asyncio.to_thread(out.get, True, 300)
        server_proc = psutil.Process(server.pid)
        server_cpu = sum(server_proc.cpu_times()[:2])
        start = time.perf_counter()
        go.set()
        reports = [await asyncio.to_thread(out.get, True, 1200) for _ in procs]
        elapsed = time.perf_counter() - start
        server_cpu = sum(server_proc.cpu_times()[:2]) - server_cpu
        for proc in procs:
            proc.join()
        stats = await client.statistics()
        await client.aclose()
    finally:
        server.terminate()
        server.wait()
    rollouts = sum(r["rollouts"] for r in reports)
    otel = sum(r["otel_spans"] for r in reports)
    runner_cpu = sum(r["cpu_s"] for r in reports)
    own_per_span = sum(r["own_s"] for r in reports) / sum(r["own_spans"] for r in reports)
    assert rollouts == args.tasks and stats.rollouts_by_status.get("succeeded") == args.tasks, (
        rollouts,
        stats,
    )
    return {
        "benchmark": "store_user_path",
        "side": "agl",
        "backend": args.backend,
        "tasks": args.tasks,
        "runners": args.runners,
        "processes": args.processes,
        "seconds": round(elapsed, 2),
        "rollouts_per_s": round(rollouts / elapsed, 1),
        "otel_spans": otel,
        "stored_spans": stats.spans,
        "runner_cpu_ms_per_rollout": round(1000 * runner_cpu / rollouts, 2),
        "runner_cpu_ms_per_otel_span": round(1000 * runner_cpu / otel, 3),
        # the agent's own work on a bare OTel SDK (attribute making, the SDK's spans), measured in each runner
        "agent_own_cpu_ms_per_otel_span": round(1000 * own_per_span, 3),
        "agl_runner_cpu_ms_per_otel_span": round(1000 * (runner_cpu / otel - own_per_span), 3),
        "server_cpu_ms_per_span": round(1000 * server_cpu / max(stats.spans, 1), 3),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }


def agentlightning_run(args: argparse.Namespace) -> dict[str, Any]:
    """One run of agentlightning 0.3.0's side (``_agentlightning_side.py``) in its own interpreter."""
    command = [str(args.agentlightning_python), str(ROOT / "benchmarks" / "_agentlightning_side.py")]
    command += ["--tasks", str(args.tasks), "--runners", str(args.runners)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"agentlightning's side failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="sqlite", help="memory, sqlite or postgresql://...")
    parser.add_argument("--tasks", type=int, default=1024)
    parser.add_argument("--runners", type=int, default=32)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--reference", type=float, default=12.2, help="agentlightning 0.3.0's published rollouts/s"
    )
    parser.add_argument(
        "--agentlightning",
        action="store_true",
        help="also run agentlightning 0.3.0's side in each repeat, the two sides alternating "
        "(needs `bash scripts/setup_agentlightning.sh`)",
    )
    parser.add_argument("--agentlightning-python", type=Path, default=AGENTLIGHTNING_PYTHON)
    _results.add_arguments(parser)
    args = parser.parse_args()
    if args.agentlightning and not args.agentlightning_python.exists():
        parser.error(
            f"agentlightning's side needs {args.agentlightning_python}: run "
            "`bash scripts/setup_agentlightning.sh` (makes .venv-agentlightning) or pass --agentlightning-python"
        )
    recorder = _results.Recorder("store_user_path", args)
    runs, theirs = [], []
    for n in range(args.repeat):
        sides = ["agl", "agentlightning"] if args.agentlightning else ["agl"]
        for side in sides if n % 2 == 0 else reversed(sides):
            if side == "agl":
                result = asyncio.run(one_run(args))
                runs.append(result)
            else:
                result = agentlightning_run(args)
                theirs.append(result)
            print(json.dumps(result), flush=True)
    median = statistics.median(r["rollouts_per_s"] for r in runs)
    summary = {"median_rollouts_per_s": median, "vs_reference": round(median / args.reference, 2)}
    if theirs:
        their_median = statistics.median(r["rollouts_per_s"] for r in theirs)
        summary["agentlightning_median_rollouts_per_s"] = their_median
        summary["vs_agentlightning_same_run"] = round(median / their_median, 2)
    print(json.dumps(summary))
    recorder.save(
        metric="rollouts_per_s",
        unit="rollouts/s",
        values=[r["rollouts_per_s"] for r in runs],
        runs=runs + theirs,
        summary=summary,
        variant=_results.backend_name(args.backend) + ("-vs-agentlightning" if theirs else ""),
    )


if __name__ == "__main__":
    main()
