"""External-program agents in any language: one process per rollout, talking OpenAI through the gateway.

The program gets the task as JSON on stdin (or in the file named by ``AGL_TASK_FILE``) and these
environment variables: ``OPENAI_BASE_URL`` (the rollout-scoped gateway URL), ``OPENAI_API_KEY``,
``AGL_ROLLOUT_ID``, ``AGL_ATTEMPT_ID``, ``AGL_REWARD_URL``, ``AGL_REWARD_TOKEN`` and, when configured,
``AGL_STORE_URL`` / ``AGL_STORE_TOKEN``. It reports a reward either by POSTing ``{"reward": 0.7}`` (or
``{"reward": {"acc": 1, "len": 0.2}, "primary_key": "acc"}``) to ``AGL_REWARD_URL``, or by printing a
final stdout line ``{"reward": 0.7}``. Exit code 0 means success; anything else fails the attempt.

The reward URL carries a secret made for this attempt (``?token=``, also accepted as
``Authorization: Bearer $AGL_REWARD_TOKEN``): other local processes cannot post rewards into a rollout,
and posts for an attempt that is not running get 404.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import signal
import tempfile
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agl.agent.base import LitAgent, RolloutResult
from agl.emit import _emit, emit_reward
from agl.errors import AgentError
from agl.schemas import LLM, Resource, Rollout

_STDERR_TAIL = 4000


class _RewardInbox:
    """A loopback HTTP endpoint where external agents post rewards: ``POST /reward/{rollout}/{attempt}``,
    with the attempt's secret (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rewards: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._secrets: dict[tuple[str, str], str] = {}
        inbox = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (stdlib name)
                url = urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                length = int(self.headers.get("Content-Length") or 0)
                if len(parts) != 3 or parts[0] != "reward" or length > 1_000_000:
                    return self._reply(
                        404 if length <= 1_000_000 else 413, "use POST /reward/{rollout_id}/{attempt_id}"
                    )
                key = (parts[1], parts[2])
                with inbox._lock:
                    expected = inbox._secrets.get(key)
                if expected is None:
                    return self._reply(
                        404, f"no running attempt {parts[2]} of rollout {parts[1]} takes rewards"
                    )
                auth = self.headers.get("Authorization") or ""
                given = (parse_qs(url.query).get("token") or [""])[0] or auth.removeprefix("Bearer ")
                if not given:
                    return self._reply(
                        401, "missing token: POST to $AGL_REWARD_URL as given (it has ?token=)"
                    )
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    return self._reply(403, "wrong token for this attempt ($AGL_REWARD_TOKEN)")
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except ValueError:
                    return self._reply(400, 'body is not JSON; send {"reward": <number>}')
                if not isinstance(body, dict) or not isinstance(body.get("reward"), (int, float, dict)):
                    return self._reply(400, "field 'reward' must be a number or an object of numbers")
                with inbox._lock:
                    if key in inbox._secrets:  # the attempt may have ended meanwhile
                        inbox._rewards.setdefault(key, []).append(body)
                self._reply(200, "ok")

            def _reply(self, status: int, message: str) -> None:
                data = json.dumps({"ok": status == 200, "message": message}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="agl-reward-inbox", daemon=True).start()

    def open(self, rollout_id: str, attempt_id: str) -> tuple[str, str]:
        """Start taking rewards for an attempt: its URL (secret included) and the secret."""
        secret = secrets.token_urlsafe(24)
        with self._lock:
            self._secrets[(rollout_id, attempt_id)] = secret
        port = self.server.server_address[1]
        return f"http://127.0.0.1:{port}/reward/{rollout_id}/{attempt_id}?token={secret}", secret

    def take(self, rollout_id: str, attempt_id: str) -> list[dict[str, Any]]:
        """The attempt's posted rewards; it takes no more after this."""
        with self._lock:
            self._secrets.pop((rollout_id, attempt_id), None)
            return self._rewards.pop((rollout_id, attempt_id), [])


_inbox: _RewardInbox | None = None
_inbox_lock = threading.Lock()


def _reward_inbox() -> _RewardInbox:
    global _inbox
    with _inbox_lock:
        if _inbox is None:
            _inbox = _RewardInbox()
        return _inbox


class CommandAgent(LitAgent):
    """Run ``command`` once per rollout; see the module docstring for the protocol.

    Args:
        command: argv of the program, e.g. ``["node", "agent.js"]``.
        task_via: ``"stdin"`` (default) or ``"file"`` (path in ``AGL_TASK_FILE``).
        timeout_s: kill the whole process group after this long (the rollout's own timeout also applies).
        store_url / store_token: passed on as ``AGL_STORE_URL`` / ``AGL_STORE_TOKEN``.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
        task_via: str = "stdin",
        timeout_s: float | None = None,
        store_url: str | None = None,
        store_token: str | None = None,
        name: str | None = None,
    ) -> None:
        if not command:
            raise AgentError("CommandAgent needs a command, e.g. ['node', 'agent.js']")
        if task_via not in ("stdin", "file"):
            raise AgentError(f"task_via must be 'stdin' or 'file', got {task_via!r}")
        self.command = list(command)
        self.cwd = cwd
        self.env = dict(env or {})
        self.task_via = task_via
        self.timeout_s = timeout_s
        self.store_url, self.store_token = store_url, store_token
        self.name = name

    def _environment(
        self, rollout: Rollout, attempt_id: str, resources: dict[str, Resource]
    ) -> dict[str, str]:
        env = {**os.environ, **self.env}
        llm = next((r for r in resources.values() if isinstance(r, LLM)), None)
        if llm is not None:
            env["OPENAI_BASE_URL"] = llm.endpoint
            env["OPENAI_API_KEY"] = llm.api_key or env.get("OPENAI_API_KEY", "agl")
            env["AGL_MODEL"] = llm.model
        env["AGL_ROLLOUT_ID"], env["AGL_ATTEMPT_ID"] = rollout.rollout_id, attempt_id
        env["AGL_REWARD_URL"], env["AGL_REWARD_TOKEN"] = _reward_inbox().open(rollout.rollout_id, attempt_id)
        if self.store_url:
            env["AGL_STORE_URL"] = self.store_url
        if self.store_token:
            env["AGL_STORE_TOKEN"] = self.store_token
        return env

    async def execute(
        self, rollout: Rollout, resources: dict[str, Resource], executor: Any = None
    ) -> RolloutResult:
        from agl.tracer.context import current_rollout

        ctx = current_rollout()
        assert ctx is not None
        env = self._environment(rollout, ctx.attempt_id, resources)
        task_json = json.dumps(rollout.input).encode()
        with tempfile.TemporaryDirectory() as tmp:
            if self.task_via == "file":
                env["AGL_TASK_FILE"] = str(Path(tmp) / "task.json")
                Path(env["AGL_TASK_FILE"]).write_bytes(task_json)
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                cwd=self.cwd,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group, so a timeout kills every child too
            )
            try:
                stdin = task_json if self.task_via == "stdin" else b""
                stdout, stderr = await asyncio.wait_for(proc.communicate(stdin), self.timeout_s)
            except BaseException:  # timeout or cancellation: kill the whole group, then re-raise
                _kill_group(proc.pid)
                await proc.wait()
                _reward_inbox().take(ctx.rollout_id, ctx.attempt_id)
                raise
        return self._finish(
            proc.returncode or 0, stdout.decode(errors="replace"), stderr.decode(errors="replace"), ctx
        )

    def _finish(self, code: int, stdout: str, stderr: str, ctx: Any) -> RolloutResult:
        _emit(
            "agl.command",
            {
                "agl.command.argv": self.command,
                "agl.command.exit_code": code,
                "agl.command.stderr": stderr[-_STDERR_TAIL:],
            },
            local=False,
            error=code != 0,
        )
        posted = _reward_inbox().take(ctx.rollout_id, ctx.attempt_id)
        if code != 0:
            raise AgentError(
                f"{self.command[0]} exited with code {code}; stderr ends with: {stderr[-500:].strip()!r}",
                rollout_id=ctx.rollout_id,
                attempt_id=ctx.attempt_id,
            )
        for body in posted:
            emit_reward(body["reward"], primary_key=body.get("primary_key"))
        for line in reversed(stdout.strip().splitlines()):
            try:
                last = json.loads(line)
            except ValueError:
                break
            if isinstance(last, dict) and isinstance(last.get("reward"), dict):
                emit_reward(last["reward"], primary_key=last.get("primary_key"))
            elif isinstance(last, dict) and "reward" in last:
                return last["reward"]
            break
        return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
