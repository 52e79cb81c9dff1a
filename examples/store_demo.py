"""A short tour of the LightningStore: queue rollouts, run them with retries, read the spans back.

python -m examples.store_demo
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agl.schemas import AttemptStatus, PromptTemplate, RetryConfig, RolloutCreate, Span
from agl.store import SqliteLightningStore


async def main() -> None:
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteLightningStore(Path(tmp) / "demo.db")
        version = await store.add_resources({"prompt": PromptTemplate(template="Solve: {question}")})
        retry = RetryConfig(max_attempts=2, retry_on=["failed"])
        rollouts = await store.enqueue_rollouts(
            [
                RolloutCreate(input={"question": f"{i} + {i}"}, retry=retry, group_id=f"g{i // 2}")
                for i in range(6)
            ]
        )
        console.print(f"queued {len(rollouts)} rollouts with resources {version.resources_id}")

        async def worker(name: str) -> None:
            while (claimed := await store.dequeue(name)) is not None:
                rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
                await store.add_span(Span.new(rid, aid, "agent.step", {"question": claimed.rollout.input}))
                flaky = (
                    claimed.rollout.input["question"].startswith("3") and claimed.attempt.attempt_number == 1
                )
                await store.update_attempt(
                    rid, aid, status=AttemptStatus.FAILED if flaky else AttemptStatus.SUCCEEDED
                )

        await asyncio.gather(worker("runner-a"), worker("runner-b"))
        done = await store.wait_for_rollouts([r.rollout_id for r in rollouts], timeout_s=10)

        table = Table(title="rollouts")
        for column in ("rollout", "input", "status", "attempts", "spans"):
            table.add_column(column)
        for r in done:
            spans = await store.query_spans(rollout_id=r.rollout_id)
            table.add_row(
                r.rollout_id, str(r.input), r.status.value, str(r.num_attempts), str(len(spans.items))
            )
        console.print(table)
        console.print(await store.statistics())
        await store.aclose()


if __name__ == "__main__":
    asyncio.run(main())
