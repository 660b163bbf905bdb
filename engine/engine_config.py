"""EngineConfig: every engine option, frozen and validated once at construction, passed downward."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from .kernel_modes import BACKENDS, EngineConfigError, KernelModes

DType = Literal["float32", "bfloat16", "float16"]
MlaPath = Literal["auto", "normal", "absorb"]
Backend = Literal["ref", "triton"]
DecodeKernel = Literal["auto", "triton"]
SharedExperts = Literal["auto", "fused", "separate"]

# None: off; EAGLE is SGLang's alias of NEXTN for DeepSeek's MTP module (the one draft model here)
SPEC_ALGORITHMS = (None, "NEXTN", "EAGLE")
MAX_SPEC_STEPS = 3  # the range; SGLang's DeepSeek-V3 default (3 steps, top-1, 4 tokens verified)
MAX_LAUNCH_STEPS = 8  # speculative steps chained in one graph: each adds its kernels to the graph, its rows to capture

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_batch_sizes(max_running_requests: int) -> tuple[int, ...]:
    """The decode batch sizes captured as CUDA graphs when none are given: 1, 2, 4, 8, then every 8 up to 64,
    every 32 up to 256, every 64 beyond (SGLang captures a similar ladder): padding a batch up to the next
    captured size wastes at most 12% of a step above 8 requests, and each graph costs one capture."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(96, 257, 32)) + list(range(320, 1025, 64))
    out = [s for s in sizes if s < max_running_requests] + [max_running_requests]
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EngineConfig(KernelModes):
    dtype: DType = "float32"
    device: str = "cpu"
    # scheduling
    chunked_prefill_size: int = 512  # max new tokens per forward (the per-step token budget)
    max_running_requests: int = 64
    # KV slots a page. 1: prefix-cache hits at any token. A multiple of 64 lets Hopper's Gluon decode kernels load a
    # 64-key tile as TMA boxes: at H < 64 the narrow kernel, 1.10-1.18x the Triton tile on an H200 at batch 16-256
    # and 1K-8K keys (BENCHMARKS.md, MLA decode, the narrow Gluon stage 1); prefix hits then come in whole pages.
    page_size: int = 1
    kv_pool_tokens: int = 16384  # KV slots in the paged latent pool
    max_context_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    # Overlapped scheduler (engine/event_loop.py): the host prepares step i+1 while the GPU runs step i. The same
    # steps as without it, except that a request stopping on a sampled token still has its (dropped) row in the
    # step after: that step is one row larger, which can move other rows' values by a GEMM's batch-size rounding
    # (tests/engine/test_overlap.py: same tokens and routes, logprobs within 1e-5 in fp32). Off serializes host
    # and device (a debugging aid, and the A/B baseline).
    overlap_schedule: bool = True
    # math backends, chosen once here (never inside forward)
    mla_path: MlaPath = "auto"  # auto: normal for prefix-free prefill, absorbed otherwise
    attention_backend: Backend = "ref"
    moe_backend: Backend = "ref"
    topk_backend: Backend = "ref"
    norm_backend: Backend = "ref"  # RMSNorm (+ the residual add before it): torch or one triton launch
    rope_backend: Backend = "ref"
    # MLA decode stage 1 of the triton attention backend: auto = a Gluon kernel where one runs (Hopper, bf16/fp16,
    # kv_lora 128/256/512: >= 64 heads, 1.35x the Triton kernel at H = 128 on an H200; fewer heads on pages of a
    # multiple of 64 slots, 1.10-1.18x), Triton elsewhere; triton = always the Triton kernel (the one the CPU
    # interpreter tests).
    decode_kernel: DecodeKernel = "auto"
    # Shared experts: fused = extra experts of the routed MoE (ids E..E+S-1, weight 1 for every token: one
    # grouped pass instead of an MLP's 3 GEMMs, 2 elementwise kernels and an add a layer); separate = the MLP
    # beside it (the reference twin). auto: fused with the triton moe backend.
    shared_experts: SharedExperts = "auto"
    # Batch sizes captured as CUDA graphs (decode; under speculation the draft and verify forwards). None: a
    # default ladder up to max_graph_batch when on CUDA with all three triton backends (the ref backends loop
    # over host values and cannot be captured; exact mode's can, when sizes are given); () turns graphs off.
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    seed: int = 0
    # Exact mode (layers/exact.py): batch-invariant math, so a request's logits and routes do not depend on its
    # batch, chunking, prefix hits or the TP shard count. Needs the ref backends; forces the absorbed MLA path
    # and separate shared experts (both through exact ops); CUDA graphs only when cuda_graph_batch_sizes names them
    # (no default ladder: exact mode is for checking, not speed). Under expert parallelism it takes the
    # low-latency dispatcher, whose combine sums a token's K expert outputs in k order as one process does.
    deterministic: bool = False
    # Batch-invariant mode (SGLang's --enable-deterministic-inference, vLLM's VLLM_BATCH_INVARIANT): the fast triton
    # path with every reduction in one order whatever the batch, so a row's bits (logits, routes) do not depend on the
    # other rows, the batch size, a verify's width or chunking: the linears and per-head products through Triton GEMM
    # tiles that take K's steps in one order at every T, no split-K (kernels/invariant_matmul.py), the fused MoE on the
    # default plan's grouped tiles, its MMA steps in K order at any tile (no gemv switch), the router logits' kernel at
    # every T, and every query row on the absorbed MLA path through the Triton decode kernel with fixed 256-key splits
    # merged in order (kernels/mla_decode/fixed_split.py; decode_kernel is not consulted). Needs all five triton
    # backends; forces the absorbed MLA path; one process (tp, dp, ep > 1 are refused: their collectives reduce in
    # NCCL's order, which follows the message size).
    batch_invariant: bool = False
    # Row-invariant mode (the default on CUDA with the triton backends): a decode or verify row's bits and a prompt
    # row's bits each follow the row's own tokens only, whatever the batch, its size, a verify's width, the chunking or
    # the step's mix, so speculation returns the routes and tokens plain decoding does (issue 26's default-mode goal)
    # and a request alone equals it batched. batch_invariant's GEMMs, MoE plan and router logits at every T; decode and
    # verify rows on the absorbed path through the fixed-split attention; prompt rows (chunks on a cached prefix
    # too) on the normal path, MHA over every key decompressed from the cache (kernels/mha_prefill.py): a prompt row's
    # bits are not the same token's decode bits (batch_invariant=True gives that too: a recomputed preempted request,
    # or a prefix cached from decode rows against one recomputed as a prompt, differ here). The MTP draft runs the
    # fast kernels (its bits choose drafts, never a target row). None: on with the five triton backends on CUDA, the
    # auto MLA path, neither exact nor batch-invariant mode; True: the same, refused where it cannot hold; False: off.
    row_invariant: bool | None = None
    # Expert parallelism's token dispatcher (SGLang's --deepep-mode): normal (DeepEP normal mode: rows sized by a
    # host count each dispatch) or low_latency (fixed [E_local, max_tokens * G, D] buffers, graph-safe, k-order
    # combine). auto: low_latency in exact mode, else normal.
    deepep_mode: Literal["auto", "normal", "low_latency"] = "auto"
    # Expert placement under expert parallelism (SGLang's names). P = n_routed_experts + ep_num_redundant_experts
    # physical slots, P / ep_size on each rank. init_expert_location: "trivial" (slot p holds expert p % E), or a
    # path to `r3trace eplb --out`'s JSON or SGLang's expert-location JSON / .pt. Either one builds an
    # ExpertLocation (engine/layers/expert_location.py); neither leaves slot e = expert e, today's path.
    ep_num_redundant_experts: int = 0
    init_expert_location: str | None = None
    ep_dispatch_algorithm: Literal["static", "dynamic"] = "static"  # which replica a pair goes to (expert_map.py)
    expert_dispatch_seed: int = 0  # dynamic dispatch's hash seed: the same on every rank, so choices agree
    # route capture
    capture_weights: bool = False  # keep top-k weights too (return_routed_weights; +2 bytes per id)
    # also record the physical slot of each routed pair (meta_info["routed_experts_physical"], and a physical_ids
    # column in traces); logical ids stay what routed_experts and topk_ids hold
    capture_physical_ids: bool = False
    trace_dir: str | None = None  # record every request into this trace folder from the start
    # Speculative decoding (SGLang's names; engine/spec/): "NEXTN" drafts with the checkpoint's MTP module ("EAGLE"
    # is accepted as its alias, as SGLang does); speculative_num_steps d = 1..3 draft tokens a step (None: 3, SGLang's
    # choice for DeepSeek-V3), checked by one target forward of d + 1 tokens a request. Runs un-overlapped, in one
    # process (several are refused); CUDA graphs hold its draft and verify forwards (engine/spec/graphs.py).
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    # Whole speculative steps chained on the device per launch (spec/greedy_step.py), when every running request
    # decodes greedily on the graphs and no waiting request could take a seat: S > 1 replays S steps as one graph,
    # each step's positions and KV slots taken on the device from the one before's accepted counts (a request's KV
    # reserved for S x (d + 1) positions, the unused freed after), and the host reads the S results back at once.
    # 4: the fastest of 2, 4 and 8 at batch 1 and 32 on the sample model (within 2% of 8 at batch 8), where a step
    # of one launch spends about as long on the host as on the GPU (BENCHMARKS.md#speculative-decoding).
    speculative_launch_steps: int = 4

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise EngineConfigError(f"dtype={self.dtype!r}: expected one of {sorted(_DTYPES)}")
        for name in ("chunked_prefill_size", "max_running_requests", "page_size", "kv_pool_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise EngineConfigError(f"{name}={value!r}: must be a positive integer")
        if self.kv_pool_tokens % self.page_size:
            raise EngineConfigError(
                f"kv_pool_tokens={self.kv_pool_tokens} is not a multiple of page_size={self.page_size}"
            )
        if self.mla_path not in ("auto", "normal", "absorb"):
            raise EngineConfigError(f"mla_path={self.mla_path!r}: expected auto, normal or absorb")
        for name in BACKENDS:
            if getattr(self, name) not in ("ref", "triton"):
                raise EngineConfigError(f"{name}={getattr(self, name)!r}: expected ref or triton")
        if self.shared_experts not in ("auto", "fused", "separate"):
            raise EngineConfigError(f"shared_experts={self.shared_experts!r}: expected auto, fused or separate")
        if self.decode_kernel not in ("auto", "triton"):
            raise EngineConfigError(f"decode_kernel={self.decode_kernel!r}: expected auto or triton")
        if not isinstance(self.deterministic, bool):
            raise EngineConfigError(f"deterministic={self.deterministic!r}: expected True or False")
        if not isinstance(self.batch_invariant, bool):
            raise EngineConfigError(f"batch_invariant={self.batch_invariant!r}: expected True or False")
        if self.row_invariant not in (None, True, False):
            raise EngineConfigError(f"row_invariant={self.row_invariant!r}: expected None (auto), True or False")
        if self.deepep_mode not in ("auto", "normal", "low_latency"):
            raise EngineConfigError(f"deepep_mode={self.deepep_mode!r}: expected auto, normal or low_latency")
        self._check_placement()
        self._check_speculative()
        if self.deterministic:
            self._check_deterministic()
        if self.batch_invariant:
            self._check_batch_invariant()
        if self.row_invariant:
            self._check_row_invariant()
        if self.cuda_graph_batch_sizes:
            self._check_graphs(self.cuda_graph_batch_sizes)

    def _check_graphs(self, sizes: tuple[int, ...]) -> None:
        if not self.device.startswith("cuda") or not (self.all_triton or self.deterministic):
            raise EngineConfigError(
                f"cuda_graph_batch_sizes={sizes}: needs device cuda and the triton attention, moe and topk backends "
                "(or deterministic=True)"
            )
        bad = [b for b in sizes if not 0 < b <= self.max_running_requests]
        if bad:
            raise EngineConfigError(
                f"cuda_graph_batch_sizes has {bad} outside 1..max_running_requests={self.max_running_requests}"
            )
        # A verify graph runs B requests of exactly 1 + d tokens: a step holds that many only within its budget
        too_big = [b for b in sizes if b > self.max_graph_batch]
        if too_big:
            raise EngineConfigError(
                f"cuda_graph_batch_sizes has {too_big}: a verify of B x (1 + speculative_num_steps {self.spec_steps}) "
                f"tokens must fit chunked_prefill_size={self.chunked_prefill_size} (B <= {self.max_graph_batch})"
            )

    def _check_placement(self) -> None:
        """Field by field; P % ep_size needs the model's E and the launch's ep_size: check_expert_slots."""
        r = self.ep_num_redundant_experts
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise EngineConfigError(f"ep_num_redundant_experts={r!r}: must be an integer >= 0")
        loc = self.init_expert_location
        if loc is not None and (not isinstance(loc, str) or not loc):
            raise EngineConfigError(f"init_expert_location={loc!r}: expected 'trivial' or a path to a JSON / .pt file")
        if self.ep_dispatch_algorithm not in ("static", "dynamic"):
            raise EngineConfigError(f"ep_dispatch_algorithm={self.ep_dispatch_algorithm!r}: expected static or dynamic")
        if not isinstance(self.capture_physical_ids, bool):
            raise EngineConfigError(f"capture_physical_ids={self.capture_physical_ids!r}: expected True or False")
        seed = self.expert_dispatch_seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= 0xFFFFFFFF:
            raise EngineConfigError(f"expert_dispatch_seed={seed!r}: must be an integer in 0..{0xFFFFFFFF}")

    def _check_speculative(self) -> None:
        algo, steps = self.speculative_algorithm, self.speculative_num_steps
        if algo not in SPEC_ALGORITHMS:
            raise EngineConfigError(f"speculative_algorithm={algo!r}: expected one of {SPEC_ALGORITHMS}")
        chain = self.speculative_launch_steps
        if not isinstance(chain, int) or isinstance(chain, bool) or not 1 <= chain <= MAX_LAUNCH_STEPS:
            raise EngineConfigError(f"speculative_launch_steps={chain!r}: must be an integer in 1..{MAX_LAUNCH_STEPS}")
        if steps is None:
            return
        if algo is None:
            raise EngineConfigError(f"speculative_num_steps={steps!r}: given without speculative_algorithm")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_SPEC_STEPS:
            raise EngineConfigError(f"speculative_num_steps={steps!r}: must be an integer in 1..{MAX_SPEC_STEPS}")

    @property
    def spec_steps(self) -> int:
        """Draft tokens a speculative step proposes per request: 0 with speculation off."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_steps or MAX_SPEC_STEPS

    @property
    def launch_steps(self) -> int:
        """Speculative steps a launch may chain: speculative_launch_steps with speculation on CUDA graphs, else 1."""
        return self.speculative_launch_steps if self.spec_steps and self.graph_batch_sizes else 1

    @property
    def has_placement(self) -> bool:
        """A placement was asked for: the MoE runs over physical slots through an ExpertMap."""
        return self.ep_num_redundant_experts > 0 or self.init_expert_location is not None

    def check_expert_slots(self, num_experts: int, ep_size: int) -> None:
        """P = E + ep_num_redundant_experts must split evenly over the expert-parallel ranks."""
        p = num_experts + self.ep_num_redundant_experts
        if p % ep_size:
            raise EngineConfigError(
                f"ep_num_redundant_experts={self.ep_num_redundant_experts}: P = {num_experts} + "
                f"{self.ep_num_redundant_experts} = {p} physical slots is not a multiple of ep_size={ep_size}"
            )

    def check_graph_layout(self, tp_size: int, dp_size: int, ep_size: int) -> None:
        """Refuses batch_invariant=True over several ranks (the TP all-reduce and the EP dispatch sum in NCCL's order,
        which follows the message size: no batch-invariance is claimed there), and named CUDA-graph sizes where
        decode cannot run under graphs. DP attention and expert parallelism
        read host counts every forward (the DpLayout's all-gather, the dispatcher's row counts), which a captured
        graph cannot. Exact mode under TP > 1 reduces with an all_gather of R partials (layers/exact.py) that no GPU
        run has captured: refused rather than run unproven (the CPU suite's gloo ranks cannot run graphs)."""
        for name in ("batch_invariant", "row_invariant"):
            if getattr(self, name) and max(tp_size, dp_size, ep_size) > 1:
                raise EngineConfigError(
                    f"{name}=True with tp_size={tp_size}, dp_size={dp_size}, ep_size={ep_size}: one process only "
                    "(the collectives' reduction order follows the message size)"
                )
        if not self.cuda_graph_batch_sizes:
            return
        if dp_size > 1 or ep_size > 1:
            raise EngineConfigError(
                f"cuda_graph_batch_sizes={self.cuda_graph_batch_sizes}: not with dp_size={dp_size}, "
                f"ep_size={ep_size} (decode under DP attention or EP runs eager)"
            )
        if self.deterministic and tp_size > 1:
            raise EngineConfigError(
                f"cuda_graph_batch_sizes={self.cuda_graph_batch_sizes}: not with deterministic=True and "
                f"tp_size={tp_size} (exact mode's all-gather reduction has not run under CUDA graphs; pass () )"
            )

    @property
    def draft_config(self) -> EngineConfig:
        """The MTP draft's: the fast kernels in row-invariant mode (a draft's bits choose drafts, never a target row;
        the normal path would decompress every key of a request each draft step), else this config."""
        return replace(self, row_invariant=False) if self.row_invariant_on else self

    @property
    def dispatcher_mode(self) -> Literal["normal", "low_latency"]:
        """deepep_mode resolved: exact mode needs the low-latency layout's k-order combine (deterministic=True with
        deepep_mode="normal" is refused)."""
        if self.deepep_mode == "auto":
            return "low_latency" if self.deterministic else "normal"
        return self.deepep_mode

    @property
    def all_triton(self) -> bool:
        return self.attention_backend == self.moe_backend == self.topk_backend == "triton"

    @property
    def fuse_shared_experts(self) -> bool:
        # Exact mode's "auto" is separate: the one form every layout can run (expert parallelism refuses fused) and
        # the tensor-parallel split of the shared MLP reduces exactly (exact_all_reduce).
        auto_fused = self.moe_backend == "triton" and not self.deterministic
        return self.shared_experts == "fused" or (self.shared_experts == "auto" and auto_fused)

    @property
    def max_graph_batch(self) -> int:
        """The most requests a graph serves: max_running_requests; under speculation the verifies of 1 + d tokens
        that one step's token budget holds (a step of more gives some requests fewer drafts, and runs eager)."""
        if not self.spec_steps:
            return self.max_running_requests
        return min(self.max_running_requests, self.chunked_prefill_size // (1 + self.spec_steps))

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes to capture (empty: eager): decode graphs, or under speculation the draft and verify
        graphs of each size (engine/spec/graphs.py). The default ladder needs CUDA and the triton backends."""
        if self.cuda_graph_batch_sizes is not None:
            return tuple(self.cuda_graph_batch_sizes)
        if self.device.startswith("cuda") and self.all_triton and self.max_graph_batch > 0:
            return default_batch_sizes(self.max_graph_batch)
        return ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
