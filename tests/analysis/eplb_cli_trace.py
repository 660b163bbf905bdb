"""The trace `r3trace eplb`'s window tests plan on (a drifting router over 12 s, written by the real TraceWriter) and
the figures they recompute with numpy from the rows written, not through r3trace's scorer: even-split balancedness
(SGLang's compute_utilization_rate without its 1e-5, python/sglang/srt/eplb/expert_distribution.py at
sgl-project/sglang commit 02295fe5ac5ccff3e8829800d50450351c56fb53) and nodes per token by trying every node subset.
Used by test_eplb_windows.py, test_eplb_report_lines.py and test_eplb_previous.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3trace.cli import main
from r3trace.trace import TraceWriter

L_IDS, E, K = (1, 2, 4), 16, 2
T0 = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00 in ns: a whole second, so rollup windows start on it
SECONDS, TOKENS, PER_FORWARD = 12, 2400, 8
CLUSTER = ("--gpus", "8", "--nodes", "4", "--slots", "24", "--node-limit", "2", "--groups", "4")


def drifting_routes(rng: np.random.Generator, t: int) -> np.ndarray:
    """[T, L, K] distinct ids; popularity Zipf over a permutation that drifts: the later tokens favour other
    experts, so a plan on the early window scores lower held out than in-sample."""
    ids = np.empty((t, len(L_IDS), K), dtype=np.int64)
    perm_a, perm_b = rng.permutation(E), rng.permutation(E)
    zipf = 1.0 / np.arange(1, E + 1) ** 1.1
    for i in range(t):
        mix = i / t
        p = (1 - mix) * zipf[np.argsort(perm_a)] + mix * zipf[np.argsort(perm_b)]
        for li in range(len(L_IDS)):
            ids[i, li] = rng.choice(E, K, replace=False, p=p / p.sum())
    return ids


def write_trace(root: Path) -> dict[str, Any]:
    """Run "a" into root: 2,400 tokens over 12 s, 8 tokens a forward, written by the real TraceWriter (rollup window
    1 s) -> {root, ids [T, L, K], ts [T], fwd [T]}."""
    ids = drifting_routes(np.random.default_rng(7), TOKENS)
    ts = T0 + (np.arange(TOKENS) * SECONDS * 10**9) // TOKENS
    fwd = np.arange(TOKENS) // PER_FORWARD
    with TraceWriter(root, model_name="m", num_hidden_layers=5, moe_layer_ids=L_IDS, num_experts=E, top_k=K,
                     run_id="a", num_groups=4, rows_per_file=600) as w:
        w.append_tokens([f"r{i % 5}" for i in range(TOKENS)], np.arange(TOKENS), "decode", "computed", fwd, ts, 0,
                        ids)
    return {"root": root, "ids": ids, "ts": ts, "fwd": fwd}


def heat(ids: np.ndarray) -> np.ndarray:
    """[T, L, K] -> [L, E] selections, one layer at a time."""
    return np.stack([np.bincount(ids[:, li].ravel(), minlength=E) for li in range(ids.shape[1])]).astype(float)


def even_balancedness(phy2log: np.ndarray, h: np.ndarray, gpus: int) -> float:
    """Each expert's heat split evenly over its slots, summed per GPU; mean over layers of mean/max."""
    out = []
    for li in range(len(h)):
        cnt = np.bincount(phy2log[li], minlength=E)
        gpu = (h[li][phy2log[li]] / cnt[phy2log[li]]).reshape(gpus, -1).sum(1)
        out.append(gpu.mean() / gpu.max())
    return float(np.mean(out))


def min_nodes(phy2log: np.ndarray, ids: np.ndarray, nodes: int) -> np.ndarray:
    """[T, L] size of the smallest node set holding all K experts of each row, by trying every subset."""
    node_of = np.arange(phy2log.shape[1]) // (phy2log.shape[1] // nodes)
    out = np.zeros(ids.shape[:2], dtype=np.int64)
    for li in range(ids.shape[1]):
        homes = [frozenset(node_of[phy2log[li] == x].tolist()) for x in range(E)]
        for ti, row in enumerate(ids[:, li].tolist()):
            out[ti, li] = next(n for n in range(1, nodes + 1) for s in itertools.combinations(range(nodes), n)
                               if all(homes[x] & set(s) for x in row))
    return out


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    capsys.readouterr()
    assert main(["eplb", *args]) == 0
    return capsys.readouterr().out.strip().splitlines()


def row(lines: list[str], name: str) -> list[str]:
    """The in-sample and held-out cells of one printed score row."""
    [line] = [x for x in lines if x.startswith(name)]
    return line[len(name):].split()[-2:]
