"""The store at cluster load: ~1,000 concurrent simulated runners against ``agl store serve``.

Each simulated runner is one asyncio task (spread over ``--processes`` processes) that loops:
dequeue; 1 to 6 rounds of a think time (``--think-s``) and three spans (an agent span with two
children carrying ~6 KB of nested attributes); a reward span; then completion. Idle runners poll
dequeue every ``--poll-s``. By default it talks to the store as ``agl.Runner`` does: an attempt's
spans go in one batch when it ends (the runner's buffer flushes at 64 spans or at the end) and a
heartbeat goes out every ``--heartbeat-s`` (5 s). ``--flush round --heartbeat-s 0`` is the chattier
pattern of an older runner: a heartbeat and a span batch every round, the reward apart.
Against one server on SQLite or PostgreSQL, or ``--servers 2`` sharing one PostgreSQL (runners split
between them). Reports sustained spans/s and rollouts/s over the steady
window (counted by the store, and as acknowledged to the runners), p50/p99 per operation for the calls
started in that window, and where the CPU went in it, as one JSON line: seconds of the servers (their
event loops and database threads, and how long those waited for a core), the runner processes,
PostgreSQL and the rest of the machine (``other``), and per span stored. The runners share the
machine's cores with the server; their spans are copies of pre-validated ones (``--span-build new``
validates each, as a tracer would).

    python benchmarks/store_cluster_load.py --backend sqlite
    python benchmarks/store_cluster_load.py --backend postgresql://postgres@127.0.0.1:5432/test
    python benchmarks/store_cluster_load.py --backend postgresql://postgres@127.0.0.1:5432/test --servers 2

PostgreSQL runs need psycopg: ``pip install -e '.[postgres]'`` (``make install`` has it).

``--py-spy DIR`` records each server with py-spy (``DIR/server-N.txt``, collapsed stacks) for profiling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_throughput import attribute_pool  # noqa: E402

from agl.schemas import AttemptStatus, RolloutCreate, Span  # noqa: E402
from agl.store import LightningStore  # noqa: E402
from agl.testing import free_port  # noqa: E402
from benchmarks import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK")


class Timings:
    """Each call's start (wall clock) and duration, so the summary covers the steady window only."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.acked: list[tuple[float, int]] = []  # (when, spans stored) per add_spans answer

    async def timed(self, name: str, coro: Any) -> Any:
        start, t0 = time.time(), time.perf_counter()
        result = await coro
        self.calls[name].append((start, (time.perf_counter() - t0) * 1000))
        if name == "add_spans":
            self.acked.append((time.time(), len(result)))
        return result


def summary(calls: dict[str, list[tuple[float, float]]], t1: float, t2: float) -> dict[str, Any]:
    """p50/p99 (ms) per operation over the calls started in [t1, t2)."""
    out: dict[str, Any] = {}
    for name, values in sorted(calls.items()):
        ms = sorted(d for start, d in values if t1 <= start < t2)
        if ms:
            out[name] = {
                "p50_ms": round(statistics.median(ms), 1),
                "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1),
                "count": len(ms),
            }
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        return _cpu_s_of(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0


def _postgres_pids() -> list[int]:
    """Every local process named postgres (other clients' queries included, if any run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip().startswith("postgres"):
                    pids.append(int(entry.name))
    return pids


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / _TICK


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """A server's event loop (its main thread) and other threads (the database thread, and for
    PostgreSQL the mostly idle LISTEN thread): CPU seconds, and seconds spent ready to run but waiting
    for a core (``... waiting``: what the machine's other load cost them)."""
    out: dict[str, float] = defaultdict(float)
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                kind = "event loop" if task.name == str(pid) else "db threads"
                out[kind] += _cpu_s_of(task / "stat")
                out[f"{kind} waiting"] += int((task / "schedstat").read_text().split()[1]) / 1e9
    return out


def _cpu_s_of(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _cpu_snapshot(servers: list[int], clients: list[int]) -> dict[str, Any]:
    pg = {pid: _cpu_s(pid) for pid in _postgres_pids()}
    threads: dict[str, float] = defaultdict(float)
    for pid in servers:
        for name, seconds in _thread_cpu_s(pid).items():
            threads[name] += seconds
    return {
        "servers": sum(_cpu_s(p) for p in servers),
        "server_threads": threads,
        "clients": sum(_cpu_s(p) for p in clients),
        "postgres": pg,
        "machine": _machine_busy_s(),
    }


def _cpu_window(a: dict[str, Any], b: dict[str, Any], parent_s: float) -> dict[str, float]:
    """CPU seconds per part between two snapshots; ``other``: the rest of the machine (other processes)."""
    pg = sum(v - a["postgres"].get(pid, 0.0) for pid, v in b["postgres"].items())
    out = {
        "servers": b["servers"] - a["servers"],
        "runners": b["clients"] - a["clients"] + parent_s,
        "postgres": pg,
    }
    out["other"] = max(0.0, b["machine"] - a["machine"] - sum(out.values()))
    for name, seconds in b["server_threads"].items():  # where the servers' CPU went
        out[f"server {name}"] = seconds - a["server_threads"].get(name, 0.0)
    return {k: round(v, 1) for k, v in out.items()}


class SpanMaker:
    """The runner's spans, as ``Span.new`` makes them.

    By default they are copies of templates validated once, with fresh ids and times: the same bytes
    on the wire, but the runner processes, which share the machine's cores with the server, do not
    validate the same 6 KB of attributes again for every span (``--span-build new`` does, as a real
    tracer would on its own machine).
    """

    def __init__(self, pool: list[dict[str, Any]], validate: bool) -> None:
        self.validate = validate
        self.pool = pool
        self.templates = {
            name: [Span.new("ro", "at", name, attributes) for attributes in pool]
            for name in ("llm.call", "tool.call")
        }
        self.templates["agent.step"] = [Span.new("ro", "at", "agent.step", {"round": n}) for n in range(6)]
        self.templates["agl.reward"] = [Span.new("ro", "at", "agl.reward", {"agl.reward.value": 1.0})]

    def make(self, name: str, n: int, rid: str, aid: str, trace: str, parent: str | None = None) -> Span:
        template = self.templates[name][n % len(self.templates[name])]
        if self.validate:
            return Span.new(rid, aid, name, template.attributes, trace_id=trace, parent_id=parent)
        now = time.time_ns()
        update = {"rollout_id": rid, "attempt_id": aid, "trace_id": trace, "span_id": secrets.token_hex(8)}
        return template.model_copy(
            update={**update, "parent_id": parent, "start_time_ns": now, "end_time_ns": now}
        )


async def sim_runner(
    store: LightningStore,
    name: str,
    spans_of: SpanMaker,
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
        beat, buffered = time.monotonic(), []
        for round_no in range(rng.randint(1, 6)):
            if time.monotonic() - beat >= args.heartbeat_s:
                await t.timed("heartbeat", store.heartbeat(rid, aid))
                beat = time.monotonic()
            await asyncio.sleep(args.think_s * (0.5 + rng.random()))
            agent = spans_of.make("agent.step", round_no, rid, aid, trace)
            buffered += [agent] + [
                spans_of.make(child, rng.randrange(len(spans_of.pool)), rid, aid, trace, agent.span_id)
                for child in ("llm.call", "tool.call")
            ]
            if args.flush == "round":
                await t.timed("add_spans", store.add_spans(buffered))
                spans, buffered = spans + len(buffered), []
        buffered.append(spans_of.make("agl.reward", 0, rid, aid, secrets.token_hex(16)))
        await t.timed("add_spans", store.add_spans(buffered))
        await t.timed("complete", store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED))
        rollouts, spans = rollouts + 1, spans + len(buffered)
    return rollouts, spans


def _process(
    urls: list[str], first: int, count: int, args: argparse.Namespace, stop_at: float, out: Any
) -> None:
    from agl.store.client import LightningStoreClient

    async def main() -> None:
        clients = [LightningStoreClient(u, retries=20, backoff_s=0.2) for u in urls]
        spans_of = SpanMaker(attribute_pool(32, first), validate=args.span_build == "new")
        t = Timings()
        results = await asyncio.gather(
            *(
                sim_runner(clients[(first + i) % len(clients)], f"r{first + i}", spans_of, args, t, stop_at)
                for i in range(count)
            )
        )
        for c in clients:
            await c.aclose()
        out.put(
            {
                "rollouts": sum(r for r, _ in results),
                "spans": sum(s for _, s in results),
                "calls": dict(t.calls),
                "acked": t.acked,
            }
        )

    asyncio.run(main())


def _server_pid(server: subprocess.Popen[bytes]) -> int:
    """The server's own pid: under py-spy, its child."""
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children")
    with contextlib.suppress(OSError):
        found = children.read_text().split()
        if found:
            return int(found[0])
    return server.pid


def _drop_schema(url: str) -> None:
    import psycopg

    dsn, _, query = url.partition("?")
    schema = dict(part.split("=", 1) for part in query.split("&"))["schema"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from agl.store.client import LightningStoreClient

    workdir = tempfile.mkdtemp()
    backend = args.backend
    if backend == "sqlite":
        backend = f"sqlite:///{workdir}/cluster.db"
    elif backend.startswith("postgres"):  # a fresh schema per run
        backend += ("&" if "?" in backend else "?") + f"schema=bench_{uuid.uuid4().hex[:8]}"
    ports = [free_port() for _ in range(args.servers)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    servers = []
    for n, port in enumerate(ports):
        command = [sys.executable, "-m", "agl", "store", "serve", "--backend", backend, "--port", str(port)]
        if args.py_spy is not None:
            args.py_spy.mkdir(parents=True, exist_ok=True)
            record = [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--format",
                "raw",
                "--threads",
                "--rate",
                "50",
                "--nonblocking",
            ]
            command = [*record, "-o", str(args.py_spy / f"server-{n}.txt"), "--", *command]
        servers.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        admin = LightningStoreClient(urls[0], retries=100, backoff_s=0.1)
        for u, server in zip(urls, servers, strict=True):
            probe = LightningStoreClient(u, retries=0)  # a refused probe answers False at once
            while not await probe.health():
                if server.poll() is not None:
                    raise SystemExit(f"the store server for {u} exited with {server.returncode}")
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
        server_pids = [_server_pid(s) for s in servers]
        client_pids = [p.pid for p in procs if p.pid is not None]
        await asyncio.sleep(max(0.0, start_at - time.time()) + args.ramp_s)
        cpu1, own1 = _cpu_snapshot(server_pids, client_pids), time.process_time()
        t1 = time.time()  # the statistics call may wait in the server's queue: the window is from before it
        s1 = await admin.statistics()
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        cpu2, own2 = _cpu_snapshot(server_pids, client_pids), time.process_time()
        t2 = time.time()
        s2 = await admin.statistics()
        reports = [await asyncio.to_thread(out.get, True, 600) for _ in procs]
        for proc in procs:
            proc.join()
        await admin.aclose()
    finally:
        for server in servers:
            os.kill(_server_pid(server), signal.SIGTERM)  # under py-spy: the server, so py-spy writes out
            server.wait()
        if backend.startswith("postgres"):  # leave the database as it was
            _drop_schema(backend)
    calls: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for report in reports:
        for name, values in report["calls"].items():
            calls[name] += values
    acked = sum(n for report in reports for when, n in report["acked"] if t1 <= when < t2)
    done = lambda s: s.rollouts_by_status.get("succeeded", 0)  # noqa: E731
    window = t2 - t1
    cpu = _cpu_window(cpu1, cpu2, own2 - own1)
    return {
        "benchmark": "store_cluster_load",
        "backend": args.backend.split("@")[-1],
        "servers": args.servers,
        "runners": args.runners,
        "processes": args.processes,
        "think_s": args.think_s,
        "flush": args.flush,
        "heartbeat_s": args.heartbeat_s,
        "span_build": args.span_build,
        "window_s": round(window, 1),
        "spans_per_s": round((s2.spans - s1.spans) / window, 1),
        "spans_acked_per_s": round(acked / window, 1),
        "rollouts_per_s": round((done(s2) - done(s1)) / window, 1),
        "spans_total": s2.spans - stats0.spans,
        "rollouts_total": sum(r["rollouts"] for r in reports),
        "latency": summary(calls, t1, t2),
        # CPU seconds in the window: what the 2-core machine gave each part, and per 1,000 spans stored
        "cpu_s": cpu,
        "cpu_ms_per_span": {
            k: round(1000 * v / max(1, s2.spans - s1.spans), 3)
            for k, v in cpu.items()
            if k in ("servers", "runners", "postgres")
        },
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
    parser.add_argument(
        "--flush",
        choices=["attempt", "round"],
        default="attempt",
        help="send an attempt's spans when it ends (as agl.Runner does) or every round",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=5.0,
        help="seconds between an attempt's heartbeats (agl.Runner's default); 0: one every round",
    )
    parser.add_argument("--poll-s", type=float, default=1.0, help="an idle runner's dequeue interval")
    parser.add_argument(
        "--startup-s", type=float, default=15.0, help="time allowed for runner processes to start"
    )
    parser.add_argument("--ramp-s", type=float, default=5.0, help="excluded from the steady window")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument(
        "--span-build",
        choices=["copy", "new"],
        default="copy",
        help="runners copy pre-validated spans (copy) or validate each one (new, as Span.new)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON line here")
    parser.add_argument("--py-spy", type=Path, default=None, help="record the servers with py-spy into DIR")
    _results.add_arguments(parser, repeat=True)
    args = parser.parse_args()
    recorder = _results.Recorder("store_cluster_load", args)
    runs = []
    for _ in range(args.repeat):
        runs.append(asyncio.run(run(args)))
        print(json.dumps(runs[-1]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("".join(json.dumps(r) + "\n" for r in runs))
    recorder.save(
        metric="spans_per_s",
        unit=f"spans/s stored, {args.runners:,} runners",
        values=[r["spans_per_s"] for r in runs],
        runs=runs,
        variant=_results.backend_name(args.backend)
        + (f"-{args.servers}-servers" if args.servers > 1 else ""),
    )


if __name__ == "__main__":
    main()
