"""Expert-parallel placement: DeepSeek's EPLB policies (deepseek.py), our planner (planner.py), scoring under
node-limited dispatch (score.py) and trace replay (replay.py). Contract: weight [L, E] -> Placement
(phy2log [L, P], log2phy [L, E, R] padded with -1, logcnt [L, E])."""

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.deepseek import cross_node, global_policy, hierarchical
from r3trace.eplb.fresh import Layout, layout
from r3trace.eplb.placement import (
    Cluster,
    Placement,
    PlacementError,
    churn,
    from_phy2log,
    sglang_map,
    to_json,
    to_sglang,
)
from r3trace.eplb.planner import plan

__all__ = [
    "Cluster", "Layout", "Placement", "PlacementError", "PlannerConfig", "churn", "cross_node", "from_phy2log",
    "global_policy", "hierarchical", "layout", "plan", "sglang_map", "to_json", "to_sglang",
]
