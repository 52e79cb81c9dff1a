"""agentlightning 0.3.0's side of ``store_user_path.py``: the same agent work through its own stack.

Runs in the interpreter ``scripts/setup_agentlightning.sh`` makes (agentlightning pinned with the
dependencies of its release date); imports nothing of agl. Its ``agl store`` server (in-memory, its
default), its ``LightningStoreClient``, and one ``LitAgentRunner`` with an ``OtelTracer`` per process:
agentlightning lets a process hold one active trace at a time, so its 32 runners are 32 processes.
Prints one JSON line, in the fields agl's side reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _user_path_agent import cpu_s, free_port, work  # noqa: E402


def _runner_process(url: str, index: int, out: Any, go: Any, stop: Any) -> None:
    import agentlightning as al
    from opentelemetry import trace

    counted = {"otel_spans": 0}

    class Agent(al.LitAgent[dict[str, Any]]):
        async def rollout_async(self, task: dict[str, Any], resources: Any, rollout: Any) -> None:
            spans = await work(task, trace.get_tracer("bench"), al.emit_reward)
            counted["otel_spans"] += spans

    async def main() -> None:
        client = al.LightningStoreClient(url)
        runner = al.LitAgentRunner(al.OtelTracer(), poll_interval=0.5, heartbeat_interval=10.0)
        with runner.run_context(agent=Agent(), store=client, worker_id=index):
            out.put({"ready": index})
            await asyncio.to_thread(go.wait)
            cpu = cpu_s()
            await runner.iter(event=stop)
            out.put({"cpu_s": cpu_s() - cpu, **counted})
        await client.close()

    asyncio.run(main())


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    import agentlightning as al
    import psutil
    from agentlightning.execution.events import MultiprocessingEvent
    from agentlightning.types import EnqueueRolloutRequest, PromptTemplate

    port = free_port()
    agl_cli = Path(sys.executable).parent / "agl"
    server = subprocess.Popen(
        [str(agl_cli), "store", "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # until the server answers: its client logs every refused connection
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/v1/agl/health", timeout=5).close()
                break
            await asyncio.sleep(0.2)
        client = al.LightningStoreClient(url)
        await client.add_resources({"prompt": PromptTemplate(template="{x}", engine="f-string")})
        rollouts = await client.enqueue_many_rollouts(
            [EnqueueRolloutRequest(input={"i": i}, mode="train") for i in range(args.tasks)]
        )
        ids = [r.rollout_id for r in rollouts]
        ctx = mp.get_context("spawn")
        # one set() of ``stop`` stops every runner
        out, go, stop = ctx.Queue(), ctx.Event(), MultiprocessingEvent(ctx=ctx)
        procs = [
            ctx.Process(target=_runner_process, args=(url, i, out, go, stop)) for i in range(args.runners)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            await asyncio.to_thread(out.get, True, 600)
        server_proc = psutil.Process(server.pid)
        server_cpu = sum(server_proc.cpu_times()[:2])
        start = time.perf_counter()
        go.set()
        finished: list[Any] = []
        while len(finished) < len(ids):  # its client allows only waits under 0.1 s: a poll
            await asyncio.sleep(0.25)
            finished = await client.wait_for_rollouts(rollout_ids=ids, timeout=0)
        elapsed = time.perf_counter() - start
        server_cpu = sum(server_proc.cpu_times()[:2]) - server_cpu
        stop.set()
        reports = [await asyncio.to_thread(out.get, True, 120) for _ in procs]
        for proc in procs:
            proc.join(30)
        succeeded = sum(1 for r in finished if r.status == "succeeded")
        stored = int((await client.statistics()).get("total_spans", 0))
        await client.close()
    finally:
        server.terminate()
        server.wait()
    otel = sum(r["otel_spans"] for r in reports)
    runner_cpu = sum(r["cpu_s"] for r in reports)
    assert succeeded == args.tasks, f"{succeeded} of {args.tasks} rollouts succeeded"
    assert stored == otel + args.tasks, f"{stored} spans stored of {otel} OTel spans and {args.tasks} rewards"
    return {
        "benchmark": "store_user_path",
        "side": "agentlightning 0.3.0",
        "backend": "memory (agentlightning's `agl store`)",
        "tasks": args.tasks,
        "runners": args.runners,
        "processes": args.runners,
        "seconds": round(elapsed, 2),
        "rollouts_per_s": round(args.tasks / elapsed, 1),
        "otel_spans": otel,
        "stored_spans": stored,
        "runner_cpu_ms_per_rollout": round(1000 * runner_cpu / args.tasks, 2),
        "runner_cpu_ms_per_otel_span": round(1000 * runner_cpu / max(otel, 1), 3),
        "server_cpu_ms_per_span": round(1000 * server_cpu / max(stored, 1), 3),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=1024)
    parser.add_argument("--runners", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(one_run(args))), flush=True)


if __name__ == "__main__":
    main()
