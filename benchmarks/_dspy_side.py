"""The DSPy half of ``apo_vs_gepa.py``; runs in the DSPy environment (``.venv-dspy``), prints one JSON line.

.venv-dspy/bin/python benchmarks/_dspy_side.py --base-url URL --optimizer gepa --budget 120
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep LiteLLM offline
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dspy  # noqa: E402

from examples.apo.price_tasks import CATALOG_CENTS, grade, make_tasks  # noqa: E402


class PriceProgram(dspy.Module):  # type: ignore[misc]
    """The price agent as a DSPy program: one predictor whose instruction is the prompt being tuned."""

    def __init__(self, instruction: str) -> None:
        super().__init__()
        self.answer = dspy.Predict(dspy.Signature("question, observation -> answer", instruction))

    def forward(self, question: str) -> dspy.Prediction:
        observation, used_tool = "none", False
        for _ in range(3):
            out = self.answer(question=question, observation=observation)
            match = re.match(r"LOOKUP (item-\d+)", str(out.answer).strip())
            if match is None:
                break
            used_tool = True
            observation = f"{CATALOG_CENTS.get(match.group(1))} cents"
        return dspy.Prediction(answer=str(out.answer), used_tool=used_tool)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--optimizer", choices=["gepa", "miprov2"], required=True)
    parser.add_argument("--budget", type=int, required=True, help="metric calls")
    parser.add_argument("--start-prompt", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=["basic", "hard"], default="basic")
    parser.add_argument("--sizes", default="24,15,60", help="train,val,test task counts")
    args = parser.parse_args()
    n_train, n_val, n_test = (int(x) for x in args.sizes.split(","))

    def lm(model: str) -> dspy.LM:
        return dspy.LM(f"openai/{model}", api_base=args.base_url, api_key="k", cache=False, temperature=0.0)

    dspy.configure(lm=lm("task"))
    calls = {"metric": 0}

    def as_example(task: object) -> dspy.Example:
        return dspy.Example(question=task.question, task=task.as_input()).with_inputs("question")  # type: ignore[attr-defined]

    train = [as_example(t) for t in make_tasks(n_train, seed=args.seed, variant=args.variant)]
    val = [as_example(t) for t in make_tasks(n_val, seed=args.seed + 1, variant=args.variant)]
    test = [as_example(t) for t in make_tasks(n_test, seed=args.seed + 2, variant=args.variant)]

    def metric(gold, pred, trace=None, pred_name=None, pred_trace=None):  # type: ignore[no-untyped-def]
        calls["metric"] += 1
        score, feedback = grade(gold.task, pred.answer, pred.used_tool)
        return dspy.Prediction(score=score, feedback=feedback) if pred_name is not None else score

    started = time.perf_counter()
    program = PriceProgram(args.start_prompt)
    if args.optimizer == "gepa":
        optimizer = dspy.GEPA(
            metric=metric,
            max_metric_calls=args.budget,
            reflection_lm=lm("reflector"),
            seed=args.seed,
            num_threads=4,
        )
        best = optimizer.compile(program, trainset=train, valset=val)
    else:
        optimizer = dspy.MIPROv2(
            metric=metric,
            prompt_model=lm("reflector"),
            auto=None,
            num_candidates=4,
            num_threads=4,
            seed=args.seed,
        )
        best = optimizer.compile(program, trainset=train, valset=val, num_trials=4, minibatch=False)
    optimize_metric_calls = calls["metric"]
    seconds = round(time.perf_counter() - started, 2)
    val_scores = [float(metric(ex, best(question=ex.question))) for ex in val]
    test_scores = [float(metric(ex, best(question=ex.question))) for ex in test]
    print(
        json.dumps(
            {
                "optimizer": args.optimizer,
                "best_val_score": sum(val_scores) / len(val_scores),
                "test_score": sum(test_scores) / len(test_scores),
                "metric_calls": optimize_metric_calls,
                "best_prompt": best.answer.signature.instructions,
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
