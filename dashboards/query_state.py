"""Widget state lives in the URL (`st.query_params`): a view can be bookmarked and shared, and a reload
keeps it. Each helper reads its default from the query string and writes the chosen value back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import streamlit as st

T = TypeVar("T")


def select(label: str, options: Sequence[T], key: str, where: Any = st, default: int = 0) -> T:
    """A selectbox over `options` whose choice is query param `key` (matched by str())."""
    names = [str(o) for o in options]
    raw = st.query_params.get(key)
    index = names.index(raw) if raw in names else min(default, len(options) - 1)
    value = where.selectbox(label, options, index=index, key=f"qp_{key}")
    st.query_params[key] = str(value)
    return value  # type: ignore[no-any-return]


def number(label: str, key: str, default: int, lo: int, hi: int, where: Any = st) -> int:
    raw = st.query_params.get(key)
    try:
        start = min(max(int(raw), lo), hi) if raw is not None else default
    except ValueError:
        start = default
    value = int(where.number_input(label, min_value=lo, max_value=hi, value=start, step=1, key=f"qp_{key}"))
    st.query_params[key] = str(value)
    return value


def index_range(label: str, n: int, key: str, where: Any = st) -> tuple[int, int]:
    """A two-ended slider over 0..n-1 (window indices); query param "lo-hi"."""
    lo, hi = 0, n - 1
    raw = st.query_params.get(key)
    if raw and "-" in raw:
        a, _, b = raw.partition("-")
        if a.isdigit() and b.isdigit():
            lo, hi = min(int(a), n - 1), min(int(b), n - 1)
    if n == 1:
        return 0, 0
    got = where.slider(label, 0, n - 1, (lo, max(lo, hi)), key=f"qp_{key}")
    st.query_params[key] = f"{got[0]}-{got[1]}"
    return int(got[0]), int(got[1])


def text(label: str, key: str, default: str, where: Any = st, area: bool = False) -> str:
    start = st.query_params.get(key, default)
    widget = where.text_area if area else where.text_input
    value = str(widget(label, value=start, key=f"qp_{key}"))
    st.query_params[key] = value
    return value
