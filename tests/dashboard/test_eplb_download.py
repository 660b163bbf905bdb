"""The EPLB page's SGLang download: the file SGLang's --init-expert-location loads, as `r3trace eplb --sglang` writes
it. The loader's rules are tests/analysis/test_eplb_export.py's sglang_load (sgl-project/sglang commit
01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1, python/sglang/srt/eplb/expert_location.py): physical_to_logical_map
[num_hidden_layers][P] by real layer id and no other key (init_by_mapping takes no other keyword: the page's
download held logical_count beside MoE rows only, which SGLang refuses with a TypeError).
Run: .venv/bin/pytest tests/dashboard/test_eplb_download.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest, app_test

from r3trace.eplb import deepseek
from r3trace.eplb.placement import Cluster
from tests.analysis.test_eplb_export import sglang_load
from tests.dashboard.conftest import CFG
from tests.dashboard.test_pages import FORWARD_NS, WINDOW_NS, app, heat_of, open_page, routes  # noqa: F401 (fixtures)


class Recording(MemoryMediaFileStorage):
    """AppTest's in-memory media storage, kept where the test can read a download's bytes after the run."""

    made: list[Recording] = []

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        Recording.made.append(self)


def test_the_download_is_the_file_sglang_loads(app: AppTest, routes: Any, tmp_path: Path,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_test, "MemoryMediaFileStorage", Recording)
    at = open_page(app, "eplb", gpus="4", nodes="2", slots="20", policy="global", nlim="2")
    [button] = at.get("download_button")
    assert any("--init-expert-location FILE --expert-parallel-size 4 --ep-num-redundant-experts 4" in c.value
               for c in at.caption)
    path = tmp_path / "loc.json"
    path.write_bytes(Recording.made[-1].get_file(button.proto.url.rsplit("/", 1)[1]).content)
    l2p = sglang_load(path, CFG.num_hidden_layers, CFG.num_experts, ep_size=4, num_redundant=20 - CFG.num_experts)
    # its MoE rows are DeepSeek global's plan on the training window (recomputed here), the dense row trivial
    train = routes.forward_id * FORWARD_NS < 3 * WINDOW_NS
    cluster = Cluster(num_gpus=4, num_nodes=2, num_slots=20, num_groups=CFG.num_groups, node_limit=2)
    pl = deepseek.global_policy(heat_of(routes.topk_ids[train]).astype(float), cluster)
    full = np.asarray(json.loads(path.read_text())["physical_to_logical_map"])
    moe = list(CFG.moe_layer_ids)
    np.testing.assert_array_equal(full[moe], pl.phy2log)
    dense = [i for i in range(CFG.num_hidden_layers) if i not in moe]
    assert dense and (full[dense] == np.arange(20) % CFG.num_experts).all()
    assert all(sorted(s for s in range(20) if full[moe[0], s] == e) == l2p[moe[0]][e] for e in range(CFG.num_experts))
