"""Trainer's arguments: at most 7, serving settings in one ``agl.Serving``; each pre-``serving`` keyword
still works for one release with a DeprecationWarning naming its new spelling; bad values name the field."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

import agl
from agl.engines import BuiltinEngine, VllmEngine
from agl.errors import ConfigError
from agl.trainer.trainer import DEPRECATED_KEYWORDS


def test_trainer_takes_at_most_seven_arguments() -> None:
    params = [p for p in inspect.signature(agl.Trainer.__init__).parameters.values() if p.name != "self"]
    named = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
    assert named == [
        "algorithm",
        "store",
        "n_runners",
        "output_dir",
        "serving",
        "initial_resources",
        "trackers",
    ]
    trainer = agl.Trainer("my-algorithm", serving=agl.Serving(port=8123))  # algorithm may be positional
    assert trainer.algorithm == "my-algorithm" and trainer.serving.port == 8123
    assert agl.Trainer().serving == agl.Serving()  # loopback, a free port, the built-in engine, T=1
    assert agl.Serving().sampling == {"temperature": 0.7} and agl.Serving().engine is None


VLLM = VllmEngine(replicas=2)

# old keyword, its value, what it means now
OLD_KEYWORDS: list[tuple[str, Any, agl.Serving]] = [
    ("sampling", {"temperature": 0.3}, agl.Serving(sampling={"temperature": 0.3})),
    ("engine", VLLM, agl.Serving(engine=VLLM)),
    ("engine_options", {"device": "cpu"}, agl.Serving(engine=BuiltinEngine({"device": "cpu"}))),
    ("gateway", agl.Serving(host="0.0.0.0", token="t"), agl.Serving(host="0.0.0.0", token="t")),
    ("gateway_host", "0.0.0.0", agl.Serving(host="0.0.0.0")),
    ("gateway_port", 8123, agl.Serving(port=8123)),
    ("public_host", "trainer.lan", agl.Serving(public_host="trainer.lan")),
]


def test_every_deprecated_keyword_is_covered() -> None:
    assert sorted(key for key, _, _ in OLD_KEYWORDS) == sorted(DEPRECATED_KEYWORDS)


@pytest.mark.parametrize(("key", "value", "serving"), OLD_KEYWORDS, ids=[k for k, _, _ in OLD_KEYWORDS])
def test_each_old_keyword_warns_with_its_new_spelling_and_still_works(
    key: str, value: Any, serving: agl.Serving
) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        trainer = agl.Trainer(**{key: value})
    (warning,) = caught
    assert (
        str(warning.message) == f"Trainer({key}=...) is deprecated; use Trainer({DEPRECATED_KEYWORDS[key]})"
    )
    assert DEPRECATED_KEYWORDS[key].startswith("serving=agl.Serving(")
    assert warning.filename == __file__  # it points at the caller's line, not at agl
    assert trainer.serving == serving
    assert trainer.serving.token == serving.token  # not part of the dataclass's repr, still compared


def test_old_keywords_combine_as_before() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        trainer = agl.Trainer(
            gateway_host="0.0.0.0", gateway_port=9000, sampling={"temperature": 0.7}, engine_options={"a": 1}
        )
    assert trainer.serving == agl.Serving(
        host="0.0.0.0", port=9000, sampling={"temperature": 0.7}, engine=BuiltinEngine({"a": 1})
    )


def test_the_old_gateway_settings_name_warns_and_is_serving() -> None:
    with pytest.warns(DeprecationWarning, match="GatewaySettings is deprecated; use agl.Serving"):
        from agl.trainer import GatewaySettings
    assert GatewaySettings is agl.Serving
    with pytest.warns(DeprecationWarning, match="GatewaySettings is deprecated"):
        from agl.trainer.trainer import GatewaySettings as Again
    assert Again is agl.Serving


def test_conflicting_or_unknown_arguments_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="pass serving=agl.Serving"), pytest.warns(DeprecationWarning):
        agl.Trainer(serving=agl.Serving(), sampling={"temperature": 0.1})  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="engine= or engine_options="), pytest.warns(DeprecationWarning):
        agl.Trainer(engine=VLLM, engine_options={"device": "cpu"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_runner'"):
        agl.Trainer(n_runner=2)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match=r"Trainer\(serving=...\) takes an agl.Serving"):
        agl.Trainer(serving={"port": 1})  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="Serving.port must be 0"):
        agl.Serving(port=70000)
    with pytest.raises(ConfigError, match="Serving.port must be 0 .* got '80'"):
        agl.Serving(port="80")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Serving.sampling must be a mapping"):
        agl.Serving(sampling=0.7)  # type: ignore[arg-type]
