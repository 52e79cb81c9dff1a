"""agl.openai_client: rollouts' OpenAI clients over one connection pool per event loop, against a real
OpenAI-compatible server on loopback, and the runner closing that pool when the last runner on the loop stops."""

from __future__ import annotations

import asyncio
import ssl
import traceback
from typing import Any

import pytest

import agl
from agl.agent.clients import shared_http_client
from agl.schemas import RolloutCreate
from tests.support.openai_upstream import OpenAIUpstream


def ssl_contexts_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the SSL contexts HTTP clients make from here on (a fresh AsyncOpenAI's client makes one)."""
    made: list[int] = []
    real = ssl.SSLContext.__new__

    def counting(cls: type[ssl.SSLContext], *args: Any, **kwargs: Any) -> ssl.SSLContext:
        if any(frame.name == "_init_transport" for frame in traceback.extract_stack()):
            made.append(1)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "__new__", counting)
    return made


def test_rollout_clients_share_one_pool_and_closing_one_leaves_it_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with OpenAIUpstream() as up:
        llm = agl.LLM(endpoint=up.base_url, model="test-model", api_key="k-1")

        async def scenario() -> list[str]:
            made = ssl_contexts_made(monkeypatch)
            replies = []
            for i in range(3):
                async with agl.openai_client(llm, max_retries=0) as client:  # closed after each call
                    reply = await client.chat.completions.create(
                        model=llm.model, messages=[{"role": "user", "content": f"hi {i}"}]
                    )
                    replies.append(reply.choices[0].message.content or "")
                    assert client._client is shared_http_client() and not client._client.is_closed
            assert len(made) == 1  # the pool's, once; a fresh AsyncOpenAI per call would make three
            return replies

        assert asyncio.run(scenario()) == ["echo: hi 0", "echo: hi 1", "echo: hi 2"]
        assert [r.headers.get("authorization") for r in up.requests] == ["Bearer k-1"] * 3


def test_each_event_loop_gets_its_own_pool() -> None:
    async def pool() -> Any:
        return shared_http_client()

    first, second = asyncio.run(pool()), asyncio.run(pool())
    assert first is not second


def test_bad_calls_say_what_to_do() -> None:
    llm = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(RuntimeError, match="needs a running event loop"):
        agl.openai_client(llm)
    with pytest.raises(TypeError, match="agl.LLM resource"):
        asyncio.run(_call(lambda: agl.openai_client("http://127.0.0.1:9/v1")))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sets base_url itself"):
        asyncio.run(_call(lambda: agl.openai_client(llm, base_url="http://elsewhere/v1")))


async def _call(fn: Any) -> Any:
    return fn()


def test_the_pool_closes_when_the_last_runner_on_the_loop_stops() -> None:
    with OpenAIUpstream() as up:
        pools: list[Any] = []

        @agl.rollout
        async def agent(task: str, llm: agl.LLM) -> float:
            client = agl.openai_client(llm)
            reply = await client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task}]
            )
            pools.append(client._client)
            return float((reply.choices[0].message.content or "") == f"echo: {task}")

        async def scenario() -> tuple[bool, bool]:
            store = agl.InMemoryLightningStore()
            await store.add_resources({"llm": agl.LLM(endpoint=up.base_url, model="test-model")})
            ids = [
                r.rollout_id
                for r in await store.enqueue_rollouts([RolloutCreate(input=f"t{i}") for i in range(4)])
            ]
            long_running, short = (agl.Runner(agent, store, handle_signals=False) for _ in range(2))
            first = asyncio.create_task(long_running.run())  # runs until stopped
            await short.run(stop_when_idle=True)
            done = await store.wait_for_rollouts(ids, timeout_s=30)
            assert [r.status for r in done] == [agl.RolloutStatus.SUCCEEDED] * 4, done
            open_after_one_stopped = not pools[0].is_closed
            long_running.stop()
            await first
            return open_after_one_stopped, pools[0].is_closed

        open_after_one_stopped, closed_after_both = asyncio.run(scenario())
        assert open_after_one_stopped and closed_after_both
        assert len(pools) == 4 and len({id(p) for p in pools}) == 1
