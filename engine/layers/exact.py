"""Exact mode's batch-invariant ops (EngineConfig.deterministic): elementwise torch ops and one fixed
pairwise-tree reduction, so that a value's bits depend on its own inputs only.

Shape legend: T tokens, In / Out a linear's feature sizes, H heads, N keys, R tensor-parallel ranks.

Why not BLAS or torch's reductions: their lane order, blocking and threading are picked from the shapes
(torch.sum splits a long row over threads when it is the only output; a GEMM's K-blocking depends on M), so
a row's result moves by ulps with the batch it lands in. Here every sum is `tree_sum`: pad to the next power
of two with zeros, then add adjacent pairs until one is left. Adjacent pairing makes every aligned block a
subtree, and x + 0 = x, so padding to any larger power of two gives the same bits: a sum over the keys a
query sees does not depend on how many masked (exactly zero) keys follow, nor on chunking or the batch.

Elementwise ops are not all position-free either: torch's CPU sigmoid and silu run a scalar loop on the last
elements of each contiguous run (fewer than two vectors) whose bits differ from the vector loop's in about 4% of
values (AVX-512, torch 2.13), so a token's gate scores moved with its place in the batch (a [4, 8] score tensor
is vectorised, a lone [1, 8] row is not). exact_sigmoid / exact_silu are built from exp, + and / instead, which
agree in both loops on this build (tests/engine/test_exact_mode.py checks it).

exact_linear splits In into EXACT_BLOCKS = 8 contiguous blocks: a tree within each block, then a tree over
the 8 blocks. A row-parallel shard over R in {1, 2, 4, 8} ranks holds 8 / R whole blocks, a complete subtree,
so `exact_tree_reduce` of the ranks' partials (rank order, the tree's top levels) is bitwise the unsplit
result. `exact_all_reduce` is that reduction after an all_gather: the communicators call it in exact mode
(the model math here stays free of collectives).

Guarantees (fp32; tests/engine/test_exact_mode.py): a request's logits, logprobs and routes do not depend on
the other requests in its batch, on chunked-prefill boundaries, on prefix-cache hits or on the decode batch
size; nor on the tensor-parallel shard count R in {1, 2, 4, 8} after the exact reduction. MLA runs one path
(absorbed) for every forward. No op syncs with the host (attention masks by the request's prefix length on the
device, the experts run every pair at once), so a CUDA graph can hold an exact forward and give its eager bits
(tests/spec/test_spec_graphs*.py). Not covered: bf16/fp16 under R > 1 (partials are rounded to the model dtype
before the reduction), expert-parallel dispatch, and the Triton backends (exact mode requires ref). Their
counterpart is EngineConfig.batch_invariant: the triton backends with every reduction in one order (GEMM and MoE
K steps in one order at every T, fixed-split decode for every query row), batch- but not TP-invariant,
near default speed (layers/matmul.py, kernels/invariant_matmul.py, kernels/mla_decode/fixed_split.py).

Cost (samples/model, fp32, CPU, 2 threads, torch 2.13; bench/exact_cost.py -> bench/results/exact_cost-cpu.json,
fastest of 10 on a shared 2-core machine): exact / default forward time 18x for a 4 x 64-token prefill (466 vs
26 ms), 23x with logits on every row (input logprobs: the exact lm_head), 3.7x per decode step at batch 4 (32
vs 8.6 ms). exact_linear materialises every product (a GEMM's work as elementwise passes, about 75% of the
exact prefill), so it is a reference-speed mode for checking and replaying, not for serving throughput.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXACT_BLOCKS = 8  # In is split into 8 blocks: any R in {1, 2, 4, 8} ranks holds whole subtrees
# Elements of the [rows, Out, In] (or [q, H, N, D]) product tensor a chunk may hold: 4M fp32 = 16 MiB.
_CHUNK_ELEMENTS = 1 << 22

class ExactModeError(ValueError):
    """A shape exact mode cannot split into its fixed reduction tree; the message names the size."""


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over dim by a pairwise tree of adjacent elements, after zero-padding dim to a power of two.

    x: [..., n, ...] -> [..., ...] (dim removed), in x's dtype."""
    dim = dim % x.dim()
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()  # the next power of two >= n
    if width != n:
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, width - n]
        x = F.pad(x, pad)
    while x.shape[dim] > 1:
        pairs = x.unflatten(dim, (x.shape[dim] // 2, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def exact_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), elementwise, the same bits wherever x's element sits in the tensor."""
    return 1.0 / (1.0 + torch.exp(-x))


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)), elementwise, position-free (F.silu is not: see the module docstring)."""
    return x / (1.0 + torch.exp(-x))


def exact_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, its denominator a tree_sum. x: [..., n] -> [..., n]."""
    p = torch.exp(x - x.amax(-1, keepdim=True))
    return p / tree_sum(p, -1).unsqueeze(-1)


def _blocked_dot(a: torch.Tensor, b: torch.Tensor, blocks: int) -> torch.Tensor:
    """sum over the last dim of a * b (broadcast), In split into blocks: a tree within each, then over them."""
    prod = a * b  # [..., In]
    prod = prod.unflatten(-1, (blocks, prod.shape[-1] // blocks))  # [..., blocks, In / blocks]
    return tree_sum(tree_sum(prod, -1), -1)


def check_blocks(in_f: int, blocks: int, what: str) -> None:
    if blocks < 1 or in_f % blocks:
        raise ExactModeError(f"{what}: in_features={in_f} is not a multiple of the {blocks} exact reduction blocks")


def exact_linear(x: torch.Tensor, w: torch.Tensor, blocks: int = EXACT_BLOCKS) -> torch.Tensor:
    """x: [T, In], w: [Out, In] -> [T, Out] in x's dtype, summed in fp32 over `blocks` contiguous blocks of In.

    A row-parallel shard (In / R columns of R ranks) passes blocks = EXACT_BLOCKS // R: its result is the
    subtree the unsplit sum holds for those columns. Rows are processed in chunks (about _CHUNK_ELEMENTS
    products at a time); a row's bits never depend on its chunk."""
    t, in_f = x.shape
    out_f = w.shape[0]
    check_blocks(in_f, blocks, f"exact_linear [{out_f}, {in_f}]")
    wf = w.float()[None]  # [1, Out, In]
    out = torch.empty(t, out_f, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(out_f * in_f, 1))
    for s in range(0, t, step):
        out[s : s + step] = _blocked_dot(x[s : s + step, None, :].float(), wf, blocks)
    return out.to(x.dtype)


def exact_pair_linear(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row p of x through weight w[index[p]]: x [P, In], w [E, Out, In], index [P] int64 -> [P, Out] in x's dtype.
    Row p's bits are exact_linear(x[p:p+1], w[index[p]])'s (the same products, the same EXACT_BLOCKS tree); the
    weights are gathered per row on the device (no host sync), in chunks of about _CHUNK_ELEMENTS products."""
    rows, in_f = x.shape
    out_f = w.shape[1]
    check_blocks(in_f, EXACT_BLOCKS, f"exact_pair_linear [{out_f}, {in_f}]")
    out = torch.empty(rows, out_f, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(out_f * in_f, 1))
    for s in range(0, rows, step):
        wp = w.index_select(0, index[s : s + step]).float()  # [c, Out, In]
        out[s : s + step] = _blocked_dot(x[s : s + step, None, :].float(), wp, EXACT_BLOCKS)
    return out.to(x.dtype)


def exact_head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head linear: x [T, H, In], w [H, Out, In] -> [T, H, Out] in x's dtype (one tree over In).

    The absorbed MLA's w_kc and w_vc products: heads split across ranks, In never, so no blocks."""
    t, h, in_f = x.shape
    out_f = w.shape[1]
    wf = w.float()[None]  # [1, H, Out, In]
    out = torch.empty(t, h, out_f, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(h * out_f * in_f, 1))
    for s in range(0, t, step):
        out[s : s + step] = _blocked_dot(x[s : s + step, :, None, :].float(), wf, 1)
    return out.to(x.dtype)


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of one request, every sum a tree over the key or feature dim.

    q: [n, H, Dk]; k: [N, H, Dk] and v: [N, H, Dv] (an expanded view is fine); query i sits at key position
    q_start + i (q_start: a 0-d device tensor; None: N - n, the queries are the last n keys). -> [n, H, Dv] fp32.
    Masked keys (after a query's position) get probability exactly 0 and add exact zeros, so a query's result has
    the same bits whatever the number of keys after it: N may be any window that holds the request's keys (a CUDA
    graph passes the longest context, masked on the device). The max is exact
    in any order."""
    n, h, dk = q.shape
    big_n, dv = k.shape[0], v.shape[2]
    kt = k.float().permute(1, 0, 2)[None]  # [1, H, N, Dk]
    vt = v.float().permute(1, 0, 2)[None]  # [1, H, N, Dv]
    out = torch.empty(n, h, dv, dtype=torch.float32, device=q.device)
    k_pos = torch.arange(big_n, device=q.device)
    first = big_n - n if q_start is None else q_start
    step = max(1, _CHUNK_ELEMENTS // max(h * big_n * max(dk, dv), 1))
    for s in range(0, n, step):
        qc = q[s : s + step].float()  # [c, H, Dk]
        scores = tree_sum(qc[:, :, None, :] * kt, -1) * scale  # [c, H, N]
        q_pos = torch.arange(s, s + qc.shape[0], device=q.device) + first
        masked = (k_pos[None, :] > q_pos[:, None])[:, None, :]  # [c, 1, N]
        scores = scores.masked_fill(masked, float("-inf"))
        p = exact_softmax(scores)  # [c, H, N]; masked keys: exactly 0
        # masked products are +0 and the sum gets + 0.0: a key window longer than the keys pairs the same subtree
        # with +0 subtrees, which maps -0 to +0 and leaves every other value as it is; so does the + 0.0
        out[s : s + step] = tree_sum((p[..., None] * vt).masked_fill(masked[..., None], 0.0), 2) + 0.0  # [c, H, Dv]
    return out


def exact_tree_reduce(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of R same-shaped partials (rank order) by a pairwise tree, in fp32; R a power of two.

    The top levels of exact_linear's block tree: R row-parallel shards combine to the unsplit result."""
    r = len(parts)
    if r < 1 or r & (r - 1):
        raise ExactModeError(f"exact_tree_reduce needs a power-of-two number of partials, got {r}")
    level = [p.float() for p in parts]
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def exact_all_reduce(x: torch.Tensor, group: object, size: int) -> torch.Tensor:
    """The exact all-reduce: all_gather the R partials, then exact_tree_reduce in rank order; x's dtype.

    The communicators' reduce in exact mode (same contract as communicator._all_reduce); identity for one
    rank. R times the bytes of a ring all-reduce's input, for sums that do not depend on the ring's order."""
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)  # type: ignore[arg-type]
    return exact_tree_reduce(parts).to(x.dtype)
