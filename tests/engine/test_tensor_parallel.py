"""Tensor parallelism: the rank layout against SGLang's formulas.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_tensor_parallel.py
"""

from __future__ import annotations

import pytest

from r3trace.engine.parallel import ParallelInfo, group_ranks


def _sglang_ranks(tp_rank: int, tp_size: int, dp_size: int, ep_size: int) -> tuple[int, int, int, int]:
    """SGLang's formulas (compute_dp_attention_world_info; initialize_model_parallel's moe_ep groups)."""
    attn_tp_size = tp_size // dp_size
    moe_tp_size = tp_size // ep_size
    return attn_tp_size, tp_rank % attn_tp_size, tp_rank // attn_tp_size, tp_rank // moe_tp_size


LAYOUTS = [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 2, 4), (8, 2, 4), (8, 4, 8), (8, 8, 1)]  # (tp, dp, ep)


@pytest.mark.parametrize(("tp", "dp", "ep"), LAYOUTS)
def test_derived_ranks_and_groups_follow_sglang(tp: int, dp: int, ep: int) -> None:
    groups = group_ranks(tp, dp, ep)
    for rank in range(tp):
        p = ParallelInfo(rank, tp, dp, ep)
        attn_tp_size, attn_tp_rank, attn_dp_rank, ep_rank = _sglang_ranks(rank, tp, dp, ep)
        assert (p.attn_tp_size, p.attn_tp_rank, p.attn_dp_rank, p.dp_rank, p.ep_rank) == (
            attn_tp_size, attn_tp_rank, attn_dp_rank, attn_dp_rank, ep_rank
        )
        # Each rank is in exactly one group of each kind, at the position of its rank within that group.
        mine = {kind: [g for g in gs if rank in g] for kind, gs in groups.items()}
        assert all(len(g) == 1 for g in mine.values()), mine
        assert mine["tp"][0] == list(range(tp))
        assert mine["attn_tp"][0].index(rank) == p.attn_tp_rank and len(mine["attn_tp"][0]) == p.attn_tp_size
        assert mine["dp"][0].index(rank) == p.attn_dp_rank and len(mine["dp"][0]) == dp
        assert mine["ep"][0].index(rank) == p.ep_rank and len(mine["ep"][0]) == ep


@pytest.mark.parametrize("bad", [dict(tp_size=4, dp_size=3), dict(tp_size=2, ep_size=4), dict(tp_rank=2, tp_size=2)])
def test_parallel_info_rejects_bad_layouts(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ParallelInfo(**bad)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
