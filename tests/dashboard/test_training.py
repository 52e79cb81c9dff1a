"""The training views on a real GRPO run's store: groups, advantages, skip reasons and merged samples,
checked against GRPO's own batch code on the same spans."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.adapter import llm_calls, to_samples
from agl.adapter.trajectory import classify_mismatch
from agl.algorithm.grpo import GRPOConfig, build_batch
from agl.store import SqliteLightningStore
from tests.dashboard.conftest import Trained

pytestmark = pytest.mark.slow  # two tiny-model GRPO runs (~30 s on a busy machine)


@pytest.fixture(scope="module")
def http(trained: Trained) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=trained.url, timeout=60) as client:
        yield client


def get(http: httpx.Client, path: str, **params: Any) -> Any:
    response = http.get(f"/ui/api/{path}", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _batch(trained: Trained, group_id: str) -> Any:
    async def read() -> Any:
        store = SqliteLightningStore(str(trained.out / "store.db"))
        members = (await store.query_rollouts(group_id=group_id, limit=100)).items
        spans = {
            r.rollout_id: (await store.query_spans(rollout_id=r.rollout_id, attempt_id="latest")).items
            for r in members
        }
        await store.aclose()
        return members, build_batch(members, spans, GRPOConfig(model_path="-", scale_by_std=False))

    return asyncio.run(read())


def _calls(trained: Trained, rollout_id: str) -> list[Any]:
    async def read() -> list[Any]:
        store = SqliteLightningStore(str(trained.out / "store.db"))
        spans = (await store.query_spans(rollout_id=rollout_id, attempt_id="latest")).items
        await store.aclose()
        return llm_calls(spans)

    return asyncio.run(read())


def test_each_steps_groups_and_their_zero_variance(http: httpx.Client, trained: Trained) -> None:
    for step, row in enumerate(trained.history, start=1):
        groups = get(http, "groups", step=step)["items"]
        assert len(groups) == 2 and all(g["rollouts"] == 4 for g in groups)
        flat = [g for g in groups if g["zero_variance"]]
        assert len(flat) == row["zero_variance_groups"]  # what the step itself counted
        for g in groups:
            assert g["zero_variance"] == (len(set(g["rewards"])) == 1)
    no_update = get(http, "groups", step=2)["items"]  # seed 3 draws the two constant tasks
    assert all(g["zero_variance"] for g in no_update) and trained.history[1]["samples"] == 0


def test_the_group_view_matches_grpo_s_batch(http: httpx.Client, trained: Trained) -> None:
    groups = get(http, "groups", step=1)["items"]
    live = next(g for g in groups if not g["zero_variance"])
    view = get(http, f"groups/{live['group_id']}")
    members, batch = _batch(trained, live["group_id"])
    expected = {members[i].rollout_id: a for a, i in zip(batch.advantages, batch.rollout_index, strict=True)}
    assert {r["rollout_id"]: r["advantage"] for r in view["rollouts"]} == pytest.approx(expected)
    assert all(r["trained"] and r["reason"] is None for r in view["rollouts"])
    assert view["zero_variance"] is False and view["step"] == 1 and view["input"] == "count"
    assert view["source"] == "record" and view["settings"]["scale_by_std"] is False
    # the run's loss weights: each trained rollout's share of step 1's loss (they sum to 1 over the step)
    assert all(0 < r["loss_weight"] <= 1 for r in view["rollouts"])
    # asking for GRPOConfig's default (std scaling) is a what-if: other advantages, and the view says so
    what_if = get(http, f"groups/{live['group_id']}", scale_by_std="true")
    assert what_if["source"] == "what_if" and what_if["settings"]["scale_by_std"] is True
    spread = statistics.pstdev(r["reward"] for r in view["rollouts"])
    scaled = {r["rollout_id"]: r["advantage"] for r in what_if["rollouts"]}
    for r in view["rollouts"]:
        assert scaled[r["rollout_id"]] == pytest.approx(r["advantage"] / (spread + 1e-6), rel=1e-3)
    assert abs(sum(r["advantage"] for r in view["rollouts"])) < 1e-6  # group-relative: they sum to 0
    flat = next(g for g in groups if g["zero_variance"])
    skipped = get(http, f"groups/{flat['group_id']}")
    assert skipped["zero_variance"] is True and skipped["trained_samples"] == 0
    assert all(not r["trained"] and "zero-variance" in r["reason"] for r in skipped["rollouts"])
    assert _batch(trained, flat["group_id"])[1].samples == []


def test_a_rollout_s_calls_samples_and_token_strip(http: httpx.Client, trained: Trained) -> None:
    live = next(g for g in get(http, "groups", step=1)["items"] if not g["zero_variance"])
    rollout_id = get(http, f"groups/{live['group_id']}")["rollouts"][0]["rollout_id"]
    t = get(http, f"rollouts/{rollout_id}/training")
    assert [c["trained"] for c in t["calls"]] == [True, True]
    calls = _calls(trained, rollout_id)
    expected, _ = to_samples(calls, 0.0)  # the adapter GRPO uses, on the same spans
    assert [s["input_ids"] for s in t["samples"]] == [list(e.input_ids) for e in expected]
    assert [s["loss_mask"] for s in t["samples"]] == [list(e.loss_mask) for e in expected]
    assert [s["call_spans"] for s in t["samples"]] == [[list(c) for c in e.call_spans] for e in expected]
    assert sum(s["num_calls"] for s in t["samples"]) == 2 and all(s["trained"] for s in t["samples"])
    if len(t["samples"]) == 1:  # the second turn's prompt extends the first call: merged
        assert t["samples"][0]["mismatch"] is None
    else:  # the engine re-tokenized the first reply differently: a new sample, and the view says why
        mismatch = t["samples"][1]["mismatch"]
        assert mismatch["class"] == classify_mismatch(calls[0], calls[1].prompt_token_ids or [])
        before = t["samples"][0]["input_ids"]
        after = list(calls[1].prompt_token_ids or [])
        assert after[: mismatch["at"]] == before[: mismatch["at"]]
        assert (
            mismatch["at"] == min(len(before), len(after)) or after[mismatch["at"]] != before[mismatch["at"]]
        )
    for sample in t["samples"]:
        mask = sample["loss_mask"]
        for a, b in sample["call_spans"]:
            assert 0 < a < b <= sample["length"] and mask[a:b] == [1] * (b - a)
        assert sum(mask) == sample["model_tokens"]
        assert all(lp == 0.0 for lp, m in zip(sample["logprobs"], mask, strict=True) if not m)
        assert all(lp < 0 for lp, m in zip(sample["logprobs"], mask, strict=True) if m)
    t = _decoded(http, f"rollouts/{rollout_id}/training")  # the tokenizer loads in the background
    assert t["tokenizer"] is True and t["tokenizer_loading"] is False
    assert all(len(sample["texts"]) == sample["length"] for sample in t["samples"])
    flat = next(g for g in get(http, "groups", step=2)["items"])
    skipped_id = get(http, f"groups/{flat['group_id']}")["rollouts"][0]["rollout_id"]
    skipped = get(http, f"rollouts/{skipped_id}/training")
    assert all(not c["trained"] and "zero-variance" in c["reason"] for c in skipped["calls"])
    only = get(http, f"rollouts/{rollout_id}/training", agents="writer")
    assert all(c["reason"].startswith("agent filtered out") for c in only["calls"])
    long = get(http, f"rollouts/{rollout_id}/training", max_sample_tokens=5)
    assert long["samples"][0]["reason"].startswith("overlong") and not long["calls"][0]["trained"]
    bad = http.get(f"/ui/api/rollouts/{rollout_id}/training", params={"level": "turn"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "level"


def _decoded(http: httpx.Client, path: str) -> Any:
    """The training view once its tokenizer has loaded (the first answers come with token ids)."""
    deadline = time.monotonic() + 60
    while (t := get(http, path))["tokenizer_loading"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return t


def test_the_first_training_view_does_not_wait_for_the_tokenizer(trained: Trained) -> None:
    """Loading a tokenizer takes seconds; the page gets token ids at once, and text once it loaded."""
    from agl.dashboard import create_dashboard
    from agl.dashboard.training import load_tokenizer

    async def check() -> None:
        load_tokenizer.cache_clear()  # as after a start: nothing loaded yet
        store = SqliteLightningStore(str(trained.out / "store.db"))
        app = create_dashboard(store)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dash", timeout=60) as client:
            groups = (await client.get("/ui/api/groups", params={"step": 1})).json()["items"]
            live = next(g for g in groups if not g["zero_variance"])
            group = (await client.get(f"/ui/api/groups/{live['group_id']}")).json()
            path = f"/ui/api/rollouts/{group['rollouts'][0]['rollout_id']}/training"
            first = (await client.get(path)).json()
            assert first["tokenizer"] is False and first["tokenizer_loading"] is True
            assert first["samples"] and all(s["texts"] is None for s in first["samples"])
            deadline = time.monotonic() + 60
            while (t := (await client.get(path)).json())["tokenizer_loading"]:
                assert time.monotonic() < deadline, "the tokenizer never finished loading"
                await asyncio.sleep(0.1)
            assert t["tokenizer"] is True
            assert all(len(s["texts"]) == s["length"] for s in t["samples"])
        await store.aclose()

    asyncio.run(check())


def test_every_step_records_what_it_trained_on_each_rollout(trained: Trained) -> None:
    """The training record the views read: one per train rollout of each step, advantages that are
    the Dr. GRPO ones the run used, loss weights summing to 1 over a step, skip reasons where none."""

    async def read() -> list[Any]:
        store = SqliteLightningStore(str(trained.out / "store.db"))
        rows = (await store.query_rollouts(mode="train", limit=1000)).items
        await store.aclose()
        return rows

    rollouts = asyncio.run(read())
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in rollouts:
        record = r.metadata[sc.TRAINING_RECORD]
        assert record["step"] == r.metadata["step"] and record["settings"]["scale_by_std"] is False
        by_step.setdefault(record["step"], []).append(record)
    assert sorted(by_step) == [1, 2, 3] and all(len(v) == 8 for v in by_step.values())
    for step, records in by_step.items():
        weights = [s["loss_weight"] for rec in records for s in rec["samples"]]
        assert len(weights) == trained.history[step - 1]["samples"]
        if weights:
            assert sum(weights) == pytest.approx(1.0)
        for rec in records:
            assert rec["trained"] == bool(rec["samples"]) and (rec["reason"] is None) == rec["trained"]
            for sample in rec["samples"]:
                assert sample["calls"] and all(0 < a < b <= sample["tokens"] for a, b in sample["spans"])
    assert all("zero-variance" in rec["reason"] for rec in by_step[2])


def test_each_step_logs_what_the_agent_did(trained: Trained) -> None:
    """Behaviour curves from the run's own spans: two calls a rollout, no tool, the emitted flag."""
    for row in trained.history:
        assert row["behaviour_calls_per_rollout"] == 2.0 and row["behaviour_tool_call_rate"] == 0.0
        assert 0 < row["behaviour_completion_tokens"] <= 4  # max_tokens=4
        assert 0.0 <= row["emitted_has_digit"] <= 1.0 and "emitted_label" not in row


def test_settings_read_agents_from_a_record_and_make_a_config() -> None:
    """A record's ``agents`` (a JSON list) and an older record's single ``agent`` both give the tuple
    ``GRPOConfig.agents`` takes; several agents make a LoRA config (their samples need no rank)."""
    from agl.dashboard.training import Settings

    assert Settings.recorded({"settings": {"agents": ["solver", "checker"]}}).agents == ("solver", "checker")
    assert Settings.recorded({"settings": {"agent": "solver"}}).agents == ("solver",)
    assert Settings.recorded({"settings": {"agent": None, "level": "transition"}}).agents == ()
    assert Settings(agents=("solver", "checker")).config().agents == ("solver", "checker")
