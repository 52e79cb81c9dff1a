"""Run untrusted Python (a model's code and its tests) in a throw-away sandbox, for rewards.

Each run gets a fresh temp directory holding only the files given, inside bubblewrap (``bwrap``: new
mount, PID, network, IPC and UTS namespaces; the host's files are not mounted, only the Python install
read-only), as an unprivileged uid of its own, with CPU-time, memory, process, file-size, output and wall-clock
limits. Whatever the code does, the host is untouched: a loop, a fork bomb, a huge allocation, a read
outside its directory or a network call ends the run with a result that says which limit it hit.

    result = run_python({"main.py": code}, ["main.py"], SandboxLimits(cpu_s=2))
    result.ok, result.stdout, result.limit_hit
"""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agl.errors import ConfigError

_NO_BWRAP = (
    "agl.sandbox needs bubblewrap (bwrap) to isolate untrusted code: `apt-get install bubblewrap` "
    "(Debian/Ubuntu; make test installs it when run as root)"
)
# read-only system folders the interpreter may need; the host's /etc, /home, /root, /work... are never mounted
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin")
_UID_BASE, _UID_SPAN = 200_000, 100_000  # uids no account has: one per run when agl runs as root


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use; exceeding any of them ends the run."""

    cpu_s: float = 5.0  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 10.0  # wall-clock seconds, then the whole sandbox is killed
    memory_mb: int = 512  # address space (RLIMIT_AS)
    processes: int = 16  # processes of the sandbox user (RLIMIT_NPROC): stops fork bombs
    output_bytes: int = 64_000  # stdout + stderr kept; more ends the run
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "file_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended. ``limit_hit`` names the limit that ended it (``cpu``, ``wall``,
    ``memory``, ``output``, ``processes``, ``file``), or is None when the program ended on its own."""

    returncode: int
    stdout: str
    stderr: str
    limit_hit: str | None
    duration_s: float
    uid: int  # the uid the code ran as (one of its own when agl runs as root)

    @property
    def ok(self) -> bool:
        """The program exited 0 within every limit."""
        return self.returncode == 0 and self.limit_hit is None


def sandbox_available() -> bool:
    """Whether ``bwrap`` is installed (every run needs it)."""
    return shutil.which("bwrap") is not None


def sandbox_python() -> str:
    """The interpreter sandboxed code runs with: the system's Python (readable by any user), else ours."""
    for candidate in ("/usr/bin/python3", sys.executable):
        if os.access(candidate, os.X_OK):
            return candidate
    raise ConfigError("no Python interpreter found for the sandbox")


def run_python(
    files: Mapping[str, str],
    argv: Sequence[str],
    limits: SandboxLimits | None = None,
    *,
    stdin: str = "",
) -> SandboxResult:
    """Write ``files`` (relative path -> text) into a fresh directory and run ``python *argv`` there.

    Raises:
        ConfigError: bubblewrap is missing, or a file path leaves the directory.
    """
    limits = limits or SandboxLimits()
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ConfigError(_NO_BWRAP)
    python = sandbox_python()
    with tempfile.TemporaryDirectory(prefix="agl-sandbox-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        for name, text in files.items():
            path = (work / name).resolve()
            if not path.is_relative_to(work.resolve()):
                raise ConfigError(f"sandbox file {name!r} leaves the sandbox directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        user = _unprivileged_user()
        if user is not None:
            for path in [Path(tmp), *Path(tmp).rglob("*")]:
                os.chown(path, user[0], user[1])
        command = [bwrap, *_bwrap_args(python, work), python, "-E", "-s", *argv]  # no env, no user site
        return _run(command, limits, user, stdin)


def _bwrap_args(python: str, work: Path) -> list[str]:
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
    for folder in _SYSTEM_DIRS:
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    prefix = sys.base_prefix if python == sys.executable else None
    if prefix and not prefix.startswith(_SYSTEM_DIRS):
        args += ["--ro-bind", prefix, prefix]
    # a private /tmp and home; the code's own folder is the only writable host path
    args += ["--tmpfs", "/tmp", "--bind", str(work), "/sandbox", "--chdir", "/sandbox"]
    args += ["--setenv", "HOME", "/sandbox", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    return args


def _unprivileged_user() -> tuple[int, int] | None:
    """As root, each run gets a uid of its own that no process uses, so the process limit counts only
    that run's processes and its leftovers can be found and killed; otherwise runs keep the caller's uid."""
    if os.geteuid() != 0:
        return None
    busy = _uids_in_use()
    for _ in range(100):
        uid = secrets.randbelow(_UID_SPAN) + _UID_BASE
        if uid not in busy:
            return uid, uid
    raise ConfigError("no free uid for a sandbox run")


def _uids_in_use() -> set[int]:
    uids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                uids.add(entry.stat().st_uid)
    return uids


def _processes_of(uid: int) -> list[int]:
    """Live processes of ``uid`` (zombies hold nothing and wait for their reaper, so they don't count)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid and not _is_zombie(entry.path):
                    pids.append(int(entry.name))
    return pids


def _is_zombie(proc_path: str) -> bool:
    with open(f"{proc_path}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[-1].split()[0] == b"Z"


def _run(
    command: list[str], limits: SandboxLimits, user: tuple[int, int] | None, stdin: str
) -> SandboxResult:
    uid = user[0] if user else os.getuid()
    # RLIMIT_NPROC counts every process of the user: leave room for the ones it already has
    nproc = limits.processes + (0 if user else len(_processes_of(uid)))
    memory = limits.memory_mb * 1024**2
    cpu = max(1, int(limits.cpu_s + 0.999))

    def preexec() -> None:
        if user is not None:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 1024**2,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=preexec,  # noqa: PLW1509  (no threads run code between fork and exec here)
        start_new_session=True,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
    assert proc.stdin and proc.stdout and proc.stderr
    try:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out, err, limit = _collect(proc, limits, started)
    if limit is not None:
        _kill(proc)
    returncode = proc.wait()
    duration = time.monotonic() - started
    if user is not None:
        _reap(user[0])
    errors = err.decode(errors="replace")
    if limit is None:
        limit = _limit_from_exit(returncode, errors, duration, limits)
    return SandboxResult(returncode, out.decode(errors="replace"), errors, limit, duration, uid)


def _collect(
    proc: subprocess.Popen[bytes], limits: SandboxLimits, started: float
) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until they close, the output limit is passed or the wall clock runs out."""
    assert proc.stdout and proc.stderr
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            left = limits.wall_s - (time.monotonic() - started)
            if left <= 0:
                return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), "wall"
            for key, _ in selector.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fd] += chunk
                if sum(len(b) for b in buffers.values()) > limits.output_bytes:
                    out, err = (bytes(b[: limits.output_bytes]) for b in buffers.values())
                    return out, err, "output"
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    # bwrap leads its own session and PID namespace: killing the group ends every process inside
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(uid: int) -> None:
    """Kill whatever the run left behind (a fork bomb's children outlive their parent for a moment)."""
    deadline = time.monotonic() + 5.0
    while (pids := _processes_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _limit_from_exit(returncode: int, stderr: str, duration: float, limits: SandboxLimits) -> str | None:
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGKILL):
        return "cpu" if duration < limits.wall_s else "wall"
    if "File too large" in stderr:
        return "file"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if "BlockingIOError" in stderr and "Resource temporarily unavailable" in stderr:
        return "processes"
    return None


__all__ = ["SandboxLimits", "SandboxResult", "run_python", "sandbox_available"]
