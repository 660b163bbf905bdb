"""step_layout and idle_batch: the one place a forward learns where its rows sit among the DP ranks.

ModelRunner.launch calls step_layout on every batch it builds, and ModelRunner.run_idle on a rank with no
requests while another DP rank has some (engine/launch/lockstep.py decides which, for all ranks together).

- dp_size == 1: every rank of the TP group runs the same batch; the layout is the batch itself (dp_rank 0).
- dp_size > 1 (DP attention): the rank all-gathers its token count and gets the padded buffer length, its
  offset and count (engine/dp_layout.py's DpLayout). Every rank enters that all-gather, idle ones with 0
  tokens, so it is a collective of the whole step and must be called once per forward on every rank.
"""

from __future__ import annotations

import numpy as np
import torch

from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.parallel import ParallelInfo


def step_layout(fb: ForwardBatch, parallel: ParallelInfo) -> ForwardBatch:
    """Stamp the batch with this rank's DP rank (the trace's dp_rank column) and, under DP attention, its
    DpLayout; returns fb."""
    fb.dp_rank = parallel.dp_rank
    if parallel.dp_size > 1:
        # The dp helper's gather_dp_layout: one all-gather of every rank's token count (a collective).
        from r3trace.engine.dp_layout import gather_dp_layout

        fb.dp_layout = gather_dp_layout(fb.num_tokens, parallel, fb.mode)  # type: ignore[attr-defined]
    return fb


def idle_batch(forward_id: int, req_to_token: torch.Tensor, device: str) -> ForwardBatch:
    """A forward with no tokens: a DP rank with nothing to run joins the step's collectives with it.
    (ForwardBatch.idle, from the DP attention work, replaces this body once merged.)"""
    empty: list[int] = []
    return ForwardBatch.build(
        forward_id=forward_id, input_ids=empty, prefix_lens=empty, extend_lens=empty, req_pool_indices=empty,
        out_cache_loc=np.zeros(0, np.int64), req_to_token=req_to_token, logits_rows=empty, device=device,
    )
