"""The dashboard's view functions on spans and files no well-behaved agent writes: cycles, orphans, junk."""

from __future__ import annotations

from pathlib import Path

from agl import semconv as sc
from agl.dashboard import views
from agl.schemas import LLM, PromptTemplate, ResourcesVersion, Span


def _span(name: str, span_id: str, parent_id: str | None, start: int, **attributes: object) -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        trace_id="0" * 32,
        span_id=span_id,
        parent_id=parent_id,
        name=name,
        start_time_ns=start,
        end_time_ns=start + 10,
        attributes=attributes,
    )


def test_span_tree_orders_parents_first_and_survives_cycles_and_orphans() -> None:
    a, b, c, d = "a" * 16, "b" * 16, "c" * 16, "d" * 16
    spans = [
        _span("child-late", c, a, 30),
        _span("root", a, None, 10),
        _span("child-early", b, a, 20),
        _span("orphan", d, "e" * 16, 5),  # its parent was never stored: shown as a root
    ]
    tree = views.span_tree(spans)
    assert [(s["name"], s["depth"]) for s in tree] == [
        ("orphan", 0),
        ("root", 0),
        ("child-early", 1),
        ("child-late", 1),
    ]
    cyclic = [_span("x", a, b, 1), _span("y", b, a, 2)]  # foreign spans pointing at each other
    assert sorted(s["name"] for s in views.span_tree(cyclic)) == ["x", "y"]


def test_llm_span_view_reads_content_parts_tool_calls_and_drops_bulky_token_ids() -> None:
    span = _span(
        sc.SPAN_LLM_CALL,
        "a" * 16,
        None,
        1,
        **{
            sc.LLM_REQUEST_MESSAGES: [
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}
            ],
            sc.LLM_RESPONSE_MESSAGE: {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            sc.LLM_PROMPT_TOKEN_IDS: list(range(5000)),
            sc.LLM_REQUEST: {"api_key": "sk-x", "messages": []},
        },
    )
    view = views.span_view(span)
    assert view["category"] == "llm"
    assert view["detail"]["messages"] == [{"role": "user", "content": "hi\n[image_url]"}]
    assert view["detail"]["tool_calls"] == [{"id": "c1", "name": "f", "arguments": "{}"}]
    assert view["attributes"][sc.LLM_PROMPT_TOKEN_IDS] == "<5000 values>"
    assert view["attributes"][sc.LLM_REQUEST] == "<object with 2 keys>" and "sk-x" not in str(view)
    assert view["detail"]["prompt_token_ids"] == 5000 and view["detail"]["completion_token_ids"] is None
    assert view["detail"]["settings"] == {"api_key": "***"}  # the request's settings, secrets hidden


def test_usage_reads_chat_and_responses_api_counts() -> None:
    assert views.usage_of({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }
    assert views.usage_of({"input_tokens": 5, "output_tokens": 2}) == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
    }
    assert views.usage_of(None) == {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None}


def test_resources_diff_lists_added_removed_and_changed_resources() -> None:
    old = ResourcesVersion(
        resources_id="rs-1",
        version=1,
        created_at=0,
        resources={"prompt": PromptTemplate(template="a\nb"), "gone": PromptTemplate(template="x")},
    )
    new = ResourcesVersion(
        resources_id="rs-2",
        version=2,
        created_at=1,
        resources={
            "prompt": PromptTemplate(template="a\nc"),
            "llm": LLM(endpoint="http://h/v1", model="m", api_key="sk-secret"),
        },
    )
    diff = {d["name"]: d for d in views.resources_diff(old, new)}
    assert [(x["op"], x["text"]) for x in diff["prompt"]["lines"]] == [(" ", "a"), ("-", "b"), ("+", "c")]
    assert {x["op"] for x in diff["llm"]["lines"]} == {"+"} and "sk-secret" not in str(diff["llm"])
    assert diff["gone"]["lines"] == [{"op": "-", "text": "x"}]


def test_read_metrics_keeps_numbers_and_blanks_junk(tmp_path: Path) -> None:
    (tmp_path / "run-a").mkdir()
    (tmp_path / "run-a" / "metrics.csv").write_text("step,loss,note\n1,0.5,hello\n2,,nan\n3,inf,2\n")
    (tmp_path / "run-b").mkdir()
    (tmp_path / "run-b" / "metrics.csv").write_bytes(b"step,loss\n\xff\xfe\n")  # not text: skipped
    (run,) = views.read_metrics(tmp_path)
    assert run["name"] == "run-a" and run["columns"] == ["step", "loss", "note"]
    assert run["rows"] == [
        {"step": 1.0, "loss": 0.5, "note": None},
        {"step": 2.0, "loss": None, "note": None},
        {"step": 3.0, "loss": None, "note": 2.0},
    ]
    assert views.read_metrics(tmp_path / "missing") == []
