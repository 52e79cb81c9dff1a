"""A custom algorithm in a dozen lines: best-of-n prompt selection, written against the training context only.

    python -m examples.custom_algorithm

It tries each candidate system prompt on the training tasks as real rollouts (store, runners, a
simulated OpenAI-compatible model), reads the rewards through the adapter, and keeps the best prompt.
It trains no local model, so fit serves none. One that does subclasses ``agl.Algorithm`` and declares it,
``def model_spec(self) -> agl.ModelSpec: return agl.ModelSpec(path, lora_rank=8)``; fit then serves that
model behind the gateway (``ctx.llm``) and ``ctx.publish_policy(policy)`` pushes new weights to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import agl
from agl.adapter import final_reward
from agl.algorithm.base import TrainingContext
from agl.schemas import LLM, PromptTemplate
from agl.store import InMemoryLightningStore
from examples.apo.agent import price_agent
from examples.apo.simulated_lm import SimulatedLMServer, make_tasks

CANDIDATES = [
    "You are a shopping assistant.",
    "You are a shopping assistant. End with 'ANSWER: <number>'.",
    "End with 'ANSWER: <number>'. Use the lookup tool when a price is not given. Prices are in cents.",
]


@agl.as_algorithm
async def best_of_prompts(ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> dict[str, float]:
    llm = (await ctx.store.get_latest_resources()).resources["llm"]  # type: ignore[union-attr]
    scores = {}
    for prompt in CANDIDATES:
        resources_id = await ctx.publish({"llm": llm, "prompt": PromptTemplate(template=prompt)})
        done = await ctx.rollouts(train, resources_id=resources_id, timeout_s=60)  # run, wait, read spans
        scores[prompt] = sum(final_reward(spans) or 0.0 for _, spans in done) / len(done)
    return scores


def main() -> None:
    with SimulatedLMServer() as server:
        store = InMemoryLightningStore()
        asyncio.run(store.add_resources({"llm": LLM(endpoint=server.base_url, model="task")}))
        tasks = [t.as_input() for t in make_tasks(9, seed=3)]
        scores = agl.Trainer(algorithm=best_of_prompts, store=store, n_runners=4).fit(price_agent, tasks)
    for prompt, score in scores.items():
        print(f"{score:.2f}  {prompt}")
    print("best:", max(scores, key=scores.__getitem__))


if __name__ == "__main__":
    main()
