"""Command line for ``verispec serve --ray``: deploy on a Ray cluster (or a local instance), or print the Serve
config file that does."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

from ..errors import InvalidRequest
from ..ray import APP_NAME, SECRET_OPTIONS, build_app, parse_autoscale, replica_options, require_ray
from ..server.config import ServeOptions


def serve_config(args: argparse.Namespace, options: ServeOptions) -> dict[str, Any]:
    """A Ray Serve config file for ``serve deploy`` running these options."""
    app_args: dict[str, Any] = dict(replica_options(options))
    if args.autoscale:
        parse_autoscale(args.autoscale)
        app_args["autoscale"] = args.autoscale
    else:
        app_args["replicas"] = args.replicas
    app_args["replica_cpus"] = args.replica_cpus
    app_args["log_level"] = args.log_level
    app_args["metrics_host"] = args.replica_metrics_host
    for secret in SECRET_OPTIONS:  # never in a file: the cluster's environment gives them ($VERISPEC_API_KEY, ...)
        app_args.pop(secret, None)
    return {"proxy_location": "EveryNode", "http_options": {"host": args.host, "port": args.port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "verispec.ray:app_builder",
                              "args": app_args}]}


def cmd_serve_ray(args: argparse.Namespace, options: ServeOptions) -> int:
    if args.autoscale:
        parse_autoscale(args.autoscale)
    if args.replicas < 1:
        raise InvalidRequest(f"--replicas must be >= 1, got {args.replicas}")
    if args.print_config:
        import yaml

        print("# verispec on Ray Serve: `serve deploy THIS_FILE` on a running cluster (see docs/serving.md)")
        print(yaml.safe_dump(serve_config(args, options), sort_keys=False), end="")
        return 0
    ray, serve = require_ray()
    app = build_app(replicas=args.replicas, autoscale=args.autoscale, replica_cpus=args.replica_cpus,
                    log_level=args.log_level, metrics_host=args.replica_metrics_host, **replica_options(options))
    address = ray_address(args)
    local = address == "local"
    if local:
        _prefetch(args)  # one download or conversion here, not one per replica at once
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    # after ray.init, which installs its own: a terminate signal unwinds like Ctrl-C, so the application and a
    # local Ray instance are stopped, not left behind
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        where = "a local Ray instance" if local else f"the Ray cluster at {address}"
        print(f"verispec: deploying on {where}: " + (f"autoscaling {args.autoscale} replicas" if args.autoscale
              else f"{args.replicas} replica(s)") + f" of {args.replica_cpus:g} CPU each", file=sys.stderr, flush=True)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        print(f"verispec: serving {args.target} on http://{args.host}:{args.port} through Ray Serve "
              "(Ctrl-C stops it)", file=sys.stderr, flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        print("verispec: stopping the Ray Serve application", file=sys.stderr, flush=True)
        try:
            serve.delete(APP_NAME)
            if local:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def ray_address(args: argparse.Namespace) -> str:
    """What ``ray.init`` is given: ``--ray-address``, else ``$RAY_ADDRESS``, else ``"local"`` (a new local instance).

    Never None: given None, Ray joins whatever cluster its temp folder's ``ray_current_cluster`` file names, the
    last one ``ray start`` started on this machine, even if it has since stopped. Ray then retries that dead
    address forever and the server never comes up. Joining this machine's cluster is ``--ray-address auto``."""
    return args.ray_address or os.environ.get("RAY_ADDRESS") or "local"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _prefetch(args: argparse.Namespace) -> None:
    from ..backends.references import BUILTINS, ensure_builtin

    for ref in (args.target, args.draft_model):
        if ref in BUILTINS:
            ensure_builtin(BUILTINS[ref])
