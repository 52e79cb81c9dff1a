"""Flags and exports through the dashboard's API, against the real ``filled`` store: a flag persists in
the store (a second dashboard on the same file sees it), and the flagged or filtered rollouts come out as
SFT JSONL that ``WarmStart.from_jsonl`` reads back with its tools, or as ``agl eval`` tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl.asgi_server import BackgroundServer
from agl.dashboard import standalone_app
from agl.store import SqliteLightningStore
from tests.dashboard.conftest import TOKEN, TOOLS, Filled

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def http(filled: Filled) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=filled.url, headers=AUTH, timeout=30) as client:
        yield client


def flag(http: httpx.Client, rollout_id: str, flagged: bool) -> None:
    answer = http.post(f"/ui/api/rollouts/{rollout_id}/flag", json={"flagged": flagged})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"rollout_id": rollout_id, "flagged": flagged}


def listed(http: httpx.Client, **params: Any) -> list[str]:
    answer = http.get("/ui/api/rollouts", params=params)
    assert answer.status_code == 200, answer.text
    return [r["rollout_id"] for r in answer.json()["items"]]


@pytest.fixture
def two_flagged(http: httpx.Client, filled: Filled) -> Iterator[list[str]]:
    """The two v2 train rollouts that called the lookup tool, flagged; unflagged afterwards (the store is shared)."""
    picked = [
        r
        for r, v in filled.versions.items()
        if v == filled.v2 and filled.modes[r] == "train" and r != filled.failed
    ]
    assert len(picked) == 2 and filled.tool_rollout in picked
    for r in picked:
        flag(http, r, True)
    yield picked
    for r in picked:
        flag(http, r, False)


def test_a_flag_persists_in_the_store_and_filters_the_list(
    http: httpx.Client, filled: Filled, two_flagged: list[str]
) -> None:
    assert sorted(listed(http, flagged=1)) == sorted(two_flagged)
    assert listed(http, flagged=1, q="pear") == [r for r in two_flagged if r != filled.tool_rollout]
    shown = http.get(f"/ui/api/rollouts/{filled.tool_rollout}").json()["rollout"]
    assert shown["metadata"]["agl.flag"] == 1
    # a restarted dashboard (a new process's store on the same file) sees the same flags
    again = SqliteLightningStore(str(filled.metrics_dir.parent / "store.db"))
    with BackgroundServer(standalone_app(again)) as server, httpx.Client(base_url=server.url) as other:
        assert sorted(listed(other, flagged=1)) == sorted(two_flagged)
    flag(http, filled.tool_rollout, False)
    assert listed(http, flagged=1) == [r for r in two_flagged if r != filled.tool_rollout]


def test_flag_rejects_bad_input_by_field(http: httpx.Client, filled: Filled) -> None:
    path = f"/ui/api/rollouts/{filled.tool_rollout}/flag"
    bad = http.post(path, json={"flagged": "yes"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "flagged"
    form = http.post(
        path, content=b"flagged=true", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert form.status_code == 422 and form.json()["error"]["field"] == "body"  # no cross-site form posts
    broken = http.post(path, content=b"{", headers={"Content-Type": "application/json"})
    assert broken.status_code == 422 and broken.json()["error"]["field"] == "body"
    assert http.post("/ui/api/rollouts/ro-nope/flag", json={"flagged": True}).status_code == 404
    assert httpx.post(f"{filled.url}{path}", json={"flagged": True}).status_code == 401  # no token
    assert http.get(path).status_code == 404  # POST only
    for params, field in (({"format": "csv"}, "format"), ({"format": "sft", "flagged": "2"}, "flagged")):
        answer = http.get("/ui/api/export", params=params)
        assert answer.status_code == 422 and answer.json()["error"]["field"] == field, answer.text
    answer = http.get("/ui/api/export", params={"format": "eval", "status": "done"})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "status"


def test_flagged_rollouts_export_as_sft_jsonl_that_warm_start_reads_back(
    http: httpx.Client, filled: Filled, two_flagged: list[str], tmp_path: Path
) -> None:
    from agl.algorithm.grpo.warm_start import WarmStart
    from agl.algorithm.sft.samples import samples_from_messages

    answer = http.get("/ui/api/export", params={"format": "sft", "flagged": 1})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-disposition"] == 'attachment; filename="agl-sft-flagged-2.jsonl"'
    assert answer.headers["x-agl-exported"] == "2" == answer.headers["x-agl-matched"]
    path = tmp_path / "flagged.jsonl"
    path.write_bytes(answer.content)
    warm = WarmStart.from_jsonl(path, steps=1)
    assert warm.tools == TOOLS
    assert len(warm.conversations) == 2
    for messages in warm.conversations:
        roles = [m["role"] for m in messages]
        assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
        (call,) = messages[2]["tool_calls"]
        assert call["function"]["name"] == "lookup"
        assert messages[3]["tool_call_id"] == call["id"] and "costs 3 dollars" in messages[3]["content"]
        assert messages[-1]["content"].startswith("tool result:")  # the upstream's answer after the tool
    # and the conversations train: the tiny model's chat template renders them with the tools
    from transformers import AutoTokenizer

    from agl.models import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model()))
    samples = samples_from_messages(tokenizer, list(warm.conversations), warm.tools)
    assert len(samples) == 4 and all(sum(s.loss_mask) > 0 for s in samples)  # two assistant turns each


def test_flagged_or_filtered_rollouts_export_as_eval_tasks(
    http: httpx.Client, filled: Filled, two_flagged: list[str], tmp_path: Path
) -> None:
    from agl.cli.train import read_jsonl  # what `agl eval --tasks` reads

    def tasks(**params: Any) -> list[Any]:
        answer = http.get("/ui/api/export", params={"format": "eval", **params})
        assert answer.status_code == 200, answer.text
        path = tmp_path / "tasks.jsonl"
        path.write_bytes(answer.content)
        assert len(answer.text.splitlines()) == int(answer.headers["x-agl-exported"])
        return read_jsonl(path, "--tasks")

    flagged = tasks(flagged=1)
    assert sorted(json.dumps(t, sort_keys=True) for t in flagged) == sorted(
        json.dumps(t, sort_keys=True) for t in _inputs(http, two_flagged)
    )
    assert {t["question"] for t in tasks(mode="val")} == {
        "what does a plum cost?",
        "use the lookup tool: plum",
    }
    assert tasks(mode="val", q="lookup") == [{"question": "use the lookup tool: plum", "reward": 0.9}]


def _inputs(http: httpx.Client, rollout_ids: list[str]) -> list[Any]:
    return [http.get(f"/ui/api/rollouts/{r}").json()["rollout"]["input"] for r in rollout_ids]


def test_the_export_path_imports_no_torch() -> None:
    code = (
        "import sys, agl.dashboard.app, agl.dashboard.export, agl.dashboard.replay; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # a request must not wait seconds on torch's import
