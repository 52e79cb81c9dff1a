"""The suite-wide rule of tests/conftest.py: under CI or AGL_REQUIRE_ALL=1 a skip fails the run."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

INNER = """
import pytest

def test_runs():
    assert True

def test_skips_inside():
    pytest.skip("needs the frobnicator service")

@pytest.mark.skipif(True, reason="no GPU here")
def test_skipif():
    pass

@pytest.fixture
def service():
    pytest.skip("fixture: PostgreSQL is not reachable")

def test_fixture_skips(service):
    pass

@pytest.mark.optional_dependency("vllm")
def test_optional():
    pytest.importorskip("no_such_vllm_module_for_agl")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_xfail():
    assert False
"""


@pytest.fixture(autouse=True)
def _importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the subprocess loads `-p tests.conftest`
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the rule needs no plugin; start in ~1 s


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in ("CI", "AGL_REQUIRE_ALL", "AGL_OPTIONAL_SKIPS"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_inner=INNER)
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # In a subprocess: an in-process run empties and refills sys.modules afterwards, and a background thread
    # left by an earlier test that imports in that window re-initialises `_io` (io.UnsupportedOperation then
    # no longer matches what BytesIO raises, which broke torch.save in the Ray tests that ran later).
    return pytester.runpytest_subprocess(
        "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA", *args, timeout=120
    )


def test_without_the_rule_skips_stay_skips(inner: pytest.Pytester) -> None:
    result = _run(inner)
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)
    result.stdout.fnmatch_lines(["agl: 6 test items collected; require-all off*"])


@pytest.mark.parametrize("env", [("AGL_REQUIRE_ALL", "1"), ("CI", "true")])
def test_every_kind_of_skip_fails_under_the_rule(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, env: tuple[str, str]
) -> None:
    monkeypatch.setenv(*env)
    result = _run(inner)
    result.assert_outcomes(passed=1, failed=2, errors=2, xfailed=1)  # setup-phase skips: errors
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    for reason in ("frobnicator", "no GPU here", "PostgreSQL is not reachable", "no_such_vllm_module"):
        result.stdout.fnmatch_lines([f"*skipped under AGL_REQUIRE_ALL/CI*{reason}*"])
    result.stdout.fnmatch_lines(["agl: 6 test items collected; require-all on*"])


def test_agl_require_all_0_overrides_ci(inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("AGL_REQUIRE_ALL", "0")
    _run(inner).assert_outcomes(passed=1, skipped=4, xfailed=1)


def test_an_optional_dependency_skips_only_when_listed_by_name(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_REQUIRE_ALL", "1")
    monkeypatch.setenv("AGL_OPTIONAL_SKIPS", "ray, vllm")
    _run(inner).assert_outcomes(passed=1, failed=1, errors=2, skipped=1, xfailed=1)
    monkeypatch.setenv("AGL_OPTIONAL_SKIPS", "ray")
    _run(inner).assert_outcomes(passed=1, failed=2, errors=2, xfailed=1)


def test_a_module_skipped_at_collection_fails_collection(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_mod="import pytest\npytest.importorskip('no_such_module_agl')\n\ndef test_x():\n    pass\n",
        test_ok="def test_y():\n    pass\n",
    )
    monkeypatch.setenv("AGL_REQUIRE_ALL", "1")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # pytest stops on a collection error
    result.stdout.fnmatch_lines(["*skipped under AGL_REQUIRE_ALL/CI*no_such_module_agl*"])
    monkeypatch.setenv("AGL_REQUIRE_ALL", "0")
    _run(pytester).assert_outcomes(passed=1, skipped=1)


def test_an_import_error_is_a_collection_error_even_without_the_rule(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("AGL_REQUIRE_ALL", raising=False)
    pytester.makepyfile(test_broken="import no_such_module_agl\n\ndef test_x():\n    pass\n")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*ModuleNotFoundError*no_such_module_agl*", "*1 error*"])


def test_two_items_with_one_node_id_are_refused(pytester: pytest.Pytester) -> None:
    # pytest-xdist would run one of them and drop the other unreported
    pytester.makeconftest(
        "import pytest\n\n@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_collection_modifyitems(items):\n"
        "    items.append(pytest.Function.from_parent(items[0].parent, name=items[0].name))\n"
    )
    pytester.makepyfile(test_twice="def test_x():\n    pass\n")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*1 node ids name more than one test item: test_twice.py::test_x*"])


def test_under_xdist_the_count_is_the_workers(inner: pytest.Pytester) -> None:
    result = _run(inner, "-p", "xdist.plugin", "-n", "2")
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)
    result.stdout.fnmatch_lines(["agl: 6 test items collected"])
