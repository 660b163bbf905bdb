"""ExpertMap: one MoE layer's logical -> physical step for one rank, between the router and the dispatcher.

Shape legend: T tokens, K routed pairs per token, E logical experts, P physical slots, R max replicas, G ranks.

    to_physical(topk_ids [T, K] logical) -> [T, K] int32 physical slots (-1 stays -1)

The router's logical ids are what capture records; only the dispatcher and the experts see physical slots, and
a replica holds the same weights as its expert, so the choice of replica changes which rank computes a pair,
never its value (up to the order of the fp32 sums, dispatcher.py).

| mode    | the replica of logical expert e a pair goes to                                                    |
| ------- | ------------------------------------------------------------------------------------------------- |
| static  | fixed per (rank, e): the first replica on this rank, else one spread over the ranks that lack one  |
| dynamic | per pair: replica hash(seed, layer_id, row, e) % count[e], the same on every rank and every run    |

static is SGLang's ep_dispatch_algorithm="static" (compute_logical_to_rank_dispatch_physical_map in
python/sglang/srt/eplb/expert_location.py, sgl-project/sglang@01fec5c): a same-rank replica when there is one. A
rank without one there draws a shuffled fair choice with random.Random(42); here the i-th such rank in rank order
takes replica (i + e) % count[e], so every replica serves about as many ranks without a Python RNG. SGLang since
PR #9849 first sends such a rank to its node's first replica where the node holds some but not all of them
(r3trace/eplb/static.py); the engine's ranks share one host, where that rule never applies.
dynamic is SGLang's "dynamic" (_topk_ids_logical_to_physical_dynamic in expert_location_dispatch.py,
sgl-project/sglang@032b6b8), which draws torch.randint per pair: that draw differs between ranks and runs. Here it
is an integer hash of the pair's row and expert, so every rank that holds the same batch (attention TP, or an
all-gathered MoE input) sends a token's pair to the same replica, a rerun makes the same choices, and the op is a
few elementwise kernels with no generator state (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Literal

import torch

from .expert_location import ExpertLocation, ExpertLocationError

DispatchMode = Literal["static", "dynamic"]

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**59, so int64 never overflows


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def static_choice(location: ExpertLocation, layer_id: int, ep_rank: int) -> torch.Tensor:
    """[E] int64: the slot rank ep_rank sends each logical expert to under static dispatch."""
    row = location.row(layer_id)
    l2p = location.logical_to_physical[row]  # [E, R]
    cnt = location.logical_count[row]  # [E]
    e, r = l2p.shape
    owner = torch.where(l2p >= 0, l2p // location.slots_per_rank, -1)  # [E, R] rank of each replica
    has_local = (owner[None] == torch.arange(location.ep_size)[:, None, None]).any(-1)  # [G, E]
    local = (owner == ep_rank).long().argmax(-1)  # [E] the first replica on this rank (if any)
    nth_remote = torch.cumsum((~has_local).long(), 0)[ep_rank] - 1  # [E] i: this rank among those lacking one
    remote = (nth_remote + torch.arange(e)) % cnt  # [E] spread the remote ranks over the replicas
    pick = torch.where(has_local[ep_rank], local, remote)
    return torch.gather(l2p, 1, pick[:, None])[:, 0]


class ExpertMap:
    """One layer's map for one rank. Its device tensors keep their storage for the model's life: a rebalance
    copies the new placement into them in place (load_), so a CUDA graph captured before it reads the new map,
    queued after the weight copies on the same stream. Their shapes depend only on E and P: the replica table
    has P - E + 1 columns, the most replicas one expert can have."""

    def __init__(
        self,
        location: ExpertLocation,
        layer_id: int,
        ep_rank: int,
        mode: DispatchMode = "static",
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if mode not in ("static", "dynamic"):
            raise ExpertLocationError(f"dispatch mode={mode!r}; expected 'static' or 'dynamic'")
        if not 0 <= seed <= _MASK32:
            raise ExpertLocationError(f"seed={seed} outside 0..{_MASK32}")
        self.layer_id, self.ep_rank, self.mode, self.seed = layer_id, ep_rank, mode, seed
        self.num_logical, self.num_physical = location.num_logical, location.num_physical
        e, r = self.num_logical, self.num_physical - self.num_logical + 1
        self.log2phy = torch.full((e, r), -1, dtype=torch.int32, device=device)  # [E, P - E + 1]
        self.count = torch.ones(e, dtype=torch.int32, device=device)  # [E]
        self.static = torch.zeros(e, dtype=torch.int32, device=device)  # [E] this rank's fixed replica
        self.location = location
        self.load_(location)

    def load_(self, location: ExpertLocation) -> None:
        """Copy location's row for this layer into the device tensors (in place), then hold the new snapshot."""
        if (location.num_logical, location.num_physical) != (self.num_logical, self.num_physical):
            raise ExpertLocationError(
                f"placement has E={location.num_logical}, P={location.num_physical}; layer {self.layer_id}'s map "
                f"was built for E={self.num_logical}, P={self.num_physical}"
            )
        row = location.row(self.layer_id)
        l2p = location.logical_to_physical[row]  # [E, R]
        table = torch.full(tuple(self.log2phy.shape), -1, dtype=torch.int32)
        table[:, : l2p.shape[1]] = l2p[:, : table.shape[1]]  # R <= P - E + 1 always (every expert has a slot)
        self.log2phy.copy_(table)
        self.count.copy_(location.logical_count[row])
        self.static.copy_(static_choice(location, self.layer_id, self.ep_rank))
        self.location = location

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, K] logical (-1: no expert) -> [T, K] int32 physical slots (-1 kept)."""
        ids = topk_ids.long()  # [T, K]
        valid = ids >= 0
        safe = ids.clamp(min=0)
        if self.mode == "static":
            phys = self.static[safe]  # [T, K]
        else:
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None]  # [T, 1]
            h = _mix(torch.full_like(rows, self.seed))
            h = _mix(h ^ self.layer_id)
            h = _mix(h ^ rows)  # rows < 2**32: T never comes near
            h = _mix(h ^ safe)  # [T, K]
            replica = h % self.count[safe].long()  # [T, K] in 0..count-1
            phys = self.log2phy[safe, replica]
        return torch.where(valid, phys, -1).to(torch.int32)
