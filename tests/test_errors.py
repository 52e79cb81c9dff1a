"""agl/errors.py: the install command a missing optional dependency names fits how agl was installed."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from agl.errors import AgentError, ConfigError, RolloutsFailedError, install_command, missing_extra

ROOT = Path(__file__).resolve().parents[1]


def test_from_a_clone_the_install_command_is_an_editable_install_of_that_clone() -> None:
    assert install_command("ray") == f"pip install -e '{ROOT}[ray]'"
    error = missing_extra("ray", "ray")
    assert isinstance(error, ConfigError)
    assert str(error) == f"ray is not installed; install it with `pip install -e '{ROOT}[ray]'`."


def test_outside_a_clone_the_install_command_names_the_package_on_the_index(tmp_path: Path) -> None:
    # agl/errors.py as an installed wheel lays it out: no pyproject.toml beside the package
    (tmp_path / "agl").mkdir()
    shutil.copy(ROOT / "agl" / "errors.py", tmp_path / "agl" / "errors.py")
    spec = importlib.util.spec_from_file_location("installed_errors", tmp_path / "agl" / "errors.py")
    assert spec is not None and spec.loader is not None
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.install_command("trackers") == "pip install 'agl[trackers]'"


def test_rollouts_failed_is_an_agent_error_of_the_one_tree() -> None:
    from agl.algorithm.health import RolloutsFailedError as reexported

    assert reexported is RolloutsFailedError and issubclass(RolloutsFailedError, AgentError)
