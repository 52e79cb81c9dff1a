"""The recipes' held-out split: test items spread over question templates, never more than a third of one."""

from __future__ import annotations

import zlib
from typing import Any


def split_by_template(items: list[dict[str, Any]], test: int, key: str, seed: int = 0) -> tuple[list, list]:
    """``(train, test)``: ``test`` items chosen round-robin over ``item["template"]`` in a stable hash order of
    ``item[key]``, at most a third of any template's items, so every template is tested and mostly trained.

    Raises:
        ValueError: ``test`` is more than a third of the items allows.
    """
    ranked = sorted(items, key=lambda item: zlib.crc32(f"{seed}:{item[key]}".encode()))
    per_template: dict[int, list[dict[str, Any]]] = {}
    for item in ranked:
        per_template.setdefault(item["template"], []).append(item)
    quota = {t: len(group) // 3 for t, group in per_template.items()}
    if sum(quota.values()) < test:
        raise ValueError(f"at most {sum(quota.values())} held-out items keep two thirds of each template")
    held: list[dict[str, Any]] = []
    while len(held) < test:
        for t, group in per_template.items():
            if len(held) < test and quota[t] > 0:
                held.append(group.pop(0))
                quota[t] -= 1
    held_keys = {item[key] for item in held}
    return [item for item in items if item[key] not in held_keys], held
