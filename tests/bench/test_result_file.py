"""bench/result_file.py: a run writes its own result file, a smoke run nothing unless --out names one."""

from __future__ import annotations

import json

from bench.result_file import write_result


def test_where_a_result_document_goes(tmp_path, capsys):
    doc = {"results": [{"cell": "a", "bal": 0.5}]}
    own, named = tmp_path / "own.json", tmp_path / "named.json"
    assert write_result(doc, None, True, own) is None and not own.exists()  # smoke: nothing
    assert write_result(doc, None, False, own) == own
    assert json.loads(own.read_text()) == doc
    assert write_result({"results": []}, str(named), True, own) == named  # --out wins, smoke or not
    assert json.loads(named.read_text()) == {"results": []} and json.loads(own.read_text()) == doc
    assert capsys.readouterr().out.splitlines() == [f"wrote {own}", f"wrote {named}"]
