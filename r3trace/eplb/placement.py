"""Placement: where the replicas of each logical expert live, in DeepSeek EPLB's contract.

Shape legend: L MoE layers, E logical experts, P physical slots (P/G per GPU, slot p on GPU p // (P/G)),
R max replicas of one expert, G GPUs, N nodes (G/N GPUs each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from r3trace.phy2log import rows_fault


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


def slot_order(keys: np.ndarray) -> np.ndarray:
    """[X, n] integer keys -> their stable argsort along the last axis. Keys that fit int16 take numpy's radix sort
    (0.13 ms against 1.4 at [164, 288]); a stable sort's indices depend only on the keys' order, so they are the
    same, and so are an unstable sort's where no key repeats in a row."""
    keys = np.asarray(keys)
    if keys.size and keys.min() >= -(1 << 15) and keys.max() < 1 << 15:
        keys = keys.astype(np.int16)
    return np.argsort(keys, axis=-1, kind="stable")


def replicas_per_node(phy2log: np.ndarray, num_experts: int, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] -> [L, E, N] int64 replicas of each expert on each node (one bincount: np.add.at took 0.48 ms,
    this 0.13 at [58, 320])."""
    n_layers, n = len(phy2log), cluster.num_nodes
    key = (np.asarray(phy2log) + (np.arange(n_layers) * num_experts)[:, None]) * n + cluster.slot_node()  # [L, P]
    return np.bincount(key.ravel(), minlength=n_layers * num_experts * n).reshape(n_layers, num_experts, n)


def replica_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """phy2log [L, P] -> [L, E] int64 replicas of each expert (one bincount; np.add.at took ~0.16 ms at [58, 288])."""
    n_layers = len(phy2log)
    key = np.asarray(phy2log, dtype=np.int64) + (np.arange(n_layers) * num_experts)[:, None]
    return np.bincount(key.ravel(), minlength=n_layers * num_experts).reshape(n_layers, num_experts)


def from_phy2log(phy2log: np.ndarray, num_experts: int, rank: np.ndarray | None = None) -> Placement:
    """Builds log2phy [L, E, R] and logcnt [L, E] from phy2log [L, P]; every expert needs >= 1 replica.

    log2phy[l, e, r] is the slot of replica r of expert e: with `rank` [L, P] (each slot's replica index,
    as DeepSeek's replicate_experts numbers them: 0 for the expert's first slot, then in the order extras
    were added) r is that rank, which is the order DeepSeek's rebalance_experts writes; without it the
    replicas are listed by ascending slot.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    n_layers, p = phy2log.shape
    ids_ok = phy2log.min() >= 0 and phy2log.max() < num_experts  # whole-array checks: a plan's hot path
    logcnt = replica_counts(phy2log, num_experts) if ids_ok else None
    if logcnt is None or (logcnt == 0).any():  # the shared row check names the first fault
        bad = rows_fault(phy2log, range(n_layers), num_experts)
        assert bad is not None  # a row holds an id outside 0..E-1 or leaves an expert without a slot
        raise PlacementError(f"phy2log row {bad[0]}: {bad[2]}")
    r = int(logcnt.max())
    rows = np.arange(n_layers)[:, None]
    log2phy = np.full((n_layers, num_experts, r), -1, dtype=np.int64)
    if rank is None:
        order = slot_order(phy2log)  # slots grouped by expert, ascending slot
        sorted_log = np.take_along_axis(phy2log, order, 1)
        first = np.cumsum(logcnt, axis=1) - logcnt  # [L, E] start of each expert's run
        log2phy[rows, sorted_log, np.arange(p)[None, :] - np.take_along_axis(first, sorted_log, 1)] = order
        return Placement(phy2log, log2phy, logcnt)
    rank = np.asarray(rank, dtype=np.int64)
    if rank.shape != phy2log.shape:
        raise PlacementError(f"rank has shape {list(rank.shape)}, phy2log {list(phy2log.shape)}")
    if (rank < 0).any() or (rank >= logcnt[rows, phy2log]).any():
        raise PlacementError("rank holds a replica index outside 0..logcnt - 1 of its expert")
    log2phy[rows, phy2log, rank] = np.arange(p)[None, :]
    if ((log2phy >= 0).sum(2) != logcnt).any():  # two slots of one expert with the same rank
        raise PlacementError("rank repeats a replica index within one expert")
    return Placement(phy2log, log2phy, logcnt)


def check_placement(pl: Placement, cluster: Cluster) -> None:
    """Raises PlacementError unless the three tensors agree with each other and with the cluster.

    log2phy may list an expert's slots in any order (DeepSeek's replica rank, or ascending slot), padded
    with -1 after the last one."""
    if pl.phy2log.shape[1] != cluster.num_slots:
        raise PlacementError(f"phy2log has {pl.phy2log.shape[1]} slots, cluster has {cluster.num_slots}")
    again = from_phy2log(pl.phy2log, pl.num_experts)
    big = np.iinfo(np.int64).max  # sorts the -1 padding after every slot

    def slot_sets(log2phy: np.ndarray) -> np.ndarray:
        return np.sort(np.where(log2phy >= 0, log2phy, big), axis=2)

    if not (np.array_equal(again.logcnt, pl.logcnt) and pl.log2phy.shape == again.log2phy.shape
            and np.array_equal(pl.log2phy >= 0, again.log2phy >= 0)
            and np.array_equal(slot_sets(pl.log2phy), slot_sets(again.log2phy))):
        raise PlacementError("log2phy/logcnt disagree with phy2log")


def churn(prev: Placement, new: Placement) -> float:
    """Share of the L*P slots whose logical expert changed (each one is a weight transfer)."""
    return float((prev.phy2log != new.phy2log).mean())


def within_churn(kept: np.ndarray, cand: np.ndarray, prev: np.ndarray, order: np.ndarray, budget: int) -> np.ndarray:
    """kept [L, P] (a re-plan), cand [L, P] (other layouts), prev [L, P] (the previous placement), order [R] (layers,
    the most wanted first) -> kept with each layer of `order` taken from cand while the slots moved from prev on top of
    kept's own stay within `budget` (a layer that does not fit is skipped, later ones may)."""
    out = kept.copy()
    for layer in order:
        cost = int((cand[layer] != prev[layer]).sum()) - int((out[layer] != prev[layer]).sum())
        if cost <= budget:
            out[layer] = cand[layer]
            budget -= cost
    return out


def sglang_map(pl: Placement, num_hidden_layers: int, moe_layer_ids: tuple[int, ...]) -> np.ndarray:
    """[num_hidden_layers, P] physical_to_logical_map as SGLang indexes it: by real layer id, MoE rows from
    the plan, every other row the trivial map SGLang's init_trivial builds (slot p holds expert p % E)."""
    n_moe, p = pl.phy2log.shape
    if len(moe_layer_ids) != n_moe:
        raise PlacementError(f"moe_layer_ids lists {len(moe_layer_ids)} layers, the placement has {n_moe}")
    if min(moe_layer_ids) < 0 or max(moe_layer_ids) >= num_hidden_layers:
        raise PlacementError(f"moe_layer_ids holds {max(moe_layer_ids)}, outside 0..{num_hidden_layers - 1}")
    full = np.tile(np.arange(p) % pl.num_experts, (num_hidden_layers, 1))
    full[list(moe_layer_ids)] = pl.phy2log
    return full


def to_sglang(pl: Placement, path: str | Path, num_hidden_layers: int, moe_layer_ids: tuple[int, ...]) -> None:
    """The file SGLang's --init-expert-location loads: {"physical_to_logical_map": [num_hidden_layers][P]}.

    That one key and nothing else: SGLang passes every key to init_by_mapping, which takes no other. SGLang
    reads a path as a file only when it ends in .json (json) or .pt (torch.load); any other string it parses
    as inline JSON, so other names are refused here."""
    path = Path(path)
    full = sglang_map(pl, num_hidden_layers, moe_layer_ids)
    if path.suffix == ".json":
        path.write_text(json.dumps({"physical_to_logical_map": full.tolist()}))
    elif path.suffix == ".pt":
        import torch  # only this export needs torch

        torch.save({"physical_to_logical_map": torch.from_numpy(full)}, path)
    else:
        raise PlacementError(f"SGLang init-expert-location file {path} must end in .json or .pt "
                             "(SGLang parses any other value as inline JSON)")


def to_json(pl: Placement, cluster: Cluster, meta: dict[str, object] | None = None) -> str:
    """All three tensors, the cluster, and free metadata (policy, loads window, ...)."""
    return json.dumps({
        "cluster": cluster.__dict__, "phy2log": pl.phy2log.tolist(), "log2phy": pl.log2phy.tolist(),
        "logcnt": pl.logcnt.tolist(), "meta": meta or {},
    })


def from_json(text: str) -> tuple[Placement, Cluster]:
    """to_json's text -> (Placement, its Cluster), checked (from_doc)."""
    return from_doc(json.loads(text))


def from_doc(doc: dict[str, Any]) -> tuple[Placement, Cluster]:
    """to_json's document, already parsed -> (Placement, its Cluster), checked against each other."""
    cluster = Cluster(**doc["cluster"])
    log2phy = np.asarray(doc["log2phy"], dtype=np.int64)
    pl = Placement(np.asarray(doc["phy2log"], dtype=np.int64), log2phy, np.asarray(doc["logcnt"], dtype=np.int64))
    check_placement(pl, cluster)  # log2phy kept as written: its order is the replica rank
    return pl, cluster
