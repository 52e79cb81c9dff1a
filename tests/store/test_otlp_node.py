"""OTLP from another language: the official Node.js OpenTelemetry SDK and protobuf exporter into the store."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from agl import semconv as sc
from agl.store import InMemoryLightningStore
from tests.store.remote_backends import serve

PACKAGES = [
    "@opentelemetry/api@1",
    "@opentelemetry/sdk-trace-base@2",
    "@opentelemetry/exporter-trace-otlp-proto@0",
    "@opentelemetry/resources@2",
]
SCRIPT = textwrap.dedent(
    """
    const { context, trace } = require('@opentelemetry/api');
    const { BasicTracerProvider, SimpleSpanProcessor } = require('@opentelemetry/sdk-trace-base');
    const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-proto');
    const { resourceFromAttributes } = require('@opentelemetry/resources');
    const resource = resourceFromAttributes({
      'service.name': 'node-agent', 'agl.rollout_id': process.env.RID, 'agl.attempt_id': process.env.AID });
    const exporter = new OTLPTraceExporter({ url: process.env.URL + '/v1/traces' });
    const provider = new BasicTracerProvider({ resource, spanProcessors: [new SimpleSpanProcessor(exporter)] });
    const tracer = provider.getTracer('node-test');
    const plan = tracer.startSpan('node-plan', { attributes: { step: 3 } });
    const act = tracer.startSpan('node-act', { attributes: { tool: 'calc' } }, trace.setSpan(context.active(), plan));
    act.end(); plan.end();
    provider.forceFlush().then(() => provider.shutdown()).then(() => console.log('exported'));
    """
)


@pytest.fixture(scope="module")
def node_otel() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the cross-language OTLP test")
    home = Path(os.environ.get("AGL_CACHE_DIR", Path.home() / ".cache" / "agl")) / "otel-node"
    if not (home / "node_modules" / "@opentelemetry" / "exporter-trace-otlp-proto").exists():
        home.mkdir(parents=True, exist_ok=True)
        (home / "package.json").write_text('{"name": "agl-otel-node-test", "private": true}')
        proc = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", *PACKAGES],
            cwd=home,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            pytest.skip(f"npm could not install the OpenTelemetry JS packages: {proc.stderr[-500:]}")
    return home


async def test_node_sdk_exports_into_the_store(node_otel: Path) -> None:
    async with serve(InMemoryLightningStore()) as client:
        await client.enqueue_rollout("node")
        claimed = await client.dequeue("w")
        assert claimed is not None
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        (node_otel / "export.js").write_text(SCRIPT)
        env = {**os.environ, "URL": client.url, "RID": rid, "AID": aid}
        proc = await asyncio.to_thread(
            subprocess.run,
            ["node", "export.js"],
            cwd=node_otel,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and "exported" in proc.stdout, proc.stderr
        spans = {s.name: s for s in (await client.query_spans(rollout_id=rid)).items}
        assert set(spans) == {"node-plan", "node-act"}
        assert spans["node-act"].parent_id == spans["node-plan"].span_id
        assert spans["node-plan"].attributes["step"] == 3 and spans["node-act"].attributes["tool"] == "calc"
        assert spans["node-plan"].resource["service.name"] == "node-agent"
        assert spans["node-plan"].resource[sc.ROLLOUT_ID] == rid
