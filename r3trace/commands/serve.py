"""r3trace serve MODEL: the SGLang/OpenAI-compatible HTTP server with routed-expert capture.

Start-up order: the model folder is checked and the port bound before the engine loads, so a typo or a
taken port fails in a second, not after minutes of loading weights.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import socket
import tempfile
from pathlib import Path

from r3trace.commands.args import port_number

HELP = "serve a DeepSeek-style checkpoint over HTTP (SGLang /generate, OpenAI endpoints, capture flag)"


def cuda_graph_sizes(text: str) -> tuple[int, ...] | None:
    """argparse type of --cuda-graphs: auto -> None (EngineConfig decides), off -> (), "1,2,4" -> (1, 2, 4)."""
    if text == "auto":
        return None
    if text == "off":
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, off or a list like 1,2,4,8") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    p.add_argument("--port", type=port_number, default=30000)
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name", default=None,
                   help="the name /v1/models lists and requests' `model` must carry (SGLang's flag; --model-name "
                        "is an alias). Default: the folder name. The folder's path is accepted too")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--kv-pool-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=None,
                   help="KV slots a page (a multiple of 64 lets Hopper's Gluon decode load tiles by TMA). Default: "
                        "64 with the triton backend on CUDA, else 1 (prefix-cache hits at any token)")
    p.add_argument("--backend", default="auto", choices=["auto", "ref", "triton"],
                   help="the math backends (attention, MoE, top-k, norm, RoPE). auto: triton on CUDA (ref in exact "
                        "mode), ref elsewhere")
    p.add_argument("--cuda-graphs", type=cuda_graph_sizes, default="auto",
                   help="batch sizes captured as CUDA graphs (decode; with --speculative-algorithm the draft and "
                        "verify forwards): auto (a ladder up to --max-running-requests, or the verifies one "
                        "--chunked-prefill-size holds, with --backend triton on CUDA), off, or a list such as 1,2,4,8")
    p.add_argument("--no-overlap", action="store_true", help="serialize the host loop with the GPU (debugging)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="exact mode (SGLang's flag): batch- and layout-invariant results, bitwise equal to one "
                        "process under any --tp / --dp / --ep; needs --backend ref")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the triton path's batch-invariant mode (bf16, CUDA graphs): a request's routes, logits and "
                        "tokens do not depend on its batch, chunking or speculation, and a prompt row equals the same "
                        "token's decode row; one process")
    p.add_argument("--no-row-invariant", action="store_true",
                   help="turn off the CUDA default row-invariant mode (decode and prompt rows each batch-invariant: "
                        "speculation returns plain decoding's routes) for the batch-dependent fastest kernels")
    p.add_argument("--max-body-bytes", type=int, default=None, help="request body limit (default 8 MiB)")
    p.add_argument("--enable-cache-report", action="store_true",
                   help="SGLang's flag: OpenAI usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)")
    p.add_argument("--trace-root", default="traces", help="POST /start_trace writes only below this folder")
    p.add_argument("--trace-dir", default=None, help="record every request from the start (under --trace-root)")
    p.add_argument("--trace-flush-interval-s", type=float, default=None,
                   help="with --trace-dir: commit finished requests at least this often (default 1 s)")
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1,
                   help="tensor-parallel size: the number of rank processes (SGLang's --tp-size)")
    p.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=1,
                   help="DP attention groups (SGLang's --dp-size with --enable-dp-attention); divides --tp")
    p.add_argument("--ep-size", "--ep", dest="ep_size", type=int, default=1,
                   help="expert-parallel size of the MoE; divides --tp")
    p.add_argument("--load-balance-method", default="round_robin", choices=["round_robin", "shortest_queue"],
                   help="how requests without routed_dp_rank are spread over the DP ranks (SGLang's names)")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="redundant expert slots: P = n_routed_experts + this, split over --ep (SGLang's name)")
    p.add_argument("--init-expert-location", default=None,
                   help="trivial, or an expert placement: `r3trace eplb --out` JSON or SGLang's JSON / .pt")
    p.add_argument("--eplb-algorithm", default="auto", choices=["auto", "deepseek", "deepseek_hierarchical"],
                   help="DeepSeek's policy an --init-expert-location of logical_count (a stat dump) is planned with, "
                        "as SGLang's init_by_eplb (auto: hierarchical where the groups divide over the nodes)")
    p.add_argument("--ep-dispatch-algorithm", default="static", choices=["static", "dynamic"],
                   help="which replica of an expert a token's pair goes to (SGLang's name)")
    p.add_argument("--expert-dispatch-seed", type=int, default=0, help="dynamic dispatch's seed")
    p.add_argument("--capture-physical-ids", action="store_true",
                   help="also return the physical slot of each route (meta_info routed_experts_physical)")
    p.add_argument("--speculative-algorithm", default=None, choices=["NEXTN", "EAGLE"],
                   help="speculative decoding with the checkpoint's MTP layer (EAGLE: SGLang's alias of NEXTN)")
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft tokens a step, 1..3 (default 3); one verify forward checks them")
    p.add_argument("--speculative-launch-steps", type=int, default=None,
                   help="greedy speculative steps chained on the GPU per launch, 1..8 (default 4)")
    p.add_argument("--placement-root", default=".", help="POST /update_expert_placement reads only below this folder")
    p.add_argument("--expert-distribution-recorder-mode", default="stat", choices=["stat", "per_pass"],
                   help="what /dump_expert_distribution_record writes (SGLang's files; per_pass needs "
                        "--capture-physical-ids with a placement)")
    p.add_argument("--expert-distribution-recorder-dir", default=None,
                   help="where dumps go (default: $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp, as SGLang)")
    p.add_argument("--log-level", default="info")


def fast_path(args: argparse.Namespace) -> tuple[str, int]:
    """(backend, page_size) for the command line: what a user of --device cuda gets without knowing the flags
    (the triton backends, which also turn on CUDA graphs, and 64-slot pages for Hopper's Gluon decode); the
    reference backends and 1-slot pages on the CPU and in exact mode. A flag given explicitly wins."""
    on_cuda = str(args.device).startswith("cuda")
    backend = args.backend
    if backend == "auto":
        backend = "triton" if on_cuda and not args.enable_deterministic_inference else "ref"
    page = args.page_size if args.page_size is not None else (64 if on_cuda and backend == "triton" else 1)
    return backend, page


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig fields from the command line (EngineConfig validates them and names the field it rejects)."""
    from r3trace.engine.kernel_modes import BACKENDS  # the engine's import, here: `--help` stays light

    backend, page_size = fast_path(args)
    return {
        "dtype": args.dtype, "device": args.device, "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size, "kv_pool_tokens": args.kv_pool_tokens,
        "page_size": page_size, "cuda_graph_batch_sizes": args.cuda_graphs,
        "overlap_schedule": not args.no_overlap, "enable_prefix_cache": not args.no_prefix_cache,
        "deterministic": args.enable_deterministic_inference, "batch_invariant": args.batch_invariant,
        **({"row_invariant": False} if args.no_row_invariant else {}),
        **dict.fromkeys(BACKENDS, backend),
        "ep_num_redundant_experts": args.ep_num_redundant_experts, "init_expert_location": args.init_expert_location,
        "ep_dispatch_algorithm": args.ep_dispatch_algorithm, "expert_dispatch_seed": args.expert_dispatch_seed,
        "capture_physical_ids": args.capture_physical_ids,
        "speculative_algorithm": args.speculative_algorithm, "speculative_num_steps": args.speculative_num_steps,
        **({} if args.speculative_launch_steps is None
           else {"speculative_launch_steps": args.speculative_launch_steps}),
    }  # fmt: skip


def init_location(args: argparse.Namespace, model: Path, log: logging.Logger, folder: Path) -> str | None:
    """--init-expert-location as the engine reads it: a map as given; counts (`logical_count`, SGLang's stat dump)
    planned first, as SGLang's init_by_eplb plans them (r3trace/eplb/sglang_init.py), into a map file in `folder`
    (the caller's, removed once every rank has read it)."""
    if args.init_expert_location is None:
        return None
    from r3trace.engine.model_config import ModelConfig
    from r3trace.eplb.placement import PlacementError
    from r3trace.eplb.sglang_init import logical_counts, plan_from_counts
    from r3trace.errors import UsageError

    flag = f"--init-expert-location {args.init_expert_location}"
    try:
        counts = logical_counts(args.init_expert_location)
        if counts is None:
            return str(args.init_expert_location)
        mc = ModelConfig.from_hf(model)
        full, algorithm = plan_from_counts(counts, mc.num_hidden_layers, tuple(mc.moe_layer_ids), mc.n_routed_experts,
                                           mc.n_group or 1, mc.n_routed_experts + args.ep_num_redundant_experts,
                                           args.ep_size, args.eplb_algorithm)
    except PlacementError as e:
        raise UsageError(f"{flag}: {e}") from e
    out = folder / "physical_to_logical_map.json"
    out.write_text(json.dumps({"physical_to_logical_map": full.tolist()}))
    log.info("%s holds logical_count: planned with %s as SGLang's init_by_eplb; the map is %s", flag, algorithm, out)
    return str(out)


def launch_options(args: argparse.Namespace) -> dict[str, object]:
    """Engine's process-layout keywords (LaunchConfig validates them and names the field it rejects)."""
    return {"tp_size": args.tp_size, "dp_size": args.dp_size, "ep_size": args.ep_size,
            "load_balance_method": args.load_balance_method, "launcher": getattr(args, "launcher", "spawn")}


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), handed to uvicorn, which listens on it once the app starts."""
    from r3trace.errors import UsageError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: rebinding over TIME_WAIT works
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fix = ("pick a free --port, or stop the process that holds it" if e.errno == errno.EADDRINUSE
               else "check --host")
        raise UsageError(f"--host {host} --port {port}: cannot listen ({e.strerror or e}); {fix}") from e
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def run(args: argparse.Namespace) -> int:
    import os

    from r3trace.commands.args import check_model_dir

    model = check_model_dir(args.model, "model")
    sock = listen_socket(args.host, args.port)

    import uvicorn

    from r3trace.engine import Engine
    from r3trace.server import ServerConfig, create_app
    from r3trace.server.chat import load_chat_template

    log = logging.getLogger("r3trace.server")
    if not is_loopback(args.host):
        log.warning("binding %s: the API has no authentication; anyone who reaches this address can generate",
                    args.host)
    # a map planned from counts lives until the engine is up (every rank has read it) or has failed
    with tempfile.TemporaryDirectory(prefix="r3trace-init-") as planned:
        location = init_location(args, model, log, Path(planned))
        engine = Engine(model, **{**engine_options(args), "init_expert_location": location},  # type: ignore[arg-type]
                        **launch_options(args))
    try:
        resolved = model.resolve()
        cfg = ServerConfig(model_name=args.served_model_name or resolved.name, host=args.host, port=args.port,
                           trace_root=Path(args.trace_root), placement_root=Path(args.placement_root),
                           chat_template=load_chat_template(model),
                           model_aliases=(args.model, str(model), str(resolved), resolved.name),
                           enable_cache_report=args.enable_cache_report,
                           expert_distribution_mode=args.expert_distribution_recorder_mode,
                           expert_distribution_dir=Path(args.expert_distribution_recorder_dir or os.environ.get(
                               "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", "/tmp")),
                           **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}))
        if args.trace_dir:
            cfg.trace_root.mkdir(parents=True, exist_ok=True)
            opts = {} if args.trace_flush_interval_s is None else {"flush_interval_s": args.trace_flush_interval_s}
            engine.start_trace(cfg.trace_root / args.trace_dir, **opts)
        # uvicorn turns SIGINT / SIGTERM into a graceful shutdown; then engine.shutdown() aborts what still runs
        # and commits and closes the trace (one started over HTTP too).
        server = uvicorn.Server(uvicorn.Config(create_app(engine, cfg), log_level=args.log_level))
        host, port = sock.getsockname()[:2]
        logging.getLogger("uvicorn.error").info("serving %s on http://%s:%d (Ctrl-C stops)", cfg.model_name,
                                                host, port)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0
