"""The dashboard in headless Chromium (Debian's package, driven by Playwright): what a person sees and clicks.

Screenshots land in ``results/dashboard/``. Needs ``apt-get install -y chromium chromium-driver`` and
``pip install playwright`` (never ``playwright install``: the system Chromium is used).
"""

from __future__ import annotations

import csv
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.schemas import Span
from tests.dashboard.conftest import SHOTS, TOKEN, Filled, Trained


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
    # each model call is one row where the client's span sits, though the client and the gateway both
    # recorded it; none is left at the root
    calls = [n for n in names if "(client + gateway)" in n]
    assert len(calls) == 2 and not any("agl.llm.call" in n for n in names), names
    assert any("lookup" in n for n in names)
    llm = page.locator("#transcript .card.llm").first
    assert "Use the lookup tool for every price." in llm.inner_text()  # the system prompt
    assert "use the lookup tool: apple" in llm.inner_text()  # the user message
    assert "tool call lookup(" in llm.inner_text()  # the tool call the model made
    indents = page.locator("#trace td.name").evaluate_all(
        "es => es.map(e => [e.innerText.trim(), e.style.paddingLeft])"
    )
    assert ["solve", "8px"] in indents and ["lookup", "26px"] in indents  # lookup is drawn under solve
    assert [pad for name, pad in indents if "(client + gateway)" in name] == [
        "26px",
        "26px",
    ]  # so are the calls
    assert (
        "tool result:" in page.locator("#transcript .card.llm").nth(1).inner_text()
    )  # the completion after the tool ran
    assert page.locator("#transcript .card.reward .big-reward").inner_text() == "0.800"
    # no GRPO step recorded this rollout: its training section says it is a re-simulation
    banner = page.locator("#training .source-banner[data-source='simulated']")
    banner.wait_for()
    assert "no training record" in banner.inner_text()
    page.locator("#trace tr", has_text="agl.reward").click()
    assert "flash" in (page.locator("#transcript .card.reward").get_attribute("class") or "")
    assert page.locator("#span-detail .big-reward").inner_text() == "0.800"  # and its detail panel
    page.screenshot(path=SHOTS / "rollout.png", full_page=True)


def test_a_failed_rollout_shows_its_attempts_and_exception(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.failed}")
    page.locator("#attempts tbody tr").nth(1).wait_for()
    assert page.locator("#attempts tbody tr").count() == 2
    assert "the task asked to fail" in page.locator("#transcript .card.exception").first.inner_text()
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
    rewarded = sum(w is not None for w in filled.rewards.values())
    assert (
        page.locator(".chart[data-title='Reward of finished rollouts over time'] circle").count() == rewarded
    )
    metric = page.locator(".chart[data-title='reward_mean']")
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
    page.locator("#transcript .card.reward .big-reward", has_text="0.250").wait_for(timeout=10_000)
    page.locator("h2 .badge", has_text="succeeded").wait_for(timeout=10_000)
    assert page.evaluate("window.__noReload") is True
    store.close()


# ----- the seven defects, fixed ------------------------------------------------------------------------


def test_a_responses_api_call_shows_its_token_counts(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.responses_rollout}")
    card = page.locator(".card.llm").first
    card.wait_for()
    title = card.locator(".title").inner_text()
    assert "undefined" not in title and re.search(r"\d+\+\d+ tokens", title), title
    assert "temperature=0.3" in card.inner_text()
    card.screenshot(path=SHOTS / "fix-responses-usage.png")


def test_small_defects_unknown_id_tool_call_ids_empty_reply_and_dated_times(
    page: Any, filled: Filled
) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/ro-does-not-exist")
    page.locator("#load-error").wait_for()
    assert "loading" not in page.locator("#view").inner_text()
    assert "not" in page.locator("#load-error").inner_text().lower()
    page.screenshot(path=SHOTS / "fix-unknown-rollout.png")
    page.goto(f"{filled.url}/ui/#/rollout/{filled.tool_rollout}")
    tool_message = page.locator(".msg.tool").first
    tool_message.wait_for()
    assert re.search(r"call_\d+", tool_message.locator(".role").inner_text())  # as the model wrote it
    times = page.locator("#rollout-times").inner_text()
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d → \d{4}-\d\d-\d\d", times) and "(" in times
    assert re.search(r"\d+(\.\d+)? (ms|s)", page.locator("#attempts tbody tr").first.inner_text())
    page.locator(".card.llm").nth(1).screenshot(path=SHOTS / "fix-tool-call-id.png")
    page.goto(f"{filled.url}/ui/#/rollout/{filled.empty_rollout}")
    empty = page.locator(".card.llm .empty-msg")
    empty.wait_for()
    assert empty.inner_text() == "(empty completion)"
    page.locator(".card.llm").first.screenshot(path=SHOTS / "fix-empty-completion.png")


def test_the_span_detail_panel_shows_every_attribute_raw_json_and_copies_it(
    browser: Any, filled: Filled
) -> None:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.goto(f"{filled.url}/ui/?token={TOKEN}#/rollout/{filled.tool_rollout}")
    page.locator("#trace tr", has_text="(client + gateway)").first.click()
    panel = page.locator("#span-detail")
    panel.wait_for()
    attrs = panel.locator("#span-attrs").inner_text()
    for key in (sc.LLM_HAS_TOKEN_IDS, sc.LLM_REQUEST_MESSAGES, sc.LLM_LATENCY_MS, sc.LLM_REQUEST):
        assert key in attrs, key
    assert "tools: lookup" in panel.inner_text()  # the request's tools
    page.wait_for_function("document.querySelector('#span-raw').textContent.startsWith('{')")
    raw = json.loads(panel.locator("#span-raw").inner_text())
    assert raw["attributes"][sc.LLM_REQUEST]["tools"][0]["function"]["name"] == "lookup"
    panel.locator("#copy-raw").click()
    page.get_by_text("Copied").wait_for()
    assert json.loads(page.evaluate("navigator.clipboard.readText()")) == raw
    panel.screenshot(path=SHOTS / "span-detail.png")
    page.goto(f"{filled.url}/ui/#/rollout/{filled.command_rollout}")
    page.locator("#trace tr", has_text="agl.command").click()
    command = panel.locator(".card.command")
    command.wait_for()
    assert "exit code 0" in command.inner_text() and "warming up the shell agent" in command.inner_text()
    assert sys.executable in command.inner_text()
    page.locator("#rollout-times").scroll_into_view_if_needed()
    page.screenshot(path=SHOTS / "span-detail-command.png", full_page=True)
    context.close()


def test_search_sort_and_filter_rollouts(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollouts")
    page.fill("#search", "costs 3 dollars")
    page.press("#search", "Enter")
    page.wait_for_function("location.hash.includes('q=costs')")
    page.wait_for_function(
        "[...document.querySelectorAll('#rollouts tr[data-rollout]')].length > 0 && "
        "[...document.querySelectorAll('#rollouts tr[data-rollout]')].every(r => r.innerText.includes('lookup tool'))"
    )
    assert filled.tool_rollout in rows(page)
    page.goto(f"{filled.url}/ui/#/rollouts?sort=reward&mode=train&status=succeeded")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 4")
    rewards = page.locator("#rollouts td.reward").all_inner_texts()
    assert rewards == ["0.800", "0.600", "0.400", "0.200"]
    page.goto(f"{filled.url}/ui/#/rollouts")
    page.fill("#agent", "shell-agent")
    page.press("#agent", "Enter")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 1")
    assert rows(page) == [filled.command_rollout]
    assert page.locator("#rollouts td.agent").inner_text() == "shell-agent"
    page.screenshot(path=SHOTS / "search-agent.png")
    page.goto(f"{filled.url}/ui/#/rollouts?sort=reward&mode=train&status=succeeded")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 4")
    # an unnamed @agl.rollout function is listed by its function's name
    assert page.locator("#rollouts td.agent").all_inner_texts() == ["shop_agent"] * 4


def test_filter_on_calls_and_see_what_each_rollout_did(page: Any, filled: Filled) -> None:
    """Each call is recorded by the gateway and the openai tracer: the columns count it once."""
    page.goto(f"{filled.url}/ui/#/rollouts")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length > 0")
    heads = page.locator("#rollouts thead th").all_text_contents()
    assert heads[heads.index("calls") :][:3] == ["calls", "tool calls", "completion tokens"]
    page.fill("#calls-min", "2")
    page.press("#calls-min", "Enter")
    page.wait_for_function("location.hash.includes('calls_min=2')")
    looked_up = {
        r for r, w in filled.rewards.items() if filled.versions.get(r) == filled.v2 and w in (0.6, 0.8, 0.9)
    }
    page.wait_for_function(
        f"document.querySelectorAll('#rollouts tr[data-rollout]').length === {len(looked_up)}"
    )
    assert set(rows(page)) == looked_up  # the tool call, then the answer
    assert page.locator("#rollouts td.calls").all_inner_texts() == ["2"] * len(looked_up)
    assert page.locator("#rollouts td.tool-calls").all_inner_texts() == ["1"] * len(looked_up)
    assert page.locator("#rollouts td.tokens").all_inner_texts() == ["10"] * len(looked_up)
    page.screenshot(path=SHOTS / "calls-filter.png")
    page.fill("#calls-max", "1")
    page.press("#calls-max", "Enter")
    page.wait_for_function("location.hash.includes('calls_max=1')")
    page.wait_for_selector("#rollouts td.empty")  # at least 2 and at most 1: none
    page.fill("#calls-min", "1")
    page.press("#calls-min", "Enter")
    page.wait_for_function("location.hash.includes('calls_min=1')")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length > 0")
    once = set(rows(page))
    assert filled.tool_rollout not in once and filled.queued not in once
    assert set(page.locator("#rollouts td.calls").all_inner_texts()) == {"1"}


def test_the_transcript_shows_each_message_once(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.tool_rollout}")
    second = page.locator("#transcript .card.llm").nth(1)
    second.wait_for()
    assert "Use the lookup tool for every price." not in second.inner_text()  # the system prompt: once
    assert "3 dollars" in second.inner_text()  # the tool result is new in the second call
    second.locator(".show-context").click()
    assert "Use the lookup tool for every price." in second.inner_text()
    second.screenshot(path=SHOTS / "transcript-once.png")


def test_resources_pick_what_to_diff_against(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/resources/{filled.v1}")
    page.locator("#diff-against").wait_for()
    page.select_option("#diff-against", filled.v2)
    page.wait_for_function("location.hash.includes('against=')")
    page.locator("#version-detail .diff .del").first.wait_for()
    assert (
        "Use the lookup tool for every price." in page.locator("#version-detail .diff .del").all_inner_texts()
    )
    page.screenshot(path=SHOTS / "resources-against.png", full_page=True)


# ----- a real GRPO run: groups, what was trained, curves ----------------------------------------------


@pytest.fixture(scope="module")
def run_page(browser: Any, trained: Trained) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    opened.set_default_timeout(30_000)  # the first training view imports torch
    opened.goto(f"{trained.url}/ui/")
    yield opened
    context.close()


def _groups(trained: Trained, step: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = httpx.get(f"{trained.url}/ui/api/groups", params={"step": step}).json()[
        "items"
    ]
    return items


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_curves_of_a_real_run(run_page: Any, trained: Trained) -> None:
    page = run_page
    page.goto(f"{trained.url}/ui/#/curves")
    page.locator("#metric-charts .chart").first.wait_for()
    titles = page.locator("#metric-charts .chart").evaluate_all("cs => cs.map(c => c.dataset.title)")
    assert titles[:3] == ["reward_mean", "val_reward", "loss"]  # key metrics first
    reward = page.locator(".chart[data-title='reward_mean']")
    assert reward.locator(".legend").inner_text().count("lr-1e-") == 2  # both runs overlaid
    # one x range for every chart: the same step ticks everywhere, integers only (a one-point run too)
    ticks = page.locator("#metric-charts .chart").evaluate_all(
        "cs => cs.map(c => [...c.querySelectorAll('text.xtick')].map(t => t.textContent).join(','))"
    )
    assert len(set(ticks)) == 1 and all(t.isdigit() for t in ticks[0].split(",")), ticks
    ratio = page.locator(".chart[data-title='ratio_mean'] text.ytick").evaluate_all(
        "ts => ts.map(t => t.textContent)"
    )
    assert len(set(ratio)) == len(ratio) > 1, ratio  # no tick reads the same as another
    # behaviour curves, and the agent's emit_object flag as a curve of its own, folded
    groups = page.locator("#metric-charts details.metric-group").evaluate_all(
        "ds => ds.map(d => d.dataset.group)"
    )
    assert "behaviour" in groups, groups  # a lone emitted name folds under "other"
    assert page.locator(".chart[data-title='emitted_has_digit']").count() == 1
    # step 2 drew only zero-variance groups: no update, so a marker, and the loss line has a gap there
    loss = page.locator(".chart[data-title='loss']")
    assert loss.locator("line.no-update").count() >= 1
    assert loss.locator("polyline[data-series='lr-1e-3']").count() == 0  # steps 1 and 3 are not joined
    train_colors = [
        page.locator(f".chart[data-title='{t}'] .legend span", has_text="train")
        .first.locator("span")
        .get_attribute("style")
        for t in ("Mean reward per resources version", "Reward of finished rollouts over time")
    ]
    assert train_colors[0] == train_colors[1], train_colors  # train is the same colour on both
    # another run's point may lie on top of this one: either reads out
    reward.locator("circle").first.hover(force=True)
    assert re.search(r"lr-1e-\d · step \d+: ", reward.locator(".readout").inner_text())
    page.screenshot(path=SHOTS / "curves-run.png", full_page=True)
    reward.locator("circle[data-x='2']").last.click()  # to the groups of step 2 (the top circle)
    page.locator("#step-groups tbody tr").first.wait_for()
    assert page.locator("#step-groups").inner_text().count("skipped: zero variance") == 2
    assert "made no update" in page.locator("#no-update").inner_text()
    assert "null" not in page.locator("#view").inner_text()
    page.screenshot(path=SHOTS / "step-groups.png", full_page=True)


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_the_group_view_and_what_was_trained(run_page: Any, trained: Trained) -> None:
    page = run_page
    live = next(g for g in _groups(trained, 1) if not g["zero_variance"])
    first = httpx.get(f"{trained.url}/ui/api/groups/{live['group_id']}").json()["rollouts"][0]["rollout_id"]
    page.goto(f"{trained.url}/ui/#/rollout/{first}")
    page.locator("#training-calls tbody tr").first.wait_for()
    verdicts = page.locator("#training-calls td.verdict").all_inner_texts()
    assert verdicts == ["TRAINED", "TRAINED"] or verdicts == ["trained", "trained"], verdicts
    # the run's own training record, not a re-simulation with defaults (it ran without std scaling)
    assert page.locator("#training .source-note[data-source='record']").count() == 1
    assert page.locator("#training .source-banner").count() == 0
    assert '"scale_by_std"' not in page.locator("#training").inner_text()
    assert "scale_by_std=false" in page.locator("#training .source-note").inner_text()
    assert "loss weight 0." in page.locator("#training").inner_text()
    strip = page.locator(".sample .strip").first
    completion = strip.locator(".tok.gen").first
    assert "logprob -" in (completion.get_attribute("title") or "")
    assert strip.locator(".tok.ctx").count() > 0 and strip.locator(".tok.call-start").count() >= 1
    page.locator("#training").screenshot(path=SHOTS / "what-was-trained.png")
    page.click("#group-link")
    grid = page.locator("#group-grid .member")
    grid.first.wait_for()
    assert grid.count() == 4
    advantages = [float(a) for a in page.locator("#group-grid .advantage").all_inner_texts()]
    assert abs(sum(advantages)) < 0.01 and any(a != 0 for a in advantages)
    page.screenshot(path=SHOTS / "group.png", full_page=True)
    flat = next(g for g in _groups(trained, 1) + _groups(trained, 2) if g["zero_variance"])
    page.goto(f"{trained.url}/ui/#/group/{flat['group_id']}")
    page.locator("#zero-variance").wait_for()
    assert page.locator("#group-grid").inner_text().count("zero-variance group") == 4
    page.screenshot(path=SHOTS / "group-zero-variance.png", full_page=True)
    page.locator("#group-grid .member").first.click()
    page.locator("#training-calls tbody tr").first.wait_for()
    assert "zero-variance group" in page.locator("#training-calls").inner_text()
    assert "skipped" in page.locator("#training-calls").inner_text().lower()


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_a_grpo_version_is_diffed_against_the_previous_one(run_page: Any, trained: Trained) -> None:
    page = run_page
    versions = httpx.get(f"{trained.url}/ui/api/resources").json()["items"]
    newest = versions[0]
    page.goto(f"{trained.url}/ui/#/resources/{newest['resources_id']}")
    title = page.locator("#diff-title")
    title.wait_for()
    assert "First version" not in title.inner_text()
    assert f"v{newest['version'] - 1} · weights" in title.inner_text()
    assert page.locator("#version-detail .diff .add").count() >= 1  # the weights' version changed
    assert f"weights {newest['model_version']}" in page.locator("#version-detail h3").first.inner_text()
    page.screenshot(path=SHOTS / "resources-grpo.png", full_page=True)


# ----- on-screen defects of a first look, fixed ---------------------------------------------------------


def test_ids_are_shown_whole_and_copy_whole(page: Any, filled: Filled) -> None:
    """A resources id lost its last character (``rs-059bc2d98e42`` read ``rs-059bc2d98e4``), no ellipsis."""
    page.goto(f"{filled.url}/ui/#/rollouts?mode=train")
    page.locator("#rollouts tr[data-rollout]").first.wait_for()
    for row in page.locator("#rollouts tr[data-rollout]").all():
        rollout_id = row.get_attribute("data-rollout")
        cell = row.locator("td.resources .id")
        assert cell.inner_text() == filled.versions[rollout_id]  # the text a copy gets
        assert cell.get_attribute("title") == filled.versions[rollout_id]
        # drawn whole: nothing cut off on screen
        assert cell.evaluate("e => e.scrollWidth <= e.clientWidth"), filled.versions[rollout_id]
    page.goto(f"{filled.url}/ui/#/resources/{filled.v2}")
    parent = page.locator(f"#versions tr[data-resources='{filled.v2}'] td.parent .id")
    parent.wait_for()
    assert parent.inner_text() == filled.v1
    assert filled.v1 in page.locator("#diff-against").inner_text()  # the version labels too


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_a_validation_rollout_is_not_trained_not_skipped(run_page: Any, trained: Trained) -> None:
    """Validation rollouts read "skipped: zero variance" in red, as if GRPO had dropped them."""
    page = run_page
    val = httpx.get(f"{trained.url}/ui/api/rollouts", params={"mode": "val", "limit": 1000}).json()["items"]
    assert val, "the run validated every step"
    flat = next((r for r in val if r["group_id"]), val[0])
    page.goto(f"{trained.url}/ui/#/rollout/{flat['rollout_id']}")
    summary = page.locator("#training-summary")
    summary.wait_for()
    assert "validation: not trained" in summary.inner_text()
    assert "zero variance" not in summary.inner_text()
    assert "skipped" not in page.locator("#training").inner_text().lower()
    summary.screenshot(path=SHOTS / "fix-validation-not-trained.png")
    if flat["group_id"]:
        page.goto(f"{trained.url}/ui/#/group/{flat['group_id']}")
        page.locator("#group-grid .member").first.wait_for()
        assert "validation: not trained" in page.locator("h2").inner_text()
        assert page.locator("#zero-variance").count() == 0


def _no_update_steps(trained: Trained) -> set[tuple[str, int]]:
    """(run, step) of every step of the two runs that trained on no sample, from their metrics.csv."""
    out = set()
    for run in ("lr-1e-3", "lr-1e-2"):
        with (trained.out.parent / run / "metrics.csv").open() as f:
            out |= {
                (run, int(row["step"]))
                for row in csv.DictReader(f)
                if float(row.get("samples") or "nan") == 0
            }
    return out


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_overlaid_runs_keep_their_own_no_update_markers_and_steps(run_page: Any, trained: Trained) -> None:
    """One run's no-update markers were drawn for every run, and any run's point opened this store's step."""
    page = run_page
    expected = _no_update_steps(trained)
    assert expected, "seed 3 makes step 2 of each run draw only zero-variance groups"
    page.goto(f"{trained.url}/ui/#/curves")
    loss = page.locator(".chart[data-title='loss']")
    loss.locator("line.no-update").first.wait_for(state="attached")  # a vertical line: no width to be visible
    drawn = loss.locator("line.no-update").evaluate_all("ls => ls.map(l => [l.dataset.run, +l.dataset.x])")
    assert {(run, x) for run, x in drawn} == expected and len(drawn) == len(expected)
    colors = loss.locator(".legend > span").evaluate_all(
        "ss => Object.fromEntries(ss.filter(s => s.children.length).map(s => [s.innerText.trim().slice(2), s.firstChild.style.color]))"
    )
    for line in loss.locator("line.no-update").all():  # each in its own run's colour
        run = line.get_attribute("data-run")
        assert line.evaluate("l => l.style.stroke") == colors[run], (run, colors)
    page.locator("#runs input").first.uncheck()  # hide lr-1e-2: its markers go with it
    page.wait_for_function(
        "!document.querySelector(\".chart[data-title='loss'] line.no-update[data-run='lr-1e-2']\")"
    )
    assert {line.get_attribute("data-run") for line in loss.locator("line.no-update").all()} == {"lr-1e-3"}
    page.locator("#runs input").first.check()
    reward = page.locator(".chart[data-title='reward_mean']")
    reward.locator("circle[data-series='lr-1e-2'][data-x='1']").wait_for()
    # dispatched to the circle itself: seeded runs share step 1, so the other run's point may lie on top of it
    reward.locator("circle[data-series='lr-1e-2'][data-x='1']").dispatch_event("click")
    note = page.locator("#step-elsewhere")
    note.wait_for()
    assert "run=lr-1e-2" in page.url and page.locator("#step-run").inner_text() == "lr-1e-2"
    assert str(trained.out.parent / "lr-1e-2" / "store.db") in note.inner_text()
    assert page.locator("#step-groups").count() == 0  # not this store's groups under another run's name
    page.screenshot(path=SHOTS / "fix-other-run-step.png")
    page.goto(f"{trained.url}/ui/#/curves")
    reward.locator("circle[data-series='lr-1e-3'][data-x='1']").dispatch_event("click")
    page.locator("#step-groups tbody tr").first.wait_for()
    assert "run=lr-1e-3" in page.url and page.locator("#step-run").inner_text() == "lr-1e-3"


def test_a_tool_result_names_its_tool(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollout/{filled.tool_rollout}")
    result = page.locator("#transcript .msg.tool").first
    result.wait_for()
    assert result.locator(".tool-name").inner_text().strip() == "lookup"  # the call it answers named it
    assert "3 dollars" in result.inner_text()
    result.screenshot(path=SHOTS / "fix-tool-name.png")


def test_a_zero_reward_is_not_drawn_as_a_success(page: Any, filled: Filled) -> None:
    store = httpx.Client(base_url=f"{filled.url}/v1/agl", headers={"Authorization": f"Bearer {TOKEN}"})
    claim = store.post("/rollouts/start", json={"rollout": {"input": "score zero", "mode": "test"}}).json()
    rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
    filled.rewards[rollout_id], filled.modes[rollout_id] = 0.0, "test"
    reward = Span.new(rollout_id, attempt_id, sc.SPAN_REWARD, {sc.REWARD_VALUE: 0.0})
    store.post("/spans", json={"spans": [reward.model_dump(mode="json")]}).raise_for_status()
    store.patch(
        f"/rollouts/{rollout_id}/attempts/{attempt_id}", json={"status": "succeeded"}
    ).raise_for_status()
    store.close()
    page.goto(f"{filled.url}/ui/#/rollout/{rollout_id}")
    zero = page.locator("#transcript .card.reward .big-reward")
    zero.wait_for()
    assert zero.inner_text() == "0.000"
    green = page.evaluate("getComputedStyle(document.documentElement).getPropertyValue('--ok').trim()")
    color = zero.evaluate("e => getComputedStyle(e).color")
    ok = page.evaluate(
        f"(() => {{ const e = document.createElement('b'); e.style.color = '{green}'; document.body.append(e); const c = getComputedStyle(e).color; e.remove(); return c; }})()"
    )
    assert color != ok, color
    page.goto(f"{filled.url}/ui/#/rollout/{filled.tool_rollout}")  # a positive reward stays green
    positive = page.locator("#transcript .card.reward .big-reward", has_text="0.800")
    positive.wait_for()
    assert positive.evaluate("e => getComputedStyle(e).color") == ok


def test_the_error_filter_lists_the_error_types_seen(page: Any, filled: Filled) -> None:
    page.goto(f"{filled.url}/ui/#/rollouts")
    option = page.locator("#error option", has_text="ValueError")
    option.wait_for(state="attached")
    assert option.inner_text() == "ValueError (1)"
    page.select_option("#error", "ValueError")
    page.wait_for_function("location.hash.includes('error=ValueError')")
    page.wait_for_function("document.querySelectorAll('#rollouts tr[data-rollout]').length === 1")
    assert rows(page) == [filled.failed]
    assert page.input_value("#error") == "ValueError"  # the choice stays shown


def test_a_validation_curve_is_a_line_not_dots(page: Any, filled: Filled) -> None:
    """Validation is logged every other step: its points are joined, not left as dots between gaps."""
    page.goto(f"{filled.url}/ui/#/curves")
    val = page.locator(".chart[data-title='val_reward']")
    val.locator("circle").first.wait_for()
    assert val.locator("circle").count() == 3
    (line,) = val.locator("polyline").all()
    assert len((line.get_attribute("points") or "").split()) == 3
    loss = page.locator(".chart[data-title='loss'] polyline")  # a metric on every step: one line too
    assert len((loss.get_attribute("points") or "").split()) == 5


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_metric_panels_key_curves_first_the_rest_folded(run_page: Any, trained: Trained) -> None:
    """A run logs ~40 metrics: they were 40 equal panels, 5,000 px tall, with a flat-zero kl up top."""
    page = run_page
    with (trained.out / "metrics.csv").open() as f:
        table = list(csv.DictReader(f))
    columns = [c for c in table[0] if c != "step"]
    page.goto(f"{trained.url}/ui/#/curves")
    page.locator("#key-charts .chart").first.wait_for()
    key = page.locator("#key-charts .chart").evaluate_all("cs => cs.map(c => c.dataset.title)")
    assert key[:3] == ["reward_mean", "val_reward", "loss"] and len(key) <= 7
    flat = [c for c in ("kl", "clip_fraction") if c in columns and all(float(r[c] or 0) == 0 for r in table)]
    for column in flat:  # zero on every step: not in the key row, but still there, folded
        assert column not in key and page.locator(f"details .chart[data-title='{column}']").count() == 1
        assert column in page.locator("#flat-key").inner_text()
    folded = page.locator("details.metric-group")
    assert folded.count() >= 2 and all(not d.evaluate("d => d.open") for d in folded.all())
    every = page.locator("#metric-charts .chart").evaluate_all("cs => cs.map(c => c.dataset.title)")
    assert sorted(every) == sorted(columns)  # each metric once
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 2200, height  # the page is a screen or two, not 5,000 px
    page.screenshot(path=SHOTS / "fix-metric-groups.png", full_page=True)
    folded.first.locator("summary").click()
    assert folded.first.locator(".chart").first.is_visible()


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_a_rollout_page_of_a_real_run_durations_agents_and_untrained_samples(
    run_page: Any, trained: Trained
) -> None:
    page = run_page
    flat = next(g for g in _groups(trained, 2) if g["zero_variance"])
    rollout_id = httpx.get(f"{trained.url}/ui/api/groups/{flat['group_id']}").json()["rollouts"][0][
        "rollout_id"
    ]
    one = httpx.get(f"{trained.url}/ui/api/rollouts/{rollout_id}").json()
    r, first = one["rollout"], one["attempts"][0]
    page.goto(f"{trained.url}/ui/#/rollout/{rollout_id}")
    page.locator("#training-calls tbody tr").first.wait_for()
    # the duration: from the claim, not from the first span (seconds of model calls read as a few ms)
    shown = page.locator("#rollout-times").inner_text()
    seconds = _seconds(re.search(r"\(([^)]+)\)", shown).group(1))  # type: ignore[union-attr]
    assert seconds == pytest.approx(r["ended_at"] - first["started_at"], abs=0.01)
    assert seconds == pytest.approx(r["ended_at"] - r["started_at"], abs=0.05)  # the store stamps the claim
    # the calls carry the rollout's agent (count_agent names no agent on its calls)
    assert page.locator("#training-calls tbody td:nth-child(2)").all_inner_texts() == ["count_agent"] * 2
    # a skipped sample's completion tokens are not "trained on"
    header = page.locator(".sample .title").first.inner_text()
    assert "trained on" not in header and "(not trained)" in header
    page.goto(f"{trained.url}/ui/#/rollouts")
    cell = page.locator(f"tr[data-rollout='{rollout_id}'] td.duration")
    if cell.count():  # on the first page: the list shows the same duration
        assert _seconds(cell.inner_text()) == pytest.approx(seconds, abs=0.01)


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) / 1000 if unit == "ms" else float(value)


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_a_rollout_page_does_not_wait_for_its_tokenizer(run_page: Any, trained: Trained) -> None:
    """The first page after a start sat on "loading…" for 2.6 s while a tokenizer loaded."""
    page = run_page
    # step 3's weights: a version whose tokenizer no earlier test here has asked for
    live = next(g for g in _groups(trained, 3) + _groups(trained, 1) if not g["zero_variance"])
    rollout_id = httpx.get(f"{trained.url}/ui/api/groups/{live['group_id']}").json()["rollouts"][1][
        "rollout_id"
    ]
    page.goto(f"{trained.url}/ui/#/curves")
    page.locator("#key-charts").wait_for()
    page.evaluate(f"window.__t0 = performance.now(); location.hash = '#/rollout/{rollout_id}'")
    page.locator("#trace").wait_for()
    drawn_ms = page.evaluate("performance.now() - window.__t0")
    assert drawn_ms < 1000, drawn_ms  # ~50 ms on an idle machine; the tokenizer takes seconds
    page.locator(".sample .strip").first.wait_for()
    page.wait_for_function("!document.querySelector('.tokenizer-note')", timeout=60_000)  # decoded later
    title = page.locator(".sample .strip .tok").first.get_attribute("title") or ""
    assert re.search(r'id \d+ · ".*"', title), title  # each token's text, decoded


@pytest.mark.slow  # the session's two tiny-model GRPO runs (~40 s, shared with test_training)
def test_what_changed_step_by_step_on_a_real_run(run_page: Any, trained: Trained) -> None:
    """Validation ran before the first step and after each: each version against the one before."""
    page = run_page
    page.goto(f"{trained.url}/ui/#/changes")
    steps = page.locator("#changes-steps tbody tr")
    steps.first.wait_for()
    updates = [row for row in trained.history if row["samples"] > 0]  # a step without one publishes none
    assert steps.count() == len(updates) == 2  # v0 -> v1 -> v2, each validated
    steps.nth(1).click()
    page.locator("#changes-steps tbody tr.selected").wait_for()
    assert page.locator("#changes-steps tbody tr.selected").inner_text().startswith("v")
    assert "the same" in page.locator("#changes-summary").inner_text()
