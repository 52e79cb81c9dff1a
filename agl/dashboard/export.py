"""From rollouts to data sets: flags a person sets on rollouts (kept in the store, rollout metadata
``agl.flag``), and the flagged or filtered rollouts exported as SFT/warm-start JSONL or as ``agl eval`` tasks.

The SFT file is OpenAI chat JSONL with the tools each conversation declared, as
:func:`agl.algorithm.chat_jsonl.export_jsonl` writes it (``WarmStart.from_jsonl`` reads it back); the eval
file holds one task input, as JSON, a line (what ``agl eval --tasks`` reads).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal, get_args

from starlette.requests import Request
from starlette.responses import Response

from agl.algorithm.chat_jsonl import chat_line, conversation
from agl.dashboard import inputs
from agl.dashboard.inputs import BadRequest
from agl.schemas import Rollout, Span
from agl.store.read_model import RolloutSearch, RolloutSort, StoreWithReadModel

#: the rollout metadata key of a person's flag: 1 flagged, 0 not (an integer: every store compares it alike)
FLAG = "agl.flag"
#: the most rollouts one export writes (the first ones, oldest first)
EXPORT_MAX = 10_000
#: rollouts whose spans are read at once while exporting
READ_AT_ONCE = 32
Format = Literal["sft", "eval"]
SORTS = frozenset(get_args(RolloutSort))


def is_flagged(rollout: Rollout) -> bool:
    """Whether a person flagged the rollout."""
    return rollout.metadata.get(FLAG) == 1


async def set_flag(store: StoreWithReadModel, rollout_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """Flag or unflag a rollout (``{"flagged": true|false}``); the flag merges into its metadata, so every
    browser and a restarted dashboard see it."""
    wanted = body.get("flagged")
    if not isinstance(wanted, bool):
        raise BadRequest("flagged", f"flagged must be true or false, got {wanted!r}")
    updated = await store.update_rollout(rollout_id, metadata={FLAG: 1 if wanted else 0})
    return {"rollout_id": updated.rollout_id, "flagged": is_flagged(updated)}


def rollout_search(request: Request, *, limit: int, offset: int, descending: bool = True) -> RolloutSearch:
    """The rollout list's filters (``q``, ``status``, ``mode``, ``group_id``, ``resources_id``, ``agent``,
    ``error``, ``flagged``, ``reward_min``, ``reward_max``, ``calls_min``, ``calls_max``, ``sort``,
    ``order``) as a store search; a bad one is a 422 naming it."""
    q = request.query_params
    sort = q.get("sort") or "created"
    if sort not in SORTS:
        raise BadRequest("sort", f"sort must be one of {sorted(SORTS)}, got {sort!r}")
    order = q.get("order") or ("desc" if descending else "asc")
    if order not in ("asc", "desc"):
        raise BadRequest("order", f"order must be 'asc' or 'desc', got {order!r}")
    return RolloutSearch(
        text=(q.get("q") or "").strip() or None,
        status=inputs.statuses(request),
        mode=q.get("mode") or None,
        group_id=q.get("group_id") or None,
        resources_id=q.get("resources_id") or None,
        agent=q.get("agent") or None,
        error_type=q.get("error") or None,
        metadata={FLAG: 1} if inputs.flagged(request) else None,
        reward_min=inputs.query_float(request, "reward_min"),
        reward_max=inputs.query_float(request, "reward_max"),
        calls_min=inputs.query_count(request, "calls_min"),
        calls_max=inputs.query_count(request, "calls_max"),
        sort=sort,  # type: ignore[arg-type]  # one of SORTS, checked above
        descending=order == "desc",
        limit=limit,
        offset=offset,
    )


async def _matches(store: StoreWithReadModel, request: Request) -> tuple[list[Rollout], int]:
    """The rollouts the export's filters match (at most EXPORT_MAX, oldest first unless sorted) and how many match."""
    found: list[Rollout] = []
    total = 0
    while len(found) < EXPORT_MAX:
        search = rollout_search(
            request, limit=min(1000, EXPORT_MAX - len(found)), offset=len(found), descending=False
        )
        page = await store.search_rollouts(search)
        found += [x.rollout for x in page.items]
        total = page.total
        if not page.items or len(found) >= total:
            break
    return found, total


def _sft_lines(spans: list[list[Span]]) -> list[str]:
    """Each rollout's conversation with its tools as a chat JSONL line; rollouts without one are left out."""
    lines = []
    for its_spans in spans:
        messages, tools = conversation(its_spans)
        if messages:
            lines.append(chat_line(messages, tools))
    return lines


async def export(store: StoreWithReadModel, request: Request, max_spans: int) -> Response:
    """The flagged or filtered rollouts as a file download: ``format=sft`` (chat JSONL with tools) or
    ``format=eval`` (one task input a line). Headers say how many matched and how many lines were written."""
    fmt = request.query_params.get("format") or ""
    if fmt not in get_args(Format):
        raise BadRequest(
            "format", f"format must be 'sft' (chat JSONL) or 'eval' (agl eval tasks), got {fmt!r}"
        )
    rollouts, total = await _matches(store, request)
    if fmt == "eval":
        lines = [json.dumps(r.input) for r in rollouts]
    else:
        lines = []
        for start in range(0, len(rollouts), READ_AT_ONCE):
            chunk = rollouts[start : start + READ_AT_ONCE]
            pages = await asyncio.gather(
                *(
                    store.query_spans(rollout_id=r.rollout_id, attempt_id="latest", limit=max_spans)
                    for r in chunk
                )
            )
            lines += await asyncio.to_thread(_sft_lines, [p.items for p in pages])
    which = "flagged" if inputs.flagged(request) else "filtered"
    name = f"agl-{fmt}-{which}-{len(lines)}.jsonl"
    return Response(
        "".join(line + "\n" for line in lines),
        media_type="application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="{name}"',
            "X-Agl-Matched": str(total),
            "X-Agl-Exported": str(len(lines)),
        },
    )
