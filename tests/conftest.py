"""Suite-wide rules: under CI (``CI`` set, or ``AGL_REQUIRE_ALL=1`` as ``make test`` sets it) a skip is a failure.

A missing import or service must not drop tests silently: every skip (``pytest.skip``, ``importorskip``,
a ``skipif`` that triggers, in a test, a fixture or at module level during collection) turns into a
failure that quotes the skip's reason. A test marked ``@pytest.mark.optional_dependency("vllm")`` may
skip only when that name is listed in ``AGL_OPTIONAL_SKIPS`` (comma-separated), so even optional parts
run in CI unless someone opts out by name. ``xfail`` is untouched. The number of collected items is
printed, so a shrinking suite is visible.
"""

from __future__ import annotations

import collections
import io
import os
from collections.abc import Generator
from typing import Any

import pytest

pytest_plugins = ["pytester"]

# "auto" precision means bf16 on CPUs with native bf16 and fp32 elsewhere: pin fp32 so results (and tight
# numeric comparisons) do not depend on the CI machine's CPU; tests/algorithm/test_precision.py runs bf16
os.environ.setdefault("AGL_PRECISION", "fp32")

_TRUE = {"1", "true", "yes", "on"}


def require_all() -> bool:
    """Whether skips fail this run: ``AGL_REQUIRE_ALL`` decides when set, else whether ``CI`` is set."""
    explicit = os.environ.get("AGL_REQUIRE_ALL")
    if explicit is not None:
        return explicit.strip().lower() in _TRUE
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def _allowed_optional() -> set[str]:
    return {n.strip() for n in os.environ.get("AGL_OPTIONAL_SKIPS", "").split(",") if n.strip()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "optional_dependency(name): may skip when NAME is absent, but under CI/AGL_REQUIRE_ALL only "
        "if AGL_OPTIONAL_SKIPS lists NAME",
    )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _failure(reason: str) -> str:
    return (
        f"skipped under AGL_REQUIRE_ALL/CI, which counts as a failure: {reason}\n"
        "Install or start what the test needs (see its reason), or, for an optional part, mark the "
        "test @pytest.mark.optional_dependency(NAME) and list NAME in AGL_OPTIONAL_SKIPS."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not require_all():
        return
    allowed = _allowed_optional()
    if any(m.args and m.args[0] in allowed for m in item.iter_markers("optional_dependency")):
        return
    report.outcome = "failed"
    report.longrepr = _failure(_skip_reason(report))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """A module skipped while collecting (``importorskip``, ``skip(allow_module_level=True)``) fails too."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and require_all():
        report.outcome = "failed"
        report.longrepr = _failure(_skip_reason(report))


def _io_intact() -> bool:
    try:
        io.BytesIO().fileno()
    except io.UnsupportedOperation:
        return True
    except Exception:  # noqa: BLE001 - any other class means a second `_io` was initialised
        return False
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """Name the test after which ``io.UnsupportedOperation`` stopped matching what ``BytesIO`` raises.

    That happens when ``_io`` is imported again (sys.modules emptied while another thread imports) and
    breaks ``torch.save`` to memory far from the cause; the failure is reported once, at its source.
    """
    yield
    if not _io_intact() and not item.config.stash.get(_IO_REPORTED, False):
        item.config.stash[_IO_REPORTED] = True
        raise RuntimeError(f"`_io` was re-initialised during {item.nodeid}: io.UnsupportedOperation is stale")


_IO_REPORTED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Two items with one node id are one test to pytest-xdist, which runs the first and drops the rest
    unreported: refuse them (parametrize with ids instead)."""
    counts = collections.Counter(item.nodeid for item in items)
    twice = sorted(nodeid for nodeid, n in counts.items() if n > 1)
    if twice:
        raise pytest.UsageError(f"{len(twice)} node ids name more than one test item: {', '.join(twice[:5])}")


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str:
    rule = "on: skips fail" if require_all() else "off: skips allowed (set AGL_REQUIRE_ALL=1 to forbid)"
    return f"agl: {len(items)} test items collected; require-all {rule}"


_WORKER_COLLECTED = pytest.StashKey[int]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under pytest-xdist the controller collects nothing itself: count what the workers collected."""
    config = node.config
    config.stash[_WORKER_COLLECTED] = max(config.stash.get(_WORKER_COLLECTED, 0), len(ids))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    collected = config.stash.get(_WORKER_COLLECTED, None) or getattr(terminalreporter, "_numcollected", None)
    if collected is not None:
        terminalreporter.write_line(f"agl: {collected} test items collected")
