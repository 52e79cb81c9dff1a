"""Learn from production, simulated on this machine: the served model's held-out score across published versions.

Every part is a separate process, as in production:
- `agl engine serve` serves the production model: SmolLM2 after the calc demo's SFT warm start (the base
  model solves none of the tasks, so no reward would differ), `v0`;
- `agl gateway serve --record-unattributed --reward-token T` in front of it records each conversation as an
  `online` rollout (session id in the `x-agl-session-id` header);
- a client (`online_loop.py client`) runs the calc agent's conversations on a pool of train tasks through the
  gateway, sampling at temperature 0.7, and hands each outcome to
- a user (`online_loop.py user`), who posts it with `agl.post_reward` after a delay of seconds to minutes, or
  never (a share of sessions);
- `agl train --online --every-rollouts N` trains a round per N new rewarded conversations, scores the current
  and the candidate model on gate tasks, and publishes to the engine only if not worse.
After `--rounds` rounds, one more round trains with a learning rate far too high (`--bad-lr`), to show the gate
refusing a worse model. Then every published version is scored on test tasks that the gate never saw, and
every client session is accounted for: trained on, read but skipped (and why), rewarded after the last round
(late), or never rewarded.

    python benchmarks/online_loop.py                      # SmolLM2 (~40 min on 2 cores)
    python benchmarks/online_loop.py --model tiny --rounds 2 --per-round 6 --no-save   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl.testing import free_port, wait_http  # noqa: E402
from benchmarks import _results  # noqa: E402

TOKEN = "reward-token-online-loop"
AGENT = "examples.calc.agent:calc_agent"


def production_model(model: str, out: Path, seed: int) -> Path:
    """The model in production: ``model`` after the calc demo's SFT warm start, written to ``out/v0``."""
    from agl.algorithm.export import export_policy
    from agl.algorithm.grpo import GRPO, GRPOConfig, WarmStart
    from agl.algorithm.grpo.warm_start import train_warm_start
    from agl.models import smollm2, tiny_model
    from examples.calc.agent import CALCULATOR
    from examples.calc.train import calc_tasks, tool_use_trace

    folder = out / "v0"
    if (folder / "agl_export.json").is_file():
        return folder
    tiny = model == "tiny"
    base = str(tiny_model(seed=seed) if tiny else smollm2())
    policy = GRPO(GRPOConfig(model_path=base, precision="fp32", seed=seed))._make_policy(base)
    warm = calc_tasks(0, 8)[2]
    steps, lr = (2, 1e-4) if tiny else (8, 1e-5)  # the demo's warm start
    conversations = [tool_use_trace(t) for t in warm]
    train_warm_start(
        policy, WarmStart(conversations, [CALCULATOR], steps=steps, batch_size=8, lr=lr, seed=seed)
    )
    schedule = {"steps": steps, "batch_size": 8, "lr": lr, "seed": seed}
    export_policy(policy, folder, base_path=base, info={"warm_start": schedule, "base": base})
    return folder


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


class Follow:
    """A JSONL file another process appends to: each call of :meth:`new` returns the lines completed since."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def new(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        done = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(done)
        return [json.loads(line) for line in done.splitlines() if line.strip()]


def client(args: argparse.Namespace) -> None:
    """Production traffic: the calc agent's conversations, ``--concurrency`` at a time, until ``--stop`` exists."""
    import openai

    from examples.calc.agent import score, solve

    tasks = read_jsonl(args.tasks)
    rng = random.Random(args.seed)

    async def one(n: int, api: openai.AsyncOpenAI) -> None:
        task = rng.choice(tasks)
        session = f"s{n:05d}-{uuid.uuid4().hex[:6]}"
        started = time.time()
        try:
            reply = await solve(
                api,
                "production",
                task["question"],
                {"temperature": 0.7},
                extra_headers={"x-agl-session-id": session},
            )
            reward: float | None = score(reply, task["answer"])
        except Exception as exc:  # noqa: BLE001 (production goes on; the user never rewards a failed session)
            reply, reward = f"error: {type(exc).__name__}: {exc}", None
        row = {
            "session": session,
            "question": task["question"],
            "reward": reward,
            "reply": reply[:200],
            "started": started,
            "ended": time.time(),
        }
        append_jsonl(args.log, row)

    async def main() -> None:
        api = openai.AsyncOpenAI(base_url=args.gateway + "/v1", api_key="sk-app", max_retries=2)
        n = 0
        while not args.stop.exists():
            await asyncio.gather(*(one(n + i, api) for i in range(args.concurrency)))
            n += args.concurrency
        await api.close()

    asyncio.run(main())


def user(args: argparse.Namespace) -> None:
    """Late rewards: each outcome the client logged is posted after a random delay, or never."""
    import agl
    from agl.errors import GatewayError, InvalidRequestError

    rng = random.Random(args.seed + 1)
    outcomes = Follow(args.outcomes)
    due: list[tuple[float, dict[str, Any]]] = []
    while True:
        fresh = outcomes.new()
        for row in fresh:
            if row["reward"] is None or rng.random() < args.never:
                append_jsonl(args.log, {"session": row["session"], "decision": "never", "at": time.time()})
                continue
            due.append((time.time() + rng.uniform(args.min_delay, args.max_delay), row))
        now = time.time()
        for when, row in [d for d in due if d[0] <= now]:
            due.remove((when, row))
            for tries in range(10):
                try:
                    answer = agl.post_reward(
                        args.gateway, row["reward"], session_id=row["session"], token=TOKEN
                    )
                    break
                except (GatewayError, InvalidRequestError) as exc:  # the session's rollout may be on its way
                    answer = {"error": str(exc)}
                    time.sleep(1.0 + tries)
            verdict = {
                "session": row["session"],
                "decision": "posted",
                "reward": row["reward"],
                "delay_s": round(time.time() - row["ended"], 1),
                "at": time.time(),
                "answer": answer,
            }
            append_jsonl(args.log, verdict)
        if args.stop.exists() and not due and not fresh:
            return
        time.sleep(0.5)


def spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_results.ROOT), env.get("PYTHONPATH")]))
    handle = log.open("ab")
    return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=_results.ROOT)


def online_train(
    args: argparse.Namespace, urls: dict[str, str], v0: Path, lr: float, *extra: str
) -> list[str]:
    """The ``agl train --online`` command line of this loop (``extra``: --once or the schedule)."""
    return [
        sys.executable, "-m", "agl", "train", "--online", *extra,
        "--agent", AGENT,
        "--val", str(args.out / "gate.jsonl"),
        "--from-store", urls["store"],
        "--engine", urls["engine"],
        "--max-version-lag", str(args.max_version_lag),
        "--set", f"grpo.model_path={v0}",
        "--set", f"grpo.lr={lr}",
        "--set", "grpo.precision=fp32",
        "--set", f"grpo.seed={args.seed}",
        "--set", f"trainer.output_dir={args.out / 'online'}",
        "--set", "trainer.n_runners=4",
    ]  # fmt: skip


def wait_rounds(
    out: Path, n: int, procs: list[subprocess.Popen[bytes]], timeout_s: float
) -> list[dict[str, Any]]:
    """The first ``n`` rounds of ``out/online/rounds.jsonl`` (fails when a process died or time ran out)."""
    deadline = time.monotonic() + timeout_s
    shown = 0
    while True:
        rounds = [r for r in read_jsonl(out / "online" / "rounds.jsonl") if "round" in r]
        for row in rounds[shown:]:
            print(
                f"round {row['round']}: {row['decision']} (candidate {row['candidate_score']}, current "
                f"{row['current_score']}, trained on {len(row['trained'])}); serving {row['served']}",
                flush=True,
            )
        shown = len(rounds)
        if len(rounds) >= n:
            return rounds[:n]
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(
                f"after {len(rounds)} of {n} rounds: {'exited: ' + str(dead) if dead else 'timed out'}"
            )
        time.sleep(2.0)


def bad_round(args: argparse.Namespace, urls: dict[str, str], v0: Path) -> dict[str, Any]:
    """One ``--once`` round at ``--bad-lr``, tried again (``--bad-tries``) while nothing new trains."""
    row: dict[str, Any] = {}
    for _ in range(args.bad_tries):
        before = len(read_jsonl(args.out / "online" / "rounds.jsonl"))
        command = online_train(args, urls, v0, args.bad_lr, "--once")
        with (args.out / "bad-round.log").open("ab") as log:
            subprocess.run(command, check=True, cwd=_results.ROOT, stdout=log, stderr=subprocess.STDOUT)
        row = {**read_jsonl(args.out / "online" / "rounds.jsonl")[before], "lr": args.bad_lr}
        if row["decision"] != "nothing to train":
            break
        time.sleep(30.0)
    return row


def account(args: argparse.Namespace, rounds: list[dict[str, Any]], store_url: str) -> dict[str, Any]:
    """Every client session: trained on, read but skipped (why), rewarded after the last round, or never."""
    from agl.adapter import final_reward
    from agl.algorithm.base import rollout_spans
    from agl.gateway.online import session_rollout_id
    from agl.store import open_store

    sessions = read_jsonl(args.out / "client.jsonl")
    verdicts = {v["session"]: v for v in read_jsonl(args.out / "user.jsonl")}
    trained = {rid for r in rounds for rid in r.get("trained", [])}
    skipped = {rid: why for r in rounds for rid, why in r.get("skipped", {}).items()}

    async def read() -> dict[str, Any]:
        store = open_store(store_url)
        counts: dict[str, int] = {}
        problems: list[str] = []
        try:
            for row in sessions:
                rid = session_rollout_id(row["session"])
                verdict = verdicts.get(row["session"], {}).get("decision", "unseen")
                found = (await store.query_rollouts(rollout_ids=[rid], limit=1)).items
                rollout = found[0] if found else None
                reward = final_reward(await rollout_spans(store, rid)) if rollout is not None else None
                if rollout is None:
                    kind = "lost"
                elif row["reward"] is None:
                    kind = "agent error, never rewarded" if reward is None else "reward without a post"
                elif verdict == "posted":
                    kind = (
                        "trained"
                        if rid in trained
                        else ("skipped: " + skipped[rid].split(":")[0] if rid in skipped else "late")
                    )
                    if reward is None or abs(reward - row["reward"]) > 1e-9:
                        problems.append(f"{row['session']}: posted {row['reward']}, store has {reward}")
                else:
                    kind = "never rewarded" if reward is None else "reward without a post"
                counts[kind] = counts.get(kind, 0) + 1
        finally:
            await store.aclose()
        return {"sessions": len(sessions), "by_fate": counts, "problems": problems}

    return asyncio.run(read())


def test_scores(args: argparse.Namespace, versions: dict[str, str]) -> dict[str, float]:
    """Each published version's mean reward on the test tasks (never seen by the gate), as ``agl eval``."""
    from agl.trainer.evaluation import evaluate_models
    from examples.calc.agent import calc_agent
    from examples.calc.tasks import make_tasks

    test = make_tasks(args.test_tasks, seed=30_000)
    result = evaluate_models(calc_agent, test, versions, k=1, output_dir=args.out / "test-eval", n_runners=4)
    return {label: result.model(label).mean_reward for label in versions}


def orchestrate(args: argparse.Namespace) -> None:
    from examples.calc.train import calc_tasks

    recorder = _results.Recorder("online_loop", args)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in (
        "production.db",
        "production.db-wal",
        "production.db-shm",
        "client.jsonl",
        "user.jsonl",
        "stop",
    ):
        (args.out / name).unlink(missing_ok=True)
    for folder in ("online", "test-eval"):
        subprocess.run(["rm", "-rf", str(args.out / folder)], check=True)
    train, val, _ = calc_tasks(0, args.gate_tasks)
    write_jsonl(args.out / "pool.jsonl", train)
    write_jsonl(args.out / "gate.jsonl", val)
    started = time.monotonic()
    v0 = production_model(args.model, args.out, args.seed)
    ports = {"engine": free_port(), "gateway": free_port()}
    urls = {
        "engine": f"http://127.0.0.1:{ports['engine']}",
        "gateway": f"http://127.0.0.1:{ports['gateway']}",
        "store": f"sqlite:///{(args.out / 'production.db').resolve()}",
    }
    me = [sys.executable, str(Path(__file__).resolve())]
    procs = [spawn([sys.executable, "-m", "agl", "engine", "serve", "--model", str(v0), "--port",
                    str(ports["engine"]), "--max-batch-size", "8"], args.out / "engine.log")]  # fmt: skip
    try:
        wait_http(urls["engine"] + "/health", 300)
        procs.append(spawn([sys.executable, "-m", "agl", "gateway", "serve", "--upstream", urls["engine"] + "/v1",
                            "--kind", "agl", "--store", urls["store"], "--port", str(ports["gateway"]),
                            "--record-unattributed", "--reward-token", TOKEN], args.out / "gateway.log"))  # fmt: skip
        wait_http(urls["gateway"] + "/health", 300)
        common = ["--gateway", urls["gateway"], "--seed", str(args.seed), "--stop", str(args.out / "stop")]
        procs.append(spawn([*me, "client", *common, "--tasks", str(args.out / "pool.jsonl"), "--log",
                            str(args.out / "client.jsonl")], args.out / "client.log"))  # fmt: skip
        procs.append(spawn([*me, "user", *common, "--outcomes", str(args.out / "client.jsonl"), "--log",
                            str(args.out / "user.jsonl"), "--never", str(args.never), "--min-delay",
                            str(args.min_delay), "--max-delay", str(args.max_delay)], args.out / "user.log"))  # fmt: skip
        schedule = ["--every-rollouts", str(args.per_round)]
        trainer = spawn(online_train(args, urls, v0, args.lr, *schedule), args.out / "trainer.log")
        rounds = wait_rounds(args.out, args.rounds, [*procs, trainer], args.timeout_minutes * 60)
        trainer.terminate()
        trainer.wait(60)
        rounds.append(bad_round(args, urls, v0))
        print(f"bad round: {rounds[-1]['decision']} ({rounds[-1]['reason']})", flush=True)
        (args.out / "stop").touch()
        for proc in procs[2:]:
            proc.wait(args.max_delay + 120)
        time.sleep(2.0)  # the gateway's background writes
        accounting = account(args, rounds, urls["store"])
    finally:
        (args.out / "stop").touch()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    state = json.loads((args.out / "online" / "online.json").read_text())
    scores = test_scores(args, state["versions"])
    save(recorder, args, rounds, accounting, scores, time.monotonic() - started)


def save(
    recorder: _results.Recorder,
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    accounting: dict[str, Any],
    scores: dict[str, float],
    seconds: float,
) -> None:
    keep = ("round", "decision", "served", "current", "current_score", "candidate_score", "reason", "counts")
    table = [{k: r.get(k) for k in keep} | {"lr": r.get("lr", args.lr), "trained": len(r.get("trained", []))}
             for r in rounds]  # fmt: skip
    versions = sorted(scores, key=lambda v: int(v[1:]))
    summary = {
        "model": args.model,
        "test_score_by_version": {v: scores[v] for v in versions},
        "gate_tasks": args.gate_tasks,
        "test_tasks": args.test_tasks,
        "published": sum(r["decision"] == "published" for r in rounds),
        "refused": sum(r["decision"] == "refused" for r in rounds),
        "accounting": accounting,
        "wall_s": round(seconds, 1),
    }
    print(json.dumps({"rounds": table, **summary}, indent=1))
    recorder.save(
        metric="test score of the last published version minus v0's",
        unit="share",
        values=[scores[versions[-1]] - scores["v0"]],
        runs=table,
        summary=summary,
        variant=args.model,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", nargs="?", choices=["run", "client", "user"], default="run",
                        help="run (default) starts everything; client and user are its parts")  # fmt: skip
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--out", type=Path, default=Path("results/online_loop"), help="working folder")
    parser.add_argument("--rounds", type=int, default=5, help="scheduled rounds before the bad one")
    parser.add_argument("--per-round", type=int, default=32, help="new rewarded conversations a round")
    parser.add_argument("--lr", type=float, default=5e-5, help="the rounds' learning rate")
    parser.add_argument("--bad-lr", type=float, default=1e-3, help="the last round's (to be refused)")
    parser.add_argument("--bad-tries", type=int, default=10, help="rounds tried until the bad one trains")
    parser.add_argument("--max-version-lag", type=int, default=1)
    parser.add_argument("--gate-tasks", type=int, default=32, help="held-out tasks the gate scores on")
    parser.add_argument(
        "--test-tasks", type=int, default=48, help="tasks the versions are scored on at the end"
    )
    parser.add_argument("--never", type=float, default=0.15, help="share of sessions never rewarded")
    parser.add_argument("--min-delay", type=float, default=2.0, help="seconds before a reward, at least")
    parser.add_argument("--max-delay", type=float, default=120.0, help="seconds before a reward, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-minutes", type=float, default=90.0)
    # the parts' own arguments
    parser.add_argument("--gateway", default="")
    parser.add_argument("--stop", type=Path, default=Path("stop"))
    parser.add_argument("--tasks", type=Path, default=Path("pool.jsonl"))
    parser.add_argument("--outcomes", type=Path, default=Path("client.jsonl"))
    parser.add_argument("--log", type=Path, default=Path("log.jsonl"))
    parser.add_argument("--concurrency", type=int, default=4)
    _results.add_arguments(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    {"run": orchestrate, "client": client, "user": user}[parsed.role](parsed)
