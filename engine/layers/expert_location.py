"""ExpertLocation: which logical expert each physical slot holds, for every MoE layer (an immutable snapshot).

Shape legend: M MoE layers, E logical experts, P physical slots (E + redundant), R max replicas of one expert,
G expert-parallel ranks. Rank r holds slots [r * P/G, (r + 1) * P/G), so P % G == 0.

    physical_to_logical [M, P]  the logical expert held by each slot
    logical_to_physical [M, E, R]  the slots of each logical expert, replica 0 first, padded with -1
    logical_count [M, E]  replicas of each logical expert (>= 1)

Row m is MoE layer layer_ids[m] (the model's MoE layers in order; dense layers have no row). The replica order of
logical_to_physical is the source's: DeepSeek's rebalance_experts orders replicas by replica rank (eplb.py,
deepseek-ai/EPLB@d52c72d), r3trace's Placement and SGLang's _compute_logical_to_all_physical_map by ascending slot
(python/sglang/srt/eplb/expert_location.py, sgl-project/sglang@01fec5c). Dispatch (expert_map.py) picks among
replicas by their index in this order, so the same snapshot always gives the same choices.

Sources: trivial (slot p holds expert p % E, SGLang's init_trivial), r3trace's EPLB output (`r3trace eplb --out`,
or a Placement in memory), SGLang's init-expert-location JSON ({"physical_to_logical_map": [L][P]}, rows indexed
by real layer id over num_hidden_layers, so the rows of dense layers are skipped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from r3trace.phy2log import rows_fault

from ..model_config import ModelConfig


class ExpertLocationError(ValueError):
    """A map breaks the contract; the message names the field, the value and the limit."""


@dataclass(frozen=True, eq=False)
class ExpertLocation:
    physical_to_logical: torch.Tensor  # [M, P] int64, CPU
    logical_to_physical: torch.Tensor  # [M, E, R] int64, CPU, -1 padded
    logical_count: torch.Tensor  # [M, E] int64, CPU
    ep_size: int
    layer_ids: tuple[int, ...]  # [M] the real layer id of each row

    def __post_init__(self) -> None:
        for name in ("physical_to_logical", "logical_to_physical", "logical_count"):
            # a private CPU int64 copy: the snapshot never aliases a caller's tensor, so it cannot change later
            object.__setattr__(self, name, torch.as_tensor(getattr(self, name)).to("cpu", torch.int64).clone())
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        _validate(self)

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logical_count.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def row(self, layer_id: int) -> int:
        """The row of MoE layer layer_id."""
        if layer_id not in self.layer_ids:
            raise ExpertLocationError(
                f"layer_id={layer_id} is not a MoE layer of this map (layer_ids={self.layer_ids})"
            )
        return self.layer_ids.index(layer_id)

    def rank_slots(self, ep_rank: int) -> range:
        """The physical slots rank ep_rank holds, in w13 / w2 row order."""
        if not 0 <= ep_rank < self.ep_size:
            raise ExpertLocationError(f"ep_rank={ep_rank} outside 0..{self.ep_size - 1}")
        return range(ep_rank * self.slots_per_rank, (ep_rank + 1) * self.slots_per_rank)

    def is_identity(self, layer_id: int) -> bool:
        """Slot e holds expert e and nothing is replicated: the map step is the identity."""
        return self.num_physical == self.num_logical and bool(
            torch.equal(self.physical_to_logical[self.row(layer_id)], torch.arange(self.num_logical))
        )

    def same_as(self, other: ExpertLocation) -> bool:
        return (
            self.ep_size == other.ep_size and self.layer_ids == other.layer_ids
            and torch.equal(self.physical_to_logical, other.physical_to_logical)
            and torch.equal(self.logical_to_physical, other.logical_to_physical)
            and torch.equal(self.logical_count, other.logical_count)
        )  # fmt: skip

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_physical_to_logical(
        cls, physical_to_logical: Any, num_experts: int, ep_size: int, layer_ids: tuple[int, ...]
    ) -> ExpertLocation:
        """[M, P] -> the snapshot, replicas in ascending slot order (SGLang's init_by_mapping)."""
        phy = torch.as_tensor(physical_to_logical, dtype=torch.int64)
        if phy.dim() != 2:
            raise ExpertLocationError(f"physical_to_logical has shape {tuple(phy.shape)}; expected [M, P]")
        m, p = phy.shape
        if len(layer_ids) != m:
            raise ExpertLocationError(f"layer_ids has {len(layer_ids)} entries, physical_to_logical {m} rows")
        if phy.numel() and (phy.min() < 0 or phy.max() >= num_experts):  # the scatter below indexes by these ids
            _check_rows(phy, num_experts, layer_ids)  # the rest (P < E, an expert with no slot) waits for _validate
        count = torch.zeros(m, num_experts, dtype=torch.int64).scatter_add_(1, phy, torch.ones_like(phy))
        r = max(int(count.max()) if count.numel() else 1, 1)
        order = torch.argsort(phy * p + torch.arange(p), dim=1)  # [M, P] slots grouped by expert, ascending slot
        first = torch.cumsum(count, 1) - count  # [M, E] where each expert's run of slots starts
        sorted_log = torch.gather(phy, 1, order)
        replica = torch.arange(p) - torch.gather(first, 1, sorted_log)  # [M, P] index within its expert's run
        log2phy = torch.full((m, num_experts, r), -1, dtype=torch.int64)
        log2phy[torch.arange(m)[:, None], sorted_log, replica] = order
        return cls(phy, log2phy, count, ep_size, layer_ids)

    @classmethod
    def trivial(
        cls, num_experts: int, ep_size: int, layer_ids: tuple[int, ...], num_physical: int | None = None
    ) -> ExpertLocation:
        """Slot p holds expert p % E (SGLang's init_trivial): the identity when P == E."""
        p = num_experts if num_physical is None else num_physical
        phy = (torch.arange(p) % max(num_experts, 1)).repeat(len(layer_ids), 1)
        return cls.from_physical_to_logical(phy, num_experts, ep_size, layer_ids)

    @classmethod
    def from_placement(cls, placement: Any, ep_size: int, layer_ids: tuple[int, ...]) -> ExpertLocation:
        """r3trace's Placement (r3trace.eplb: phy2log [M, P], log2phy [M, E, R], logcnt [M, E]), as planned."""
        return cls(
            torch.as_tensor(placement.phy2log), torch.as_tensor(placement.log2phy),
            torch.as_tensor(placement.logcnt), ep_size, layer_ids,
        )  # fmt: skip

    @classmethod
    def from_eplb_json(cls, text: str, layer_ids: tuple[int, ...]) -> ExpertLocation:
        """What `r3trace eplb --out` writes: the placement and its cluster (G = cluster.num_gpus)."""
        from r3trace.eplb.placement import PlacementError, from_json

        try:
            placement, cluster = from_json(text)
        except PlacementError as e:
            raise ExpertLocationError(f"r3trace eplb output: {e}") from e
        return cls.from_placement(placement, cluster.num_gpus, layer_ids)

    @classmethod
    def from_sglang(cls, source: str | Path | dict[str, Any], cfg: ModelConfig, ep_size: int) -> ExpertLocation:
        """SGLang's init-expert-location JSON (a path, a JSON string or the parsed dict), read as its
        compute_initial_expert_location_metadata reads it: rows are real layer ids over num_hidden_layers."""
        doc = source if isinstance(source, dict) else _read_json(source)
        if "physical_to_logical_map" not in doc:
            raise ExpertLocationError(
                f"SGLang expert location has fields {sorted(doc)}; only physical_to_logical_map is read "
                "(logical_count alone asks SGLang to plan: `r3trace serve --init-expert-location` plans it as SGLang "
                "does, r3trace eplb plans it held out)"
            )
        phy = torch.as_tensor(doc["physical_to_logical_map"], dtype=torch.int64)
        if phy.dim() != 2 or phy.shape[0] != cfg.num_hidden_layers:
            raise ExpertLocationError(
                f"physical_to_logical_map has shape {tuple(phy.shape)}; SGLang indexes rows by layer id: "
                f"expected [num_hidden_layers={cfg.num_hidden_layers}, P]"
            )
        moe = cfg.moe_layer_ids
        return cls.from_physical_to_logical(phy[list(moe)], cfg.n_routed_experts, ep_size, moe)


def _read_json(source: str | Path) -> dict[str, Any]:
    text = str(source)
    doc = json.loads(Path(text).read_text() if not text.lstrip().startswith("{") else text)
    if not isinstance(doc, dict):
        raise ExpertLocationError(f"SGLang expert location is a JSON {type(doc).__name__}; expected an object")
    return doc


def _check_rows(phy: torch.Tensor, num_experts: int, layer_ids: tuple[int, ...]) -> None:
    """Each row of physical_to_logical [M, P] holds ids in 0..E-1 and gives every expert a slot: the row check the
    trace's placements table and `eplb --previous` run too (r3trace/phy2log.py)."""
    bad = rows_fault(phy.cpu().numpy(), layer_ids, num_experts)
    if bad is not None:
        raise ExpertLocationError(f"physical_to_logical row {bad[0]} (layer {bad[1]}): {bad[2]}")


def _validate(loc: ExpertLocation) -> None:
    """Every check names the field; all are on the host at construction, never per forward."""
    phy, l2p, cnt = loc.physical_to_logical, loc.logical_to_physical, loc.logical_count
    if phy.dim() != 2 or l2p.dim() != 3 or cnt.dim() != 2:
        raise ExpertLocationError(
            f"physical_to_logical {tuple(phy.shape)}, logical_to_physical {tuple(l2p.shape)}, logical_count "
            f"{tuple(cnt.shape)}: expected [M, P], [M, E, R], [M, E]"
        )
    m, p = phy.shape
    e = cnt.shape[1]
    if len(loc.layer_ids) != m or l2p.shape[:2] != (m, e) or cnt.shape[0] != m:
        raise ExpertLocationError(
            f"layer_ids has {len(loc.layer_ids)} entries, physical_to_logical {m} rows, logical_to_physical "
            f"{tuple(l2p.shape[:2])}, logical_count {tuple(cnt.shape)}: they must agree on M and E"
        )
    if list(loc.layer_ids) != sorted(set(loc.layer_ids)) or (m and loc.layer_ids[0] < 0):
        raise ExpertLocationError(f"layer_ids={loc.layer_ids} must be distinct, ascending and >= 0")
    if loc.ep_size < 1 or p % loc.ep_size:
        raise ExpertLocationError(f"physical_to_logical has P={p} slots, not a multiple of ep_size={loc.ep_size}")
    if p < e:
        raise ExpertLocationError(f"physical_to_logical has P={p} slots, fewer than E={e} logical experts")
    if m == 0:
        return
    _check_rows(phy, e, loc.layer_ids)
    held = torch.zeros(m, e, dtype=torch.int64).scatter_add_(1, phy, torch.ones_like(phy))
    if not torch.equal(cnt, held):
        row, expert = (cnt != held).nonzero()[0].tolist()
        raise ExpertLocationError(
            f"logical_count[{row}, {expert}] = {int(cnt[row, expert])}; physical_to_logical holds it in "
            f"{int(held[row, expert])} slots"
        )
    r = l2p.shape[2]
    if r < int(cnt.max()) or l2p.min() < -1 or l2p.max() >= p:
        raise ExpertLocationError(
            f"logical_to_physical has R={r} columns and ids {int(l2p.min())}..{int(l2p.max())}; "
            f"expected R >= {int(cnt.max())} and ids in -1..{p - 1}"
        )
    valid = torch.arange(r) < cnt[..., None]  # [M, E, R] the first count entries of a row are its replicas
    holder = torch.gather(phy, 1, l2p.clamp(min=0).reshape(m, -1)).reshape(m, e, r)
    seen = torch.zeros(m, p, dtype=torch.int64).scatter_add_(
        1, l2p.clamp(min=0).reshape(m, -1), valid.reshape(m, -1).long()
    )  # [M, P] how often each slot is listed: exactly once when the rows partition the slots
    ok = ((l2p >= 0) == valid) & (~valid | (holder == torch.arange(e)[:, None]))
    if not bool(ok.all()) or not bool((seen == 1).all()):
        row = int((~ok).any(-1).any(-1).nonzero()[0]) if not bool(ok.all()) else int((seen != 1).any(-1).nonzero()[0])
        raise ExpertLocationError(
            f"logical_to_physical row {row} (layer {loc.layer_ids[row]}) does not list each expert's slots of "
            "physical_to_logical exactly once, replicas first then -1"
        )


def held_experts(location: ExpertLocation, layer_id: int, ep_rank: int) -> list[int]:
    """[P/G] the logical expert each of rank ep_rank's slots holds, in w13 / w2 row order: the experts a loader
    reads from the checkpoint for this rank (a replicated expert is read once and copied into each of its slots)."""
    slots = location.rank_slots(ep_rank)
    return location.physical_to_logical[location.row(layer_id), slots.start : slots.stop].tolist()


def physical_expert_weights(
    full_w13: torch.Tensor, full_w2: torch.Tensor, location: ExpertLocation, layer_id: int, ep_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's logical weights (w13 [E, 2I, D], w2 [E, D, I]) -> this rank's slots (w13 [P/G, 2I, D],
    w2 [P/G, D, I]): slot p holds expert physical_to_logical[p]'s weights (replicas are identical copies)."""
    e = location.num_logical
    if full_w13.shape[0] != e or full_w2.shape[0] != e:
        raise ExpertLocationError(
            f"full_w13 has {full_w13.shape[0]} experts, full_w2 {full_w2.shape[0]}; the map has E={e}"
        )
    held = torch.tensor(held_experts(location, layer_id, ep_rank), device=full_w13.device)
    return full_w13.index_select(0, held), full_w2.index_select(0, held)
