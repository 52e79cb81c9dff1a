"""Loopback helpers for tests and scripts that start agl's servers as processes (``agl store serve``, ...)."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import httpx

#: ports this process has handed out, never handed out twice
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server started next, and one this process never gave before.

    It is drawn below the kernel's ephemeral range: a port the OS picks for ``bind(0)`` is one it also gives
    outgoing connections, so a client elsewhere (another test's) could hold it by the time the server binds.
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # the range below is crowded: take the OS's pick
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


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
