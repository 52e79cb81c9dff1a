"""The store at cluster load: ~1,000 concurrent simulated runners against ``agl store serve``.

Each simulated runner is one asyncio task (spread over ``--processes`` processes) that loops:
dequeue; per round a heartbeat, a think time (``--think-s``) and a batch of spans (an agent span
with two children carrying ~6 KB of nested attributes); then completion. Idle runners poll dequeue
every ``--poll-s``. Against one server on SQLite or PostgreSQL, or ``--servers 2`` sharing one
PostgreSQL (runners split between them). Reports sustained spans/s and rollouts/s over the steady
window and p50/p99 per operation, as one JSON line.

    python benchmarks/store_cluster_load.py --backend sqlite
    python benchmarks/store_cluster_load.py --backend postgresql://postgres@127.0.0.1:5432/test
    python benchmarks/store_cluster_load.py --backend postgresql://postgres@127.0.0.1:5432/test --servers 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_throughput import Timings, attribute_pool  # noqa: E402

from agl.schemas import AttemptStatus, RolloutCreate, Span  # noqa: E402
from agl.store import LightningStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


async def sim_runner(
    store: LightningStore,
    name: str,
    pool: list[dict[str, Any]],
    args: argparse.Namespace,
    t: Timings,
    stop_at: float,
) -> tuple[int, int]:
    """One simulated runner until ``stop_at`` (wall clock): returns (rollouts finished, spans sent)."""
    rng = random.Random(name)
    rollouts = spans = 0
    await asyncio.sleep(rng.random() * args.think_s)  # spread the start
    while time.time() < stop_at:
        claimed = await t.timed("dequeue", store.dequeue(name))
        if claimed is None:
            await asyncio.sleep(args.poll_s)
            continue
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        trace = secrets.token_hex(16)
        for round_no in range(rng.randint(1, 6)):
            await t.timed("heartbeat", store.heartbeat(rid, aid))
            await asyncio.sleep(args.think_s * (0.5 + rng.random()))
            agent = Span.new(rid, aid, "agent.step", {"round": round_no}, trace_id=trace)
            batch = [agent] + [
                Span.new(
                    rid, aid, child, pool[rng.randrange(len(pool))], trace_id=trace, parent_id=agent.span_id
                )
                for child in ("llm.call", "tool.call")
            ]
            await t.timed("add_spans", store.add_spans(batch))
            spans += len(batch)
        await t.timed(
            "add_spans", store.add_spans([Span.new(rid, aid, "agl.reward", {"agl.reward.value": 1.0})])
        )
        await t.timed("complete", store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED))
        rollouts, spans = rollouts + 1, spans + 1
    return rollouts, spans


def _process(
    urls: list[str], first: int, count: int, args: argparse.Namespace, stop_at: float, out: Any
) -> None:
    from agl.store.client import LightningStoreClient

    async def main() -> None:
        clients = [LightningStoreClient(u, retries=20, backoff_s=0.2) for u in urls]
        pool = attribute_pool(32, first)
        t = Timings()
        results = await asyncio.gather(
            *(
                sim_runner(clients[(first + i) % len(clients)], f"r{first + i}", pool, args, t, stop_at)
                for i in range(count)
            )
        )
        for c in clients:
            await c.aclose()
        out.put(
            {"rollouts": sum(r for r, _ in results), "spans": sum(s for _, s in results), "ms": dict(t.ms)}
        )

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from agl.store.client import LightningStoreClient

    workdir = tempfile.mkdtemp()
    backend = args.backend
    if backend == "sqlite":
        backend = f"sqlite:///{workdir}/cluster.db"
    elif backend.startswith("postgres"):  # a fresh schema per run
        backend += ("&" if "?" in backend else "?") + f"schema=bench_{uuid.uuid4().hex[:8]}"
    ports = [_free_port() for _ in range(args.servers)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "agl", "store", "serve", "--backend", backend, "--port", str(p)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        for p in ports
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        admin = LightningStoreClient(urls[0], retries=100, backoff_s=0.1)
        for u in urls:
            probe = LightningStoreClient(u, retries=100, backoff_s=0.1)
            while not await probe.health():
                await asyncio.sleep(0.2)
            await probe.aclose()
        for first in range(0, args.rollouts, 5000):  # the server takes at most 10,000 per request
            chunk = range(first, min(first + 5000, args.rollouts))
            await admin.enqueue_rollouts([RolloutCreate(input={"i": i}) for i in chunk])
        stats0 = await admin.statistics()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        per = [
            args.runners // args.processes + (i < args.runners % args.processes)
            for i in range(args.processes)
        ]
        start_at = time.time() + args.startup_s
        stop_at = start_at + args.duration_s
        procs = [
            ctx.Process(target=_process, args=(urls, sum(per[:i]), n, args, stop_at, out))
            for i, n in enumerate(per)
        ]
        for proc in procs:
            proc.start()
        # the steady window: from after start-up and ramp to the stop time, counted by the store itself
        await asyncio.sleep(max(0.0, start_at - time.time()) + args.ramp_s)
        s1, t1 = await admin.statistics(), time.time()
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        s2, t2 = await admin.statistics(), time.time()
        reports = [await asyncio.to_thread(out.get, True, 600) for _ in procs]
        for proc in procs:
            proc.join()
        await admin.aclose()
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    timings = Timings()
    for report in reports:
        for name, values in report["ms"].items():
            timings.ms[name] += values
    done = lambda s: s.rollouts_by_status.get("succeeded", 0)  # noqa: E731
    window = t2 - t1
    return {
        "benchmark": "store_cluster_load",
        "backend": args.backend.split("@")[-1],
        "servers": args.servers,
        "runners": args.runners,
        "processes": args.processes,
        "think_s": args.think_s,
        "window_s": round(window, 1),
        "spans_per_s": round((s2.spans - s1.spans) / window, 1),
        "rollouts_per_s": round((done(s2) - done(s1)) / window, 1),
        "spans_total": s2.spans - stats0.spans,
        "rollouts_total": sum(r["rollouts"] for r in reports),
        "latency": timings.summary(),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="sqlite", help="sqlite or postgresql://...")
    parser.add_argument(
        "--servers", type=int, default=1, help="store servers sharing the backend (PostgreSQL)"
    )
    parser.add_argument("--runners", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument(
        "--rollouts", type=int, default=20_000, help="queued up front; more than the run finishes"
    )
    parser.add_argument("--think-s", type=float, default=1.0, help="mean agent time per round")
    parser.add_argument("--poll-s", type=float, default=1.0, help="an idle runner's dequeue interval")
    parser.add_argument(
        "--startup-s", type=float, default=15.0, help="time allowed for runner processes to start"
    )
    parser.add_argument("--ramp-s", type=float, default=5.0, help="excluded from the steady window")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON line here")
    args = parser.parse_args()
    line = json.dumps(asyncio.run(run(args)))
    print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
