"""Group commit for SQL stores: one thread owns the connection and runs queued calls in shared transactions.

Calls from any event loop or thread are queued; the thread takes everything queued so far and runs
it in one transaction (``BEGIN IMMEDIATE`` when any call writes), each call in its own savepoint so
a failing call rolls back only itself. Results are handed back to each caller's loop after COMMIT,
so nobody sees a write acknowledged before it is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agl.errors import AglError, StoreError

R = TypeVar("R")
Conn = sqlite3.Connection
Call = Callable[[Conn, list[str]], Any]
_MAX_GROUP = 512


@dataclass
class _Op:
    fn: Call
    write: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    finished: list[str] = field(default_factory=list)  # rollout ids the call finished


def _deliver(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver_all(answered: list[tuple[asyncio.Future[Any], Any, Any]]) -> None:
    for future, result, error in answered:
        _deliver(future, result, error)


def _convert(exc: Exception) -> Exception:
    """Database driver errors become StoreError (cause kept); agl's own errors pass through."""
    if isinstance(exc, AglError):
        return exc
    converted = StoreError(f"database error ({type(exc).__name__}): {exc}")
    converted.__cause__ = exc
    return converted


class GroupCommitThread:
    """Owns ``conn``; ``await call(fn)`` runs ``fn(conn, finished)`` on the thread and returns its result.

    ``on_finished`` is called after COMMIT with the rollout ids a call appended to ``finished``;
    ``before_commit(conn, ids)`` sees all of a group's finished ids inside its transaction.
    """

    def __init__(
        self,
        conn: Any,
        name: str,
        on_finished: Callable[[Iterable[str]], None],
        *,
        begin_write: str = "BEGIN IMMEDIATE",
        is_retryable: Callable[[BaseException], bool] = lambda exc: False,
        before_commit: Callable[[Any, list[str]], None] | None = None,
        ops: queue.SimpleQueue[_Op | None] | None = None,
    ) -> None:
        self._conn = conn
        self._on_finished = on_finished
        self._begin_write = begin_write
        self._is_retryable = is_retryable
        self._before_commit = before_commit
        # ``ops``: a queue shared with other threads (GroupCommitPool): each takes the next group when free
        self._ops: queue.SimpleQueue[_Op | None] = ops if ops is not None else queue.SimpleQueue()
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[[Conn, list[str]], R], *, write: bool = True) -> R:
        if self.closed:
            raise StoreError("the SQLite store is closed; open a new one")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._ops.put(_Op(fn, write, loop, future))
        return await future

    async def close(self) -> None:
        if not self.closed:
            self.stop()
            await self.join()

    def stop(self) -> None:
        """Refuse new calls and ask a thread to stop once the calls queued before are done."""
        self.closed = True
        self._ops.put(None)  # with a shared queue, whichever thread takes it stops

    async def join(self) -> None:
        await asyncio.to_thread(self._thread.join, 30)

    @property
    def ops(self) -> queue.SimpleQueue[_Op | None]:
        return self._ops

    def _loop(self) -> None:
        stop = False
        while not stop:
            first = self._ops.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < _MAX_GROUP:
                try:
                    op = self._ops.get_nowait()
                except queue.Empty:
                    break
                if op is None:
                    stop = True
                    break
                batch.append(op)
            self._run_group(batch)
        self._conn.close()

    def _run_group(self, batch: list[_Op]) -> None:
        conn = self._conn
        outcomes: list[tuple[_Op, Any, BaseException | None]] = []
        try:
            conn.execute(self._begin_write if any(op.write for op in batch) else "BEGIN")
            for op in batch:
                outcomes.append(self._run_op(op))
            finished = [i for op, _, error in outcomes if error is None for i in op.finished]
            if finished and self._before_commit is not None:
                self._before_commit(conn, finished)
            conn.execute("COMMIT")
        except Exception as exc:  # the transaction itself failed: nothing of the group is kept
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            group_error = _convert(exc)
            outcomes = [(op, None, group_error) for op in batch]
        self._answer(outcomes)

    def _answer(self, outcomes: list[tuple[_Op, Any, BaseException | None]]) -> None:
        """Announce the group's finished rollouts, then hand each caller its outcome: one wake-up per
        event loop, not one per call."""
        answers: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, Any]]] = {}
        for op, result, error in outcomes:
            if error is None and op.finished:
                self._on_finished(op.finished)
            answers.setdefault(op.loop, []).append((op.future, result, error))
        for loop, answered in answers.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                loop.call_soon_threadsafe(_deliver_all, answered)

    def _run_op(self, op: _Op, tries: int = 8) -> tuple[_Op, Any, BaseException | None]:
        """One call in its own savepoint; a deadlock or serialization failure is retried in place."""
        conn = self._conn
        for attempt in range(tries):
            conn.execute("SAVEPOINT op")
            try:
                result = op.fn(conn, op.finished)
            except Exception as exc:
                conn.execute("ROLLBACK TO SAVEPOINT op")
                conn.execute("RELEASE SAVEPOINT op")
                op.finished.clear()
                if self._is_retryable(exc) and attempt < tries - 1:
                    time.sleep(0.005 * 2**attempt)
                    continue
                return op, None, _convert(exc)
            conn.execute("RELEASE SAVEPOINT op")
            return op, result, None
        raise AssertionError("unreachable")


class GroupCommitPool:
    """Group-commit threads with a connection each, taking groups from one queue: while one connection
    runs a group the next forms and runs on another, so a call waits for a free connection rather than
    for the group ahead of it (a database that locks rows, not the file: PostgreSQL)."""

    def __init__(self, threads: list[GroupCommitThread]) -> None:
        self.threads = threads

    @property
    def closed(self) -> bool:
        return self.threads[0].closed

    async def call(self, fn: Callable[[Conn, list[str]], R], *, write: bool = True) -> R:
        return await self.threads[0].call(fn, write=write)  # the queue is shared

    async def close(self) -> None:
        if self.closed:
            return
        for thread in self.threads:  # one stop each before any join: a thread may take another's
            thread.stop()
        for thread in self.threads:
            await thread.join()
