"""step_layout and idle_batch: the one place a forward learns where its rows sit among the DP ranks.

ModelRunner.launch calls step_layout on every batch it builds, and ModelRunner.run_idle on a rank with no
requests while another DP rank has some (engine/launch/lockstep.py decides which, for all ranks together).

- dp_size == 1: every rank of the TP group runs the same batch; the layout is the batch itself (dp_rank 0).
- dp_size > 1 (DP attention): the rank all-gathers its token count and gets the padded buffer length, its
  offset and count (engine/dp_layout.py's DpLayout). Every rank enters that all-gather, idle ones with 0
  tokens, so it is a collective of the whole step and must be called once per forward on every rank.
"""

from __future__ import annotations

import torch

from r3trace.engine.dp_layout import DpMode, gather_dp_layout
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.parallel import ParallelInfo


def step_layout(fb: ForwardBatch, parallel: ParallelInfo) -> ForwardBatch:
    """Stamp the batch with this rank's DP rank (the trace's dp_rank column) and, under DP attention, its
    DpLayout; returns fb."""
    fb.dp_rank = parallel.dp_rank
    if parallel.dp_size > 1:
        # One all-gather of every rank's token count, extend-or-decode wish and replay flag (a collective over
        # parallel.cpu_group); an extend anywhere makes the whole step "sum" mode (engine/dp_layout.py).
        wish: DpMode = "max" if fb.mode == "decode" else "sum"
        fb.dp_layout = gather_dp_layout(fb.num_tokens, parallel, wish, replay=fb.replay is not None)
    return fb


def idle_batch(forward_id: int, req_to_token: torch.Tensor, device: str, parallel: ParallelInfo) -> ForwardBatch:
    """A forward with no tokens: a DP rank with nothing to run joins the step's collectives with it (its layout is
    stamped by step_layout, like any batch)."""
    return ForwardBatch.idle(
        forward_id=forward_id, req_to_token=req_to_token, device=device, dp_layout=None, dp_rank=parallel.dp_rank
    )
