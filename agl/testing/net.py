"""Loopback helpers for tests and scripts that start agl's servers as processes (``agl store serve``, ...)."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick), for a server started next."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_http(
    url: str,
    timeout_s: float = 60.0,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    interval_s: float = 0.2,
) -> None:
    """Return once ``url`` answers with a status under 500; raise ``TimeoutError`` after ``timeout_s``, or
    ``RuntimeError`` (with the exit code) as soon as ``proc``, the server's process, has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode} before it answered")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(interval_s)


__all__ = ["free_port", "wait_http"]
