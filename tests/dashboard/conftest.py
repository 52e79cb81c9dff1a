"""Real stores served with the dashboard mounted.

``filled``: a runner, an ``@agl.rollout`` agent calling a scripted OpenAI upstream through the gateway (so
spans hold real prompts, completions and tool calls), a Responses-API call, an empty completion, a
``CommandAgent`` run, two APO prompt versions, and a metrics.csv written by ``MetricsLogger``.
``trained``: the store and metrics of a real GRPO run (``Trainer.fit`` on the tiny model) where some
groups have one reward only, so GRPO skips them, and one step makes no update at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionFunctionToolParam

import agl
from agl.asgi_server import BackgroundServer
from agl.dashboard import mount_dashboard
from agl.gateway import Gateway, GatewayConfig
from agl.metrics import MetricsLogger
from agl.schemas import LLM, PromptTemplate, RetryConfig, RolloutCreate
from agl.store import SqliteLightningStore
from agl.store.client import LightningStoreClient
from agl.store.server import create_app
from tests.support.openai_upstream import OpenAIUpstream, ScriptedReply

TOKEN = "dash-secret"
API_KEY = "sk-never-shown"
PROMPT_V1 = "You are a shop assistant.\nAnswer briefly."
PROMPT_V2 = "You are a shop assistant.\nUse the lookup tool for every price.\nAnswer briefly."
CRITIQUE = "Answers guessed prices: the prompt never says to use the lookup tool."
TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Price of an item",
            "parameters": {"type": "object", "properties": {"item": {"type": "string"}}},
        },
    }
]


@dataclass
class Filled:
    """The servers and what was written, so tests can check the dashboard shows exactly that."""

    url: str
    metrics_dir: Path
    v1: str
    v2: str
    rewards: dict[str, float | None] = field(default_factory=dict)  # rollout_id -> final reward
    modes: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)  # rollout_id -> resources_id
    failed: str = ""
    queued: str = ""
    tool_rollout: str = ""
    responses_rollout: str = ""
    empty_rollout: str = ""
    command_rollout: str = ""

    def client(self) -> LightningStoreClient:
        return LightningStoreClient(self.url, token=TOKEN, retries=0)


@agl.operation("lookup")
def lookup(item: str) -> str:
    return f"{item} costs 3 dollars"


@agl.rollout
async def shop_agent(task: dict[str, Any], llm: LLM, prompt: PromptTemplate) -> float:
    import openai

    if task.get("fail"):
        raise ValueError("the task asked to fail")
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": prompt.template},
        {"role": "user", "content": task["question"]},
    ]
    with agl.operation("solve", question=task["question"]):  # the tool and message spans nest under it
        first = await client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)
        reply = first.choices[0].message
        if reply.tool_calls:
            call = reply.tool_calls[0]
            assert call.type == "function"  # the only kind of tool offered
            result = lookup(json.loads(call.function.arguments).get("item", "?"))
            messages += [
                reply.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result},
            ]
            await client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)
        agl.emit_message(f"answered: {task['question']}")
    return float(task["reward"])


async def _fill(filled: Filled, gateway_endpoint: str, upstream: OpenAIUpstream) -> None:
    store = filled.client()
    llm = LLM(endpoint=gateway_endpoint, model="shop-model", api_key=API_KEY)
    v1 = await store.add_resources(
        {"llm": llm, "prompt": PromptTemplate(template=PROMPT_V1)},
        metadata={"apo": {"parent_id": None, "round": 0, "critique": None}},
    )
    v2 = await store.add_resources(
        {"llm": llm, "prompt": PromptTemplate(template=PROMPT_V2)},
        metadata={"apo": {"parent_id": v1.resources_id, "round": 1, "critique": CRITIQUE}},
    )
    filled.v1, filled.v2 = v1.resources_id, v2.resources_id
    plan = [  # (resources, mode, question, reward)
        (v1, "train", "what does an apple cost?", 0.2),
        (v1, "train", "what does a pear cost?", 0.4),
        (v1, "val", "what does a plum cost?", 0.3),
        (v2, "train", "use the lookup tool: apple", 0.8),
        (v2, "train", "use the lookup tool: pear", 0.6),
        (v2, "val", "use the lookup tool: plum", 0.9),
    ]
    creates = [
        RolloutCreate(input={"question": q, "reward": w}, mode=mode, resources_id=v.resources_id)
        for v, mode, q, w in plan
    ]
    creates.append(
        RolloutCreate(
            input={"question": "boom", "fail": True},
            resources_id=v2.resources_id,
            retry=RetryConfig(max_attempts=2, retry_on=["failed"]),
        )
    )
    rollouts = await store.enqueue_rollouts(creates)
    for r, (_, _, _, w) in zip(rollouts, plan + [(None, None, None, None)], strict=True):
        filled.rewards[r.rollout_id] = w
        filled.modes[r.rollout_id] = r.mode
        filled.versions[r.rollout_id] = r.resources_id or ""
    filled.failed = rollouts[-1].rollout_id
    filled.tool_rollout = rollouts[3].rollout_id
    runner = agl.Runner(shop_agent, store, poll_interval_s=0.01, heartbeat_interval_s=0.5)
    await runner.run(max_rollouts=8)  # six rollouts and the failing one's two attempts
    # one at a time: the empty reply is scripted for the next chat call
    upstream.script(ScriptedReply(content=""))
    for kind in ("responses", "empty"):
        (r,) = await store.enqueue_rollouts(
            [RolloutCreate(input={"kind": kind}, mode="test", resources_id=v2.resources_id)]
        )
        await agl.Runner(edge_agent, store, poll_interval_s=0.01).run(max_rollouts=1)
        setattr(filled, f"{kind}_rollout", r.rollout_id)
        filled.rewards[r.rollout_id], filled.modes[r.rollout_id] = 1.0, "test"
        filled.versions[r.rollout_id] = v2.resources_id
    (r,) = await store.enqueue_rollouts(
        [RolloutCreate(input={"kind": "command"}, mode="test", resources_id=v2.resources_id)]
    )
    command = agl.CommandAgent(COMMAND, name="shell-agent")
    await agl.Runner(command, store, poll_interval_s=0.01).run(max_rollouts=1)
    filled.command_rollout = r.rollout_id
    filled.rewards[r.rollout_id], filled.modes[r.rollout_id] = 0.5, "test"
    filled.versions[r.rollout_id] = v2.resources_id
    await store.aclose()


#: a program run by ``CommandAgent``: it writes to stderr and prints its reward
COMMAND = [
    sys.executable,
    "-c",
    "import sys; sys.stderr.write('warming up the shell agent\\n'); print('{\"reward\": 0.5}')",
]


@agl.rollout
async def edge_agent(task: dict[str, Any], llm: LLM) -> float:
    """A Responses-API call, or a chat call whose reply is empty (both shown as they are)."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="unused", max_retries=0)
    if task["kind"] == "responses":
        await client.responses.create(model=llm.model, input="what does a fig cost?", temperature=0.3)
    else:
        await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "say nothing"}], max_tokens=5
        )
    return 1.0


@pytest.fixture(scope="session")  # the API and browser tests share one (the fill takes seconds)
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    # client-side openai tracing on, as agl.agent_scope switches it on: each call is then recorded twice
    # (gateway and tracer), and the dashboard must still show it once
    agl.instrument("openai", required=True)
    root = tmp_path_factory.mktemp("dashboard")
    metrics_dir = root / "runs"
    logger = MetricsLogger(metrics_dir / "grpo", progress=False)
    for step in range(1, 6):
        # validation every other step, as with eval_every=2: its points are joined over the steps between
        val = {"val_reward": 0.05 * step} if step % 2 else {}
        logger.log(step, {"reward_mean": 0.1 * step, "loss": 1.0 / step, **val})
    logger.close()
    inner = SqliteLightningStore(str(root / "store.db"))
    app = mount_dashboard(create_app(inner, token=TOKEN), inner, token=TOKEN, metrics_dir=metrics_dir)
    with BackgroundServer(app) as server, OpenAIUpstream() as upstream:
        filled = Filled(url=server.url, metrics_dir=metrics_dir, v1="", v2="")
        with Gateway(inner, [upstream.base_url], GatewayConfig(health_interval_s=0.1)) as gateway:
            asyncio.run(_fill(filled, gateway.endpoint_template, upstream))
        queued = asyncio.run(_enqueue(filled, RolloutCreate(input={"question": "later"}, mode="test")))
        filled.queued = queued
        filled.rewards[queued], filled.modes[queued] = None, "test"
        yield filled


async def _enqueue(filled: Filled, create: RolloutCreate) -> str:
    store = filled.client()
    (rollout,) = await store.enqueue_rollouts([create])
    await store.aclose()
    return rollout.rollout_id


# ----- a real GRPO run's store --------------------------------------------------------------------
#: with seed 3 and two of these per step, step 2 draws only the constant tasks: it makes no update
TRAIN_TASKS = ["count", "constant", "steady"]


@agl.rollout
async def count_agent(task: str, llm: LLM) -> float:
    """Two chat turns (merged into one sample); a varied reward on "count", one fixed reward otherwise."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task}]
    first = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "more"},
    ]
    second = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)
    await client.close()
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    agl.emit_object({"has_digit": any(c.isdigit() for c in text), "label": "not a number"})  # a curve
    if task != "count":
        return 0.5  # every rollout of the task gets the same reward: a zero-variance group
    return sum(c.isdigit() for c in text) / 8 + (sum(map(ord, text)) % 97) / 9700


@dataclass
class Trained:
    url: str
    out: Path
    history: list[dict[str, float]]


def _fit(out: Path, steps: int, lr: float, scale_by_std: bool = True) -> dict[str, Any]:
    from agl.algorithm.grpo import GRPO, GRPOConfig
    from agl.models import tiny_model

    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=steps,
        tasks_per_step=2,
        group_size=4,
        lr=lr,
        eval_every=1,
        seed=3,
        scale_by_std=scale_by_std,
    )
    trainer = agl.Trainer(algorithm=GRPO(config), n_runners=8, output_dir=str(out))
    result: dict[str, Any] = trainer.fit(count_agent, TRAIN_TASKS, ["count"])
    return result


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """Two short real GRPO runs (their metrics overlaid); the first one's store is served. The first runs
    without std scaling (Dr. GRPO), so views that assumed GRPOConfig's defaults would show wrong advantages."""
    root = tmp_path_factory.mktemp("trained")
    # in a thread of its own: fit runs its own event loop, and Playwright's sync API holds this thread's
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_fit, root / "runs" / "lr-1e-3", 3, 1e-3, False).result()
        pool.submit(_fit, root / "runs" / "lr-1e-2", 2, 1e-2).result()
    inner = SqliteLightningStore(str(root / "runs" / "lr-1e-3" / "store.db"))
    app = mount_dashboard(create_app(inner), inner, metrics_dir=root / "runs")
    with BackgroundServer(app) as server:
        yield Trained(url=server.url, out=root / "runs" / "lr-1e-3", history=first["history"])


# ----- the browser the page tests drive ---------------------------------------------------------
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[2] / "results" / "dashboard"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "playwright is not installed: run `.venv/bin/pip install 'playwright>=1.40'` (no `playwright install`)"
        )
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: run `apt-get update && apt-get install -y chromium chromium-driver` as root"
        )
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield launched
        launched.close()
