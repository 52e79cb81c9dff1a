"""The dashboard in headless Chromium (Debian's package, driven by Playwright): what a person sees and clicks.

Screenshots land in ``results/dashboard/``. Needs ``apt-get install -y chromium chromium-driver`` and
``pip install playwright`` (never ``playwright install``: the system Chromium is used).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.schemas import Span
from tests.dashboard.conftest import TOKEN, Filled

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


@pytest.fixture(scope="module")
def page(browser: Any, filled: Filled) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    opened.goto(f"{filled.url}/ui/?token={TOKEN}")
    yield opened
    context.close()


def rows(page: Any, selector: str = "#rollouts tbody tr[data-rollout]") -> list[str]:
    return [r.get_attribute("data-rollout") for r in page.locator(selector).all()]


def test_the_rollout_list_shows_every_rollout_and_keeps_the_token_out_of_the_url(
    page: Any, filled: Filled
) -> None:
    page.wait_for_function(
        f"document.querySelectorAll('#rollouts tr[data-rollout]').length >= {len(filled.rewards)}"
    )
    assert set(rows(page)) >= set(filled.rewards)
    assert "token" not in page.url
    assert page.evaluate("sessionStorage.getItem('agl.dashboard.token')") == TOKEN
    assert "rollouts" in page.locator("#counts").inner_text()
    page.screenshot(path=SHOTS / "rollouts.png", full_page=True)


def test_without_a_token_the_page_asks_for_one(browser: Any, filled: Filled) -> None:
    context = browser.new_context()
    anon = context.new_page()
    anon.goto(f"{filled.url}/ui/")
    anon.locator("#banner").get_by_text("This store needs a token").wait_for()
    anon.screenshot(path=SHOTS / "token.png")
    anon.type("#token-input", TOKEN[:4])
    anon.wait_for_timeout(2500)  # a poll in between must not wipe what is being typed
    anon.type("#token-input", TOKEN[4:])
    assert anon.input_value("#token-input") == TOKEN
    anon.get_by_role("button", name="Use token").click()
    anon.locator("#rollouts tr[data-rollout]").first.wait_for()
    context.close()


def test_filter_by_status(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollouts")
    page.click("button.chip[data-status=failed]")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 1")
    assert rows(page) == [filled.failed]
    assert "status=failed" in page.url
    page.screenshot(path=SHOTS / "rollouts-failed.png")
    page.click("button.chip[data-status=failed]")
    page.click("button.chip[data-status=queuing]")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 1")
    assert rows(page) == [filled.queued]


def test_a_rollout_shows_its_span_tree_messages_tool_calls_and_reward(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollouts")
    page.click(f"tr[data-rollout='{filled.tool_rollout}']")
    page.locator("#trace").wait_for()
    assert page.locator("#rollout-reward").inner_text() == "0.800"
    names = page.locator("#trace td.name").all_inner_texts()
    assert any("agl.llm.call" in n for n in names) and any("lookup" in n for n in names)
    llm = page.locator(".card.llm").first
    assert "Use the lookup tool for every price." in llm.inner_text()  # the system prompt
    assert "use the lookup tool: apple" in llm.inner_text()  # the user message
    assert "tool call lookup(" in llm.inner_text()  # the tool call the model made
    indents = page.locator("#trace td.name").evaluate_all(
        "es => es.map(e => [e.innerText.trim(), e.style.paddingLeft])"
    )
    assert ["solve", "8px"] in indents and ["lookup", "26px"] in indents  # lookup is drawn under solve
    assert (
        "tool result:" in page.locator(".card.llm").nth(1).inner_text()
    )  # the completion after the tool ran
    assert page.locator(".card.reward .big-reward").inner_text() == "0.800"
    page.locator("#trace tr", has_text="agl.reward").click()
    assert "flash" in (page.locator(".card.reward").get_attribute("class") or "")
    page.screenshot(path=SHOTS / "rollout.png", full_page=True)


def test_a_failed_rollout_shows_its_attempts_and_exception(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.failed}")
    page.locator("#attempts tbody tr").nth(1).wait_for()
    assert page.locator("#attempts tbody tr").count() == 2
    assert "the task asked to fail" in page.locator(".card.exception").first.inner_text()
    page.screenshot(path=SHOTS / "rollout-failed.png", full_page=True)
    page.locator("#attempts tbody tr").first.click()
    page.wait_for_function("document.querySelector('#attempts tbody tr').classList.contains('selected')")


def test_resources_show_the_apo_prompt_diff(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/resources/{filled.v2}")
    added = page.locator("#version-detail .diff .add")
    added.first.wait_for()
    assert added.all_inner_texts() == ["Use the lookup tool for every price."]
    assert "never says to use the lookup tool" in page.locator("#version-detail").inner_text()
    assert page.locator("#versions tbody tr").count() == 2
    assert "sk-never-shown" not in page.content()
    page.screenshot(path=SHOTS / "resources.png", full_page=True)


def test_curves_are_drawn(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/curves")
    by_version = page.locator(".chart[data-title='Mean reward per resources version']")
    by_version.locator("polyline").first.wait_for()
    assert by_version.locator("polyline").count() == 2  # train and val
    assert page.locator(".chart[data-title='Reward of finished rollouts over time'] circle").count() == 6
    metric = page.locator(".chart[data-title='grpo: reward_mean']")
    assert metric.locator("circle").count() == 5
    page.screenshot(path=SHOTS / "curves.png", full_page=True)


def test_a_new_rollout_appears_without_a_reload(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollouts")
    page.locator("#rollouts tr[data-rollout]").first.wait_for()
    page.evaluate("window.__noReload = true")
    # through the store's HTTP API (Playwright's sync API owns this thread's event loop)
    body = {"rollouts": [{"input": {"question": "live"}, "mode": "test"}]}
    response = httpx.post(
        f"{filled.url}/v1/agl/rollouts", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    new_id = response.raise_for_status().json()[0]["rollout_id"]
    filled.rewards[new_id], filled.modes[new_id] = None, "test"
    page.locator(f"tr[data-rollout='{new_id}']").wait_for(timeout=10_000)
    assert page.evaluate("window.__noReload") is True
    assert rows(page)[0] == new_id  # newest first
    page.screenshot(path=SHOTS / "rollouts-live.png")
    cancel = {"status": "cancelled"}  # leave the queue as the API tests expect it, whatever the order
    auth = {"Authorization": f"Bearer {TOKEN}"}
    httpx.patch(f"{filled.url}/v1/agl/rollouts/{new_id}", json=cancel, headers=auth).raise_for_status()


def test_a_running_rollout_page_follows_new_spans_and_its_end(page: Any, filled: Filled) -> None:
    store = httpx.Client(base_url=f"{filled.url}/v1/agl", headers={"Authorization": f"Bearer {TOKEN}"})
    claim = store.post("/rollouts/start", json={"rollout": {"input": "watch me", "mode": "test"}}).json()
    rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
    filled.rewards[rollout_id], filled.modes[rollout_id] = 0.25, "test"
    page.goto(f"{filled.url}/ui/#/rollout/{rollout_id}")
    page.get_by_text("No spans.").wait_for()
    page.evaluate("window.__noReload = true")
    reward = Span.new(rollout_id, attempt_id, sc.SPAN_REWARD, {sc.REWARD_VALUE: 0.25})
    store.post("/spans", json={"spans": [reward.model_dump(mode="json")]}).raise_for_status()
    store.patch(
        f"/rollouts/{rollout_id}/attempts/{attempt_id}", json={"status": "succeeded"}
    ).raise_for_status()
    page.locator(".card.reward .big-reward", has_text="0.250").wait_for(timeout=10_000)
    page.locator("h2 .badge", has_text="succeeded").wait_for(timeout=10_000)
    assert page.evaluate("window.__noReload") is True
    store.close()
