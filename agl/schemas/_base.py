"""Shared helpers for the wire models: id generation and the strict base model."""

from __future__ import annotations

import math
import secrets
import time
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Base of every model that crosses a process boundary; unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)


def new_id(prefix: str, nbytes: int = 6) -> str:
    """A short random id such as ``ro-3f9a1c2b7d4e``."""
    return f"{prefix}-{secrets.token_hex(nbytes)}"


def now_s() -> float:
    """Wall-clock seconds; the store's default clock."""
    return time.time()


MAX_JSON_DEPTH = 64
JsonT = TypeVar("JsonT")
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what every backend's JSON encoder round-trips


def check_json(value: JsonT, field: str, max_depth: int = MAX_JSON_DEPTH) -> JsonT:
    """``value`` unchanged when every backend can store and read it back as JSON, else ValueError.

    Rejects NaN and Infinity (JSON has none; they would come back as null), nesting deeper than
    ``max_depth`` (it would be unreadable later), integers outside 64 bits, non-string keys,
    unpaired surrogates and non-JSON types. The message names the offending path under ``field``.
    """
    if not _fine(value, max_depth):
        _walk(value, field, max_depth)  # the slow walk finds the problem and names its path
    return value


_INF = math.inf


def _fine(value: Any, depth: int) -> bool:
    """True when ``value`` is storable JSON: the fast check, building no paths (on every span's attributes)."""
    kind = type(value)
    if kind is dict:
        for key in value:
            if type(key) is not str or not (key.isascii() or _utf8(key)):
                return False
        items = value.values()
    elif kind is list or kind is tuple:
        items = value
    else:
        return _fine([value], depth + 1)
    if depth <= 0:
        return False
    if kind is not dict and len(items) > 16 and _plain_list(items):
        return True  # token ids, logprobs: checked at C speed instead of item by item
    for item in items:
        kind = type(item)
        if kind is str:
            if not (item.isascii() or _utf8(item)):
                return False
        elif kind is int:
            if not _INT_MIN <= item <= _INT_MAX:
                return False
        elif kind is float:
            if not -_INF < item < _INF:  # False for NaN too
                return False
        elif kind is dict or kind is list or kind is tuple:
            if not _fine(item, depth - 1):
                return False
        elif item is not None and kind is not bool:
            return False
    return True


def check_no_nul(value: str | None, field: str) -> str | None:
    """``value`` unless it holds a NUL character, which PostgreSQL's text columns (ids, names) refuse."""
    if value is not None and "\x00" in value:
        raise ValueError(f"{field} contains a NUL character; ids, modes and names must be text without NUL")
    return value


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _walk(value: Any, path: str, depth: int) -> None:
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        if depth <= 0:
            raise ValueError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels; flatten it")
        if kind is dict:
            for key, item in value.items():
                if type(key) is not str:
                    raise ValueError(f"{path} has the non-string key {key!r}; JSON object keys are strings")
                if not key.isascii():
                    _check_text(key, path)
                if not _plain(item):
                    _walk(item, f"{path}.{key}", depth - 1)
        elif not _plain_list(value):
            for index, item in enumerate(value):
                if not _plain(item):
                    _walk(item, f"{path}[{index}]", depth - 1)
    elif kind is str:
        _check_text(value, path)
    elif kind is float:
        if not math.isfinite(value):
            raise ValueError(
                f"{path} is {value}; JSON has no NaN or Infinity, so send a finite number or null"
            )
    elif kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise ValueError(
                f"{path} is {value}, outside the 64-bit integers JSON stores; send it as a string"
            )
    elif value is not None and kind is not bool:
        raise ValueError(
            f"{path} is a {kind.__name__}, not a JSON value (object, array, string, number, bool, null)"
        )


def _plain_list(items: list[Any] | tuple[Any, ...]) -> bool:
    """True for a flat list of finite 64-bit numbers (token ids, logprobs), checked in C, not item by item.

    False sends the list to the item-by-item look, which has the final word.
    """
    try:
        total = sum(items)  # only numbers: text, null and containers raise TypeError
    except (TypeError, OverflowError):
        return False
    if isinstance(total, float) and not math.isfinite(total):  # a NaN or infinity (or an overflowing sum)
        return False
    try:
        orjson.dumps(items)  # exact JSON number types in the 64-bit range orjson stores
    except orjson.JSONEncodeError:
        return False
    return True


def _plain(item: Any) -> bool:
    """True for the values that need no further look: ASCII text, 64-bit ints, bools, null."""
    kind = type(item)
    if kind is str:
        return item.isascii()  # type: ignore[no-any-return]
    if kind is int:
        return _INT_MIN <= item <= _INT_MAX  # type: ignore[no-any-return]
    return item is None or kind is bool


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{path} holds an unpaired surrogate; send valid Unicode text") from exc
