"""The EPLB page's placement files: the running placement read from a path (an `r3trace eplb --out` JSON or SGLang's
location file; r3trace/eplb/previous.py), and the SGLang download, the file SGLang's --init-expert-location loads, as
`r3trace eplb --sglang` writes it. The loader's rules are tests/analysis/test_eplb_export.py's sglang_load
(sgl-project/sglang commit 01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1, python/sglang/srt/eplb/expert_location.py):
physical_to_logical_map [num_hidden_layers][P] by real layer id and no other key (init_by_mapping takes no other
keyword: the page's download held logical_count beside MoE rows only, which SGLang refuses with a TypeError).
Run: .venv/bin/pytest tests/dashboard/test_eplb_files.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest, app_test

from r3trace.eplb import deepseek, to_sglang
from r3trace.eplb.placement import Cluster, from_phy2log
from tests.analysis.test_eplb_export import sglang_load
from tests.dashboard.conftest import CFG
from tests.dashboard.test_pages import (  # noqa: F401 (app, routes: fixtures)
    FORWARD_NS,
    WINDOW_NS,
    app,
    arr,
    charts,
    even_split_gpu_load,
    heat_of,
    metrics,
    open_page,
    routes,
)


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


def test_the_running_placement_is_scored_and_drawn_as_before(app: AppTest, routes: Any,  # noqa: F811
                                                              tmp_path: Path) -> None:
    """A placement given by path (SGLang's file of DeepSeek global's plan on the first 2 s) is the bars' "before"
    and is scored kept as is on the held-out window (after 3 s): both recomputed here with numpy."""
    cluster = Cluster(num_gpus=4, num_nodes=2, num_slots=20, num_groups=CFG.num_groups, node_limit=2)
    early = routes.forward_id * FORWARD_NS < 2 * WINDOW_NS
    running = deepseek.global_policy(heat_of(routes.topk_ids[early]).astype(float), cluster)
    path = tmp_path / "running.json"
    to_sglang(running, path, CFG.num_hidden_layers, CFG.moe_layer_ids)
    at = open_page(app, "eplb", gpus="4", nodes="2", slots="20", policy="global", nlim="2", prev=str(path))
    held = heat_of(routes.topk_ids[routes.forward_id * FORWARD_NS >= 3 * WINDOW_NS]).astype(float)
    load = even_split_gpu_load(running.phy2log, held, 4)
    bal = load.mean(1) / load.max(1)
    assert metrics(at)["Balancedness (even split), held out, running placement kept"] == f"{bal.mean():.4f}"
    _, bars = charts(at)
    before = bars["data"][0]
    assert before["name"] == "before: the running placement"
    shown = [i for i, layer in enumerate(CFG.moe_layer_ids) if f"Layer {layer}," in bars["layout"]["title"]["text"]]
    np.testing.assert_allclose(arr(before["y"]), load[shown[0]] / load[shown[0]].mean(), rtol=1e-12)


def test_a_running_placement_for_another_cluster_is_an_error_not_a_crash(app: AppTest,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[e % CFG.num_experts for e in range(24)]] * 5}))
    app.query_params.update(gpus="4", nodes="2", slots="20", policy="global", nlim="2", prev=str(path))
    app.run()
    at = app.switch_page("views/eplb.py").run()
    assert not at.exception
    [err] = at.error
    assert "physical_to_logical_map has 24 slots a layer; --slots is 20" in err.value


def test_recorded_is_the_runs_own_placement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prev=recorded reads the run's placements table: the same report as the path of a file holding that map; the
    page says what the run recorded."""
    from dashboards import eplb_cache as sc
    from r3trace.trace import TraceWriter

    rng = np.random.default_rng(5)
    n, moe, e = 600, CFG.moe_layer_ids, CFG.num_experts
    ids = np.stack([np.stack([rng.choice(e, CFG.top_k, replace=False) for _ in moe]) for _ in range(n)])
    ran = np.stack([np.random.default_rng(i).permutation(np.arange(20) % e) for i in range(len(moe))])
    with TraceWriter(tmp_path / "s", model_name="m", num_hidden_layers=CFG.num_hidden_layers, moe_layer_ids=moe,
                     num_experts=e, top_k=CFG.top_k, run_id="r", num_groups=CFG.num_groups) as w:
        w.add_placement(0, moe, ran)
        w.append_tokens([f"q{i % 3}" for i in range(n)], np.arange(n), "decode", "computed", np.arange(n),
                        1_767_225_600 * 10**9 + np.arange(n) * 10**7, 0, ids.astype(np.int32))
    path = tmp_path / "ran.json"
    to_sglang(from_phy2log(ran, e), path, CFG.num_hidden_layers, moe)
    args = (str(tmp_path / "s"), "r", 4, 2, 20, "ours", 2, 2000, "time=..3", "")
    got, want = sc.eplb_report(*args, "recorded"), sc.eplb_report(*args, str(path))
    assert got["previous_held_out"] == want["previous_held_out"] and got["previous_held_out"] is not None
    np.testing.assert_array_equal(got["gpu_before"], want["gpu_before"])
    np.testing.assert_array_equal(got["phy2log"], want["phy2log"])
    from tests.dashboard.test_pages import APP

    monkeypatch.setenv("R3TRACE_STORE", str(tmp_path / "s"))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(run="r", gpus="4", nodes="2", slots="20", policy="global", nlim="2", train="time=..3")
    at = at.run().switch_page("views/eplb.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert f"This run's recorded placements: a map of {len(moe)} layers from forward 0, never switched" in [
        c.value for c in at.caption]
