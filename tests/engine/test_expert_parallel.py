"""Expert parallelism: the dispatch layout against pure Python loops.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_expert_parallel.py
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from r3trace.engine.layers.dispatcher import dispatch_layout, expert_slice, local_experts

# ---------------------------------------------------------------- the layout, against loops


def layout_loops(ids: list[list[int]], weights: list[list[float]], num_experts: int, ep_size: int) -> dict[str, Any]:
    """The dispatch layout by brute force: for each rank in order, each token in order that has an expert there."""
    per = num_experts // ep_size
    send_rank, send_token, send_ids, send_weights = [], [], [], []
    for r in range(ep_size):
        for t in range(len(ids)):
            local = [e - r * per if e >= 0 and e // per == r else -1 for e in ids[t]]
            if any(e >= 0 for e in local):
                send_rank.append(r)
                send_token.append(t)
                send_ids.append(local)
                send_weights.append([weights[t][j] if local[j] >= 0 else 0.0 for j in range(len(local))])
    sent = set(zip(send_rank, send_token, strict=True))
    return dict(
        tokens_per_rank=[send_rank.count(r) for r in range(ep_size)],
        tokens_per_expert=[sum(row.count(e) for row in ids) for e in range(num_experts)],
        is_token_in_rank=[[(r, t) in sent for r in range(ep_size)] for t in range(len(ids))],
        send_token=send_token,
        send_ids=send_ids,
        send_weights=send_weights,
    )


def random_routes(rng: random.Random, t: int, k: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """t tokens of k distinct experts drawn from `experts`, weights in [0, 1)."""
    ids = torch.tensor([rng.sample(experts, k) for _ in range(t)], dtype=torch.int32).reshape(t, k)
    weights = torch.tensor([[rng.random() for _ in range(k)] for _ in range(t)], dtype=torch.float32).reshape(t, k)
    return ids, weights


@pytest.mark.parametrize(
    "t, k, num_experts, ep_size, seed",
    [(1, 1, 2, 2, 0), (7, 3, 8, 2, 1), (13, 4, 12, 3, 2), (29, 6, 16, 4, 3), (0, 3, 8, 4, 4), (33, 2, 32, 8, 5)],
)
def test_layout_matches_loops(t: int, k: int, num_experts: int, ep_size: int, seed: int) -> None:
    rng = random.Random(seed)
    per = num_experts // ep_size
    empty_rank = 1 if ep_size >= 3 else None  # no token has an expert there: it receives zero rows
    experts = [e for e in range(num_experts) if e // per != empty_rank]
    ids, weights = random_routes(rng, t, k, experts)
    if t >= 3 and k <= per:
        ids[0] = torch.arange(k)  # every expert of token 0 on rank 0
        ids[1] = num_experts - 1 - torch.arange(k)  # token 1 only on the last rank
    if t >= 3:
        ids[2, 0] = -1  # a pair with no expert goes nowhere
    got = dispatch_layout(ids, weights, num_experts, ep_size)
    want = layout_loops(ids.tolist(), weights.tolist(), num_experts, ep_size)
    if empty_rank is not None:
        assert want["tokens_per_rank"][empty_rank] == 0
    assert got.tokens_per_rank.tolist() == want["tokens_per_rank"]
    assert got.tokens_per_expert.tolist() == want["tokens_per_expert"]
    assert got.is_token_in_rank.tolist() == want["is_token_in_rank"]
    assert got.send_token.tolist() == want["send_token"]
    assert got.send_ids.dtype == torch.int32 and got.send_ids.reshape(-1, k).tolist() == want["send_ids"]
    assert got.send_weights.reshape(-1, k).tolist() == want["send_weights"]  # exact: copied, never computed


def test_local_experts_and_slice() -> None:
    assert [local_experts(12, r, 3) for r in range(3)] == [range(0, 4), range(4, 8), range(8, 12)]
    with pytest.raises(ValueError, match="not a multiple"):
        local_experts(10, 0, 4)
    w = torch.arange(12 * 2).reshape(12, 2)
    assert torch.equal(expert_slice(w, range(4, 8)), w[4:8])
