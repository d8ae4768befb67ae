"""Command line for ``verispec serve``."""

from __future__ import annotations

import os
import sys

from ..batching import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_PROMPT_CACHE_MB
from ..server.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES, DEFAULT_QUEUE_TIMEOUT,
                             DEFAULT_SHUTDOWN_GRACE)
from .options import model_options


def add_serve_parser(sub) -> None:
    s = sub.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server with speculative decoding",
        description="Serve the target through an OpenAI-compatible API (POST /v1/chat/completions, "
                    "/v1/completions; GET /v1/models, /health, /metrics; GET/POST /admin/speculation). "
                    "Requests choose per call with the extension field {\"verispec\": {\"speculation\": false | "
                    "\"drafter\": NAME | \"k\": N}}.")
    model_options(s, drafter_default="suffix")
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="requests generating at once, decoded together in each target pass (continuous batching; "
                        f"default: {DEFAULT_MAX_BATCH}); 1 = one request per pass, unbatched (needed for token trees)")
    g.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                   help="prompt tokens prefilled per pass while other requests are decoding, so a long prompt "
                        f"never stalls their streams for long (default: {DEFAULT_PREFILL_CHUNK})")
    g.add_argument("--prompt-cache-mb", type=int, default=DEFAULT_PROMPT_CACHE_MB, metavar="MB",
                   help="batched serving: memory for finished requests' keys and values, copied out of their rows "
                        "when a new request needs the row, so a repeated prompt or a conversation's next turn is "
                        "not prefilled again; the copies used least lately go first (default: "
                        f"{DEFAULT_PROMPT_CACHE_MB}; 0: keep only what stays in free rows)")
    g.add_argument("--max-concurrency", type=int, default=1,
                   help="with --max-batch 1 only: unbatched generation slots, each in its own thread (default: 1; "
                        "on a CPU more only share the same cores)")
    g.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for a slot; beyond concurrency + queue the server answers 429 "
                        "(default: 16)")
    g.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens when a request gives none (default: 256)")
    g.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="the most tokens one request may ask for (default: the model's context window); larger "
                        "max_tokens get a 400 naming the limit, and /openapi.json declares it")
    g.add_argument("--served-model-name", metavar="NAME", help="model id clients send (default: the target's name)")
    g.add_argument("--admin-token", default=os.environ.get("VERISPEC_ADMIN_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' on /admin endpoints (default: $VERISPEC_ADMIN_TOKEN; "
                        "unset = the API keys guard them, or nothing: fine on loopback only)")
    a = s.add_argument_group("exposing the server (docs/serving.md: running it on a network)")
    a.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several keys "
                        "(default: $VERISPEC_API_KEY, comma-separated; unset = open: a warning when --host is not "
                        "loopback)")
    a.add_argument("--cors-origins", metavar="ORIGINS",
                   help="browser origins allowed to call the API, comma-separated, or * (default: none)")
    a.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help=f"largest request body; larger ones get a 413 before they are read (default: "
                        f"{DEFAULT_MAX_BODY_BYTES})")
    a.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="most prompt tokens per request, counted after admission, off the event loop (default: the "
                        "context window)")
    a.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES, metavar="N",
                   help=f"most messages in one chat request (default: {DEFAULT_MAX_MESSAGES})")
    a.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a generation running longer is stopped: a 408 error (streams: an error event) "
                        "(default: none)")
    a.add_argument("--queue-timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT, metavar="SECONDS",
                   help="a request waiting longer for a free slot gets a 503 with Retry-After (default: "
                        f"{DEFAULT_QUEUE_TIMEOUT:g})")
    a.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: stop admitting (503), give running requests this long to finish, "
                        f"then cut them, stop the worker and child processes (default: {DEFAULT_SHUTDOWN_GRACE:g})")
    g.add_argument("--acceptance-window", type=float, default=600.0, metavar="SECONDS",
                   help="window of the verispec_acceptance_rate_recent gauge (default: 600)")
    g.add_argument("--speculation-off", action="store_true",
                   help="start with speculation turned off (turn it on with POST /admin/speculation)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    r = s.add_argument_group("scale-out on Ray Serve (pip install \"verispec[ray]\")")
    r.add_argument("--ray", action="store_true",
                   help="serve the same API as a Ray Serve application: one batched engine per replica, requests "
                        "spread over the replicas by Ray's proxy on --host/--port")
    n = r.add_mutually_exclusive_group()
    n.add_argument("--replicas", type=int, default=1, metavar="N", help="with --ray: replicas (default: 1)")
    n.add_argument("--autoscale", metavar="MIN:MAX",
                   help="with --ray: let Ray scale between MIN and MAX replicas on ongoing requests (target: "
                        "--max-batch per replica)")
    r.add_argument("--replica-cpus", type=float, default=1.0, metavar="CPUS",
                   help="with --ray: CPUs each replica reserves, and the threads its engine uses (default: 1)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --ray: the Ray cluster to deploy on: auto (the one `ray start` started on this "
                        "node), HEAD:6379 or ray://HEAD:10001 (default: $RAY_ADDRESS, else a new local Ray instance "
                        "started for this command and stopped with it; never a cluster found on its own)")
    r.add_argument("--replica-metrics-host", default="127.0.0.1", metavar="HOST",
                   help="with --ray: where each replica's own /metrics listens (default: 127.0.0.1; node = the "
                        "node's address, for a Prometheus on another machine, listed by /metrics/targets)")
    r.add_argument("--print-config", action="store_true",
                   help="print a Ray Serve config file (YAML) for `serve deploy` with these options, and exit")
    s.set_defaults(func=cmd_serve)


def serve_options(args):
    """The parsed arguments as the server's options, checked (before any model loads)."""
    from ..server.config import ServeOptions

    options = ServeOptions.from_args(args)
    options.check()
    return options


def describe(args, config) -> str:
    target = config.target
    return (f"{config.served_model_name or target.name} (drafter {args.drafter}, k {args.k} ({args.k_policy}), "
            f"{target.backend}: {target.kernel}, {args.dtype}, "
            + (f"batches of up to {args.max_batch}" if args.max_batch > 1 else f"{args.max_concurrency} unbatched slot(s)")
            + f", queue {args.max_queue})")


def cmd_serve(args) -> int:
    options = serve_options(args)
    if args.ray or args.print_config:
        from .ray import cmd_serve_ray

        return cmd_serve_ray(args, options)
    import uvicorn

    from ..server import build_server_config, create_app

    from ..server.limits import is_loopback

    config = build_server_config(options)
    app = create_app(config)
    if not config.api_keys and not is_loopback(args.host):
        print(f"verispec: WARNING: serving on {args.host} without an API key: anyone who can reach this port can "
              "generate (and read /metrics); start with --api-key KEY or $VERISPEC_API_KEY (docs/serving.md)",
              file=sys.stderr, flush=True)
    print(f"verispec: serving {describe(args, config)} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server = app.state.server

    class Uvicorn(uvicorn.Server):
        """uvicorn, telling verispec's server the moment a SIGTERM or Ctrl-C arrives: from then on it admits
        nothing (503, /health too) while uvicorn gives running requests --shutdown-grace seconds."""

        def handle_exit(self, sig, frame) -> None:
            server.closing = True
            super().handle_exit(sig, frame)

    Uvicorn(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                           timeout_graceful_shutdown=max(config.shutdown_grace, 0.01))).run()
    print("verispec: stopped", file=sys.stderr, flush=True)
    return 0
