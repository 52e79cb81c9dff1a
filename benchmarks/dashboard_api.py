"""Dashboard API latency on a large store: a 50-row rollouts page must answer in under 50 ms.

Builds a SQLite store of ``--rollouts`` finished rollouts (each: one gateway-style LLM call span with
token ids, one reward span; a few failed ones with an exception span) through the store API, serves
the dashboard over it in process (ASGI, no sockets: the figure is the dashboard and the store, not the
network), and reports the median and p90 of repeated calls per route after one first call (its time
is reported apart as ``first_ms``). Searches, sorts and filters are answered by the store in SQL on
every call; the ``varied`` rows change the query on every call (a new search text, a new group filter).

Before that, two cold starts (a new store object and dashboard over the same file, as after a restart):
``cold first search`` is a search as the very first call (nothing read yet); ``cold page`` is the
default page as the page opens, then the same page called back to back for ``--cold-s`` seconds
(median and p90 of those calls), then the first search.

The process collects garbage as ``agl store serve`` and ``agl dashboard`` do (``tune_gc_for_serving``:
the startup heap frozen, a larger young-generation threshold); ``--gc default`` measures with Python's
own settings instead (a dashboard mounted in a process that does not tune them), in a result of its own.

    python benchmarks/dashboard_api.py --rollouts 10000 --repeats 30 --json out.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from agl import semconv as sc  # noqa: E402
from agl.asgi_server import tune_gc_for_serving  # noqa: E402
from agl.dashboard import create_dashboard  # noqa: E402
from agl.schemas import AttemptStatus, RolloutCreate, Span  # noqa: E402
from agl.store import SqliteLightningStore  # noqa: E402
from benchmarks import _results  # noqa: E402


async def build(store: SqliteLightningStore, n: int, batch: int = 500) -> None:
    """``n`` rollouts in groups of 4 over 10 resources versions, finished through the store API."""
    versions = [
        (await store.add_resources({}, metadata={"model_version": f"v{i}"})).resources_id for i in range(10)
    ]
    for start in range(0, n, batch):
        creates = [
            RolloutCreate(
                input={"question": f"task {i // 4}: what is {i % 97} + {i % 13}?"},
                mode="train" if i % 10 else "val",
                resources_id=versions[(i * 10) // n],
                group_id=f"gr-{i // 4}",
                metadata={"step": (i * 10) // n + 1},
            )
            for i in range(start, min(start + batch, n))
        ]
        await store.enqueue_rollouts(creates)
        spans: list[Span] = []
        finished: list[tuple[str, str, bool]] = []
        for i in range(start, min(start + batch, n)):
            claimed = await store.dequeue("bench-worker")
            assert claimed is not None
            rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
            failed = i % 50 == 0
            call = {
                sc.LLM_API: "chat.completions",
                sc.LLM_SOURCE: "gateway",
                sc.LLM_MODEL: "policy",
                sc.LLM_REQUEST_MESSAGES: [{"role": "user", "content": f"what is {i % 97} + {i % 13}?"}],
                sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": f"the answer is {i % 97 + i % 13}"},
                sc.LLM_PROMPT_TOKEN_IDS: list(range(40)),
                sc.LLM_COMPLETION_TOKEN_IDS: list(range(12)),
                sc.LLM_LOGPROBS: [-0.5] * 12,
                sc.LLM_USAGE: {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
                sc.LLM_RESPONSE_ID: f"chatcmpl-{i}",
                sc.LLM_MODEL_VERSION: "v0",
            }
            spans.append(Span.new(rid, aid, sc.SPAN_LLM_CALL, call))
            if failed:
                spans.append(
                    Span.new(
                        rid,
                        aid,
                        sc.SPAN_EXCEPTION,
                        {sc.EXCEPTION_TYPE: "ValueError", sc.EXCEPTION_MESSAGE: "x"},
                    )
                )
            else:
                reward = {sc.REWARD_VALUE: (i % 7) / 6, sc.AGENT_NAME: "bench-agent"}
                spans.append(Span.new(rid, aid, sc.SPAN_REWARD, reward))
            finished.append((rid, aid, failed))
        await store.add_spans(spans)
        for rid, aid, failed in finished:
            status = AttemptStatus.FAILED if failed else AttemptStatus.SUCCEEDED
            await store.update_attempt(rid, aid, status=status)


def _summary(path: str, first: float, times: list[float]) -> dict[str, Any]:
    times = sorted(times)
    return {
        "path": path,
        "first_ms": round(first, 2),
        "median_ms": round(statistics.median(times), 2) if times else None,
        "p90_ms": round(times[max(int(len(times) * 0.9) - 1, 0)], 2) if times else None,
        "calls": len(times),
    }


async def timed_get(client: httpx.AsyncClient, path: str) -> float:
    started = time.perf_counter()
    response = await client.get(path)
    assert response.status_code == 200, response.text
    return (time.perf_counter() - started) * 1000


async def measure_cold(db: Path, cold_s: float) -> list[dict[str, Any]]:
    """The cold first search, and the default page after opening (see the module's doc).
    The cold search also reports the process's CPU time for it (``cpu_ms``, all threads): on a loaded
    machine the wall time is mostly waiting for a core."""
    out = []
    search = "/ui/api/rollouts?limit=50&q=task%2012:"
    store = SqliteLightningStore(str(db))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(create_dashboard(store)), base_url="http://bench"
    ) as client:
        cpu = time.process_time()
        wall = await timed_get(client, search)
        out.append(_summary("cold first search: " + search, wall, []))
        out[-1]["cpu_ms"] = round((time.process_time() - cpu) * 1000, 1)
    await store.aclose()
    store = SqliteLightningStore(str(db))
    path = "/ui/api/rollouts?limit=50"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(create_dashboard(store)), base_url="http://bench"
    ) as client:
        first = await timed_get(client, path)
        times = []
        until = time.perf_counter() + cold_s
        while time.perf_counter() < until:
            times.append(await timed_get(client, path))
        out.append(_summary(f"cold page, first {cold_s:g} s: " + path, first, times))
        out.append(
            _summary(f"first search after {cold_s:g} s: " + search, await timed_get(client, search), [])
        )
    await store.aclose()
    return out


async def measure(client: httpx.AsyncClient, path: str, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    first = await client.get(path)
    assert first.status_code == 200, first.text
    warm_ms = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        response = await client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
    times.sort()
    return {
        "path": path,
        "first_ms": round(warm_ms, 2),
        "median_ms": round(statistics.median(times), 2),
        "p90_ms": round(times[int(len(times) * 0.9) - 1], 2),
    }


async def measure_varied(client: httpx.AsyncClient, template: str, repeats: int) -> dict[str, Any]:
    """Like :func:`measure`, with ``{k}`` in ``template`` replaced by a new number on every call."""
    times = []
    for k in range(repeats + 1):
        started = time.perf_counter()
        response = await client.get(template.format(k=k + 100))
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.text
    first, times = times[0], sorted(times[1:])
    return {
        "path": template + " (varied)",
        "first_ms": round(first, 2),
        "median_ms": round(statistics.median(times), 2),
        "p90_ms": round(times[int(len(times) * 0.9) - 1], 2),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "bench.db"
        if not db.exists():
            store = SqliteLightningStore(str(db))
            started = time.perf_counter()
            await build(store, args.rollouts)
            print(f"built {args.rollouts} rollouts in {time.perf_counter() - started:.1f} s", file=sys.stderr)
            await store.aclose()
        results = []
        for result in await measure_cold(db, args.cold_s):
            result["rollouts"] = args.rollouts
            results.append(result)
            print(json.dumps(result))
        store = SqliteLightningStore(str(db))
        app = create_dashboard(store)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            page = (await client.get("/ui/api/rollouts", params={"limit": 50})).json()
            some = page["items"][0]
            paths = [
                "/ui/api/rollouts?limit=50",  # the default page (the store pages)
                "/ui/api/rollouts?limit=50&status=succeeded&mode=train",
                f"/ui/api/rollouts?limit=50&cursor={page['next_cursor']}",
                f"/ui/api/rollouts/{some['rollout_id']}",
                "/ui/api/summary",
                # search and other sorts look through every rollout (the store, in SQL)
                "/ui/api/rollouts?limit=50&sort=reward",
                "/ui/api/rollouts?limit=50&q=task%2012:",
                f"/ui/api/groups/{some['group_id']}",
                # what changed: every val rollout's digest of two versions, and one task across versions
                "/ui/api/changes",
                f"/ui/api/rollouts/{some['rollout_id']}/task",
            ]
            for path in paths:
                result = await measure(client, path, args.repeats)
                result["rollouts"] = args.rollouts
                results.append(result)
                print(json.dumps(result))
            for template in (
                "/ui/api/rollouts?limit=50&q=task%20{k}:",
                "/ui/api/rollouts?limit=50&sort=reward&group_id=gr-{k}",
            ):
                result = await measure_varied(client, template, args.repeats)
                result["rollouts"] = args.rollouts
                results.append(result)
                print(json.dumps(result))
        await store.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--cold-s", type=float, default=3.0, help="seconds of default pages after opening")
    parser.add_argument("--db", type=Path, default=None, help="reuse this store file (built when missing)")
    parser.add_argument(
        "--gc",
        choices=["serving", "default"],
        default="serving",
        help="garbage collection as agl store serve / agl dashboard set it (serving), or Python's defaults",
    )
    _results.add_arguments(parser, repeat=True)
    args = parser.parse_args()
    if args.gc == "serving":
        tune_gc_for_serving()
    recorder = _results.Recorder("dashboard_api", args)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.db is None and args.repeat > 1:
            args.db = Path(tmp) / "bench.db"  # built once, measured ``--repeat`` times
        for _ in range(args.repeat):
            runs.append({"routes": asyncio.run(main_async(args))})
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for run in runs for r in run["routes"]))
    page = "/ui/api/rollouts?limit=50"
    recorder.save(
        metric="page_median_ms",
        unit=f"ms, {page}, {args.rollouts:,} rollouts",
        values=[next(r["median_ms"] for r in run["routes"] if r["path"] == page) for run in runs],
        runs=runs,
        summary={  # per route, the median over repeats of each repeat's median and p90
            stat: {
                path: round(
                    statistics.median(
                        next(r[stat] for r in run["routes"] if r["path"] == path) for run in runs
                    ),
                    2,
                )
                for path in [r["path"] for r in runs[0]["routes"] if r["median_ms"] is not None]
            }
            for stat in ("median_ms", "p90_ms")
        },
        better="lower",
        variant="" if args.gc == "serving" else "gc-default",
    )


if __name__ == "__main__":
    main()
