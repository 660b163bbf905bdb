"""r3trace serve MODEL: the SGLang/OpenAI-compatible HTTP server with routed-expert capture."""

from __future__ import annotations

import argparse
import ipaddress

HELP = "serve a DeepSeek-style checkpoint over HTTP (SGLang /generate, OpenAI endpoints, capture flag)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from r3trace.server.config import DEFAULT_MAX_BODY_BYTES

    p.add_argument("model", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-name", default=None, help="name reported by /v1/models (default: folder name)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--kv-pool-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=1,
                   help="KV slots a page (a multiple of 64 lets Hopper's Gluon decode load tiles by TMA)")
    p.add_argument("--backend", default="ref", choices=["ref", "triton"],
                   help="the math backends (attention, MoE, top-k, norm, RoPE); triton for a GPU")
    p.add_argument("--cuda-graphs", default="auto",
                   help="decode batch sizes captured as CUDA graphs: auto (a ladder up to "
                        "--max-running-requests with --backend triton on CUDA), off, or a list such as 1,2,4,8")
    p.add_argument("--no-overlap", action="store_true", help="serialize the host loop with the GPU (debugging)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--trace-root", default="traces", help="POST /start_trace writes only below this folder")
    p.add_argument("--trace-dir", default=None, help="record every request from the start (under --trace-root)")
    p.add_argument("--trace-flush-interval-s", type=float, default=None,
                   help="with --trace-dir: commit finished requests at least this often (default 1 s)")
    p.add_argument("--log-level", default="info")


BACKEND_FIELDS = ("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend")


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig fields from the command line (EngineConfig validates them and names the field it rejects)."""
    graphs: tuple[int, ...] | None
    if args.cuda_graphs == "auto":
        graphs = None
    elif args.cuda_graphs == "off":
        graphs = ()
    else:
        try:
            graphs = tuple(int(x) for x in args.cuda_graphs.split(","))
        except ValueError:
            raise SystemExit(f"--cuda-graphs {args.cuda_graphs!r}: expected auto, off or a list like 1,2,4,8") from None
    return {
        "dtype": args.dtype, "device": args.device, "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size, "kv_pool_tokens": args.kv_pool_tokens,
        "page_size": args.page_size, "cuda_graph_batch_sizes": graphs, "overlap_schedule": not args.no_overlap,
        "enable_prefix_cache": not args.no_prefix_cache, **dict.fromkeys(BACKEND_FIELDS, args.backend),
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    import uvicorn

    from r3trace.engine import Engine
    from r3trace.server import ServerConfig, create_app
    from r3trace.server.chat import load_chat_template

    host_ip = ipaddress.ip_address(args.host) if args.host != "localhost" else ipaddress.ip_address("127.0.0.1")
    if not host_ip.is_loopback:
        logging.getLogger("r3trace.server").warning(
            "binding %s: the API has no authentication; anyone who reaches this address can generate", args.host)
    model = Path(args.model)
    from r3trace.engine.engine_config import EngineConfigError

    try:
        engine = Engine(model, **engine_options(args))  # type: ignore[arg-type]
    except EngineConfigError as exc:  # a bad flag: say which, no traceback
        raise SystemExit(f"r3trace serve: {exc}") from None
    cfg = ServerConfig(model_name=args.model_name or model.resolve().name, host=args.host, port=args.port,
                       max_body_bytes=args.max_body_bytes, trace_root=Path(args.trace_root),
                       chat_template=load_chat_template(model))
    try:
        if args.trace_dir:
            cfg.trace_root.mkdir(parents=True, exist_ok=True)
            opts = {} if args.trace_flush_interval_s is None else {"flush_interval_s": args.trace_flush_interval_s}
            engine.start_trace(cfg.trace_root / args.trace_dir, **opts)
        # uvicorn turns SIGINT / SIGTERM into a graceful shutdown; then the engine aborts what is still running
        # and commits and closes the trace (also one started over HTTP).
        uvicorn.run(create_app(engine, cfg), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0
