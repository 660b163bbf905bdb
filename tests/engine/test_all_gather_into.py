"""engine.distributed.all_gather_into on two gloo ranks, under torch's current name for the flat all-gather
(all_gather_single, torch 2.13) and with that name gone, as on torch 2.11 (the lent GPU machine's, where the
engine's DP layout gather failed with AttributeError): the same rows in rank order, and no FutureWarning from the
deprecated all_gather_into_tensor where the new name exists.
Run: .venv/bin/pytest tests/engine/test_all_gather_into.py -q"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench.spawn import free_port, spawn_ranks
from r3trace.engine.distributed import all_gather_into


def _worker(rank: int, port: int, old_torch: bool, out_dir: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if old_torch and hasattr(dist, "all_gather_single"):
            delattr(dist, "all_gather_single")  # this process only: torch 2.11's namespace
        x = torch.arange(6, dtype=torch.int64).view(3, 2) + 100 * rank  # [3, 2], different on each rank
        out = torch.empty(6, 2, dtype=torch.int64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            all_gather_into(out, x, None)
        torch.save({"out": out, "warned": [str(w.message) for w in caught if w.category is FutureWarning]},
                   out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("old_torch", [False, True], ids=["all_gather_single", "all_gather_into_tensor"])
def test_rows_in_rank_order_whatever_the_name(old_torch: bool, tmp_path: Path) -> None:
    spawn_ranks(_worker, (free_port(), old_torch, tmp_path), 2)
    want = torch.cat([torch.arange(6).view(3, 2), torch.arange(6).view(3, 2) + 100])
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["out"], want), rank
        if not old_torch:
            assert got["warned"] == [], got["warned"]  # the new name, not the deprecated one
