"""The public surface: ``agl.__all__`` is pinned (a change to it is a deliberate edit here, as httpx does),
every name resolves, and a user's mypy sees the real types behind the lazy ``__getattr__``."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import agl

ROOT = Path(__file__).resolve().parents[1]

EXPORTED = [
    "APO",
    "APOConfig",
    "Algorithm",
    "Attempt",
    "AttemptStatus",
    "CommandAgent",
    "GRPO",
    "GRPOConfig",
    "InMemoryLightningStore",
    "LLM",
    "LightningStore",
    "LightningStoreClient",
    "LitAgent",
    "ModelSpec",
    "PromptTemplate",
    "ResourcesVersion",
    "RetryConfig",
    "RewardError",
    "Rollout",
    "RolloutStatus",
    "Runner",
    "SFT",
    "SFTConfig",
    "Serving",
    "Span",
    "SqliteLightningStore",
    "SyncLightningStore",
    "Teacher",
    "Trainer",
    "TrainingContext",
    "WarmStart",
    "agent_scope",
    "as_algorithm",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "evaluate_models",
    "instrument",
    "open_store",
    "openai_client",
    "operation",
    "post_reward",
    "rollout",
]


def test_the_exported_names_are_pinned_and_each_resolves() -> None:
    assert agl.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(agl, name) is not None, name
    assert set(EXPORTED) <= set(dir(agl))
    namespace: dict[str, object] = {}
    exec("from agl import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(EXPORTED)


def test_the_rewards_submodule_is_pinned() -> None:
    """``agl.rewards.Judge`` without an import of its own, and the submodule's names pinned like the top's."""
    assert agl.rewards.__all__ == [
        "Judge",
        "JudgeScore",
        "Judged",
        "Verdict",
        "judge_rollouts",
        "trajectory_text",
    ]
    from agl.rewards.judge import Judge

    assert agl.rewards.Judge is Judge


def test_the_type_checking_imports_match_the_lazy_exports() -> None:
    """``_EXPORTS`` (what ``__getattr__`` loads), ``__all__`` and the ``TYPE_CHECKING`` imports name the same
    objects, so a type checker sees exactly what the running code returns."""
    tree = ast.parse((ROOT / "agl" / "__init__.py").read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    imported: dict[str, str] = {}
    for stmt in block.body:
        assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
        for alias in stmt.names:
            imported[alias.asname or alias.name] = f"{stmt.module}.{alias.name}"
    exports = agl._EXPORTS  # type: ignore[attr-defined]
    assert set(exports) == set(agl.__all__)
    submodules = {name for name, path in imported.items() if path == f"agl.{name}"}
    assert submodules == agl._SUBMODULES  # type: ignore[attr-defined]
    assert set(imported) - submodules == set(agl.__all__)
    for name, path in imported.items():
        if name in submodules:
            continue
        module, _, attr = path.rpartition(".")
        assert getattr(__import__(module, fromlist=[attr]), attr) is getattr(agl, name), name


USER_CODE = """
import agl

@agl.rollout
def solve(task: str) -> float:
    return 1.0

@agl.rollout(name="solver")
async def solve_async(task: str, llm: agl.LLM) -> float:
    return 0.0

reveal_type(agl.Trainer(n_runners=2).serving)
reveal_type(agl.GRPOConfig)
reveal_type(solve)
reveal_type(solve("2 + 2"))
reveal_type(solve_async)
reveal_type(agl.store.open_store)
agl.Trainer(n_runner=2)
agl.Serving(port="80")
agl.Trainer(sampling={"temperature": 0.5})
"""

# agl's own modules are checked (silently); third-party ones are skipped, which keeps this run short
MYPY_CONFIG = """
[mypy]
follow_imports = skip
ignore_missing_imports = True

[mypy-agl,agl.*]
follow_imports = silent
"""


def test_a_users_mypy_sees_real_types_and_catches_a_wrong_argument(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini")]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--no-error-summary", str(tmp_path / "user.py")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines: dict[int, str] = {}  # each line's first message (an error's "defined in" note follows it)
    for line in proc.stdout.splitlines():
        if line.startswith(str(tmp_path)):
            lines.setdefault(int(line.split(":")[1]), line)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    revealed = {n: line.partition("Revealed type is ")[2] for n, line in lines.items() if "Revealed" in line}
    assert sorted(revealed) == [12, 13, 14, 15, 16, 17], proc.stdout
    assert revealed[12] == '"agl.trainer.serving.Serving"'
    assert revealed[13].startswith('"def (model_path: str') and revealed[13].endswith('GRPOConfig"')
    assert revealed[14] == '"agl.agent.base.FunctionAgent[[task: str], float]"'
    assert revealed[15] == '"float"'  # calling the agent calls the function, with its types
    assert revealed[16] == (
        '"agl.agent.base.FunctionAgent[[task: str, llm: agl.schemas.resources.LLM], '
        'typing.Coroutine[Any, Any, float]]"'
    )
    # a backend: the lifecycle core (``LightningStore``) and the read model the dashboard reads
    assert "-> agl.store.read_model.StoreWithReadModel" in revealed[17], revealed[17]
    assert 'Unexpected keyword argument "n_runner"' in lines[18] and 'did you mean "n_runners"' in lines[18]
    assert 'Argument "port" to "Serving" has incompatible type "str"; expected "int"' in lines[19]
    assert 'Unexpected keyword argument "sampling" for "Trainer"' in lines[20]  # it is Serving's now
