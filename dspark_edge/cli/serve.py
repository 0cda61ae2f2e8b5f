"""``serve``: an OpenAI-compatible HTTP server over one engine (``dspark_edge.server``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import ConfigError
from .options import engine_args, load_engine


def register(sub) -> None:
    """Add the ``serve`` command to the subparsers ``sub``."""
    s = sub.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API (/v1/chat/completions)",
                       description="An OpenAI-compatible server: /v1/chat/completions, /v1/completions (streaming "
                                   "or not), /v1/models, /health, /metrics. Requests are answered in arrival "
                                   "order, one at a time exactly as `generate` answers them, or --parallel N at "
                                   "once with their target passes batched.")
    engine_args(s, auto_precision=True)
    s.add_argument("--drafter", default="auto", help="the drafter, as for generate (default: %(default)s)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the engine folder's")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s, this machine only; 0.0.0.0 exposes it to the network)")
    s.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    s.add_argument("--model-name", default=None, help="the model id clients see (default: the engine folder's name)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: the DSPARK_API_KEY environment variable, "
                        "or none)")
    s.add_argument("--max-queue", type=int, default=8,
                   help="requests waiting beyond the one being answered; more get 429 (default: %(default)s)")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, queueing included; then it ends with 504 (default: %(default)s)")
    s.add_argument("--parallel", type=int, default=1,
                   help="requests decoded at once, their target passes batched (continuous batching: each "
                        "round's passes of all requests run as one, drafts included; see --shared-verify). "
                        "Greedy answers stay the model's own. A self drafter drafts while its request is the "
                        "only one decoding (default: %(default)s)")
    s.add_argument("--shared-verify", action=argparse.BooleanOptionalAction, default=True,
                   help="with --parallel N > 1 and a drafter: verify several requests' drafts in one pass, "
                        "choosing each request's drafts by survival under the measured pass costs; it opens a "
                        "second session of the target graph (one more copy of its weights in memory). "
                        "--no-shared-verify saves that memory: a request then drafts only while it is the "
                        "only one decoding (default: on)")
    s.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="start each request from the K/V the last one on its slot left for the prefix their "
                        "prompts share, so a conversation's next turn prefills only its new message; with "
                        "--parallel N a request goes to the idle slot whose kept K/V it continues (a "
                        "request's \"cache_prompt\": false opts out; default: on)")
    s.add_argument("--max-tokens", type=int, default=4096,
                   help="the largest max_tokens a request may ask for (default: %(default)s)")


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("serve needs Starlette and uvicorn: pip install 'dspark-edge[serve]'") from None
    from ..server import ServeConfig, build_app

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
    cfg = ServeConfig(model=args.model_name or Path(args.engine).resolve().name, max_queue=args.max_queue,
                      request_timeout_s=args.request_timeout, max_tokens=args.max_tokens,
                      default_max_tokens=min(256, args.max_tokens), api_key=api_key, parallel=args.parallel,
                      shared_verify=args.shared_verify, prompt_cache=args.prompt_cache)
    drafter = None if args.drafter == "none" else args.drafter
    # Verifying several requests' drafts opens a second session of the target graph: both on
    # the process-wide thread pool, or each session's idle threads spin against the other's.
    pipe = load_engine(args, drafter, shared_threads=cfg.parallel > 1 and cfg.shared_verify and drafter is not None)
    metrics = None
    try:
        from ..metrics import PrometheusMetrics

        metrics = PrometheusMetrics()
        pipe.add_observer(metrics)
    except ConfigError:
        pass  # /metrics answers 404 naming the package
    app = build_app(pipe, cfg, metrics)
    print(f"[serve] http://{args.host}:{args.port}/v1 (model {cfg.model!r}{', API key required' if api_key else ''});"
          " Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        pipe.close()
    return 0
