"""Serve an ASGI app with uvicorn on a background thread: in-process servers for tests, demos and the trainer."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from typing import Any

from agl.errors import ConfigError


def tune_gc_for_serving() -> None:
    """Fewer cyclic-GC passes in a process that only serves (``agl store serve``, ``agl dashboard``).

    Every span batch and every dashboard page allocates thousands of short-lived containers that
    almost never form cycles, so CPython's default young-generation threshold (700) runs the collector
    several times per request for nothing, and each full pass walks the whole startup heap. With that
    heap frozen out of the scans and a larger threshold, a store request costs less CPU and a dashboard
    page that reads 1,000 rollouts no longer stalls on collections (``benchmarks/dashboard_api.py``).
    Not for a user's process: it changes the collector for everything in it.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


class BackgroundServer:
    """``BackgroundServer(app).start()`` binds (port 0: a free port), serves until ``stop()``.

    ``url`` is ``http://host:port``. Start waits until the server accepts connections.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **uvicorn_options: Any) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.options = uvicorn_options
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted sockets inherit this: without it a response split in two writes waits ~40 ms on delayed ACKs
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            raise ConfigError(f"cannot bind {self.host}:{self.port}: {exc}; choose another port") from exc
        self.port = sock.getsockname()[1]
        self._socket = sock
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="auto", timeout_graceful_shutdown=5, **self.options
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
            name=f"agl-server-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the server on {self.url} did not start within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
