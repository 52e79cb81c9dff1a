"""Hypothesis strategies for free-form JSON values, including what no JSON store can hold (NaN,
infinities, integers beyond 64 bits), for tests of the checks that keep those out."""

from __future__ import annotations

try:
    from hypothesis import strategies as st
except ImportError as exc:  # never a silent skip: the dev extra provides it (via schemathesis)
    raise ImportError("hypothesis is missing; install the dev extra: pip install -e '.[dev]'") from exc

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=30,
)
