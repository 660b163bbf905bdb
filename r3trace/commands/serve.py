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
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--trace-root", default="traces", help="POST /start_trace writes only below this folder")
    p.add_argument("--trace-dir", default=None, help="record every request from the start (under --trace-root)")
    p.add_argument("--log-level", default="info")


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
    engine = Engine(model, dtype=args.dtype, device=args.device, max_running_requests=args.max_running_requests,
                    chunked_prefill_size=args.chunked_prefill_size, kv_pool_tokens=args.kv_pool_tokens)
    cfg = ServerConfig(model_name=args.model_name or model.resolve().name, host=args.host, port=args.port,
                       max_body_bytes=args.max_body_bytes, trace_root=Path(args.trace_root),
                       chat_template=load_chat_template(model))
    if args.trace_dir:
        cfg.trace_root.mkdir(parents=True, exist_ok=True)
        engine.start_trace(cfg.trace_root / args.trace_dir)
    try:
        uvicorn.run(create_app(engine, cfg), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if args.trace_dir:
            engine.stop_trace()
        engine.shutdown()
    return 0
