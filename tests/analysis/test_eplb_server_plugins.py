"""The entry points through which vLLM and SGLang load ours (pyproject.toml): vLLM 0.33.0 loads the group
`vllm.general_plugins` and SGLang 0.5.23 `sglang.srt.plugins` in every one of their processes, calling each entry's
function with no arguments (vllm/plugins/__init__.py load_general_plugins, sglang/srt/plugins/__init__.py
load_plugins). Installed beside a server, r3trace must change nothing until its variable is set, and then fail
naming that variable where the server is missing. Run: .venv/bin/pytest tests/analysis/test_eplb_server_plugins.py -q
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from types import ModuleType

import pytest

from r3trace.eplb import sglang_plugin, vllm_policy


@pytest.mark.parametrize(("group", "module", "server", "words"), [
    ("vllm.general_plugins", vllm_policy, "vllm", "needs vLLM"),
    ("sglang.srt.plugins", sglang_plugin, "sglang", "needs SGLang"),
])
def test_the_servers_plugin_group_points_at_register(monkeypatch: pytest.MonkeyPatch, group: str, module: ModuleType,
                                                     server: str, words: str) -> None:
    (ep,) = [ep for ep in entry_points(group=group) if ep.name == "r3trace_eplb"]
    assert ep.load() is module.register
    monkeypatch.delenv(module.ENV, raising=False)
    monkeypatch.setitem(sys.modules, server, None)  # no server: unset, the plugin does nothing and imports nothing
    module.register()
    monkeypatch.setenv(module.ENV, "1")
    with pytest.raises(ImportError, match=f"^{module.ENV}=1 {words}"):
        module.register()
