"""What GRPO trained on, read back from the store: group advantages, skip reasons, merged samples.

A run's own record comes first: each step writes what it trained on into its rollouts' metadata
(``agl.training``, :mod:`agl.algorithm.grpo.record`): settings, trained samples, advantages, loss
weights and skip reasons. Token strips are rebuilt from the spans with GRPO's own adapter under the
recorded settings. A store without a record (an older run, another trainer), or a page that asks for
other settings, gets a re-simulation with GRPO's batch code, and the view says which it shows
(``source``: "record", "simulated" or "what_if"). The GRPO modules import torch, so they load on
first use (in a worker thread) and only for these views.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agl import semconv as sc
from agl.adapter import call_rewards, final_reward, llm_calls, to_samples
from agl.adapter.calls import call_agents, calls_by_agent
from agl.adapter.trajectory import UNTRAINABLE, classify_mismatch, untrainable_reason
from agl.schemas import LLMCall, ModelWeights, ResourcesVersion, Rollout, RolloutStatus, Span

log = logging.getLogger(__name__)
#: tokens of one sample sent to the page (the strip of a longer one is cut, and says so)
MAX_STRIP_TOKENS = 4096


@dataclass(frozen=True)
class Settings:
    """The GRPO settings a view uses: a run's recorded ones, GRPOConfig's defaults, or the page's."""

    level: Literal["trajectory", "transition"] = "trajectory"
    scale_by_std: bool | str = True
    max_sample_tokens: int = 2048
    agents: tuple[str, ...] = ()
    baseline: str = "group"
    credit: str = "final"
    call_reward_weight: float = 1.0

    @classmethod
    def recorded(cls, record: dict[str, Any]) -> Settings:
        """The settings a step recorded (fields this version does not know are left out)."""
        known = cls.__dataclass_fields__
        given = dict(record.get("settings") or {})
        if given.get("agent") is not None:  # a record written before GRPOConfig.agents
            given.setdefault("agents", [given["agent"]])
        found = {k: v for k, v in given.items() if k in known}
        return cls(**{**found, "agents": tuple(found.get("agents") or ())})

    def config(self) -> Any:
        from agl.algorithm.grpo import GRPOConfig

        # several agents train one LoRA adapter each; the rank changes no sample and no advantage
        return GRPOConfig(model_path="-", lora_rank=int(len(self.agents) > 1), **self.__dict__)


Source = Literal["record", "simulated", "what_if"]


def _record(rollout: Rollout) -> dict[str, Any] | None:
    found = rollout.metadata.get(sc.TRAINING_RECORD)
    return found if isinstance(found, dict) else None


def choose_settings(members: Sequence[Rollout], asked: Settings | None) -> tuple[Settings, Source]:
    """The settings to show a group with, and where they come from: the page's (``asked``: a what-if
    when the run left a record), else the run's record, else GRPOConfig's defaults (simulated)."""
    record = next((r for r in map(_record, members) if r is not None), None)
    if asked is not None:
        return asked, "simulated" if record is None else "what_if"
    if record is not None:
        return Settings.recorded(record), "record"
    return Settings(), "simulated"


def _calls_by_agent(spans: list[Span], settings: Settings) -> dict[str | None, list[LLMCall]]:
    """The rollout's calls as GRPO splits them into units (one per agent), in call order."""
    agents = settings.agents
    return calls_by_agent(llm_calls(spans), spans, agents, own_model=len(agents) > 1)


def _flat_keys(rollouts: Sequence[Rollout], spans: dict[str, list[Span]], settings: Settings) -> set[Any]:
    """The (group, agent) units with one reward only: GRPO skips them (zero variance)."""
    from agl.algorithm.grpo import zero_variance_groups

    rewards: list[float] = []
    keys: list[str] = []
    for r in rollouts:
        if r.status != RolloutStatus.SUCCEEDED:
            continue
        agents = list(_calls_by_agent(spans[r.rollout_id], settings)) or ([] if settings.agents else [None])
        for agent in agents:
            rewards.append(final_reward(spans[r.rollout_id]) or 0.0)
            keys.append(repr((r.group_id or r.rollout_id, agent)))
    return zero_variance_groups(rewards, keys)


def _names(settings: Settings) -> str:
    return " or ".join(map(repr, settings.agents))


def _key(rollout: Rollout, agent: str | None) -> str:
    return repr((rollout.group_id or rollout.rollout_id, agent))


def analyse_group(
    rollouts: Sequence[Rollout], spans: dict[str, list[Span]], asked: Settings | None = None
) -> dict[str, Any]:
    """Per rollout of one GRPO group: reward, advantage, and whether (and why not) it is trained:
    as its step recorded, or re-simulated (see :func:`choose_settings`)."""
    from agl.algorithm.grpo import build_batch, group_advantages
    from agl.algorithm.grpo.advantages import std_scale

    settings, source = choose_settings(rollouts, asked)

    batch = build_batch(list(rollouts), spans, settings.config())
    ok = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
    trained: dict[str, list[float]] = defaultdict(list)
    for adv, index in zip(batch.advantages, batch.rollout_index, strict=True):
        trained[ok[index].rollout_id].append(adv)
    rewards = {r.rollout_id: final_reward(spans[r.rollout_id]) or 0.0 for r in ok}
    values = list(rewards.values())
    would = dict(
        zip(
            rewards,
            group_advantages(values, ["g"] * len(values), scale_by_std=std_scale(settings.scale_by_std))
            if values
            else [],
            strict=True,
        )
    )
    flat = _flat_keys(rollouts, spans, settings)
    mean = sum(values) / len(values) if values else None
    std = (sum((v - (mean or 0.0)) ** 2 for v in values) / len(values)) ** 0.5 if values else None
    out = []
    for r in rollouts:
        row: dict[str, Any] = {
            "rollout_id": r.rollout_id,
            "status": r.status.value,
            "mode": r.mode,
            "reward": final_reward(spans.get(r.rollout_id, [])),
            "advantage": None,
            "trained": False,
            "reason": None,
            "samples": len(trained.get(r.rollout_id, [])),
            "output": output_text(spans.get(r.rollout_id, [])),
        }
        if r.rollout_id in trained:
            row["advantage"] = sum(trained[r.rollout_id]) / len(trained[r.rollout_id])
            row["trained"] = True
        else:
            row["advantage"] = would.get(r.rollout_id)
            row["reason"] = _rollout_reason(r, spans.get(r.rollout_id, []), flat, settings)
        if source == "record":
            _recorded_row(row, r)
        out.append(row)
    trained_samples = len(batch.samples)
    if source == "record":
        trained_samples = sum(len(rec["samples"]) for rec in map(_record, rollouts) if rec is not None)
    return {
        "rollouts": out,
        "mean": mean,
        "std": std,
        "zero_variance": bool(values) and len({round(v, 9) for v in values}) == 1,
        "skipped_units": len(flat),
        "trained_samples": trained_samples,
        "metrics": batch.metrics,
        "settings": settings.__dict__,
        "source": source,
    }


def _recorded_row(row: dict[str, Any], rollout: Rollout) -> None:
    """A group row as the rollout's step recorded it (a train rollout without a record was not in the
    step's batch: its group was dropped for a failure, or refill set it aside)."""
    record = _record(rollout)
    if record is None:
        if rollout.mode == "train" and rollout.status == RolloutStatus.SUCCEEDED:
            row.update(
                trained=False,
                advantage=None,
                samples=0,
                reason="not in its step's batch: dropped with its group (see dropped.jsonl) or set aside",
            )
        return
    row.update(
        trained=bool(record.get("trained")),
        advantage=record.get("advantage"),
        reason=record.get("reason"),
        samples=len(record.get("samples") or []),
        loss_weight=sum(float(x.get("loss_weight") or 0.0) for x in record.get("samples") or []),
    )


def _rollout_reason(rollout: Rollout, spans: list[Span], flat: set[Any], settings: Settings) -> str:
    if rollout.mode != "train":
        return f"a {rollout.mode} rollout: GRPO trains on train rollouts only"
    if rollout.status != RolloutStatus.SUCCEEDED:
        return f"rollout {rollout.status.value}: only succeeded rollouts are trained"
    units = _calls_by_agent(spans, settings)
    if not units:
        return f"no call of agent {_names(settings)}" if settings.agents else "no model calls"
    if all(_key(rollout, agent) in flat for agent in units):
        return "zero-variance group: every rollout got the same reward"
    reasons = [untrainable_reason(c) for calls in units.values() for c in calls]
    if all(why is not None for why in reasons):
        return "no trainable call: " + "; ".join(sorted({UNTRAINABLE[why] for why in reasons if why}))
    return "every sample over max_sample_tokens"


def analyse_rollout(
    rollout: Rollout,
    group: Sequence[Rollout],
    spans: dict[str, list[Span]],
    asked: Settings | None = None,
    tokenizer: Any = None,
    tokenizer_loading: bool = False,
) -> dict[str, Any]:
    """Each model call of ``rollout`` trained or skipped (and why), and the merged samples it makes."""
    settings, source = choose_settings(group, asked)
    group_view = analyse_group(group, spans, asked)
    mine = next(row for row in group_view["rollouts"] if row["rollout_id"] == rollout.rollout_id)
    own = spans[rollout.rollout_id]
    reward = final_reward(own) or 0.0
    flat = _flat_keys(group, spans, settings)
    all_calls = llm_calls(own)
    agents = dict(zip((c.span_id for c in all_calls), call_agents(all_calls, own), strict=True))
    # a call no span names an agent for ran in the rollout's agent, when the rollout names just one
    named = {str(s.attributes[sc.AGENT_NAME]) for s in own if sc.AGENT_NAME in s.attributes}
    only_agent = next(iter(named)) if len(named) == 1 else None
    units = _calls_by_agent(own, settings)
    in_unit = {c.span_id for calls in units.values() for c in calls}
    per_call = call_rewards(own)
    calls_out: list[dict[str, Any]] = []
    samples_out: list[dict[str, Any]] = []
    where: dict[str, tuple[int, int]] = {}  # span id -> (sample index, position in it)
    reasons: dict[str, str] = {}
    for agent, calls in units.items():
        made, _ = to_samples(
            calls, reward, level=settings.level, call_rewards=per_call, group_id=rollout.group_id
        )
        by_response = {c.response_id: c for c in calls}
        previous: LLMCall | None = None
        for sample in made:
            index = len(samples_out)
            members = [by_response.get(rid) for rid in sample.call_response_ids]
            first = members[0] if members else None
            mismatch = None
            if previous is not None and first is not None and settings.level == "trajectory":
                prompt = list(first.prompt_token_ids or [])
                before = samples_out[-1]["input_ids_full"]
                at = next(
                    (i for i, (a, b) in enumerate(zip(prompt, before, strict=False)) if a != b),
                    min(len(prompt), len(before)),
                )
                mismatch = {"class": classify_mismatch(previous, prompt), "at": at}
            reason = None
            if rollout.mode != "train" or rollout.status != RolloutStatus.SUCCEEDED:
                reason = mine["reason"]
            elif _key(rollout, agent) in flat:
                reason = "zero-variance group: every rollout got the same reward"
            elif len(sample.input_ids) > settings.max_sample_tokens:
                reason = f"overlong: {len(sample.input_ids)} tokens > max_sample_tokens {settings.max_sample_tokens}"
            view = _sample_view(index, agent, sample, members, mismatch, reason, mine, tokenizer)
            if source == "record":
                reason = _recorded_sample(view, sample, rollout, mine)
            samples_out.append(view)
            for pos, member in enumerate(members):
                if member is not None:
                    where[member.span_id] = (index, pos)
                    if reason:
                        reasons[member.span_id] = reason
            previous = members[-1] if members else previous
    for n, call in enumerate(all_calls):
        row: dict[str, Any] = {
            "index": n,
            "span_id": call.span_id,
            "response_id": call.response_id,
            "agent": agents.get(call.span_id) or only_agent,
            "model_version": call.model_version,
            "prompt_tokens": len(call.prompt_token_ids) if call.prompt_token_ids is not None else None,
            "completion_tokens": (
                len(call.completion_token_ids) if call.completion_token_ids is not None else None
            ),
            "sample": where.get(call.span_id, (None, None))[0],
        }
        if call.span_id not in in_unit and row["agent"] in settings.agents:
            row["reason"] = "answered by the base model, not its agent's LoRA adapter"
        elif call.span_id not in in_unit:
            row["reason"] = f"agent filtered out: GRPO trains agent {_names(settings)} only"
        elif (why := untrainable_reason(call)) is not None:
            row["reason"] = UNTRAINABLE[why]
        else:
            row["reason"] = reasons.get(call.span_id)
        row["trained"] = row["reason"] is None
        calls_out.append(row)
    for shown in samples_out:
        del shown["input_ids_full"]
    return {
        "rollout_id": rollout.rollout_id,
        "group_id": rollout.group_id,
        "group": group_view,
        "calls": calls_out,
        "samples": samples_out,
        "tokenizer": tokenizer is not None,
        "tokenizer_loading": tokenizer_loading,
        "settings": settings.__dict__,
        "source": source,
    }


def _recorded_sample(view: dict[str, Any], sample: Any, rollout: Rollout, mine: dict[str, Any]) -> str | None:
    """Mark a rebuilt sample trained or not, with its advantage and loss weight, as the step recorded
    it (matched by its calls' response ids); returns why it was not trained, None when it was."""
    record = _record(rollout) or {}
    trained = {tuple(x.get("calls") or ()): x for x in record.get("samples") or []}
    hit = trained.get(tuple(sample.call_response_ids))
    if hit is None:
        view.update(
            trained=False, reason=mine["reason"] or "not trained: its step's record lists no such sample"
        )
        view["loss_weight"] = None
        return str(view["reason"])
    view.update(trained=True, reason=None, advantage=hit.get("advantage"), loss_weight=hit.get("loss_weight"))
    return None


def _sample_view(
    index: int,
    agent: str | None,
    sample: Any,
    members: list[LLMCall | None],
    mismatch: dict[str, Any] | None,
    reason: str | None,
    mine: dict[str, Any],
    tokenizer: Any,
) -> dict[str, Any]:
    ids = list(sample.input_ids)
    shown = ids[:MAX_STRIP_TOKENS]
    return {
        "index": index,
        "agent": agent,
        "trained": reason is None,
        "reason": reason,
        "advantage": mine["advantage"],
        "length": len(ids),
        "model_tokens": sample.num_model_tokens,
        "num_calls": sample.num_calls,
        "call_spans": [list(span) for span in sample.call_spans],
        "call_span_ids": [m.span_id if m is not None else None for m in members],
        # calls merged although their prompt re-rendered the previous reply: the strip shows the reply
        "reconciled_calls": sample.reconciled_calls,
        "mismatch": mismatch,
        "input_ids": shown,
        "loss_mask": list(sample.loss_mask)[: len(shown)],
        "logprobs": None if sample.old_logprobs is None else list(sample.old_logprobs)[: len(shown)],
        "texts": decode_each(tokenizer, shown),
        "cut": len(ids) > len(shown),
        "input_ids_full": ids,
    }


def decode_each(tokenizer: Any, ids: list[int]) -> list[str] | None:
    """Each token id as its text piece, or None without a tokenizer."""
    if tokenizer is None:
        return None
    try:
        return [tokenizer.decode([i]) for i in ids]
    except Exception:  # a tokenizer that does not know these ids: show the ids
        return None


def weights_uri(version: ResourcesVersion | None) -> str | None:
    """The local model directory of a version's weights (where its tokenizer lives), if it has one."""
    if version is None:
        return None
    for resource in version.resources.values():
        if isinstance(resource, ModelWeights) and resource.uri and Path(resource.uri).is_dir():
            return resource.uri
    return None


class Tokenizers:
    """Tokenizers loaded in a background thread: a page never waits seconds for one to load.

    :meth:`get` answers at once: the tokenizer when loaded (None when there is none to load), or
    "still loading" after starting the load; the page asks again and then decodes its tokens.
    """

    def __init__(self, keep: int = 4) -> None:
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        self._loading: set[str] = set()
        self._keep = keep

    def get(self, uri: str) -> tuple[Any, bool]:
        """(tokenizer or None, whether it is still loading)."""
        with self._lock:
            if uri in self._loaded:
                self._loaded.move_to_end(uri)
                return self._loaded[uri], False
            if uri not in self._loading:
                self._loading.add(uri)
                threading.Thread(target=self._load, args=(uri,), name="agl-tokenizer", daemon=True).start()
            return None, True

    def _load(self, uri: str) -> None:
        tokenizer = load_tokenizer(uri)
        with self._lock:
            self._loading.discard(uri)
            self._loaded[uri] = tokenizer
            while len(self._loaded) > self._keep:
                self._loaded.popitem(last=False)

    def forget(self) -> None:
        """Drop every loaded tokenizer (the next page loads them again)."""
        with self._lock:
            self._loaded.clear()
        load_tokenizer.cache_clear()


@functools.lru_cache(maxsize=4)
def load_tokenizer(uri: str) -> Any:
    """The Hugging Face tokenizer saved with the weights, or None (no transformers, no tokenizer files)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(uri, local_files_only=True)
    except Exception as exc:  # the strip then shows token ids
        log.info("no tokenizer at %s: %s", uri, exc)
        return None


def output_text(spans: list[Span]) -> str:
    """The rollout's last model reply (text and tool calls), the thing a person compares across a group."""
    calls = llm_calls(spans)
    if not calls:
        return ""
    message = calls[-1].response_message or {}
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    names = [
        str((c.get("function") or {}).get("name", c.get("name", "?")))
        for c in calls[-1].tool_calls or message.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    return text + ("".join(f" [tool call {n}]" for n in names) if names else "")
