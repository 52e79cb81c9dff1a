"""Online training rounds: learn from what production recorded, and publish only what evaluates no worse.

A round (``agl train --online --once``) reads the ``online`` rollouts a final reward finished since the
last round's watermark (:func:`agl.algorithm.grpo.online.read_online`: batch baseline, the recorded
logprobs as importance weights, stale versions skipped), takes one GRPO step from the weights the
serving engine has now, scores the current and the candidate model on held-out tasks the way ``agl
eval`` does (:func:`agl.trainer.evaluation.evaluate_models`), and publishes the candidate to the serving
engine through its weights route (``POST /v1/weights``) only if it is not worse by the gate. Every
published version stays in ``OUT/versions``, so :func:`rollback` republishes an earlier one. The state
(watermark, versions) is ``OUT/online.json``; each round's report is a line of ``OUT/rounds.jsonl``,
with the ids of the rollouts it trained on and of those it skipped (and why).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agl.agent.base import LitAgent
from agl.algorithm.grpo.config import GRPOConfig
from agl.algorithm.grpo.online import OnlineBatch, read_online, rewarded_since, version_number
from agl.errors import ConfigError
from agl.trainer.serving import Serving

log = logging.getLogger(__name__)

STATE_FILE, ROUNDS_FILE, OPTIMIZER_FILE = "online.json", "rounds.jsonl", "optimizer.pt"


@dataclass
class OnlineState:
    """What carries from one round to the next: the watermark (the newest finish time read), the round
    count, and every version published from this folder (name -> model folder), in publication order."""

    watermark: float | None = None
    rounds: int = 0
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, out: Path, base_path: str) -> OnlineState:
        """``OUT/online.json``, or a fresh state whose ``v0`` is the base model (what an engine starts with)."""
        path = out / STATE_FILE
        if not path.is_file():
            return cls(versions={"v0": str(Path(base_path).resolve())})
        data = json.loads(path.read_text())
        return cls(data.get("watermark"), int(data.get("rounds", 0)), dict(data["versions"]))

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(out / STATE_FILE)

    def next_version(self) -> str:
        return f"v{max((version_number(v) or 0 for v in self.versions), default=0) + 1}"


@dataclass(frozen=True)
class OnlineSettings:
    """Where a round reads, evaluates and publishes.

    Args:
        store: the store URL the gateway records production traffic to.
        engine: the serving engine's URL (``agl engine serve``), which takes new weights.
        output_dir: the state, the rounds' reports and every published model folder; the engine must be
            able to read it (same machine or shared disk).
        agent, held_out: the agent and the held-out tasks both models are scored on.
        min_gain: the gate: publish when the candidate's held-out mean reward is at least the current
            model's plus this (0: not worse).
        max_version_lag: skip rollouts recorded more than this many versions behind (None: no limit).
        k, seed, n_runners, serving: as ``agl eval``'s (samples per task, sampling seed, runners, serving).
    """

    store: str
    engine: str
    output_dir: Path
    agent: LitAgent
    held_out: Sequence[Any]
    engine_token: str | None = None
    min_gain: float = 0.0
    max_version_lag: int | None = 2
    k: int = 1
    seed: int | None = 0
    n_runners: int = 4
    serving: Serving | None = None

    def __post_init__(self) -> None:
        if not self.held_out:
            raise ConfigError(
                "online training gates on held-out tasks: give --val FILE.jsonl with at least one"
            )
        if not math.isfinite(self.min_gain):
            raise ConfigError(f"min_gain must be a finite number, got {self.min_gain!r}")


@dataclass
class RoundReport:
    """One round: ``decision`` is ``published``, ``refused`` or ``nothing to train``, with both held-out
    scores when there was a candidate, the version served after it, and the selection's counts."""

    round: int
    decision: str
    served: str
    current: str
    current_score: float | None = None
    candidate_score: float | None = None
    min_gain: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def line(self) -> str:
        """The one-line decision ``agl train --online`` prints."""
        scores = ""
        if self.candidate_score is not None or self.current_score is not None:
            scores = f": candidate {_fmt(self.candidate_score)} vs current {_fmt(self.current_score)} ({self.current})"
        c = self.counts
        data = (
            f"; trained on {c.get('trained_rollouts', 0):.0f} of {c.get('rewarded_new', 0):.0f} new rewarded "
            f"rollouts ({c.get('stale', 0):.0f} stale, {c.get('unrewarded', 0):.0f} still unrewarded)"
        )
        return f"round {self.round}: {self.decision}{scores}; serving {self.served}{data}"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _root(engine: str) -> str:
    return engine.rstrip("/").removesuffix("/v1")


def served_version(engine: str, token: str | None = None) -> str:
    """The weights version the engine serves now (its ``/health``)."""
    try:
        r = httpx.get(f"{_root(engine)}/health", headers=_headers(token), timeout=30)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"engine {engine}: /health did not answer ({exc}); is `agl engine serve` running?"
        ) from exc
    return str(r.json()["model_version"])


def publish_weights(engine: str, folder: str | Path, version: str, token: str | None = None) -> str:
    """Load the model ``folder`` into the engine as ``version`` (its ``POST /v1/weights``); returns the
    version it serves then."""
    body = {"path": str(Path(folder).resolve()), "version": version}
    r = httpx.post(f"{_root(engine)}/v1/weights", json=body, headers=_headers(token), timeout=600)
    if r.status_code != 200:
        raise ConfigError(f"engine {engine} refused the weights of {folder}: {r.status_code} {r.text[:300]}")
    return str(r.json()["model_version"])


def gate(current: float, candidate: float, min_gain: float) -> tuple[bool, str]:
    """Whether the candidate may replace the current model, and why (NaN: nothing scored)."""
    if math.isnan(candidate):
        return False, "every held-out rollout of the candidate failed"
    if math.isnan(current):
        return True, "every held-out rollout of the current model failed"
    if candidate >= current + min_gain:
        return True, f"candidate >= current + min_gain {min_gain:g}"
    return False, f"candidate < current + min_gain {min_gain:g}"


async def _read(
    settings: OnlineSettings, config: GRPOConfig, current: str, after: float | None
) -> OnlineBatch:
    from agl.store import open_store

    store = open_store(settings.store)
    try:
        return await read_online(
            store, config, current_version=current, after=after, max_version_lag=settings.max_version_lag
        )
    finally:
        await store.aclose()


def _train(
    config: GRPOConfig, start: str, data: OnlineBatch, folder: Path, info: dict[str, Any]
) -> dict[str, float]:
    """One GRPO step from the weights in ``start`` on ``data``'s batch, the result written to ``folder``.

    The optimizer's state carries over from the round that produced ``start`` (its ``optimizer.pt``), so
    a run of rounds moves like consecutive steps; a fresh optimizer's first step is a step of size ``lr``
    on every weight whatever the gradient's scale."""
    import torch

    from agl.algorithm.export import export_policy
    from agl.algorithm.grpo import GRPO

    policy = GRPO(config)._make_policy(start)
    policy.load_optimizer(Path(start))
    for group in policy.optimizer.param_groups:  # the moments carry over; the learning rate is this round's
        group["lr"] = config.lr
    batch = data.batch
    metrics = policy.step(batch.samples, batch.advantages, batch.rollout_index)
    export_policy(policy, folder, base_path=config.model_path, info=info)
    torch.save(policy.optimizer.state_dict(), folder / OPTIMIZER_FILE)
    return {**batch.metrics, **metrics}


def _keep_one_optimizer(state: OnlineState, served: str) -> None:
    """Only the served version keeps its optimizer state (Adam's moments: twice the model's size); a
    round trained from a rolled-back version starts a fresh optimizer."""
    for version, folder in state.versions.items():
        if version != served:
            (Path(folder) / OPTIMIZER_FILE).unlink(missing_ok=True)


def _score(settings: OnlineSettings, models: dict[str, str], out: Path) -> dict[str, float]:
    """Each model's held-out mean reward, as ``agl eval`` scores it (same tasks, seed and k)."""
    from agl.trainer.evaluation import evaluate_models

    result = evaluate_models(
        settings.agent,
        list(settings.held_out),
        models,
        k=settings.k,
        output_dir=out,
        serving=settings.serving,
        n_runners=settings.n_runners,
        sampling_seed=settings.seed,
    )
    return {label: result.model(label).mean_reward for label in models}


def run_round(config: GRPOConfig, settings: OnlineSettings) -> RoundReport:
    """One round: read, train, evaluate, gate, publish or refuse (see the module's docstring)."""
    if len(config.agents) > 1:
        raise ConfigError(
            f"online rounds serve one model: GRPOConfig.agents {config.agents} (a LoRA adapter per agent) "
            "trains through Trainer.fit only; name one agent or none"
        )
    out = settings.output_dir
    state = OnlineState.load(out, config.model_path)
    current = served_version(settings.engine, settings.engine_token)
    if current not in state.versions:
        raise ConfigError(
            f"the engine serves {current!r}, which {out / STATE_FILE} does not know (known: "
            f"{', '.join(state.versions)}); `agl model rollback --out {out} --to VERSION` serves a known one"
        )
    state.rounds += 1
    data = asyncio.run(_read(settings, config, current, state.watermark))
    report = RoundReport(state.rounds, "nothing to train", current, current, min_gain=settings.min_gain)
    report.counts = data.counts
    if not data.batch.samples:
        report.reason = (
            "no fresh rewarded rollout with a learning signal (rewards that all tie train nothing)"
        )
    else:
        folder = out / "candidates" / f"round-{state.rounds}"
        info = {"round": state.rounds, "trained_from": current, "rollouts": data.counts["trained_rollouts"]}
        report.metrics = _train(config, state.versions[current], data, folder, info)
        scores = _score(
            settings,
            {"current": state.versions[current], "candidate": str(folder)},
            out / "rounds" / str(state.rounds),
        )
        report.current_score, report.candidate_score = scores["current"], scores["candidate"]
        ok, report.reason = gate(scores["current"], scores["candidate"], settings.min_gain)
        if ok:
            version = state.next_version()
            target = out / "versions" / version
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            folder.rename(target)
            state.versions[version] = str(target.resolve())
            report.served = publish_weights(settings.engine, target, version, settings.engine_token)
            _keep_one_optimizer(state, version)
            report.decision = "published"
        else:
            report.decision = "refused"
    state.watermark = data.watermark
    state.save(out)
    trained = sorted({s.rollout_id for s in data.batch.samples})
    _append(out, {"at": time.time(), **asdict(report), "trained": trained, "skipped": data.skipped})
    log.info("online %s", report.line())
    return report


def _append(out: Path, row: dict[str, Any]) -> None:
    with (out / ROUNDS_FILE).open("a") as f:
        f.write(json.dumps(row, default=_json_nan) + "\n")


def _json_nan(value: Any) -> Any:
    return str(value)


def rollback(output_dir: Path, to: str, engine: str, token: str | None = None) -> str:
    """Republish the earlier version ``to`` (its folder under ``output_dir``) to the engine; returns the
    version it serves then. Rollouts recorded under versions newer than ``to`` count stale from now on."""
    path = output_dir / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"no {STATE_FILE} in {output_dir}: no online round ran there")
    state = OnlineState.load(output_dir, "")
    if to not in state.versions:
        raise ConfigError(f"--to {to!r}: no such version in {path}; known: {', '.join(state.versions)}")
    before = served_version(engine, token)
    served = publish_weights(engine, state.versions[to], to, token)
    _append(output_dir, {"at": time.time(), "decision": "rolled back", "from": before, "served": served})
    return served


def run_schedule(
    config: GRPOConfig,
    settings: OnlineSettings,
    *,
    every_rollouts: int | None,
    every_minutes: float | None,
    poll_s: float = 10.0,
    rounds: int | None = None,
    report: Callable[[RoundReport], None] = lambda r: None,
) -> list[RoundReport]:
    """Run :func:`run_round` whenever ``every_rollouts`` new rewarded rollouts are in the store, or
    ``every_minutes`` passed since the last round and at least one is; ``rounds`` bounds it (None: forever)."""
    if every_rollouts is None and every_minutes is None:
        raise ConfigError("say when a round runs: --every-rollouts N and/or --every-minutes T")
    if every_rollouts is not None and every_rollouts < 1:
        raise ConfigError(f"--every-rollouts must be >= 1, got {every_rollouts}")
    if every_minutes is not None and every_minutes <= 0:
        raise ConfigError(f"--every-minutes must be > 0, got {every_minutes}")
    done: list[RoundReport] = []
    last = time.monotonic()
    while rounds is None or len(done) < rounds:
        watermark = OnlineState.load(settings.output_dir, config.model_path).watermark
        waiting = len(asyncio.run(_count(settings.store, watermark)))
        due = every_rollouts is not None and waiting >= every_rollouts
        due |= every_minutes is not None and waiting > 0 and time.monotonic() - last >= every_minutes * 60
        if due:
            done.append(run_round(config, settings))
            report(done[-1])
            last = time.monotonic()
        else:
            time.sleep(poll_s)
    return done


async def _count(url: str, watermark: float | None) -> list[Any]:
    from agl.store import open_store

    store = open_store(url)
    try:
        return await rewarded_since(store, watermark)
    finally:
        await store.aclose()


__all__ = [
    "OnlineSettings",
    "OnlineState",
    "RoundReport",
    "gate",
    "publish_weights",
    "rollback",
    "run_round",
    "run_schedule",
    "served_version",
]
