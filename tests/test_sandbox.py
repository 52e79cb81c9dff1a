"""agl.sandbox: untrusted code runs, and each way of misbehaving ends in a result that names the limit, with
the host untouched (no process left, no file written outside, no host file read, no host port reached)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl.errors import ConfigError
from agl.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=1, wall_s=20, memory_mb=256, processes=8, output_bytes=10_000, file_mb=1)


def run(code: str, limits: SandboxLimits = LIMITS) -> tuple[int, str | None, str, str]:
    result = run_python({"main.py": code}, ["main.py"], limits)
    return result.returncode, result.limit_hit, result.stdout, result.stderr


def test_a_program_runs_with_its_files_and_stdin() -> None:
    result = run_python(
        {
            "main.py": "import helper, sys; print(helper.double(int(sys.stdin.read())))",
            "helper.py": "double = lambda x: 2 * x",
        },
        ["main.py"],
        LIMITS,
        stdin="21",
    )
    assert result.ok and result.stdout == "42\n" and result.limit_hit is None


def test_an_endless_loop_hits_the_cpu_limit() -> None:
    code, limit, _, _ = run("while True: pass")
    assert limit == "cpu" and code != 0


def test_a_sleeping_program_hits_the_wall_clock() -> None:
    code, limit, _, _ = run("import time; time.sleep(60)", SandboxLimits(wall_s=1))
    assert limit == "wall" and code != 0


def test_a_fork_bomb_is_stopped_and_leaves_no_process() -> None:
    result = run_python({"main.py": "import os\nwhile True:\n    os.fork()"}, ["main.py"], LIMITS)
    assert result.returncode != 0 and result.limit_hit in ("processes", "cpu", "wall")
    if os.geteuid() == 0:  # the run had a uid of its own: nothing may still run under it
        assert result.uid >= 200_000
        deadline = time.monotonic() + 10  # the kernel tears a PID namespace down asynchronously
        while (left := [p for p in _pids() if _uid(p) == result.uid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left


def test_unbounded_allocation_hits_the_memory_limit() -> None:
    code, limit, _, _ = run("x = bytearray(2 * 1024**3)")
    assert limit == "memory" and code != 0


def test_output_and_file_size_are_bounded() -> None:
    code, limit, out, _ = run("print('x' * 1_000_000)")
    assert limit == "output" and len(out) <= LIMITS.output_bytes
    code, limit, _, _ = run("open('big', 'wb').write(b'x' * (4 * 1024**2))")
    assert limit == "file" and code != 0


def test_host_files_are_invisible_and_nothing_escapes_the_directory(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    code, _, out, err = run(f"print(open({str(secret)!r}).read())")
    assert code != 0 and "host secret" not in out and "No such file" in err
    code, _, out, _ = run("import os; print(os.listdir('/'))")
    assert code == 0 and "root" not in out and "work" not in out and "home" not in out
    run("open('/sandbox/../escape.txt', 'w').write('x')")
    assert not list(tmp_path.glob("escape.txt"))
    with pytest.raises(ConfigError, match="leaves the sandbox"):
        run_python({"../evil.py": "x"}, ["evil.py"])


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on the host's loopback that records whether anyone connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    hits: list[bool] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            hits.append(True)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()
    assert not hits, "the sandbox reached a host port"


def test_the_network_is_unreachable(host_server: int) -> None:
    code, _, out, err = run(
        f"import socket; socket.create_connection(('127.0.0.1', {host_server}), timeout=2); print('connected')"
    )
    assert code != 0 and "connected" not in out and "Connection refused" in err


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError, match="cpu_s must be > 0"):
        SandboxLimits(cpu_s=0)


def _pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1
