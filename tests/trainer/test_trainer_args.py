"""Trainer's arguments: at most 7, serving settings in one ``agl.Serving``; bad values name the field."""

from __future__ import annotations

import inspect

import pytest

import agl
from agl.errors import ConfigError


def test_trainer_takes_at_most_seven_arguments() -> None:
    params = [p for p in inspect.signature(agl.Trainer.__init__).parameters.values() if p.name != "self"]
    assert [p.name for p in params] == [
        "algorithm",
        "store",
        "n_runners",
        "output_dir",
        "serving",
        "initial_resources",
        "trackers",
    ]
    algorithm = agl.Algorithm()
    trainer = agl.Trainer(algorithm, serving=agl.Serving(port=8123))  # algorithm may be positional
    assert trainer.algorithm is algorithm and trainer.serving.port == 8123
    assert agl.Trainer().serving == agl.Serving()  # loopback, a free port, the built-in engine, T=1
    assert agl.Serving().sampling == {"temperature": 0.7} and agl.Serving().engine is None


def test_unknown_arguments_and_bad_values_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_runner'"):
        agl.Trainer(n_runner=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'sampling'"):  # Serving's field now
        agl.Trainer(sampling={"temperature": 0.1})  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"Trainer\(serving=...\) takes an agl.Serving"):
        agl.Trainer(serving={"port": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Serving.port must be 0"):
        agl.Serving(port=70000)
    with pytest.raises(ConfigError, match="Serving.port must be 0 .* got '80'"):
        agl.Serving(port="80")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Serving.sampling must be a mapping"):
        agl.Serving(sampling=0.7)  # type: ignore[arg-type]
