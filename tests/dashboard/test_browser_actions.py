"""Flag, export and replay in headless Chromium over the real ``filled`` store: a flag set from the list or
the rollout view survives a reload and shows in a second browser, the exported files read back
(``WarmStart.from_jsonl`` with the tools; one ``agl eval`` task a line), and a replayed call's reply shows
beside the recorded one."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import SHOTS, TOKEN, TOOLS, Filled
from tests.support.openai_upstream import OpenAIUpstream

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def page(browser: Any, filled: Filled) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    opened.goto(f"{filled.url}/ui/?token={TOKEN}")
    yield opened
    context.close()


@pytest.fixture
def unflag_after(filled: Filled) -> Iterator[None]:
    """Every rollout unflagged after the test (the store is shared with the other dashboard tests)."""
    yield
    with httpx.Client(base_url=filled.url, headers=AUTH) as http:
        for rollout_id in filled.rewards:
            http.post(f"/ui/api/rollouts/{rollout_id}/flag", json={"flagged": False}).raise_for_status()


def _v2_train(filled: Filled) -> list[str]:
    return sorted(
        r
        for r, v in filled.versions.items()
        if v == filled.v2 and filled.modes[r] == "train" and r != filled.failed
    )


def _star(page: Any, rollout_id: str) -> Any:
    return page.locator(f"#rollouts tr[data-rollout='{rollout_id}'] button.flag")


def _rows(page: Any) -> list[str]:
    return sorted(
        r.get_attribute("data-rollout") for r in page.locator("#rollouts tbody tr[data-rollout]").all()
    )


def test_flags_set_in_the_list_survive_a_reload_and_export_as_data_sets(
    page: Any, filled: Filled, tmp_path: Path, unflag_after: None
) -> None:
    from agl.algorithm.grpo.warm_start import WarmStart
    from agl.cli.train import read_jsonl

    picked = _v2_train(filled)
    page.goto(f"{filled.url}/ui/#/rollouts")
    for rollout_id in picked:
        _star(page, rollout_id).click()
        page.wait_for_selector(f"#rollouts tr[data-rollout='{rollout_id}'] button.flag[aria-pressed=true]")
    assert page.url.endswith("#/rollouts")  # a star does not open the rollout
    page.reload()
    for rollout_id in filled.rewards:
        _star(page, rollout_id).wait_for()
        assert _star(page, rollout_id).get_attribute("aria-pressed") == (
            "true" if rollout_id in picked else "false"
        )
    page.click("#flagged-only")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 2")
    assert _rows(page) == picked and "flagged=1" in page.url
    page.screenshot(path=SHOTS / "rollouts-flagged.png")
    with page.expect_download() as sft:
        page.click("#export-sft")
    path = tmp_path / sft.value.suggested_filename
    sft.value.save_as(path)
    assert path.name == "agl-sft-flagged-2.jsonl"
    warm = WarmStart.from_jsonl(path)
    assert warm.tools == TOOLS and len(warm.conversations) == 2
    assert all(any(m.get("tool_calls") for m in c) for c in warm.conversations)
    page.locator("#export-note").get_by_text("2 written (of 2 matching)").wait_for()
    # the same file through the API, as a script would fetch it
    with httpx.Client(base_url=filled.url, headers=AUTH) as http:
        answer = http.get("/ui/api/export", params={"format": "sft", "flagged": 1})
    assert answer.content == path.read_bytes()
    # the rollouts the filters match (mode val), as agl eval tasks
    page.goto(f"{filled.url}/ui/#/rollouts?mode=val")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 2")
    page.select_option("#export-scope", "filtered")
    with page.expect_download() as tasks:
        page.click("#export-eval")
    tasks.value.save_as(tmp_path / "tasks.jsonl")
    questions = {t["question"] for t in read_jsonl(tmp_path / "tasks.jsonl", "--tasks")}
    assert questions == {"what does a plum cost?", "use the lookup tool: plum"}
    assert len((tmp_path / "tasks.jsonl").read_text().splitlines()) == 2


def test_a_flag_set_in_the_rollout_view_shows_in_a_second_browser(
    browser: Any, page: Any, filled: Filled, unflag_after: None
) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.tool_rollout}")
    star = page.locator("h2 button.flag")
    star.wait_for()
    assert star.get_attribute("aria-pressed") == "false"
    star.click()
    page.wait_for_selector("h2 button.flag[aria-pressed=true]")
    other = browser.new_context()
    second = other.new_page()
    second.set_default_timeout(15_000)
    second.goto(f"{filled.url}/ui/?token={TOKEN}#/rollouts?flagged=1")
    second.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 1")
    assert _rows(second) == [filled.tool_rollout]
    other.close()
    page.locator("h2 button.flag").click()
    page.wait_for_selector("h2 button.flag[aria-pressed=false]")


def test_a_call_replays_and_its_reply_shows_beside_the_recorded_one(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.tool_rollout}")
    first = page.locator("#transcript .card.llm").first
    first.locator(".replay-toggle").click()
    with OpenAIUpstream(api_key="sk-typed") as upstream:
        upstream.script("the replayed reply, from the browser")
        first.locator(".replay-endpoint").fill(upstream.base_url)
        first.locator(".replay-api-key").fill("sk-typed")
        first.locator(".replay-temperature").fill("0.7")
        first.locator(".replay-max-tokens").fill("32")
        first.locator(".replay-run").click()
        pair = first.locator(".replay-pair")
        pair.wait_for()
        sent = upstream.requests[-1].body
    assert "the replayed reply, from the browser" in pair.locator(".replay-side.replayed").inner_text()
    recorded = pair.locator(".replay-side.recorded").inner_text()
    assert "tool call" in recorded and "lookup" in recorded
    assert (sent["temperature"], sent["max_tokens"], sent["tools"]) == (0.7, 32, TOOLS)
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    page.screenshot(path=SHOTS / "replay.png", full_page=True)
    with socket.socket() as s:  # an endpoint that refuses: the page says so
        s.bind(("127.0.0.1", 0))
        first.locator(".replay-endpoint").fill(f"http://127.0.0.1:{s.getsockname()[1]}/v1")
        first.locator(".replay-run").click()
        first.locator(".replay-error").wait_for()
    assert "could not reach" in first.locator(".replay-error").inner_text()


def test_a_recorded_conversation_shows_no_null_input(browser: Any, tmp_path: Path) -> None:
    """Production traffic (mode ``online``) has a conversation, not a task: the list and the rollout view
    say so instead of printing ``null``."""
    import asyncio
    import concurrent.futures

    from agl.asgi_server import BackgroundServer
    from agl.dashboard import mount_dashboard
    from agl.schemas import RolloutCreate
    from agl.store import SqliteLightningStore
    from agl.store.server import create_app

    store = SqliteLightningStore(str(tmp_path / "online.db"))
    create = RolloutCreate(input=None, mode="online")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Playwright's loop runs in this thread
        started = pool.submit(asyncio.run, store.start_rollout(create)).result().rollout
    app = mount_dashboard(create_app(store, token="t"), store, token="t")
    with BackgroundServer(app) as server:
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        page.set_default_timeout(15_000)
        page.goto(f"{server.url}/ui/?token=t")
        row = page.locator(f'#rollouts tbody tr[data-rollout="{started.rollout_id}"]')
        assert "(a recorded conversation)" in row.inner_text() and "null" not in row.inner_text()
        row.click()
        page.wait_for_selector("text=(a recorded conversation)")
        assert "null" not in page.locator(".kv").first.inner_text()
        context.close()
