"""worker.store.records.dumps: the JSON of every record field and stream entry, exactly what
``json.dumps(value, separators=(",", ":"), ensure_ascii=False)`` writes, for any value."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.store.records import dumps

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
KEYS = st.text() | st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none()
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(KEYS, inner, max_size=4)
    ),
    max_leaves=20,
)


def reference(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@given(VALUES)
def test_dumps_writes_what_json_dumps_writes(value: Any) -> None:
    assert dumps(value) == reference(value)


def test_text_that_needs_escaping_and_what_json_cannot_write() -> None:
    text = 'quote " backslash \\ newline \n nul \x00 é 😀 \u2028'
    assert dumps({"content": text}) == reference({"content": text})
    assert json.loads(dumps({"content": text})) == {"content": text}
    assert dumps([math.inf, -math.inf]) == "[Infinity,-Infinity]"
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps({"when": object()})
