"""The split-KV merge inside stage 1: the P split programs of one (request, head block) run as one thread-block
cluster (sm_90) and merge through distributed shared memory, so no fp32 partials reach global memory and no merge
kernel is launched.

Why: at the small decode cells the merge is a fixed cost the loop cannot hide. H = 16, B64/1k (2 splits of 8
tiles): stage 1's loop runs at the read floor's rate, and ~6 us of the 0.026 ms call are launch, first-tile latency,
the 32 KB partial write a program and the merge launched after it (bench/NOTES.md, "Session 7", run 4). A merge by
the last program through global memory (a ticket on an acq_rel atomic, then L2 reads) lost 1.05-1.8x there.

Protocol, in an exchange region of its own past the kernel's shared memory (the launch asks for it on top; its
offset is a constexpr), so a rank can push before the others have left their loops:
0. at its top every thread arrives (relaxed) at the cluster barrier: "this CTA runs";
1. after its loop, a rank waits for that phase (every CTA of the cluster runs, its shared memory exists), then
   pushes its unnormalised O^T [kv_lora, heads] in slices, the columns rank p owns, [p R, p R + R) with R = kv_lora
   / P, into rank p's region (`mapa` + `st.shared::cluster`), and its per-head log2 max m and sum l into every
   rank's; a split with no keys pushes zeros, m = -inf and l = 0 and so weighs nothing;
2. cluster barrier (arrive.release / wait.acquire): every push has landed. Nothing remote is touched after it, so
   no third barrier keeps a CTA's shared memory alive;
3. each rank merges its R columns from its own region (16-byte loads): weights exp2(m_p - max m), divided by the
   weighted sum of l, and stores them.

Gluon (triton 3.6) has no API for a shared memory address, mapa or cluster barriers, so those are inline PTX
against `global_smem`, the dynamic shared memory every Triton kernel declares. A Gluon kernel launched with
num_ctas = P would instead split every layout across the cluster (CGA layouts), so the kernel is compiled for one
CTA and launched with a cluster dimension (launch_in_clusters).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.driver import driver

from r3trace.kernels.decode_tile import CLUSTER_SIZES

# the kernel's own shared memory per compiled configuration (its constexprs and argument dtypes), learnt once
_OWN_SHARED: dict[tuple, int] = {}
# (configuration, exchange offset, tail, cluster) -> clusters that fit at once (cuOccupancyMaxActiveClusters), once its
# shared memory limit is set
_SHARED_SET: dict[tuple, int] = {}
EXCHANGE_PAD = 4  # floats after each head's row: 16-byte aligned rows, writers' lanes spread over the banks


def max_shared_mem(device: int) -> int:
    return int(driver.active.utils.get_device_properties(device)["max_shared_mem"])


def exchange_bytes(kv_lora: int, block_h: int, cluster: int) -> int:
    """The exchange region: every rank's slice of the owner's columns (padded rows), then m and l of every rank."""
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
def cluster_arrive():
    """Step 0: this thread arrives at the cluster barrier (relaxed: nothing to publish yet); any thread on its own
    path (the non-.aligned form)."""
    gl.inline_asm_elementwise("barrier.cluster.arrive.relaxed; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _cluster_wait():
    gl.inline_asm_elementwise("barrier.cluster.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cluster_sync():
    gl.inline_asm_elementwise("barrier.cluster.arrive.release; barrier.cluster.wait.acquire; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _cluster_rank():
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def cluster_merge_store(
    acc, m_i, l_i, out_ptr, b, h0, H, stride_ob, stride_oh, XCHG_OFF: gl.constexpr,
    KV_LORA: gl.constexpr, BLOCK_H: gl.constexpr, CLUSTER: gl.constexpr, MERGE_LAYOUT: gl.constexpr,
):  # fmt: skip
    """acc: this split's O^T [KV_LORA, BLOCK_H] fp32 (unnormalised, any layout); m_i, l_i [BLOCK_H]: its log2 max
    and sum (-inf and 0 for a split with no keys). Steps 1-3 above; stores out[b, h0 + h, c] for this rank's
    columns c. XCHG_OFF: the exchange region's byte offset in the dynamic shared memory."""
    R: gl.constexpr = KV_LORA // CLUSTER
    ROW: gl.constexpr = R + 4  # EXCHANGE_PAD: 16-byte aligned rows
    M_OFF: gl.constexpr = CLUSTER * BLOCK_H * ROW * 4  # then m [CLUSTER, BLOCK_H], then l
    L_OFF: gl.constexpr = M_OFF + CLUSTER * BLOCK_H * 4
    base = _smem_base() + XCHG_OFF
    rank = _cluster_rank()
    acc_l: gl.constexpr = acc.type.layout
    rows = gl.arange(0, KV_LORA, layout=gl.SliceLayout(1, acc_l))
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, acc_l))
    owner = (rows // R)[:, None] + heads[None, :] * 0  # [KV_LORA, heads]: the rank that merges each column
    dst = base + ((rank * BLOCK_H + heads[None, :]) * ROW + (rows % R)[:, None]) * 4
    _cluster_wait()  # step 0's phase: every CTA of the cluster runs
    _st_cluster(dst, owner, acc)
    h_m = gl.arange(0, BLOCK_H, layout=m_i.type.layout)
    h_l = gl.arange(0, BLOCK_H, layout=l_i.type.layout)
    for p in gl.static_range(CLUSTER):
        _st_cluster(base + M_OFF + (rank * BLOCK_H + h_m) * 4, h_m * 0 + p, m_i)
        _st_cluster(base + L_OFF + (rank * BLOCK_H + h_l) * 4, h_l * 0 + p, l_i)
    _cluster_sync()  # step 2: every rank's pushes landed
    r_o = gl.arange(0, R, layout=gl.SliceLayout(1, MERGE_LAYOUT))
    h_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MERGE_LAYOUT))
    m_max = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MERGE_LAYOUT))
    for p in gl.static_range(CLUSTER):
        m_max = gl.maximum(m_max, _ld_shared(base + M_OFF + (p * BLOCK_H + h_o) * 4))
    o = gl.zeros([R, BLOCK_H], gl.float32, layout=MERGE_LAYOUT)
    den = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, MERGE_LAYOUT))
    for p in gl.static_range(CLUSTER):
        w = gl.exp2(_ld_shared(base + M_OFF + (p * BLOCK_H + h_o) * 4) - m_max)  # 0 for a split with no keys
        den += w * _ld_shared(base + L_OFF + (p * BLOCK_H + h_o) * 4)
        o += w[None, :] * _ld_shared_v4(base + ((p * BLOCK_H + h_o[None, :]) * ROW + r_o[:, None]) * 4)
    out = (o / den[None, :]).to(out_ptr.dtype.element_ty)
    h = h0 + h_o
    ptr = out_ptr + b * stride_ob + h[None, :] * stride_oh + rank * R + r_o[:, None]
    gl.store(ptr, out, mask=(h < H)[None, :])


def merge_layout(kv_lora: int, cluster: int, block_h: int, num_warps: int) -> gl.BlockedLayout:
    """[kv_lora / P, heads], columns fastest: 8 a thread (16-byte bf16 stores, two 16-byte DSMEM loads)."""
    rows = kv_lora // cluster
    tr = max(1, min(32, rows // 8))
    return gl.BlockedLayout([8, 1], [tr, 32 // tr], [1, num_warps], [0, 1])


def launch_in_clusters(
    kernel: Any, grid: tuple[int, int, int], cluster: int, args: tuple, kwargs: dict, tail_bytes: int
) -> None:
    """Launches a one-CTA Gluon kernel as grid[0] clusters of `cluster` CTAs along x (program_id(0) then runs over
    grid[0] * cluster, a cluster's CTAs consecutive), with tail_bytes of dynamic shared memory past the kernel's
    own, whose byte offset it gets as the constexpr XCHG_OFF: compiled once with 0 to learn its own size, then
    with the offset (the same allocation; checked). Uses triton 3.6's compiled-kernel launcher with a cluster
    dimension and the larger size in its packed metadata (num_warps, num_ctas, shared), which it turns into
    cuLaunchKernelEx's cluster attribute and dynamic shared memory, without compiling the kernel for a CTA group
    (what num_ctas would). Graph-capturable."""
    if cluster not in CLUSTER_SIZES:
        raise ValueError(f"cluster {cluster} not in {CLUSTER_SIZES}")

    def compiled_at(offset: int) -> Any:
        compiled = kernel.run(*args, grid=grid, warmup=True, XCHG_OFF=offset, **kwargs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        packed = compiled.packed_metadata
        if not (isinstance(packed, tuple) and len(packed) == 3 and packed[1] == 1):
            raise RuntimeError(f"cluster launch: this triton's packed kernel metadata {packed!r} is not the "
                               f"(num_warps, num_ctas=1, shared) it was written for (triton 3.6)")  # fmt: skip
        return compiled

    key = (kernel.fn.__qualname__, *sorted((k, repr(v)) for k, v in kwargs.items()),
           *(str(a.dtype) for a in args if isinstance(a, torch.Tensor)))  # fmt: skip
    if key not in _OWN_SHARED:  # one lookup of the compiled kernel a call, not two
        _OWN_SHARED[key] = compiled_at(0).packed_metadata[2]
    own = _OWN_SHARED[key]
    offset = -(-own // 16) * 16
    compiled = compiled_at(offset)
    num_warps, _, shared = compiled.packed_metadata
    limit = max_shared_mem(torch.cuda.current_device())  # the opt-in limit, which triton sets on the kernel
    if shared != own or offset + tail_bytes > limit:
        raise RuntimeError(f"cluster launch: the kernel's {own} B of shared memory ({shared} B with the exchange's "
                           f"offset) and a {tail_bytes} B exchange: over the {limit} B a block may have")  # fmt: skip
    named = dict(zip(kernel.arg_names[: len(args)], args, strict=True))
    named |= {k: v for k, v in kwargs.items() if k in kernel.arg_names} | {"XCHG_OFF": offset}
    bound = [named[name] for name in kernel.arg_names]
    run = compiled.run  # loads the module on first use
    if (key, offset, tail_bytes, cluster) not in _SHARED_SET:
        # triton raises a kernel's dynamic shared memory limit past the default 48 KB only for its own size; the
        # driver's cluster occupancy query sets it to ours (the tail included), and says how many clusters fit
        _SHARED_SET[key, offset, tail_bytes, cluster] = driver.active.utils.cuOccupancyMaxActiveClusters(
            compiled.function, offset + tail_bytes, cluster
        )
    stream = torch.cuda.current_stream().cuda_stream
    run(grid[0], grid[1], grid[2], stream, compiled.function, (num_warps, cluster, offset + tail_bytes), None, None,
        None, *bound)  # fmt: skip
