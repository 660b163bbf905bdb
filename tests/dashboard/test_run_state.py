"""A run's state (reader.RunFiles.state) through the dashboard (AppTest), as it changes under a running app:
a live writer's run says it is recording and each commit shows on the next rerun (the cached store is dropped
when a manifest or a writer lock changes), the notice goes when the writer closes the run; a crashed run's
warning goes once `recover_run` closes it.

Run: .venv/bin/pytest -q tests/dashboard/test_run_state.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from r3trace.trace import TraceWriter, recover_run
from tests.dashboard.odd_stores import SHAPE, _tokens, write_crashed

APP = str(Path(__file__).resolve().parents[2] / "dashboards" / "app.py")


def overview(at: AppTest, warned: bool = False) -> tuple[dict[str, str], list[str]]:
    """(metrics, info or warning lines) of the overview page after a rerun."""
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert bool(at.warning) == warned, [w.value for w in at.warning]
    notes = at.warning if warned else at.info
    return {m.label: m.value for m in at.metric}, [str(i.value) for i in notes]


def test_live_run_shows_each_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    monkeypatch.setenv("R3TRACE_STORE", str(tmp_path))
    # compact_fanin=2: the second commit merges both files into one and deletes them (what a cached store's views
    # would still name)
    w = TraceWriter(tmp_path, run_id="live", flush_interval_s=None, compact_fanin=2, **SHAPE)  # type: ignore[arg-type]
    try:
        _tokens(w, rng, "a", 3, 0)
        w.add_request("a", prompt_tokens=3, completion_tokens=0, finish_reason="stop")
        _tokens(w, rng, "b", 2, 3)  # in flight
        w.flush()
        at = AppTest.from_file(APP, default_timeout=60)
        m, info = overview(at)
        assert m["Tokens"] == "5" and m["Requests"] == "2"
        assert [line.strip() for line in info[0].splitlines()] == [
            "Run live is recording: a live writer still records it; rows appear as they are committed (on size, "
            "flush() and close only: its flush_interval_s is None), when the page reruns.",
            "1 request(s) in flight at its last commit (b) have routes and no requests-table row yet.",
        ]
        _tokens(w, rng, "c", 4, 5)  # not committed yet: not shown
        m, _ = overview(at)
        assert m["Tokens"] == "5"
        assert [f.name for f in w.flush().files] == ["part-00002.parquet"]  # 00000 and 00001 merged, deleted
        m, info = overview(at)
        assert (m["Tokens"], m["Requests"]) == ("9", "3")
        assert "2 request(s) in flight at its last commit (b, c)" in info[0]
    finally:
        w.close()  # "b" and "c" get finish_reason 'unfinished'
    m, info = overview(at)
    assert (m["Tokens"], m["Requests"]) == ("9", "3") and not info
    at.switch_page("views/requests.py").run()
    assert [c.value for c in at.caption][0] == ("2 of 3 requests had not finished when the trace was written "
                                                "(2 with finish_reason 'unfinished': empty tag and lengths)")


def test_crashed_run_recovered_under_the_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_crashed(tmp_path, np.random.default_rng(5))
    monkeypatch.setenv("R3TRACE_STORE", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=60)
    m, warning = overview(at, warned=True)
    assert (m["Tokens"], m["Requests"]) == ("5", "2")
    assert warning[0].startswith("Run crashed was not closed: its writer stopped without closing it")
    recover_run(tmp_path / "run_id=crashed")
    m, info = overview(at)
    assert (m["Tokens"], m["Requests"]) == ("5", "2") and not info
    at.switch_page("views/requests.py").run()
    assert [c.value for c in at.caption][0] == ("1 of 2 requests had not finished when the trace was written "
                                                "(1 with finish_reason 'unfinished': empty tag and lengths)")


def test_overview_warns_of_rows_repeating_an_expert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tokens of all-zero rows (slots a capture never wrote) and one [3, 3] row: the overview counts them;
    a run without any says nothing."""
    rng = np.random.default_rng(8)
    with TraceWriter(tmp_path, run_id="zeros", flush_interval_s=None, **SHAPE) as w:  # type: ignore[arg-type]
        ids = np.stack([rng.permutation(8)[:2] for _ in range(6 * 3)]).reshape(6, 3, 2)
        ids[[1, 4]] = 0
        ids[2, 0] = 3
        w.append_tokens("a", np.arange(6), "prefill", "computed", np.arange(6), 0, 0, ids)
    monkeypatch.setenv("R3TRACE_STORE", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=60)
    m, warning = overview(at, warned=True)
    assert m["Tokens"] == "6"
    assert warning == ["7 of 18 route rows name an expert twice in their top-2 (6 of them all zeros): a router picks "
                       "2 distinct experts, so these are broken captures, such as token slots the capture never "
                       "wrote. Heat and placements count them as routes; `r3trace ingest --drop-repeated` leaves "
                       "them out."]


def test_overview_warns_of_slots_read_through_another_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """physical_ids with a placements table: 2 tokens (6 rows) whose slots were picked under a map the trace did not
    record are counted against the recorded one (analysis/integrity.py's unplaced_rows); the rows that agree are not."""
    ran = np.stack([np.arange(10) % 8] * 3)  # [L, P]: slots 8, 9 hold experts 0, 1
    moved = ran.copy()
    moved[:, [1, 2]] = [2, 1]  # from forward 2 on slot 1 holds expert 2: the slot-1 rows of forwards 2, 3 miss
    ids = np.tile(np.array([0, 1]), (4, 3, 1))  # [4, L, K] experts 0 and 1
    slots = np.tile(np.array([0, 1]), (4, 3, 1))  # under `ran` slot 0 holds 0 and slot 1 holds 1: right
    with TraceWriter(tmp_path, run_id="slots", flush_interval_s=None, with_physical_ids=True,
                     **SHAPE) as w:  # type: ignore[arg-type]
        w.add_placement(0, SHAPE["moe_layer_ids"], ran)  # type: ignore[arg-type]
        w.add_placement(2, SHAPE["moe_layer_ids"], moved)  # type: ignore[arg-type]
        w.append_tokens("a", np.arange(4), "decode", "computed", np.arange(4), 0, 0, ids, physical_ids=slots)
    monkeypatch.setenv("R3TRACE_STORE", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=60)
    m, warning = overview(at, warned=True)
    assert m["Tokens"] == "4"
    assert warning == ["6 of 12 route rows have physical_ids whose slots do not hold their topk_ids under the "
                       "placement in force at their forward: a rebalance the trace did not record, or slots read "
                       "through another map. Heat by expert is unaffected; per-GPU load from these slots is wrong."]
