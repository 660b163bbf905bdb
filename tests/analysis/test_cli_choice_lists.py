"""`r3trace eplb`'s choice lists are written out in r3trace/commands/eplb.py so that building the parser imports no
numpy; they must stay the lists r3trace.eplb.evaluate plans and judges by (a name added on one side only would be
refused by argparse or fail inside the report).

Run: .venv/bin/pytest -q tests/analysis/test_cli_choice_lists.py
"""

from __future__ import annotations

from r3trace.commands import eplb as cli
from r3trace.eplb import evaluate


def test_cli_choices_are_the_evaluated_ones() -> None:
    assert cli.POLICIES[0] == "auto" and cli.POLICIES[1:] == evaluate.POLICIES
    assert cli.FORECASTS == evaluate.FORECASTS
    assert cli.DISPATCHES == evaluate.DISPATCHES
