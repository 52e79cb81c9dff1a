"""What changed between versions: the tasks whose held-out reward moved, with both replies, and one task
across every version, read over HTTP from a real SQLite store served with the dashboard."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.asgi_server import BackgroundServer
from agl.dashboard import create_dashboard, mount_dashboard
from agl.dashboard.changes import task_key
from agl.schemas import AttemptStatus, ModelWeights, ResourcesVersion, RolloutCreate, Span
from agl.store import InMemoryLightningStore, SqliteLightningStore
from agl.store.server import create_app
from tests.adapter.spans import SpanMaker
from tests.dashboard.conftest import SHOTS

TOOL = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
# task -> (reward, reply) at v1 and at v2: "sum" learned, "capital" got worse, "spell" did not move
RUNS = {
    "sum": ((0.0, "I think 5"), (1.0, "7")),
    "capital": ((1.0, "Paris"), (0.25, "paris?")),
    "spell": ((0.5, "wrod"), (0.5, "wrod")),
}


async def _fill(path: Path) -> dict[str, Any]:
    store = SqliteLightningStore(str(path))
    ids: dict[str, Any] = {"rollouts": {}}
    for n in (1, 2):
        weights = ModelWeights(uri=f"/tmp/w{n}", version=f"v{n}")
        label = ("base", "tuned")[n - 1]  # as agl eval names the models it compares
        version = await store.add_resources(
            {"policy": weights}, metadata={"model_version": f"v{n}", "label": label}
        )
        ids[f"v{n}"] = version.resources_id
        for task, runs in RUNS.items():
            reward, reply = runs[n - 1]
            started = await store.start_rollout(
                RolloutCreate(input={"question": task}, mode="val", resources_id=version.resources_id)
            )
            rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
            make = SpanMaker(rid, aid)
            message = {"role": "assistant", "content": reply}
            attrs = {
                sc.LLM_RESPONSE_MESSAGE: message,
                **({sc.LLM_TOOL_CALLS: TOOL} if task == "sum" and n == 2 else {}),
            }
            await store.add_spans([make.call([1, 2], [3], attrs=attrs), make.reward(reward)])
            await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
            ids["rollouts"][(task, n)] = rid
    await store.aclose()
    return ids


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("changes") / "store.db"
    with concurrent.futures.ThreadPoolExecutor(
        1
    ) as pool:  # Playwright's sync API may hold this thread's loop
        ids = pool.submit(asyncio.run, _fill(path)).result()
    store = SqliteLightningStore(str(path))
    with BackgroundServer(mount_dashboard(create_app(store), store)) as server:
        yield server.url, ids


def get(url: str, path: str, status: int = 200, **params: Any) -> Any:
    response = httpx.get(f"{url}/ui/api/{path}", params=params, timeout=30)
    assert response.status_code == status, response.text
    return response.json()


def test_the_tasks_whose_held_out_reward_moved_with_both_replies(served: tuple[str, dict[str, Any]]) -> None:
    url, ids = served
    got = get(url, "changes")
    assert (got["before"], got["after"]) == (ids["v1"], ids["v2"])  # the first and the last version
    assert [(v["version"], v["label"]) for v in got["versions"]] == [(1, "base"), (2, "tuned")]
    assert got["versions"][0]["mean"] == pytest.approx(0.5) and got["versions"][1]["tasks"] == 3
    assert [row["input"] for row in got["changed"]] == [{"question": "sum"}, {"question": "capital"}]
    up, down = got["changed"]  # the largest move first
    assert up["delta"] == pytest.approx(1.0) and down["delta"] == pytest.approx(-0.75)
    assert (up["before"]["reply"], up["after"]["reply"]) == ("I think 5", "7 [tool call lookup]")
    assert up["after"]["rollout_id"] == ids["rollouts"][("sum", 2)]
    assert got["same"] == 1 and got["only_before"] == got["only_after"] == 0
    assert got["steps"] == [{"before": ids["v1"], "after": ids["v2"], "up": 1, "down": 1}]
    backwards = get(url, "changes", before=ids["v2"], after=ids["v1"])
    assert [row["delta"] for row in backwards["changed"]] == pytest.approx([-1.0, 0.75])
    assert get(url, "changes", mode="train")["changed"] == []  # no train rollouts here
    missing = get(url, "changes", 404, before="rs-nope")
    assert "before" in missing["error"]["message"]


def test_one_task_at_every_version_with_its_calls_and_tool_use(served: tuple[str, dict[str, Any]]) -> None:
    url, ids = served
    assert task_key({"question": "sum"}) == task_key({"question": "sum"}) != task_key({"question": "capital"})
    got = get(url, f"rollouts/{ids['rollouts'][('sum', 2)]}/task", mode="val")
    assert got["input"] == {"question": "sum"} and got["task"] == task_key({"question": "sum"})
    rows = [
        (r["version"], r["label"], r["reward"], r["reply"], r["calls"], r["tool_calls"])
        for r in got["rollouts"]
    ]
    # oldest version first; the digest names the tool call; "capital" and "spell" are other tasks
    assert rows == [(1, "base", 0.0, "I think 5", 1, 0), (2, "tuned", 1.0, "7 [tool call lookup]", 1, 1)]
    assert get(url, f"rollouts/{ids['rollouts'][('sum', 1)]}/task", mode="train")["rollouts"] == []
    assert get(url, "rollouts/ro-nope/task", 404)["error"]["type"] == "NotFoundError"


class _CountingStore(InMemoryLightningStore):
    """An in-memory store that counts the resources versions read from it."""

    reads = 0

    async def get_resources(self, resources_id: str) -> ResourcesVersion:
        self.reads += 1
        return await super().get_resources(resources_id)


async def test_a_polled_comparison_reads_each_version_once_and_sees_new_ones() -> None:
    store = _CountingStore(watchdog_interval_s=0)

    async def version_with_val_runs(reward: float) -> None:
        version = await store.add_resources({})
        for task in ("a", "b"):
            started = await store.start_rollout(
                RolloutCreate(input=task, mode="val", resources_id=version.resources_id)
            )
            rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
            await store.add_spans([Span.new(rid, aid, sc.SPAN_REWARD, {sc.REWARD_VALUE: reward})])

    await version_with_val_runs(0.0)
    await version_with_val_runs(1.0)
    transport = httpx.ASGITransport(create_dashboard(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://ui") as http:
        first = (await http.get("/ui/api/changes")).json()
        assert [v["version"] for v in first["versions"]] == [1, 2] and len(first["changed"]) == 2
        assert (await http.get("/ui/api/changes")).json() == first and store.reads == 2  # read once
        await version_with_val_runs(0.5)  # a new version: read when it first ran a val task
        third = (await http.get("/ui/api/changes")).json()
        assert [v["version"] for v in third["versions"]] == [1, 2, 3] and store.reads == 3
    await store.aclose()


def test_the_page_lists_what_changed_and_opens_one_task_across_versions(
    browser: Any, served: tuple[str, dict[str, Any]]
) -> None:
    url, ids = served
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    try:
        page.goto(f"{url}/ui/#/changes")
        page.locator("#changes-table tbody tr").first.wait_for()
        assert (
            "2 tasks changed reward (1 up, 1 down), 1 the same"
            in page.locator("#changes-summary").inner_text()
        )  # each version named by the label it was published under (agl eval's model names)
        assert (
            "from v1 (base) · weights v1 to v2 (tuned) · weights v2"
            in page.locator("#changes-summary").inner_text()
        )
        first = page.locator("#changes-table tbody tr").first
        assert first.get_attribute("class") == "up" and first.locator("td.delta").inner_text() == "+1.000"
        assert "I think 5" in first.inner_text() and "7 [tool call lookup]" in first.inner_text()
        before, after = (first.locator("td.reply").nth(i).bounding_box() for i in (0, 1))
        assert before and after and abs(before["width"] - after["width"]) < 2  # side by side, equally wide
        assert page.locator("#changes-before").input_value() == ids["v1"]
        page.screenshot(path=SHOTS / "what-changed.png", full_page=True)
        page.select_option("#changes-before", ids["v2"])  # one version against itself: nothing changed
        page.wait_for_function(
            "(document.querySelector('#changes-summary')?.innerText || '').startsWith('0 tasks')"
        )  # redrawn: absent a moment
        page.select_option("#changes-after", ids["v1"])  # the same pair backwards: the signs flip
        page.locator("#changes-table tbody tr.down td.delta", has_text="-1.000").wait_for()
        page.locator("#changes-table tbody tr.down a").first.click()
        page.locator("#task-history tbody tr").nth(1).wait_for()
        cells = page.locator("#task-history tbody tr").all_inner_texts()
        assert (
            cells[0].startswith("v1 (base)") and cells[1].startswith("v2 (tuned)") and "tool" not in cells[0]
        )
        page.locator("#task-history tbody tr").nth(1).click()  # to that rollout
        page.locator("#rollout-reward").wait_for()
        assert page.locator("#rollout-reward").inner_text() == "1.000"
    finally:
        context.close()
