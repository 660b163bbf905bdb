"""EngineCore: everything one rank owns, built from frozen configs: the capturer, the model (its shard under
a ParallelInfo), the KV pool, the prefix cache, the scheduler, the model runner and the event loop.

One process builds one core and drives it from the event loop's own thread (engine.py). Under several
processes each rank builds one core without a thread, and its lockstep driver (engine/launch/lockstep.py)
steps it together with the other ranks. The front end (engine.py) never needs a core of its own then.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from r3trace.capture.capturer import CaptureConfig, RoutedExpertsCapturer
from r3trace.capture.physical import PhysicalRecorder
from r3trace.capture.recorder import RouteRecorder
from r3trace.engine.cuda_graph import DecodeGraphs
from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.event_loop import EventLoop
from r3trace.engine.expert_placement import ChunkDone, moe_layers, update_chunks
from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.layers.expert_location import ExpertLocation, ExpertLocationError, held_experts
from r3trace.engine.model import build_model
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.model_runner import ModelRunner
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.radix_cache import RadixCache
from r3trace.engine.request_hooks import RequestHooks
from r3trace.engine.route_capture import RouteCaptureHooks
from r3trace.engine.sampling import Sampler
from r3trace.engine.scheduler import Scheduler
from r3trace.engine.tokenizer import load_tokenizer
from r3trace.engine.weights import load_weights, read_moe_experts


def capture_config(mc: ModelConfig, cfg: EngineConfig, parallel: ParallelInfo) -> CaptureConfig:
    """The capturer's sizes, all from the configs (nothing read from elsewhere): under DP attention its device
    buffer holds the gathered batch; under EP a rank's rows are padded to a multiple of attention TP."""
    # The rows one rank's buffer holds: a chunk, or every running request's verify of 1 + d tokens (S of them in a
    # chained launch)
    launch = cfg.launch_steps
    per_rank = max(cfg.chunked_prefill_size, cfg.max_running_requests * (1 + cfg.spec_steps) * launch)
    return CaptureConfig(
        num_hidden_layers=mc.num_hidden_layers, moe_layer_ids=mc.moe_layer_ids, top_k=mc.num_experts_per_tok,
        num_experts=mc.n_routed_experts, kv_slots=cfg.kv_pool_tokens,
        max_batch_tokens=parallel.dp_size * -(-per_rank // parallel.attn_tp_size) * parallel.attn_tp_size,
        chunked_prefill_size=cfg.chunked_prefill_size, max_running_requests=cfg.max_running_requests,
        device=cfg.device, with_weights=cfg.capture_weights, dp_size=parallel.dp_size,
        attn_tp_size=parallel.attn_tp_size, spec_verify_tokens=cfg.spec_steps, verify_launch_steps=launch,
        physical_slots=mc.n_routed_experts + cfg.ep_num_redundant_experts if cfg.capture_physical_ids else 0,
    )


class EngineCore:
    def __init__(
        self,
        model_path: str | Path,
        cfg: EngineConfig,
        parallel: ParallelInfo,
        *,
        recorder: RouteRecorder | None = None,
        hooks: RequestHooks | None = None,
        threaded: bool = True,
    ) -> None:
        """threaded=False: a rank of a multi-process engine; its event loop runs no thread and never overlaps
        (lockstep ranks step one forward at a time, see engine/launch/lockstep.py)."""
        self.config = cfg
        self.parallel = parallel
        self.model_path = Path(model_path)
        self._rebalance: Iterator[ChunkDone] | None = None  # a placement update between its chunks
        self.model_config = mc = ModelConfig.from_hf(model_path)
        device = cfg.device
        # The capturer is always there (a slice write per MoE layer); rows cross to the host only for
        # requests that ask, or while a trace records. A caller-supplied recorder replaces it.
        self.capturer: RoutedExpertsCapturer | None = None
        if recorder is None:
            self.capturer = recorder = RoutedExpertsCapturer(capture_config(mc, cfg, parallel))
        self.model = build_model(mc, cfg, parallel, recorder)
        if self.capturer is not None and self.capturer.physical is not None:
            gather = self.model.model.routes.gather_routes  # under EP with attention TP > 1: the scattered slices
            for moe in moe_layers(self.model):
                moe.physical_recorder = PhysicalRecorder(self.capturer, gather)
        load_weights(self.model, model_path)
        self.model.eval()
        self.tokenizer = load_tokenizer(model_path, mc.vocab_size)
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        self.kv_pool = KVPool(mc.num_hidden_layers, mc.kv_cache_dim, cfg.kv_pool_tokens, cfg.page_size,
                              cfg.torch_dtype, device)
        self.route_hooks = None if self.capturer is None else RouteCaptureHooks(self.capturer, self.kv_pool)
        if hooks is None:
            hooks = self.route_hooks
        req_pool = ReqToTokenPool(cfg.max_running_requests, self.max_context_len, device)
        self.cache = RadixCache(self.kv_pool) if cfg.enable_prefix_cache else None
        self.sampler = Sampler(device, cfg.seed)
        self.scheduler = Scheduler(cfg, self.kv_pool, req_pool, self.cache, self.tokenizer,
                                   mc.eos_token_ids, self.max_context_len, hooks)
        graphs = None
        # DP attention and expert parallelism read host counts every forward (the DpLayout's all-gather, the normal
        # dispatcher's row counts), which a captured graph cannot: their decode runs eager. Plain TP is captured.
        cfg.check_graph_layout(parallel.tp_size, parallel.dp_size, parallel.ep_size)  # named sizes there: refused
        graph_safe = parallel.dp_size == 1 and parallel.ep_size == 1
        if cfg.graph_batch_sizes and graph_safe and not cfg.spec_steps:  # speculation captures its own graphs
            graphs = DecodeGraphs(self.model, self.kv_pool.kv_buffer, req_pool.req_to_token, cfg.graph_batch_sizes,
                                  self.max_context_len, self.kv_pool.pad_slot)
        self.runner = ModelRunner(self.model, self.kv_pool, req_pool, self.sampler, device, mc, graphs, parallel)
        if cfg.spec_steps:
            self.runner = self._spec_runner(req_pool, parallel)
        # A speculative step needs the one before it on the host (its accepted lengths): never overlapped.
        self.loop = EventLoop(self.scheduler, self.runner, self.cache, self.route_hooks, mc, self.tokenizer,
                              overlap=cfg.overlap_schedule and threaded and not cfg.spec_steps, threaded=threaded)

    def _spec_runner(self, req_pool: ReqToTokenPool, parallel: ParallelInfo) -> ModelRunner:
        """Speculative decoding's runner, its NextN draft built from the checkpoint's MTP layer (engine/spec/)."""
        from r3trace.engine.spec.drafter import Drafter
        from r3trace.engine.spec.nextn import build_draft
        from r3trace.engine.spec.runner import SpecRunner

        cfg = self.config
        if parallel.tp_size > 1:
            raise EngineConfigError(
                f"speculative_algorithm={cfg.speculative_algorithm!r}: one process only (got tp_size="
                f"{parallel.tp_size}, dp_size={parallel.dp_size}, ep_size={parallel.ep_size})"
            )
        drafter = Drafter(build_draft(self.model, cfg), self.model, self.sampler, self.kv_pool.kv_buffer.shape[1],
                          req_pool.req_to_token.shape[0], cfg.spec_steps, cfg.device)
        graphs = None
        if cfg.graph_batch_sizes:  # after build_draft: the draft's capture opt-out is checked before any capture
            from r3trace.engine.spec.graphs import SpecGraphs

            graphs = SpecGraphs(self.model, drafter, self.kv_pool.kv_buffer, req_pool.req_to_token,
                                cfg.graph_batch_sizes, self.max_context_len, self.kv_pool.pad_slot,
                                launch_steps=cfg.speculative_launch_steps)
        return SpecRunner(self.model, drafter, self.kv_pool, req_pool, self.sampler, cfg.device, self.model_config,
                          parallel, graphs)

    # ------------------------------------------------------------------ expert placement (scheduler thread only)
    def begin_expert_placement(self, location: ExpertLocation, chunk_layers: int) -> None:
        """Start a rebalance; expert_placement_step then runs one chunk of layers at a time, with forwards between.
        Every EP rank begins and steps at the same iteration (engine/launch/lockstep.py), so a layer's map switches
        on all of them between the same two forwards."""
        if self._rebalance is not None:
            raise ExpertLocationError("an expert placement update is already running; wait for it to finish")
        if not isinstance(chunk_layers, int) or chunk_layers < 1:
            raise ExpertLocationError(f"chunk_layers={chunk_layers!r}; expected an integer >= 1")
        built = {m.expert_map.num_physical if m.expert_map else None for m in moe_layers(self.model)}
        if built != {location.num_physical}:
            raise ExpertLocationError(
                f"source: P={location.num_physical} slots; the engine was built with "
                f"{'no placement (set ep_num_redundant_experts or init_expert_location)' if None in built else built}"
            )
        rank = self.parallel.ep_rank

        def weights(layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:  # only the experts this rank will hold
            held = held_experts(location, layer_id, rank)
            return read_moe_experts(self.model, self.model_path, layer_id, held)

        self._rebalance = update_chunks(self.model, location, weights, chunk_layers)

    def expert_placement_step(self) -> ChunkDone | None:
        """One chunk: its layers' moved slots copied, then their maps switched. None once every layer has. The
        chunk's from_forward_id is the next forward's id, the first to run under the new maps (run between steps)."""
        if self._rebalance is None:
            return None
        try:
            done = next(self._rebalance, None)
        except BaseException:
            self._rebalance = None  # a refused chunk changed nothing (every check precedes the first copy)
            raise
        if done is None:
            self._rebalance = None
            return None
        return done._replace(from_forward_id=self.runner.forward_id)

    def expert_map(self) -> dict[str, Any]:
        """The placement this rank runs, between steps: per MoE layer the logical expert of each local slot, and
        forward_id, the next forward's (every rank's alike), from which it holds until a rebalance switches a layer."""
        held = [list(moe.dispatcher.experts) if moe.expert_map is None
                else held_experts(moe.expert_map.location, moe.expert_map.layer_id, moe.expert_map.ep_rank)
                for moe in moe_layers(self.model)]
        return {"ep_rank": self.parallel.ep_rank, "forward_id": self.runner.forward_id,
                "layer_ids": [moe.gate.layer_id for moe in moe_layers(self.model)], "held": held}

    def expert_slots(self) -> dict[str, Any]:
        """expert_map's placement and the float64 sum of each slot's w13 and w2 (which weights are really there)."""
        out = self.expert_map()
        out["w13_sum"], out["w2_sum"] = [], []
        for moe, held in zip(moe_layers(self.model), out["held"], strict=True):
            out["w13_sum"].append(moe.w13.data[: len(held)].double().sum((1, 2)).tolist())
            out["w2_sum"].append(moe.w2.data[: len(held)].double().sum((1, 2)).tolist())
        return out
