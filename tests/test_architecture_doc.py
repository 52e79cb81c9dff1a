"""ARCHITECTURE.md names every package and top-level module of agl, and stays one short page."""

from __future__ import annotations

from pathlib import Path

import agl

PACKAGE = Path(agl.__file__).parent
PAGE = PACKAGE.parent / "ARCHITECTURE.md"


def components() -> list[str]:
    """``agl/<pkg>/`` for each subpackage and ``agl/<module>.py`` for each top-level module."""
    packages = [f"agl/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    modules = [f"agl/{p.name}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    return sorted(packages + modules)


def test_every_component_is_on_the_page() -> None:
    text = PAGE.read_text()
    assert [c for c in components() if f"`{c}" not in text] == []


def test_the_page_fits_a_sitting() -> None:
    assert len(PAGE.read_text().splitlines()) <= 400


def test_a_new_package_would_fail_it() -> None:
    # the check reads the page's text, so a component the page lacks is reported
    text = PAGE.read_text().replace("`agl/rewards/", "`agl/renamed/")
    assert [c for c in components() if f"`{c}" not in text] == ["agl/rewards/"]
