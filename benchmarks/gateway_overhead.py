"""Gateway overhead: latency added per call and max requests/s, vs calling the upstream directly.

Three processes: the scripted upstream (:class:`tests.support.openai_upstream.OpenAIUpstream`), the gateway
(in front of it, recording every call into an in-memory store through a rollout-scoped URL), and this
one, whose clients are asyncio tasks, one keep-alive connection each, speaking raw HTTP/1.1 (httpx's
client costs more than the gateway and collapses at 32 concurrent requests, see encode/httpx#3215). Each
concurrency level alternates blocks of direct and gateway calls so drift hits both alike; the
added latency is the difference of the percentiles. On a 2-core machine the client, gateway and
upstream share the cores, so the req/s figures are a floor for the gateway alone.

    python benchmarks/gateway_overhead.py --seconds 4 --json out.jsonl
    python benchmarks/gateway_overhead.py --online     # production traffic: plain /v1, conversations of 4 calls

``--online`` measures the gateway as ``agl gateway serve --record-unattributed`` runs it: calls on the plain
``/v1`` route, each conversation (an ``x-agl-session-id`` per 4 calls of a connection) recorded as a rollout
of mode ``online`` created in the background.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks import _results  # noqa: E402

PAYLOAD = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "what is two plus two"}], "max_tokens": 8}
).encode()


def serve_upstream() -> None:
    """Child role: the scripted upstream, until stdin closes."""
    from tests.support.openai_upstream import OpenAIUpstream

    with OpenAIUpstream(token_ids=True, record_bodies=False) as up:
        up.requests = _Discard()  # a benchmark run must not grow memory with every request
        print(json.dumps({"base_url": up.base_url}), flush=True)
        sys.stdin.read()


class _Discard(list):  # type: ignore[type-arg]
    def append(self, item: Any) -> None:
        pass


def serve_gateway(upstream: str, store_url: str, online: str = "") -> None:
    """Child role: a gateway recording into ``store_url``, with one running rollout, until stdin closes.

    ``sqlite`` (the default store) keeps spans off the Python heap; ``memory://`` keeps every span as
    Python objects, so its full garbage collections grow with the run and show in p99.
    """
    import tempfile

    from agl.gateway import Gateway, GatewayConfig
    from agl.schemas.rollout import RolloutCreate
    from agl.store import open_store

    if store_url == "sqlite":
        store_url = f"sqlite:///{tempfile.mkdtemp(prefix='agl-gw-bench-')}/store.db"
    store = open_store(store_url, watchdog_interval_s=0)
    started = asyncio.run(store.start_rollout(RolloutCreate(input="bench")))
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
    if online:
        with Gateway(store, [upstream], GatewayConfig(record_unattributed=True)) as gw:
            print(json.dumps({"base_url": gw.base_url, "url": gw.url}), flush=True)
            sys.stdin.read()
        return
    with Gateway(store, [upstream]) as gw:
        print(json.dumps({"base_url": gw.rollout_base_url(rid, aid), "url": gw.url}), flush=True)
        sys.stdin.read()


def spawn(*role: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", *role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise SystemExit(f"the {role[0]} process did not start")
    return proc, json.loads(line)


class RawConnection:
    """A minimal HTTP/1.1 keep-alive client connection: the client side costs little, so the figures are the servers'."""

    def __init__(self, url: str, session: str | None = None) -> None:
        self.parts = urlsplit(url)
        self.session, self.calls = session, 0  # online: a new conversation every 4 calls

    async def open(self) -> RawConnection:
        self.reader, self.writer = await asyncio.open_connection(self.parts.hostname, self.parts.port)
        self.writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = f"POST {self.parts.path} HTTP/1.1\r\nhost: {self.parts.netloc}\r\ncontent-type: application/json\r\n"
        self.head, self.body = head.encode(), f"content-length: {len(PAYLOAD)}\r\n\r\n".encode() + PAYLOAD
        return self

    async def call(self) -> int:
        session = b""
        if self.session is not None:
            session = f"x-agl-session-id: {self.session}-{self.calls // 4}\r\n".encode()
            self.calls += 1
        self.writer.write(self.head + session + self.body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            None,
        )
        if length is None:
            raise SystemExit(f"{self.parts.geturl()} answered without content-length: {head!r}")
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


async def block(
    url: str, concurrency: int, seconds: float, online: bool = False
) -> tuple[list[float], float]:
    """Latencies (ms) of calls by ``concurrency`` connections for ``seconds``, and the achieved req/s."""
    latencies: list[float] = []
    tag = os.urandom(4).hex()
    connections = [
        await RawConnection(url, f"{tag}-c{n}" if online else None).open() for n in range(concurrency)
    ]
    deadline = time.perf_counter() + seconds

    async def worker(conn: RawConnection) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            status = await conn.call()
            latencies.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                raise SystemExit(f"{url} answered {status}")

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    rate = len(latencies) / (time.perf_counter() - start)
    for conn in connections:
        conn.close()
    return latencies, rate


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]
    )


async def measure(
    direct: str, gateway: str, concurrency: int, seconds: float, blocks: int, online: bool = False
) -> dict[str, Any]:
    for url in (direct, gateway):  # warm connections and code paths
        await block(url, concurrency, 0.3, online and url == gateway)
    lat: dict[str, list[float]] = {"direct": [], "gateway": []}
    rps: dict[str, list[float]] = {"direct": [], "gateway": []}
    for _ in range(blocks):
        for name, url in (("direct", direct), ("gateway", gateway)):
            values, rate = await block(url, concurrency, seconds / blocks, online and name == "gateway")
            lat[name] += values
            rps[name].append(rate)
    out: dict[str, Any] = {"concurrency": concurrency}
    for name in lat:
        out[f"{name}_p50_ms"] = round(pct(lat[name], 50), 3)
        out[f"{name}_p99_ms"] = round(pct(lat[name], 99), 3)
        out[f"{name}_rps"] = round(statistics.median(rps[name]), 1)
        out[f"{name}_calls"] = len(lat[name])
    out["added_p50_ms"] = round(out["gateway_p50_ms"] - out["direct_p50_ms"], 3)
    out["added_p99_ms"] = round(out["gateway_p99_ms"] - out["direct_p99_ms"], 3)
    return out


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: a fresh upstream and gateway, every concurrency level, the gateway's span counts."""
    upstream, up = spawn("upstream")
    gateway, gw = spawn("gateway", up["base_url"], args.store, "online" if args.online else "")
    try:
        direct_url = f"{up['base_url']}/chat/completions"
        gateway_url = f"{gw['base_url']}/chat/completions"
        levels = [
            asyncio.run(measure(direct_url, gateway_url, c, args.seconds, args.blocks, args.online))
            for c in args.concurrency
        ]
        httpx.post(f"{gw['url']}/admin/flush", timeout=30).raise_for_status()  # spans are written off-path
        stats: dict[str, Any] = httpx.get(f"{gw['url']}/admin/stats").json()
    finally:
        for proc in (gateway, upstream):
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(15)
    return {
        "benchmark": "gateway_overhead",
        "clients": "asyncio tasks, one raw HTTP/1.1 keep-alive connection each, in a process of their own",
        "cpus": os.cpu_count(),
        "store": args.store,
        "online": args.online,
        "levels": levels,
        "recorded_spans": stats["recorded_spans"],
        "dropped_spans": stats["dropped_spans"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per target and level")
    parser.add_argument("--blocks", type=int, default=4, help="alternations of direct and gateway blocks")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON line here")
    parser.add_argument(
        "--store", default="sqlite", help="the gateway's store: sqlite (a temp file) or memory://"
    )
    parser.add_argument(
        "--online", action="store_true", help="production traffic: --record-unattributed, sessions on /v1"
    )
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    _results.add_arguments(parser, repeat=True)
    args = parser.parse_args()
    if args.role:
        serve_upstream() if args.role[0] == "upstream" else serve_gateway(*args.role[1:])
        return
    recorder = _results.Recorder("gateway_overhead", args)
    runs = []
    for _ in range(args.repeat):
        result = measure_all(args)
        runs.append(result)
        for level in result["levels"]:
            print(
                f"c={level['concurrency']:>3}: added p50 {level['added_p50_ms']:.3f} ms, p99 {level['added_p99_ms']:.3f} ms; "
                f"gateway {level['gateway_rps']:.0f} req/s (direct {level['direct_rps']:.0f} req/s; "
                f"p50 {level['gateway_p50_ms']:.3f} vs {level['direct_p50_ms']:.3f} ms)"
            )
        print(f"spans recorded {result['recorded_spans']}, dropped {result['dropped_spans']}")
        line = json.dumps(result)
        print(line, flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with args.json.open("a") as f:
                f.write(line + "\n")
    first = args.concurrency[0]
    recorder.save(
        metric=f"added_p50_ms_c{first}",
        unit="ms per call",
        values=[r["levels"][0]["added_p50_ms"] for r in runs],
        runs=runs,
        summary={
            f"c{c}_{key}": statistics.median(r["levels"][i][key] for r in runs)
            for i, c in enumerate(args.concurrency)
            for key in ("added_p50_ms", "added_p99_ms", "gateway_rps", "direct_rps")
        },
        variant=_results.backend_name(args.store) + ("-online" if args.online else ""),
        better="lower",
    )


if __name__ == "__main__":
    main()
