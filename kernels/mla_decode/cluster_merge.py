"""The split-KV merge inside stage 1: the P split programs of one (request, head block) run as one thread-block
cluster (sm_90) and merge through distributed shared memory, so no fp32 partials reach global memory and no merge
kernel is launched. Used by both Gluon decode kernels (narrow.py's O^T [kv_lora, heads], wide.py's
O [heads, kv_lora]).

Why: at the small decode cells the merge is a fixed cost the loop cannot hide. H = 16, B64/1k (2 splits of 8
tiles): stage 1's loop runs at the read floor's rate, and ~6 us of the 0.026 ms call were launch, first-tile latency,
the 32 KB partial write a program and the merge launched after it. A merge by
the last program through global memory (a ticket on an acq_rel atomic, then L2 reads) lost 1.05-1.8x there.

Protocol, every thread of every CTA of the cluster (a split with no keys too: zeros, m = -inf, l = 0, weighing
nothing), in the first bytes of the kernel's own dynamic shared memory, free once its loop is done:
1. cluster barrier: every rank is past its loop (its tiles, q and P are dead) and runs;
2. each rank pushes the columns rank p owns, [p R, p R + R) with R = kv_lora / P, of its unnormalised O into rank
   p's region (`mapa` + `st.shared::cluster`), and its per-head log2 max m and sum l into every rank's;
3. cluster barrier (arrive.release / wait.acquire): every push has landed. Nothing remote is touched after it, so
   no third barrier has to keep a CTA's shared memory alive;
4. each rank merges its R columns from its own region (16-byte loads): weights exp2(m_p - max m), divided by the
   weighted sum of l, and stores them.
When it runs: DecodeTile.cluster (the narrow default: 2 splits). Measured (H200, graph replays;
BENCHMARKS.md#mla-decode): the narrow kernel's 2 splits in clusters of 2 take B64/1k from 0.0259-0.0265 ms to
0.0238-0.0243, B64/8k 1.03x, B64/32k 1.01x. The wide kernel lost even where its clusters fit (4 splits of 64 heads,
128 KB a CTA pushed: 1.09-1.46x slower), so its default keeps the merge kernel. Clusters resident at once on the H200
(one CTA an SM): 66 of 2, 30 of 4, 15 of 8; a grid of more would run in two waves (1.3-2.2x slower), so
launch_in_clusters declines it.

Gluon (triton 3.6) has no API for a shared memory address, mapa or cluster barriers, so those are inline PTX
against `global_smem`, the dynamic shared memory every Triton kernel declares; nothing the compiler allocates is
live from step 1 on (the merge is elementwise and stores from registers). A Gluon kernel launched with num_ctas = P
would instead split every layout across the cluster (CGA layouts), so the kernel is compiled for one CTA and
launched with a cluster dimension (launch_in_clusters).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.driver import driver

from r3trace.kernels.mla_decode.tile import CLUSTER_SIZES

EXCHANGE_PAD = 4  # floats after each head's row: 16-byte aligned rows, writers' lanes spread over the banks


def exchange_bytes(kv_lora: int, block_h: int, cluster: int) -> int:
    """The exchange region: every rank's slice of the owner's columns (padded rows), then m and l of every rank; at
    most the kernel's own shared memory (launch_in_clusters checks)."""
    return cluster * block_h * ((kv_lora // cluster + EXCHANGE_PAD) + 2) * 4


@gluon.jit
def _smem_base():
    """The shared::cta address of the kernel's dynamic shared memory."""
    return gl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _st_cluster(addr, rank, val):
    """val to shared::cta address `addr` of cluster rank `rank` (itself included)."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a; mapa.shared::cluster.u32 a, $1, $2; st.shared::cluster.f32 [a], $3; } // dummy $0",
        "=r,r,r,f", [addr, rank, val], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _ld_shared(addr):
    return gl.inline_asm_elementwise("ld.shared.f32 $0, [$1];", "=f,r", [addr], dtype=gl.float32, is_pure=False,
                                     pack=1)  # fmt: skip


@gluon.jit
def _ld_shared_v4(addr):
    """Four consecutive floats from addr's first element (the caller's layout holds >= 4 consecutive rows a thread,
    16-byte aligned); not pure, so it stays after the barrier before it."""
    return gl.inline_asm_elementwise(
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r,r,r,r", [addr], dtype=gl.float32,
        is_pure=False, pack=4,
    )  # fmt: skip


@gluon.jit
def _cluster_sync():
    gl.inline_asm_elementwise("barrier.cluster.arrive.release; barrier.cluster.wait.acquire; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _cluster_rank():
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def cluster_merge_store(
    acc, m_i, l_i, out_ptr, b, h0, H, stride_ob, stride_oh,
    KV_LORA: gl.constexpr, BLOCK_H: gl.constexpr, CLUSTER: gl.constexpr, HEADS_FIRST: gl.constexpr,
    MERGE_LAYOUT: gl.constexpr,
):  # fmt: skip
    """acc: this split's unnormalised output, O [BLOCK_H, KV_LORA] (HEADS_FIRST) or O^T [KV_LORA, BLOCK_H], fp32 in
    any layout; m_i, l_i [BLOCK_H]: its log2 max and sum. Steps 1-4 above; stores out[b, h0 + h, c] for this rank's
    columns c."""
    R: gl.constexpr = KV_LORA // CLUSTER
    ROW: gl.constexpr = R + 4  # EXCHANGE_PAD: 16-byte aligned rows
    M_OFF: gl.constexpr = CLUSTER * BLOCK_H * ROW * 4  # then m [CLUSTER, BLOCK_H], then l
    L_OFF: gl.constexpr = M_OFF + CLUSTER * BLOCK_H * 4
    base = _smem_base()
    rank = _cluster_rank()
    acc_l: gl.constexpr = acc.type.layout
    if HEADS_FIRST:
        hh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, acc_l))[:, None]
        cc = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, acc_l))[None, :]
    else:
        cc = gl.arange(0, KV_LORA, layout=gl.SliceLayout(1, acc_l))[:, None]
        hh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, acc_l))[None, :]
    owner = cc // R + hh * 0  # the rank that merges each column, broadcast to acc's shape
    dst = base + ((rank * BLOCK_H + hh) * ROW + cc % R) * 4
    h_m = gl.arange(0, BLOCK_H, layout=m_i.type.layout)
    h_l = gl.arange(0, BLOCK_H, layout=l_i.type.layout)
    gl.thread_barrier()  # every warp past the kernel's own last shared-memory access (the loop, the sum's scratch)
    _cluster_sync()  # step 1
    _st_cluster(dst, owner, acc)
    for p in gl.static_range(CLUSTER):
        _st_cluster(base + M_OFF + (rank * BLOCK_H + h_m) * 4, h_m * 0 + p, m_i)
        _st_cluster(base + L_OFF + (rank * BLOCK_H + h_l) * 4, h_l * 0 + p, l_i)
    _cluster_sync()  # step 3: every rank's pushes landed
    h_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MERGE_LAYOUT))
    r_o = gl.arange(0, R, layout=gl.SliceLayout(0, MERGE_LAYOUT))
    m_max = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MERGE_LAYOUT))
    for p in gl.static_range(CLUSTER):
        m_max = gl.maximum(m_max, _ld_shared(base + M_OFF + (p * BLOCK_H + h_o) * 4))
    o = gl.zeros([BLOCK_H, R], gl.float32, layout=MERGE_LAYOUT)
    den = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, MERGE_LAYOUT))
    for p in gl.static_range(CLUSTER):
        w = gl.exp2(_ld_shared(base + M_OFF + (p * BLOCK_H + h_o) * 4) - m_max)  # 0 for a split with no keys
        den += w * _ld_shared(base + L_OFF + (p * BLOCK_H + h_o) * 4)
        o += w[:, None] * _ld_shared_v4(base + ((p * BLOCK_H + h_o[:, None]) * ROW + r_o[None, :]) * 4)
    out = (o / den[:, None]).to(out_ptr.dtype.element_ty)
    h = h0 + h_o
    ptr = out_ptr + b * stride_ob + h[:, None] * stride_oh + rank * R + r_o[None, :]
    gl.store(ptr, out, mask=(h < H)[:, None])


@gluon.jit
def cluster_merge_nothing(
    out_ptr, b, h0, H, stride_ob, stride_oh,
    KV_LORA: gl.constexpr, BLOCK_H: gl.constexpr, CLUSTER: gl.constexpr, HEADS_FIRST: gl.constexpr,
    ACC_LAYOUT: gl.constexpr, HEAD_LAYOUT: gl.constexpr, MERGE_LAYOUT: gl.constexpr,
):  # fmt: skip
    """cluster_merge_store for a split with no keys: it still takes part in the cluster's barriers, pushing zeros,
    m = -inf and l = 0 (weighing nothing). ACC_LAYOUT: the kernel's accumulator layout; HEAD_LAYOUT: its [BLOCK_H]
    row statistics' layout."""
    if HEADS_FIRST:
        acc = gl.zeros([BLOCK_H, KV_LORA], gl.float32, layout=ACC_LAYOUT)
    else:
        acc = gl.zeros([KV_LORA, BLOCK_H], gl.float32, layout=ACC_LAYOUT)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=HEAD_LAYOUT)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=HEAD_LAYOUT)
    cluster_merge_store(acc, m_i, l_i, out_ptr, b, h0, H, stride_ob, stride_oh,
                        KV_LORA, BLOCK_H, CLUSTER, HEADS_FIRST, MERGE_LAYOUT)  # fmt: skip


def merge_layout(kv_lora: int, cluster: int, num_warps: int) -> gl.BlockedLayout:
    """[heads, kv_lora / P], columns fastest: 8 a thread (16-byte bf16 stores, two 16-byte shared loads)."""
    cols = kv_lora // cluster
    tc = max(1, min(32, cols // 8))
    return gl.BlockedLayout([1, 8], [32 // tc, tc], [num_warps, 1], [1, 0])


@functools.lru_cache(maxsize=64)
def _resident_clusters(kernel_hash: str, device: int, function: int, shared: int, cluster: int) -> int:
    """Clusters of `cluster` CTAs of this compiled kernel resident at once on `device`: the driver's answer
    (cuOccupancyMaxActiveClusters; its utility assumes 128 threads a block; shared memory binds first for the decode
    kernels, one or two CTAs an SM), asked once per kernel, device and cluster size."""
    return int(driver.active.utils.cuOccupancyMaxActiveClusters(function, shared, cluster))


def launch_in_clusters(
    kernel: Any, grid: tuple[int, int, int], cluster: int, args: tuple, kwargs: dict, exchange: int
) -> bool:
    """Launches a one-CTA Gluon kernel as grid[0] clusters of `cluster` CTAs along x (program_id(0) then runs over
    grid[0] * cluster, a cluster's CTAs consecutive) and returns True; returns False, launching nothing, where the
    grid's clusters would not all be resident at once (a second wave of clusters took 1.3-2.2x the merge kernel's
    time: 16 clusters of 8 where 15 fit, 32 of 4 where 30 fit, on an H200).
    Uses triton's compiled-kernel launcher (3.6 on the H200; 3.9's has the same contract) with a cluster dimension in
    its packed metadata (num_warps, num_ctas, shared), which it turns into cuLaunchKernelEx's cluster attribute,
    without compiling the kernel for a CTA group (what num_ctas would); another layout warns and returns False.
    exchange: the bytes cluster_merge_store uses, which must fit in the kernel's own shared memory.
    Graph-capturable (the decision is the same at capture and at replay)."""
    if cluster not in CLUSTER_SIZES:
        raise ValueError(f"cluster {cluster} not in {CLUSTER_SIZES}")
    compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    packed = compiled.packed_metadata
    if not (isinstance(packed, tuple) and len(packed) == 3 and packed[1] == 1):  # another triton's launcher
        warnings.warn(f"cluster launch: triton {triton.__version__}'s packed kernel metadata {packed!r} is not the "
                      "(num_warps, num_ctas=1, shared) of triton 3.6-3.9; merging the splits in a second kernel",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
        return False
    if exchange > packed[2]:
        raise RuntimeError(f"cluster launch: the merge's {exchange} B exchange exceeds the kernel's {packed[2]} B of "
                           f"shared memory")  # fmt: skip
    run = compiled.run  # loads the module on first use
    fit = _resident_clusters(compiled.hash, torch.cuda.current_device(), compiled.function, packed[2], cluster)
    if grid[0] * grid[1] * grid[2] > fit:
        return False
    named = dict(zip(kernel.arg_names[: len(args)], args, strict=True))
    named |= {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    bound = [named[name] for name in kernel.arg_names]
    stream = torch.cuda.current_stream().cuda_stream
    run(grid[0], grid[1], grid[2], stream, compiled.function, (packed[0], cluster, packed[2]), None, None, None,
        *bound)  # fmt: skip
    return True
