"""SGLang's `--init-expert-location` given expert counts, not a map: a stat dump or JSON with `logical_count`
[passes, layers, E] (or [layers, E]), which SGLang turns into a placement with DeepSeek's EPLB at start-up
(python/sglang/srt/eplb/expert_location.py, ExpertLocationMetadata.init_by_eplb; eplb_algorithms/__init__.py:
weight = logical_count summed over passes; `--eplb-algorithm auto` is deepseek_hierarchical where the router's groups
divide over the nodes, else deepseek, the global policy). `r3trace serve` does the same before the engine starts,
with r3trace/eplb/deepseek.py (equal to deepseek-ai/EPLB's rebalance_experts) on one node, and hands the engine the
resulting physical_to_logical_map. A held-out plan (`r3trace eplb`) is the better tool; this keeps SGLang's launch
lines working.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from r3trace.eplb import deepseek
from r3trace.eplb.placement import Cluster, PlacementError
from r3trace.eplb.previous import load_location

ALGORITHMS = ("auto", "deepseek", "deepseek_hierarchical")


def logical_counts(path: str | Path) -> np.ndarray | None:
    """The `logical_count` a .pt or .json location file holds, summed over passes [layers, E]; None when the file
    holds a map (or is not a counts file), which the engine reads as it is."""
    p = Path(path)
    if not p.is_file():
        return None
    doc = load_location(p)
    if not isinstance(doc, dict) or "logical_count" not in doc or "physical_to_logical_map" in doc:
        return None
    c = doc["logical_count"]
    counts = np.asarray(c.numpy() if hasattr(c, "numpy") else c)
    if counts.ndim not in (2, 3) or not np.issubdtype(counts.dtype, np.number):
        raise PlacementError(f"{p}: logical_count must be [passes, layers, E] or [layers, E] numbers; it is "
                             f"{counts.dtype} of shape {list(counts.shape)}")
    return (counts if counts.ndim == 2 else counts.sum(0)).astype(np.float64)


def plan_from_counts(counts: np.ndarray, num_hidden_layers: int, moe_layer_ids: tuple[int, ...], num_experts: int,
                     num_groups: int, num_slots: int, num_gpus: int, algorithm: str = "auto",
                     num_nodes: int = 1) -> tuple[np.ndarray, str]:
    """counts [layers, E] (every layer, or the MoE ones) -> (physical_to_logical_map [num_hidden_layers, P], dense rows
    SGLang's trivial p % E; the algorithm run)."""
    if counts.shape[1] != num_experts or counts.shape[0] not in (num_hidden_layers, len(moe_layer_ids)):
        raise PlacementError(f"logical_count is {list(counts.shape)}; the model has {num_hidden_layers} layers "
                             f"({len(moe_layer_ids)} MoE) of {num_experts} experts")
    weight = counts[list(moe_layer_ids)] if counts.shape[0] == num_hidden_layers else counts  # [L, E]
    if algorithm == "auto":
        algorithm = "deepseek_hierarchical" if num_groups % num_nodes == 0 else "deepseek"
    if algorithm not in ALGORITHMS:
        raise PlacementError(f"eplb algorithm {algorithm!r}: one of {', '.join(ALGORITHMS)}")
    cluster = Cluster(num_gpus, num_nodes, num_slots, num_groups=num_groups)
    policy = deepseek.hierarchical if algorithm == "deepseek_hierarchical" else deepseek.global_policy
    full = np.tile(np.arange(num_slots) % num_experts, (num_hidden_layers, 1))
    full[list(moe_layer_ids)] = policy(weight, cluster).phy2log
    return full, algorithm
