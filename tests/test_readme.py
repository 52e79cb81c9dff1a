"""README.md tells the truth: its code blocks run, its names resolve and its install hints name real extras.

How the README's blocks run (follow this when you add one):

- Blocks are grouped by their ``##`` section; each section is one test, run in a fresh temporary working
  directory that mirrors the clone (links to ``agl/``, ``examples/``, ``benchmarks/``, ``scripts/``,
  ``.venv``, ``Makefile``; copies of ``pyproject.toml`` and ``README.md``), with ``.venv/bin`` first on
  ``PATH`` (as after ``. .venv/bin/activate``) and ``HF_HUB_OFFLINE=1``.
- Within a section, blocks run in README order. Consecutive ```` ```python ```` blocks are joined into
  one script, so a block may use what the blocks just before it defined (``tasks``, ``agent``); a
  ```` ```bash ```` (``sh``, ``shell``) block runs with ``bash -euo pipefail``. Fences without a
  language (diagrams) and other languages are not run.
- A block fails on a non-zero exit, on its timeout (120 s unless told), or when its output shows a
  traceback or an unclosed client session. A background server's output is in the failure message.
- Budget: the whole README takes about 50 s of CPU (two GRPO runs, one SFT run, one APO run on the
  tiny model or the simulated LM); keep a new block to seconds with a ``replace`` cheap variant.
- The ports ``4747`` (the store's default), ``8000`` (the engine's) and ``8100`` (the gateway's) become
  free ports in every block, since tests run beside other servers.
- A ``file:`` block of an earlier section is written into the working directory of every later one (so
  the SFT section can import the ``my_agent.py`` of "Train your own agent").

Directives are HTML comments right before a block, one per comment, ``<!-- readme-test: KEY: VALUE -->``:

- ``skip: REASON``: the block cannot run here (a GPU, several machines, ``make demo`` itself, a long
  run). The reason is required, the number of skipped blocks is capped (``MAX_SKIPS``), and a skipped
  Python block must still compile and use only ``agl`` names that exist.
- ``replace: OLD => NEW``: the cheap variant that runs instead (``agl.models.smollm2()`` => the tiny
  model, fewer steps, ``--help``). ``OLD`` must occur in the block, so the README cannot drift from it.
- ``background: URL``: start the block (a server) in the background, wait until ``URL`` answers, and
  stop it when the section ends.
- ``file: NAME``: write the block (any language: YAML, JSONL) to ``NAME`` in the working directory
  instead of running it.
- ``timeout: SECONDS``: a longer limit for a block that trains.

The parser is markdown-it-py (already installed by ``rich``). pytest-markdown-docs and phmdoctest run
Python blocks only; pytest-codeblocks runs shell blocks too, but executes Python inside pytest's own
process (no timeout, no fresh interpreter for a training run), turns opt-outs into pytest skips (which
``make test`` counts as failures) and has no cheap-variant substitution, hence this small extractor.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import tomllib
from markdown_it import MarkdownIt

from agl.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_SKIPS = 3
DEFAULT_TIMEOUT_S = 120.0
SHELLS = {"bash", "sh", "shell"}
PORTS = ("4747", "8000", "8100")
_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*:\s*(.*?)\s*-->", re.S)
_MIRRORED = ("agl", "examples", "benchmarks", "scripts", ".venv", "Makefile")
_COPIED = ("pyproject.toml", "README.md")
# inline code that names span attributes or span names, not Python objects
NOT_PYTHON = {
    "agl.rollout_id",
    "agl.attempt_id",
    "agl.llm",
    "agl.judge",
    "agl.training",
    "agl.flag",
}  # span and metadata keys


@dataclass
class Block:
    """One fenced code block of the README and the directives just before it."""

    section: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None
    replaces: list[tuple[str, str]] = field(default_factory=list)
    background: str | None = None
    file: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def runnable(self) -> bool:
        return self.skip is None and (self.file is not None or self.lang in SHELLS | {"python"})

    def source(self) -> str:
        """The code that runs: the block with its ``replace`` directives applied."""
        code = self.code
        for old, new in self.replaces:
            code = code.replace(old, new)
        return code


def parse_readme(text: str) -> list[Block]:
    """Every fenced block with its section and directives; a malformed directive raises ValueError."""
    blocks: list[Block] = []
    section = "intro"
    pending: list[tuple[str, str, int]] = []
    tokens = MarkdownIt("commonmark").parse(text)
    for i, token in enumerate(tokens):
        line = (token.map[0] + 1) if token.map else 0
        if token.type == "heading_open" and token.tag == "h2":
            section = tokens[i + 1].content
        if token.type == "html_block":
            found = _DIRECTIVE.findall(token.content)
            if "readme-test" in token.content and not found:
                raise ValueError(f"README line {line}: cannot read {token.content.strip()!r}")
            pending += [(key, value, line) for key, value in found]
            continue
        if token.type != "fence":
            if pending:
                raise ValueError(
                    f"README line {pending[0][2]}: a readme-test directive must come right before a block"
                )
            continue
        block = Block(section, line, token.info.strip().split(" ")[0], token.content)
        for key, value, at in pending:
            _apply(block, key, value, at)
        pending = []
        blocks.append(block)
    if pending:
        raise ValueError(f"README line {pending[0][2]}: a readme-test directive with no block after it")
    return blocks


def _apply(block: Block, key: str, value: str, line: int) -> None:
    where = f"README line {line}"
    if key == "skip":
        if len(value) < 10:
            raise ValueError(f"{where}: skip needs a reason (a sentence), got {value!r}")
        block.skip = value
    elif key == "replace":
        old, sep, new = value.partition(" => ")
        if not sep or old not in block.code:
            raise ValueError(f"{where}: replace {old!r} does not occur in the block after it")
        block.replaces.append((old, new))
    elif key == "background":
        block.background = value
    elif key == "file":
        block.file = value
    elif key == "timeout":
        block.timeout_s = float(value)
    else:
        raise ValueError(f"{where}: unknown readme-test directive {key!r}")


BLOCKS = parse_readme(README.read_text())
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if b.runnable))


def _workdir(tmp: Path) -> Path:
    for name in _MIRRORED:
        (tmp / name).symlink_to(ROOT / name)
    for name in _COPIED:
        shutil.copy(ROOT / name, tmp / name)
    return tmp


def _env() -> dict[str, str]:
    venv = ROOT / ".venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    path = [str(venv / "bin"), *[p for p in env.get("PATH", "").split(os.pathsep) if p]]
    env.update(
        PATH=os.pathsep.join(path),
        VIRTUAL_ENV=str(venv),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTHONPATH", None)
    return env


def _steps(blocks: list[Block]) -> list[list[Block]]:
    """Runnable blocks in order; consecutive plain Python blocks joined into one step."""

    def plain_python(block: Block) -> bool:
        return block.lang == "python" and block.file is None and block.background is None

    steps: list[list[Block]] = []
    for block in (b for b in blocks if b.runnable):
        if steps and plain_python(block) and plain_python(steps[-1][-1]):
            steps[-1].append(block)
        else:
            steps.append([block])
    return steps


def _check_output(blocks: list[Block], rc: int | None, out: str) -> None:
    where = ", ".join(f"README line {b.line}" for b in blocks)
    assert rc == 0, f"{where} exited with {rc}:\n{out[-4000:]}"
    for bad in ("Traceback (most recent call last)", "Unclosed client session", "Unclosed connector"):
        assert bad not in out, f"{where} printed {bad!r}:\n{out[-4000:]}"


def _wait_until_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"the background block exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            )
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s} s:\n{log.read_text()[-4000:]}")


def _ported(text: str, ports: dict[str, str]) -> str:
    for old, new in ports.items():
        text = text.replace(old, new)
    return text


def run_section(name: str, tmp: Path) -> None:
    """Run one section's blocks as the module docstring says."""
    cwd, env, ports = _workdir(tmp), _env(), {p: str(free_port()) for p in PORTS}
    earlier = BLOCKS[: next(i for i, b in enumerate(BLOCKS) if b.section == name)]
    for block in earlier:
        if block.file is not None:
            (cwd / block.file).write_text(block.source())
    background: list[subprocess.Popen[bytes]] = []
    try:
        for n, step in enumerate(_steps([b for b in BLOCKS if b.section == name])):
            first = step[0]
            code = _ported("\n".join(b.source() for b in step), ports)
            if first.file is not None:
                (cwd / first.file).write_text(code)
                continue
            script = cwd / f"readme_{n}.{'py' if first.lang == 'python' else 'sh'}"
            script.write_text(code)
            argv = (
                ["python", script.name]
                if first.lang == "python"
                else ["bash", "-euo", "pipefail", script.name]
            )
            if first.background is not None:
                log = cwd / f"{script.name}.log"
                with log.open("w") as out:  # the child keeps its own copy of the descriptor
                    proc = subprocess.Popen(
                        argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                background.append(proc)
                _wait_until_up(_ported(first.background, ports), proc, log, first.timeout_s)
                continue
            timeout = sum(b.timeout_s for b in step)
            try:
                done = subprocess.run(
                    argv,
                    cwd=cwd,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired as exc:
                raise AssertionError(f"README line {first.line}: still running after {timeout} s") from exc
            _check_output(step, done.returncode, done.stdout + done.stderr)
    finally:
        for proc in background:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs(section: str, tmp_path: Path) -> None:
    run_section(section, tmp_path)


def test_opt_outs_are_few_explained_and_still_valid_python() -> None:
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert len(skipped) <= MAX_SKIPS, [f"line {b.line}: {b.skip}" for b in skipped]
    for block in skipped:
        if block.lang == "python":
            ast.parse(block.code, filename=f"README.md:{block.line}")
    assert not [b.line for b in BLOCKS if b.lang in SHELLS | {"python"} and not b.runnable and b.skip is None]
    assert sum(b.runnable for b in BLOCKS) >= 10  # most of the README runs


def test_a_directive_that_no_longer_matches_fails() -> None:
    text = "## S\n\n<!-- readme-test: replace: smollm2() => tiny_model() -->\n```python\nprint(1)\n```\n"
    with pytest.raises(ValueError, match="does not occur"):
        parse_readme(text)
    with pytest.raises(ValueError, match="needs a reason"):
        parse_readme("<!-- readme-test: skip: gpu -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="unknown readme-test directive"):
        parse_readme("<!-- readme-test: skipp: because of reasons -->\n```bash\nls\n```\n")


def test_a_failing_block_fails_its_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = parse_readme("## Broken\n\n```python\nimport agl\nagl.no_such_name\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "BLOCKS", broken)
    with pytest.raises(AssertionError, match="no attribute 'no_such_name'"):
        run_section("Broken", tmp_path)


def _agl_names() -> set[str]:
    """``agl.x.y`` names and ``from agl.x import y`` lines in the README's inline code and Python blocks
    (skipped blocks included)."""
    texts = [c.content for t in MarkdownIt("commonmark").parse(README.read_text()) for c in t.children or []]
    texts = [t for t in texts if t] + [b.code for b in BLOCKS if b.lang == "python"]
    imports = re.compile(r"from (agl(?:\.\w+)*) import (\w+(?:, \w+)*)")
    dotted = re.compile(r"(?<![\w.])agl(?:\.[A-Za-z_]\w*)+")
    names: set[str] = set()
    for text in texts:
        names |= {f"from {m} import {n}" for m, ns in imports.findall(text) for n in ns.split(", ")}
        names |= set(dotted.findall(imports.sub("", text)))
    return {n for n in names if not any(n == p or n.startswith(p + ".") for p in NOT_PYTHON)}


RESOLVE = """
import importlib, sys
bad = []
for name in sys.argv[1:]:
    parts = name.split(".")
    if not name.startswith("from ") and parts[1] not in importlib.import_module("agl").__all__:
        # whether agl.pkg.mod resolves depends on what ran before: start from a fresh `import agl`
        for mod in [m for m in sys.modules if m == "agl" or m.startswith("agl.")]:
            del sys.modules[mod]
    obj = importlib.import_module("agl")
    try:
        if name.startswith("from "):
            exec(name, {})
        else:
            for part in parts[1:]:
                obj = getattr(obj, part)
    except (AttributeError, ImportError) as exc:
        bad.append(f"{name}: {exc}")
print("\\n".join(bad))
"""


def test_every_agl_name_in_the_readme_resolves_after_import_agl() -> None:
    names = sorted(_agl_names())
    assert len(names) > 20
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE, *names], capture_output=True, text=True, check=True, env=_env()
    ).stdout
    assert out.strip() == "", f"use `from agl.x import Y` in the README, or make these reachable:\n{out}"


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def _hint_files() -> list[Path]:
    files = [README, *(ROOT / "agl").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    return files + [*(ROOT / "examples").rglob("*.py"), *(ROOT / "scripts").glob("*")]


def test_every_extra_an_install_hint_names_exists() -> None:
    extras, seen = _extras(), set()
    for path in _hint_files():
        for group in re.findall(r"(?:agl|\.)\[([\w,\s-]+)\]", path.read_text(errors="replace")):
            for extra in (e.strip() for e in group.split(",")):
                assert extra in extras, (
                    f"{path.relative_to(ROOT)} names the extra agl[{extra}], which pyproject lacks"
                )
                seen.add(extra)
    assert {"train", "integrations", "ray", "bench"} <= seen
    table = re.findall(r"^\| `([\w-]+)` \|", README.read_text(), re.M)  # the README's table of extras
    assert sorted(table) == sorted(set(extras) - {""}), "the README's table of extras is out of date"


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_integrations_extra_holds_every_instrumentor_its_hint_promises() -> None:
    from agl.tracer.instrument import _INSTRUMENTORS

    integrations = {_distribution(r) for r in _extras()["integrations"]}
    assert {package for _, _, package in _INSTRUMENTORS.values()} <= integrations
    assert "openai" in {_distribution(r) for r in _extras()[""]}  # every README snippet imports it


def test_instrumenting_a_library_that_is_absent_names_the_library() -> None:
    import importlib.util

    import agl
    from agl.errors import ConfigError

    if importlib.util.find_spec("litellm") is None:  # the instrumentor (agl[integrations]) is, litellm is not
        with pytest.raises(ConfigError, match=r"litellm.*pip install litellm"):
            agl.instrument("litellm", required=True)
        assert "litellm" not in agl.instrument("litellm")
    else:
        assert agl.instrument("litellm", required=True) == ["litellm"]


def test_each_benchmark_names_the_extras_its_imports_need() -> None:
    """A benchmark's third-party imports are in core/``train`` or an extra its docstring tells to install."""
    from importlib.metadata import packages_distributions

    extras = {name: {_distribution(r) for r in reqs} for name, reqs in _extras().items()}
    siblings = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}  # a script imports its neighbours
    own = set(sys.stdlib_module_names) | {"agl", "examples", "benchmarks", "tests"} | siblings
    dists = packages_distributions()
    needed: set[str] = set()
    for path in (ROOT / "benchmarks").glob("*.py"):
        if path.name in ("_dspy_side.py", "_agentlightning_side.py"):  # run in .venv-dspy and
            continue  # .venv-agentlightning, which apo_vs_gepa.py's and store_user_path.py's docstrings set up
        tree = ast.parse(path.read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {
            n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level
        }
        for module in {m.split(".")[0] for m in modules} - own:
            names = {_distribution(d) for d in dists.get(module, [module])}
            homes = [e for e, reqs in extras.items() if names & reqs]
            assert homes, f"{path.name} imports {module}, which no extra installs: add it to the bench extra"
            if not {"", "train"} & set(homes):
                assert any(f"'.[{e}]'" in (ast.get_docstring(tree) or "") for e in homes), (
                    f"{path.name} needs {module}: its docstring must say pip install -e '.[{homes[0]}]'"
                )
                needed |= set(homes)
    assert "bench" in needed  # trl for grpo_vs_trl.py
