"""Engine: the public offline API, shaped like SGLang's `sgl.Engine`.

One process (tp_size 1): one scheduler thread (engine/event_loop.py) owns the model, the KV pool and every Req
(engine/engine_core.py builds them). Callers (any number of threads) hand requests over through a thread-safe
inbox and wait on a per-request queue: results, or stream chunks, come back there.

Several processes (tp_size > 1): this process is the front end. It spawns tp_size ranks, each building its
shard of the model and its own core (engine/launch/), and talks to them through a WorkerGroup with the same
methods as the event loop. Results are built on the ranks by the same code and sent back pickled, so they are
the same dicts; traces are written here by one TraceWriter. Either way this module validates requests and
their capture options, and starts and stops traces.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from r3trace.capture.recorder import RouteRecorder
from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.engine_core import EngineCore
from r3trace.engine.event_loop import Sink
from r3trace.engine.expert_placement import initial_location
from r3trace.engine.launch.config import LaunchConfig, Launcher, LoadBalanceMethod
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.placement_control import PlacementControl
from r3trace.engine.request import InvalidRequestError, Req
from r3trace.engine.request_builder import RequestBuilder, RouteArgs, as_list, pick_flag
from r3trace.engine.request_hooks import RequestHooks
from r3trace.engine.result import error_result
from r3trace.engine.sampling import Sampler
from r3trace.engine.tokenizer import load_tokenizer
from r3trace.engine.trace_control import LocalTrace, TraceControl, TraceTarget
from r3trace.trace import lifecycle

_OPTIONS = frozenset(f.name for f in fields(EngineConfig)) - {"dtype", "device"}


def config_hash(mc: ModelConfig) -> str:
    """Stable hash of the model config, so traces of different models are never mixed up."""
    return hashlib.sha256(json.dumps(mc.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


class Engine:
    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        *,
        recorder: RouteRecorder | None = None,
        hooks: RequestHooks | None = None,
        tp_size: int = 1,
        dp_size: int = 1,
        ep_size: int = 1,
        load_balance_method: LoadBalanceMethod = "round_robin",
        launcher: Launcher = "spawn",
        **options: Any,
    ) -> None:
        """tp_size processes (SGLang's process count); dp_size > 1 is DP attention, ep_size > 1 expert
        parallelism (both divide tp_size). load_balance_method: how requests are spread over DP ranks,
        "round_robin" or "shortest_queue" (a request's routed_dp_rank pins it). recorder / hooks replace the
        capturer and the route hooks; they live in this process, so only with tp_size 1. launcher: "spawn"
        starts the ranks here; "torchrun" (world rank 0 of a torchrun job, engine/launch/__main__.py) joins the
        ranks torchrun started."""
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise EngineConfigError(f"unknown engine option {unknown[0]!r}; known: {sorted(_OPTIONS)}")
        self.config = cfg = EngineConfig(dtype=dtype, device=device, **options)  # type: ignore[arg-type]
        self.launch = LaunchConfig(tp_size, dp_size, ep_size, load_balance_method, launcher=launcher)
        cfg.check_graph_layout(tp_size, dp_size, ep_size)  # before any rank starts: one line, not a rank's failure
        if cfg.spec_steps and self.launch.multi_process:  # the draft and its state are one process's (engine/spec/)
            raise EngineConfigError(f"speculative_algorithm={cfg.speculative_algorithm!r}: one process only (got "
                                    f"tp_size={tp_size}, dp_size={dp_size}, ep_size={ep_size})")
        self.model_config = mc = ModelConfig.from_hf(model_path)
        self.model_path = Path(model_path)
        initial_location(cfg, mc, ep_size)  # a bad placement option fails here, in one line, before any rank starts
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        self._closed = False
        target: TraceTarget | None
        if self.launch.multi_process:
            from r3trace.engine.launch.group import WorkerGroup

            if recorder is not None or hooks is not None:
                raise EngineConfigError(f"recorder / hooks: objects of this process, unusable with tp_size={tp_size}"
                                        " (ranks run in their own processes); pass them with tp_size=1")
            self.tokenizer = load_tokenizer(model_path, mc.vocab_size)
            self.sampler = Sampler("cpu", cfg.seed)  # validates seeds; ranks rebuild each request's generator
            start = WorkerGroup.spawn if launcher == "spawn" else WorkerGroup.beside_rank0
            group = start(self.model_path, cfg, self.launch)
            self._loop: Any = group  # the event loop's caller-side methods, served by the ranks
            target = group
        else:
            core = EngineCore(model_path, cfg, ParallelInfo(), recorder=recorder, hooks=hooks)
            self.core = core
            self.capturer, self.model, self.kv_pool, self.cache = core.capturer, core.model, core.kv_pool, core.cache
            self.route_hooks, self.sampler, self.scheduler = core.route_hooks, core.sampler, core.scheduler
            self.runner, self.tokenizer = core.runner, core.tokenizer
            self._loop = core.loop
            target = None
            if core.capturer is not None and core.route_hooks is not None:
                target = LocalTrace(core.loop, core.capturer, core.route_hooks)
        self._placement = PlacementControl(self._loop, getattr(self, "core", None), mc, ep_size, tp_size)
        self._builder = RequestBuilder(
            mc, self.max_context_len, cfg.kv_pool_tokens, self.tokenizer, capture_weights=cfg.capture_weights,
            dp_size=self.launch.dp_size, custom_recorder=recorder is not None, custom_hooks=hooks is not None,
        )
        self.traces: TraceControl | None = None
        if target is not None:
            self.traces = TraceControl(target, dict(
                model_name=mc.name or self.model_path.name, num_hidden_layers=mc.num_hidden_layers,
                moe_layer_ids=mc.moe_layer_ids, num_experts=mc.n_routed_experts, top_k=mc.num_experts_per_tok,
                with_weights=cfg.capture_weights, with_physical_ids=cfg.capture_physical_ids, num_groups=mc.n_group,
                config_hash=config_hash(mc),
                engine={k: getattr(cfg, k) for k in sorted(_OPTIONS) if k != "trace_dir"} | {"dtype": cfg.dtype},
                parallel=self.launch.manifest(),
            ), placements=self._placement)
        lifecycle.register_producer(self)  # interpreter exit: shutdown() before any writer closes
        if cfg.trace_dir is not None:
            self.start_trace(cfg.trace_dir)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_routed_weights: bool | list[bool] = False,
        routed_experts: Any = None,
        tag: str | list[str] | None = None,
        routed_experts_replay_start_len: int | list[int | None] | None = None,
        routed_dp_rank: int | list[int | None] | None = None,
        return_prompt_token_ids: bool | list[bool] = False,
        token_ids_logprob: list[int] | list[list[int] | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One request (a str prompt or a flat id list) -> a dict; a list -> a list of dicts in order;
        stream=True (one request) -> an iterator of chunks holding what each step added.

        return_routed_experts: meta_info["routed_experts"] is base64 int32 [rows - start, L, K] (row p:
        the routing of input position p; -1 on dense layers). tag: a label per request recorded in traces
        (e.g. the domain).

        Routing replay (docs/replay.md; Megatron-LM's RouterReplay semantics): routed_experts (base64, an array
        [rows, L, K], or {"trace": dir, "request_id": rid}; a list gives one per request, None routes freely)
        forces, on each forced row and MoE layer, those expert ids with weights = the gate's own scores at
        them, normalised (norm_topk_prob) and scaled (routed_scaling_factor) as the model's routing does.
        Without routed_experts_replay_start_len the routes must cover every row the request computes,
        prompt + max_new_tokens - 1 (the prompt when max_new_tokens = 0); routed_experts_replay_start_len=s
        forces only rows [s, s + n) of the n given (partial replay, e.g. a new turn after replayed ones) and
        the gate routes the rest. Returned routes are the forced ids on forced rows. A replay reuses the
        prefix cache only where the cached KV was computed with the same routes.

        routed_dp_rank (SGLang's field; one, or one per request): run the request on that DP rank, 0..dp_size-1,
        instead of the one the load balancer picks.

        return_prompt_token_ids (SGLang's GenerateReqInput field; one, or one per request): the result's top-level
        `prompt_token_ids` is the prompt's token ids (a stream: on its first chunk).

        token_ids_logprob (SGLang's field; one id list, or one per request), with return_logprob: meta_info's
        input_token_ids_logprobs / output_token_ids_logprobs hold, at each position whose logprob is returned, the
        entries (logprob, id, None) of those ids in the order given. Not served with speculative decoding."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        single, entries = as_list(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                  top_logprobs_num, rid)
        if stream and not single:
            raise InvalidRequestError("stream", "streams one request at a time; pass a single prompt")
        routes = RouteArgs(return_routed_experts, routed_experts_start_len, return_routed_weights, routed_experts, tag,
                           routed_experts_replay_start_len, routed_dp_rank)
        reqs: list[Req | None] = []
        results: list[dict[str, Any] | None] = []
        for entry in entries:
            entry_rid = entry.rid or uuid.uuid4().hex
            try:
                req = self._builder.build(entry, entry_rid, stream, self.sampler)
                self._builder.attach_listed_ids(req, token_ids_logprob, len(reqs), len(entries))
                self._builder.attach_routes(req, len(reqs), len(entries), routes)
                req.return_prompt_ids = pick_flag("return_prompt_token_ids", return_prompt_token_ids, len(reqs),
                                                  len(entries))
                self._loop.claim_rid(entry_rid)
            except InvalidRequestError as exc:
                if single:
                    raise
                reqs.append(None)
                results.append(error_result(entry_rid, str(exc)))
                continue
            reqs.append(req)
            results.append(None)
        sinks: dict[str, Sink[dict[str, Any]]] = {r.rid: Sink() for r in reqs if r is not None}
        live = [r for r in reqs if r is not None]
        if live:
            self._loop.submit([(r, sinks[r.rid]) for r in live])
        if stream:
            assert live
            return self._loop.stream(live[0].rid, sinks[live[0].rid])
        for i, req in enumerate(reqs):
            if req is not None:
                results[i] = self._loop.wait(sinks[req.rid])
        out = [r for r in results if r is not None]
        return out[0] if single else out  # a request that failed while running carries "error"

    # ------------------------------------------------------------------ traces
    def start_trace(
        self, trace_dir: str | Path, run_id: str | None = None, stream_to: Any = None, **writer_options: Any
    ) -> str:
        """Record every request into trace_dir (a run of Parquet files + manifest.json); returns the run id.

        Finished requests are committed every `flush_interval_s` (default 1 s): a kill -9 loses at most those
        that finished in the last second, and every normal stop (stop_trace, shutdown, interpreter exit,
        SIGTERM, SIGINT) commits everything (docs/durability.md). stream_to: also write every batch of rows,
        as it is captured, to an Arrow IPC stream (a path or a binary file object such as a pipe).
        writer_options: rows_per_file, flush_interval_s, fsync, rollup_window_s, small_file_rows,
        compact_fanin (TraceWriter's)."""
        if self.traces is None:
            raise RuntimeError("this engine was built with a custom recorder: no trace sink")
        return self.traces.start(trace_dir, run_id, stream_to, writer_options)

    def stop_trace(self) -> dict[str, Any] | None:
        """Commit and close the active trace; returns its manifest (None if no trace was recording). Requests
        still running are written with finish_reason "unfinished"."""
        return None if self.traces is None else self.traces.stop()

    def trace_status(self) -> dict[str, Any]:
        """{"tracing": False}, or the recording run's rows buffered / durable, last flush age, files, errors."""
        return {"tracing": False} if self.traces is None else self.traces.status()

    @property
    def recompute_mismatches(self) -> int:
        """Rows whose re-prefill after a retraction routed differently from the kept rows."""
        if self.launch.multi_process:  # each DP group counts its own requests' rows
            return sum(self._loop.call("recompute_mismatches"))
        return 0 if self.capturer is None else self.capturer.recompute_mismatches

    def abort(self, rid: str) -> None:
        """Finish a waiting or running request with finish_reason abort; unknown ids are ignored."""
        self._loop.abort(rid)

    def flush_cache(self) -> bool:
        """Drop every unlocked prefix-cache entry; False (nothing done) while requests are in flight."""
        return bool(self._loop.flush_cache())

    def update_expert_placement(self, source: Any, chunk_layers: int = 1) -> dict[str, Any]:
        """Rebalance while serving (SGLang's update_expert_location): source is an ExpertLocation or a path to
        `r3trace eplb --out`'s JSON or SGLang's expert-location JSON / .pt, for this engine's P slots and ep_size.
        chunk_layers MoE layers at a time, with steps between chunks: each rank copies its moved slots' new weights
        from the checkpoint, then switches those layers' maps, every rank at the same step. Requests in flight keep
        running; their routes are logical and do not change. Returns {"chunks": n, "slots_copied": [per rank]}.
        Raises ExpertLocationError naming the field on a bad source (engine/placement_control.py)."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        return self._placement.update(source, chunk_layers)

    def expert_placement(self) -> dict[str, Any]:
        """The placement every rank runs from the next forward on: {"forward_id", "layer_ids" (the MoE layers),
        "phy2log" [L][P]} (what a trace's placements table records; placement_control.running_map)."""
        forward_id, layer_ids, phy2log = self._placement.running()
        return {"forward_id": forward_id, "layer_ids": list(layer_ids), "phy2log": phy2log.tolist()}

    def expert_slots(self) -> list[dict[str, Any]]:
        """Per rank, in rank order: the logical expert each of its slots holds and a checksum of the weights there
        (EngineCore.expert_slots)."""
        return self._placement.slots()

    def shutdown(self) -> None:
        """Abort what is in flight, stop the scheduler thread, commit and close the trace. Idempotent; also
        run at interpreter exit and on SIGTERM while a trace records (r3trace/trace/lifecycle.py)."""
        if self._closed:
            return
        self._closed = True
        self._loop.shutdown()
        if self.traces is not None:
            self.traces.close_after_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def run_on_scheduler(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the scheduler thread, which owns the model and every request (benchmarks and tools
        use it to time or profile that thread), and return its result. One process only."""
        if self.launch.multi_process:
            raise NotImplementedError("run_on_scheduler: the schedulers run in the rank processes (tp_size > 1)")
        return self._loop.call(fn)
