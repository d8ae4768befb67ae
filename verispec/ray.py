"""verispec on Ray Serve: the OpenAI-compatible server as a Ray Serve application.

Each replica is the plain server (``verispec.server.create_app``) with its own model, batched engine and threads;
Ray's proxy spreads requests over the replicas, restarts a replica that dies and, with autoscaling, adds and
removes replicas on ongoing requests. A second, CPU-less deployment (``VerispecControl``) holds what the replicas
share: the server-wide speculation switch and where each replica's Prometheus metrics can be scraped.

    build_app(replicas=2, target="smollm2-135m", max_batch=8)   # a Ray Serve Application: serve.run(app)
    app_builder({"replicas": 2, "max_batch": 8})                 # the same from a config file (serve deploy)

Options are ``verispec serve``'s, named as on the command line (``max_batch`` or ``max-batch``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

from .errors import InvalidRequest
from .server.config import ServeOptions, build_server_config

log = logging.getLogger("verispec.ray")

APP_NAME = "verispec"
SERVER_DEPLOYMENT = "VerispecServer"
CONTROL_DEPLOYMENT = "VerispecControl"
# options of `verispec serve` that shape the deployment or the process, not a replica's server
DEPLOYMENT_OPTIONS = ("host", "port", "log_level")
# the replicas' heartbeat clock (a test replaces it; patching time.monotonic would reach every thread)
_clock = time.monotonic
HEADROOM = 4  # requests a replica takes beyond its queue: /health, /metrics, and answering overflow with a 429
HEALTH_PERIOD_S = 2.0  # replicas report to the control this often (their health check)
# what a replica's environment takes from the deploying process: settings that change where caches live and how
# models load, never a secret (API keys, the admin token, HF_TOKEN): those reach replicas as their options, in
# Ray's object store, or from the cluster's own environment (docs/serving.md)
FORWARDED_ENV = ("VERISPEC_CACHE", "VERISPEC_COST_CACHE", "VERISPEC_BACKEND", "VERISPEC_COMPILE",
                 "VERISPEC_COMPILE_AUTOTUNE", "VERISPEC_COMPILED_VERIFY", "VERISPEC_PACK", "VERISPEC_WIDTH_INVARIANT",
                 "VERISPEC_LLAMACPP_LAYER_INPUTS", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT",
                 "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS")
SECRET_OPTIONS = ("admin_token", "api_key")  # never written to a config file


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``FORWARDED_ENV`` set here, for the replicas' runtime_env."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in FORWARDED_ENV if name in environ}


def require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise InvalidRequest('Ray Serve is not installed; pip install "verispec[ray]"') from None
    return ray, serve


# ----------------------------------------------------------------------------------------------- options
def server_options(options: Mapping[str, Any]) -> ServeOptions:
    """``verispec serve``'s options with ``options`` applied: names as on the command line (with - or _), values
    typed (strings from ``serve run ... key=value`` are converted) and checked against the options' choices."""
    return ServeOptions.from_mapping(options)


def replica_options(options: ServeOptions) -> dict[str, Any]:
    """The options that differ from ``verispec serve``'s defaults and reach the replicas."""
    return {key: value for key, value in options.changed().items() if key not in DEPLOYMENT_OPTIONS}


def parse_autoscale(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise InvalidRequest(f"--autoscale takes MIN:MAX replicas (e.g. 1:4), got {text!r}") from None
    if low < 1 or high < low:
        raise InvalidRequest(f"--autoscale {text}: need 1 <= MIN <= MAX (a replica loads the model before it can "
                             "answer, so verispec does not scale to zero)")
    return low, high


# ----------------------------------------------------------------------------------------------- deployments
class VerispecControl:
    """What the replicas share: the speculation switch, and each replica's metrics address (refreshed by its
    health check; an address not refreshed for three periods is dropped). Restarted by Ray if it dies, with the
    switch back at its starting state."""

    def __init__(self, speculation: bool) -> None:
        self.speculation = bool(speculation)
        self.replicas: dict[str, tuple[str, float]] = {}

    def get(self) -> bool:
        return self.speculation

    def set(self, enabled: bool) -> bool:
        self.speculation = bool(enabled)
        return self.speculation

    def register(self, replica: str, address: str) -> None:
        self.replicas[replica] = (address, _clock())

    def targets(self) -> list[dict]:
        """Prometheus HTTP service discovery: one target group per live replica."""
        now = _clock()
        self.replicas = {r: (a, t) for r, (a, t) in self.replicas.items() if now - t < 3 * HEALTH_PERIOD_S + 5}
        return [{"targets": [address], "labels": {"replica": replica}}
                for replica, (address, _) in sorted(self.replicas.items())]


class RaySwitch:
    """The server's speculation switch, kept by ``VerispecControl``: every request reads it, so turning
    speculation off on any replica reaches all. If the control cannot be reached, the last value read holds."""

    def __init__(self, control, enabled: bool) -> None:
        self.control, self.last = control, enabled

    async def get(self) -> bool:
        try:
            self.last = await self.control.get.remote()
        except Exception as exc:  # noqa: BLE001 - a missing switch must not fail requests
            log.warning("speculation switch unreachable (%s); keeping %s", type(exc).__name__, self.last)
        return self.last

    async def set(self, enabled: bool) -> bool:
        self.last = await self.control.set.remote(enabled)
        return self.last


class VerispecServer:
    """One replica: loads the model once and serves verispec's app (built by Ray on the replica, after this)."""

    def __init__(self, options: dict, control, threads: int, metrics_host: str = "127.0.0.1") -> None:
        args = server_options(options)
        args.check()
        if args.threads is None:
            args.threads = threads  # the CPUs Ray reserved for this replica, not the whole node's (every backend)
        self.config = build_server_config(args)
        self.config.switch = RaySwitch(control, self.config.speculation)
        self.control = control
        self.metrics_address: str | None = None
        self.replica = str(os.getpid())
        self.server = None
        self.metrics_host = metrics_host

    def __serve_build_asgi_app__(self):
        import ray
        from prometheus_client import start_http_server
        from ray import serve

        from .server import create_app

        app = create_app(self.config)
        self.server, self.metrics = app.state.server, app.state.metrics
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - a name for the metrics label only
            pass
        # loopback unless the deployment asks for the node's address (a Prometheus on another machine scrapes it)
        host = ray.util.get_node_ip_address() if self.metrics_host == "node" else self.metrics_host
        server, _ = start_http_server(0, addr=host, registry=app.state.metrics.registry)
        self.metrics_address = f"{host}:{server.server_port}"
        control = self.control

        @app.get("/metrics/targets", summary="Prometheus HTTP service discovery: every replica's /metrics address")
        async def metrics_targets():
            return await control.targets.remote()

        return app

    async def check_health(self) -> None:
        """Ray calls this every few seconds: fail when /health would answer 503 (the batch worker died: Ray then
        replaces this replica), and tell the control where this replica's metrics are."""
        problem = self.server.problem() if self.server is not None else None
        if problem is not None:
            raise RuntimeError(f"this replica cannot answer: {problem}")
        if self.metrics_address is not None:
            try:
                await self.control.register.remote(self.replica, self.metrics_address)
                self.metrics.speculation.set(1 if await self.config.switch.get() else 0)
            except Exception as exc:  # noqa: BLE001 - the control being away does not make this replica sick
                log.warning("could not report to %s: %s", CONTROL_DEPLOYMENT, exc)


def _capacity(args: ServeOptions) -> int:
    return (args.max_batch if args.max_batch > 1 else args.max_concurrency) + args.max_queue


def build_app(*, replicas: int = 1, autoscale: str | tuple[int, int] | None = None, replica_cpus: float = 1.0,
              log_level: str = "warning", metrics_host: str = "127.0.0.1", **options: Any):
    """A Ray Serve application serving verispec's OpenAI-compatible API from ``replicas`` replicas (or
    ``autoscale=(MIN, MAX)``), each reserving ``replica_cpus`` CPUs. ``options`` are ``verispec serve``'s
    (``target``, ``drafter``, ``max_batch``, ...); ``log_level`` is the replicas' (info logs every request);
    ``metrics_host`` is where each replica's own /metrics listens (loopback; ``"node"``: the node's address, for a
    Prometheus elsewhere). Run it with ``serve.run(app, route_prefix="/")`` or compose it into your own
    application."""
    _, serve = require_ray()
    args = server_options(options)
    args.check()
    if replica_cpus <= 0:
        raise InvalidRequest(f"--replica-cpus must be > 0, got {replica_cpus}")
    capacity = _capacity(args)
    deployment: dict[str, Any] = dict(
        name=SERVER_DEPLOYMENT,
        # Ray sends a replica no more than this at once; past its own queue the replica answers a 429 in OpenAI's
        # shape at once. Ray's router queue stays unbounded (its default): it only holds a request while every
        # replica is at this limit (briefly, as the 429s are fast) or while no replica is up (a restart).
        max_ongoing_requests=capacity + HEADROOM,
        backpressure_config={"status_code": 429, "retry_after_s": 1},  # if a config file bounds that queue
        ray_actor_options={"num_cpus": replica_cpus,
                           "runtime_env": {"env_vars": forwarded_env()}},
        health_check_period_s=HEALTH_PERIOD_S,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=10.0,
        logging_config={"log_level": log_level.upper()},
    )
    if autoscale is not None:
        low, high = parse_autoscale(autoscale) if isinstance(autoscale, str) else autoscale
        deployment["autoscaling_config"] = {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                                            "target_ongoing_requests": args.max_batch}
    else:
        if int(replicas) < 1:
            raise InvalidRequest(f"--replicas must be >= 1, got {replicas}")
        deployment["num_replicas"] = int(replicas)
    control = serve.deployment(VerispecControl).options(
        name=CONTROL_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0},
        logging_config={"log_level": "WARNING"},  # it is called on every request: no access log
    ).bind(not args.speculation_off)
    server = serve.deployment(serve.ingress()(VerispecServer)).options(**deployment)
    return server.bind(replica_options(args), control, max(1, int(replica_cpus)), metrics_host)


def app_builder(args: dict[str, Any]):
    """For a Ray Serve config file (``import_path: verispec.ray:app_builder``): ``args`` are build_app's."""
    args = dict(args or {})
    for key in list(args):
        args[key.replace("-", "_")] = args.pop(key)
    return build_app(**args)
