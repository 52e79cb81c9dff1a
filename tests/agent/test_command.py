"""External-program agents: a shell script with curl, stdout rewards, exit codes, timeouts."""

from __future__ import annotations

import os
import shutil
import textwrap
import time
from pathlib import Path

import pytest

import agl
from agl import semconv as sc
from agl.errors import AgentError
from agl.schemas import LLM, AttemptStatus, RetryConfig
from agl.store import InMemoryLightningStore

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl for the shell agent")


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "agent.sh"
    path.write_text("#!/bin/sh\nset -e\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


async def _run_one(agent: agl.CommandAgent, task: object, **retry: float) -> tuple[object, list]:  # type: ignore[type-arg]
    store = InMemoryLightningStore()
    await store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:9/rollout/{rollout_id}/v1", model="m")})
    rollout = await store.enqueue_rollout(task, retry=RetryConfig(**retry))  # type: ignore[arg-type]
    (outcome,) = await agl.Runner(agent, store).run(max_rollouts=1)
    return outcome, (await store.query_spans(rollout_id=rollout.rollout_id)).items


async def test_shell_agent_posts_reward_with_curl(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        task=$(cat)
        echo "task=$task base=$OPENAI_BASE_URL rollout=$AGL_ROLLOUT_ID" >&2
        curl -sf -X POST -H 'Content-Type: application/json' -d '{"reward": 0.75}' "$AGL_REWARD_URL" > /dev/null
        """,
    )
    outcome, spans = await _run_one(agl.CommandAgent([str(script)]), {"q": 1})
    assert outcome.status == AttemptStatus.SUCCEEDED, outcome.error  # type: ignore[attr-defined]
    (command,) = [s for s in spans if s.name == "agl.command"]
    stderr = command.attributes["agl.command.stderr"]
    assert 'task={"q": 1}' in stderr and f"rollout={outcome.rollout_id}" in stderr  # type: ignore[attr-defined]
    assert f"/rollout/{outcome.rollout_id}/v1" in stderr  # type: ignore[attr-defined]
    (reward,) = [s for s in spans if s.name == sc.SPAN_REWARD]
    assert reward.attributes[sc.REWARD_VALUE] == 0.75


async def test_reward_from_final_stdout_line_and_task_file(tmp_path: Path) -> None:
    script = _script(tmp_path, 'cat "$AGL_TASK_FILE" >&2\necho "thinking"\necho \'{"reward": 1.0}\'\n')
    outcome, spans = await _run_one(agl.CommandAgent([str(script)], task_via="file"), [1, 2])
    assert outcome.reward == 1.0  # type: ignore[attr-defined]
    (command,) = [s for s in spans if s.name == "agl.command"]
    assert command.attributes["agl.command.stderr"] == "[1, 2]"


async def test_nonzero_exit_fails_with_stderr(tmp_path: Path) -> None:
    script = _script(tmp_path, "echo 'tool exploded' >&2\nexit 3\n")
    outcome, _ = await _run_one(agl.CommandAgent([str(script)]), None)
    assert outcome.status == AttemptStatus.FAILED  # type: ignore[attr-defined]
    assert "code 3" in outcome.error and "tool exploded" in outcome.error  # type: ignore[attr-defined]


async def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    script = _script(tmp_path, f"sleep 60 &\necho $! > {marker}\nwait\n")
    started = time.monotonic()
    outcome, _ = await _run_one(agl.CommandAgent([str(script)]), None, timeout_s=0.5)
    assert outcome.status == AttemptStatus.TIMEOUT and time.monotonic() - started < 10  # type: ignore[attr-defined]
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a reaper that this sandbox may lack."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


async def test_bad_reward_post_gets_400(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -d 'not json' "$AGL_REWARD_URL")
        echo "{\\"reward\\": $([ "$code" = 400 ] && echo 1 || echo 0)}"
        """,
    )
    outcome, _ = await _run_one(agl.CommandAgent([str(script)]), None)
    assert outcome.reward == 1.0  # type: ignore[attr-defined]


async def test_the_reward_inbox_wants_the_attempts_secret(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        base=${AGL_REWARD_URL%%\\?*}
        post() { curl -s -o /dev/null -w '%{http_code}' -X POST "$@"; }
        none=$(post -d '{"reward": 9}' "$base")
        wrong=$(post -d '{"reward": 9}' "$base?token=guess")
        wrong_header=$(post -H 'Authorization: Bearer guess' -d '{"reward": 9}' "$base")
        other=$(post -d '{"reward": 9}' "$(echo "$base" | sed 's#/reward/.*#/reward/ro-x/at-x#')?token=$AGL_REWARD_TOKEN")
        header=$(post -H "Authorization: Bearer $AGL_REWARD_TOKEN" -d '{"reward": 0.5}' "$base")
        echo "codes $none $wrong $wrong_header $other $header" >&2
        echo "$AGL_REWARD_URL" > url.txt
        """,
    )
    outcome, spans = await _run_one(agl.CommandAgent([str(script)], cwd=tmp_path), None)
    assert outcome.status == AttemptStatus.SUCCEEDED, outcome.error  # type: ignore[attr-defined]
    (command,) = [s for s in spans if s.name == "agl.command"]
    assert "codes 401 403 403 404 200" in command.attributes["agl.command.stderr"]
    assert [s.attributes[sc.REWARD_VALUE] for s in spans if s.name == sc.SPAN_REWARD] == [0.5]
    import httpx

    late = httpx.post((tmp_path / "url.txt").read_text().strip(), json={"reward": 1.0})
    assert late.status_code == 404  # the attempt is over: its URL takes nothing more


def test_command_agent_validates_arguments() -> None:
    with pytest.raises(AgentError, match="needs a command"):
        agl.CommandAgent([])
    with pytest.raises(AgentError, match="task_via"):
        agl.CommandAgent(["x"], task_via="pipe")


NODE_AGENT = """
const task = JSON.parse(require("fs").readFileSync(0, "utf8"));
(async () => {
  const res = await fetch(process.env.OPENAI_BASE_URL + "/chat/completions", {
    method: "POST",
    headers: {"Content-Type": "application/json", "Authorization": "Bearer " + process.env.OPENAI_API_KEY},
    body: JSON.stringify({model: process.env.AGL_MODEL, messages: [
      {role: "system", content: "End with ANSWER: <number>."}, {role: "user", content: task.question}]}),
  });
  const reply = (await res.json()).choices[0].message.content;
  const reward = reply.trim().endsWith("ANSWER: " + task.answer) ? 1 : 0;
  await fetch(process.env.AGL_REWARD_URL, {method: "POST", body: JSON.stringify({reward: {acc: reward, len: 0.5}, primary_key: "acc"})});
  console.error("reply:", reply, "attempt:", process.env.AGL_ATTEMPT_ID);
})().catch((e) => { console.error(e); process.exit(2); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
async def test_node_agent_calls_the_model_and_posts_a_reward(tmp_path: Path) -> None:
    from examples.apo.simulated_lm import SimulatedLMServer

    script = tmp_path / "agent.js"
    script.write_text(NODE_AGENT)
    store = InMemoryLightningStore()
    with SimulatedLMServer() as server:
        await store.add_resources({"llm": LLM(endpoint=server.base_url, model="task")})
        task = {"question": "One item-1 costs 4 dollars. What do 2 of them cost?", "answer": 8}
        rollout = await store.enqueue_rollout(task)
        (outcome,) = await agl.Runner(agl.CommandAgent(["node", str(script)]), store).run(max_rollouts=1)
    assert outcome.status == AttemptStatus.SUCCEEDED, outcome.error
    spans = (await store.query_spans(rollout_id=rollout.rollout_id)).items
    (reward,) = [s for s in spans if s.name == sc.SPAN_REWARD]
    assert reward.attributes[sc.REWARD_VALUE] == 1.0 and reward.attributes[sc.REWARD_VALUES] == {
        "acc": 1.0,
        "len": 0.5,
    }
    (command,) = [s for s in spans if s.name == "agl.command"]
    assert "ANSWER: 8" in command.attributes["agl.command.stderr"]
    assert outcome.attempt_id in command.attributes["agl.command.stderr"]
