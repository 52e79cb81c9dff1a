"""The architecture as tests: a pinned public surface, imports that point one way, modules that stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import agl

PACKAGE = Path(agl.__file__).parent

# component -> the agl components it may import (itself always allowed)
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "errors": set(),
    "semconv": set(),
    "schemas": {"errors", "semconv"},
    "store": {"schemas", "errors", "semconv"},
    "adapter": {"schemas", "errors", "semconv"},
}


def _component(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _agl_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "agl" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_public_surface_is_sorted_and_importable() -> None:
    assert agl.__all__ == sorted(agl.__all__)
    # a public name equal to a subpackage would be shadowed once that subpackage is imported
    assert [n for n in agl.__all__ if (PACKAGE / n).is_dir()] == []
    for name in agl.__all__:
        assert getattr(agl, name) is not None, name


def test_imports_point_one_way() -> None:
    violations = []
    for path in PACKAGE.rglob("*.py"):
        component = _component(path)
        allowed = ALLOWED_IMPORTS.get(component)
        if allowed is None:
            continue
        for imported in _agl_imports(path) - allowed - {component}:
            violations.append(f"{path.relative_to(PACKAGE)} imports agl.{imported}")
    assert violations == []


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
