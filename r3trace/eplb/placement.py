"""Placement: where the replicas of each logical expert live, in DeepSeek EPLB's contract.

Shape legend: L MoE layers, E logical experts, P physical slots (P/G per GPU, slot p on GPU p // (P/G)),
R max replicas of one expert, G GPUs, N nodes (G/N GPUs each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np


class PlacementError(ValueError):
    """A placement or cluster shape breaks the contract; the message names the field and the limit."""


@dataclass(frozen=True)
class Cluster:
    """G GPUs on N nodes with P expert slots in total; the node limit is per token per layer (V3: 4)."""

    num_gpus: int
    num_nodes: int
    num_slots: int
    num_groups: int = 8
    node_limit: int = 4

    def __post_init__(self) -> None:
        if self.num_gpus % self.num_nodes:
            raise PlacementError(f"num_gpus={self.num_gpus} is not a multiple of num_nodes={self.num_nodes}")
        if self.num_slots % self.num_gpus:
            raise PlacementError(f"num_slots={self.num_slots} is not a multiple of num_gpus={self.num_gpus}")

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def slots_per_node(self) -> int:
        return self.num_slots // self.num_nodes

    def slot_gpu(self) -> np.ndarray:
        """[P] GPU of each slot."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    def slot_node(self) -> np.ndarray:
        """[P] node of each slot."""
        return np.arange(self.num_slots) // self.slots_per_node


class Placement(NamedTuple):
    phy2log: np.ndarray  # [L, P] logical expert held by each slot
    log2phy: np.ndarray  # [L, E, R] slots of each logical expert, padded with -1
    logcnt: np.ndarray  # [L, E] replicas of each logical expert (>= 1)

    @property
    def num_experts(self) -> int:
        return int(self.logcnt.shape[1])


def from_phy2log(phy2log: np.ndarray, num_experts: int) -> Placement:
    """Builds log2phy [L, E, R] and logcnt [L, E] from phy2log [L, P]; every expert needs >= 1 replica."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    n_layers, p = phy2log.shape
    if phy2log.min() < 0 or phy2log.max() >= num_experts:
        raise PlacementError(f"phy2log holds ids outside 0..{num_experts - 1}")
    offset = (np.arange(n_layers) * num_experts)[:, None]
    logcnt = np.bincount((phy2log + offset).ravel(), minlength=n_layers * num_experts).reshape(n_layers, -1)
    if (logcnt == 0).any():
        layer, expert = np.argwhere(logcnt == 0)[0]
        raise PlacementError(f"expert {expert} of layer {layer} has 0 replicas; every expert needs >= 1")
    r = int(logcnt.max())
    order = np.argsort(phy2log, axis=1, kind="stable")  # slots grouped by expert, ascending slot
    sorted_log = np.take_along_axis(phy2log, order, 1)
    first = np.cumsum(logcnt, axis=1) - logcnt  # [L, E] start of each expert's run
    rank = np.arange(p)[None, :] - np.take_along_axis(first, sorted_log, 1)
    log2phy = np.full((n_layers, num_experts, r), -1, dtype=np.int64)
    log2phy[np.arange(n_layers)[:, None], sorted_log, rank] = order
    return Placement(phy2log, log2phy, logcnt)


def check_placement(pl: Placement, cluster: Cluster) -> None:
    """Raises PlacementError unless the three tensors agree with each other and with the cluster."""
    if pl.phy2log.shape[1] != cluster.num_slots:
        raise PlacementError(f"phy2log has {pl.phy2log.shape[1]} slots, cluster has {cluster.num_slots}")
    again = from_phy2log(pl.phy2log, pl.num_experts)
    if not (np.array_equal(again.logcnt, pl.logcnt) and np.array_equal(again.log2phy, pl.log2phy)):
        raise PlacementError("log2phy/logcnt disagree with phy2log")


def churn(prev: Placement, new: Placement) -> float:
    """Share of the L*P slots whose logical expert changed (each one is a weight transfer)."""
    return float((prev.phy2log != new.phy2log).mean())


def to_sglang(pl: Placement, path: str | Path) -> None:
    """SGLang's init-expert-location JSON: {"physical_to_logical_map": [L][P], "logical_count": [L][E]}."""
    doc = {"physical_to_logical_map": pl.phy2log.tolist(), "logical_count": pl.logcnt.tolist()}
    Path(path).write_text(json.dumps(doc))


def to_json(pl: Placement, cluster: Cluster, meta: dict[str, object] | None = None) -> str:
    """All three tensors, the cluster, and free metadata (policy, loads window, ...)."""
    return json.dumps({
        "cluster": cluster.__dict__, "phy2log": pl.phy2log.tolist(), "log2phy": pl.log2phy.tolist(),
        "logcnt": pl.logcnt.tolist(), "meta": meta or {},
    })


def from_json(text: str) -> tuple[Placement, Cluster]:
    doc = json.loads(text)
    cluster = Cluster(**doc["cluster"])
    pl = from_phy2log(np.asarray(doc["phy2log"]), len(doc["logcnt"][0]))
    check_placement(pl, cluster)
    return pl, cluster
