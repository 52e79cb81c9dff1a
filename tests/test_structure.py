"""The architecture as tests: a pinned public surface, imports that point down agl's layers and never in a
cycle, modules that stay small."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import agl

PACKAGE = Path(agl.__file__).parent

# agl's components (each subpackage and top-level module) bottom-up, in bands: a component imports only the
# components listed before it. Every component is listed; ``agl/__init__.py``, the public surface, is the root.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "semconv", "schemas"),  # error types, span attribute names, the records everyone exchanges
    ("store",),  # rollouts, attempts, spans and resources: in memory, SQLite, PostgreSQL, over HTTP
    ("adapter", "tracer", "emit", "failures", "seeding"),  # spans out as training data, spans in from agent
    # code; why a rollout yielded no reward; the seeds of a reproducible run
    ("asgi_server", "compute", "models", "gateway"),  # server threads, device/precision/memory, local LMs
    ("engines", "testing"),  # what serves the model, and the in-memory stand-in for one in users' tests
    (
        "agent",
        "sandbox",
        "runner",
        "rewards",
    ),  # the agent side: agents, rewards (a sandbox, a judge), the claim loop
    ("trackers", "metrics", "algorithm"),  # GRPO, APO and SFT over a TrainingContext, and their metrics
    ("trainer",),  # wires store, gateway, engines, runners and an algorithm
    ("dashboard", "cli", "__main__"),  # the user's entry points
)
RANK = {component: rank for rank, component in enumerate(c for band in LAYERS for c in band)}


def _modules() -> dict[str, Path]:
    """Every module of agl by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["agl", *path.relative_to(PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every agl module ``name`` imports anywhere in its body, inside functions and ``TYPE_CHECKING`` blocks
    too (``from pkg import sub`` names the submodule; a name inside a module, the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """agl's module import graph: each module and the agl modules it imports."""
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _component(module: str) -> str:
    """``agl.store.sqlite`` -> ``store``; the root package ``agl`` stays ``agl``."""
    return module.split(".")[1] if "." in module else module


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up a layer (or at the root package, which reaches every layer), and components
    missing from LAYERS or listed there but gone."""
    components = {_component(m) for m in graph} - {"agl"}
    problems = [f"agl.{c} is in no layer: add it to LAYERS" for c in sorted(components - set(RANK))]
    problems += [f"LAYERS lists {c}, which agl has no more" for c in sorted(set(RANK) - components)]
    for module, targets in sorted(graph.items()):
        component = _component(module)
        if component == "agl" or component not in RANK:  # the root re-exports every layer
            continue
        for target in sorted(targets):
            imported = _component(target)
            if imported != component and (imported == "agl" or RANK.get(imported, -1) > RANK[component]):
                problems.append(f"{module} imports {target}, above {component} in LAYERS")
    return problems


def test_public_surface_is_sorted_and_importable() -> None:
    assert agl.__all__ == sorted(agl.__all__)
    # a public name equal to a subpackage would be shadowed once that subpackage is imported
    assert [n for n in agl.__all__ if (PACKAGE / n).is_dir()] == []
    for name in agl.__all__:
        assert getattr(agl, name) is not None, name


def test_imports_point_down_the_layers() -> None:
    assert layer_violations(import_graph()) == []


def test_an_upward_import_or_an_unlisted_component_is_reported() -> None:
    graph = import_graph()
    graph["agl.compute.memory"] = graph["agl.compute.memory"] | {"agl.algorithm.policy.model"}
    graph["agl.store.base"] = graph["agl.store.base"] | {"agl"}
    graph["agl.newpart"] = {"agl.errors"}
    assert layer_violations(graph) == [
        "agl.newpart is in no layer: add it to LAYERS",
        "agl.compute.memory imports agl.algorithm.policy.model, above compute in LAYERS",
        "agl.store.base imports agl, above store in LAYERS",
    ]


def test_no_import_cycles_in_agl() -> None:
    """No module imports itself back, not even lazily, under TYPE_CHECKING or inside one package."""
    sorter = graphlib.TopologicalSorter(import_graph())
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_modules_stay_under_the_size_cap() -> None:
    too_big = [
        f"{p.relative_to(PACKAGE)}: {n} lines"
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    ]
    assert too_big == []


def test_import_agl_is_light() -> None:
    code = "import sys, agl, agl.store; print(sorted(m for m in ('torch', 'transformers', 'opentelemetry.sdk') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_functions_stay_under_the_size_cap() -> None:
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 120:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == []
