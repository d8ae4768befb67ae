"""What a server runs with: ``ServeOptions`` (the options of ``verispec serve``, plain values) and ``ServerConfig``
(the loaded target and drafter factories ``create_app`` serves).

The command line builds ``ServeOptions`` from its parsed arguments (``from_args``), a Ray Serve replica from a mapping
(``from_mapping``: names as on the command line, strings converted); both check it (``check``) before any model loads
and turn it into a ``ServerConfig`` with ``build_server_config``. Drafters and their options come from the drafter
registry, so a new drafter is served without a change here.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping

from ..backends import AUTO, DEFAULT_MODEL, TargetModel, backend_names, entry_options, get_backend
from ..backends.choice import default_backend
from ..backends.references import default_draft
from ..backends.registry import options_from as backend_options_from
from ..batching import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_PROMPT_CACHE_MB
from ..controller import COST, K_POLICIES
from ..drafters import Drafter, drafter_names, drafter_specs, get_spec, options_from
from ..drafters.registry import NONE, all_options, needs_layer_callback, parse_value
from ..errors import InvalidRequest, ModelNotFound
from ..verify import ACCEPTANCE_MODES, STRICT
from .limits import (ADMIN_TOKEN_ENV, API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES,
                     DEFAULT_QUEUE_TIMEOUT, DEFAULT_SHUTDOWN_GRACE, split_keys)

log = logging.getLogger(__name__)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
def _option(default: Any, type_: type, choices: Callable[[], tuple] | tuple | None = None) -> Any:
    return field(default=default, metadata={"type": type_, "choices": choices})


@dataclass
class ServeOptions:
    """The options of ``verispec serve`` (names as the command line's, '-' written '_'), deployment options aside.
    ``drafter_options`` holds the registered drafters' options by their names here (``ngram_min``, ``eagle_tree``,
    ...; see ``verispec.drafters.registry``), only those set."""

    target: str = _option(DEFAULT_MODEL, str)
    # suffix drafts: as good as prompt lookup on Spec-Bench, better where requests repeat each other, and the
    # samples of an n-request draft from each other (docs/suffix.md: the figures, and the timing channel it opens)
    drafter: str = _option("suffix", str, drafter_names)
    draft_model: str | None = _option(None, str)
    k: int = _option(8, int)
    k_policy: str = _option(COST, str, K_POLICIES)
    acceptance: str = _option(STRICT, str, ACCEPTANCE_MODES)
    backend: str = field(default_factory=default_backend,
                         metadata={"type": str, "choices": lambda: (AUTO, *backend_names())})
    host: str = _option("127.0.0.1", str)
    port: int = _option(8000, int)
    max_batch: int = _option(DEFAULT_MAX_BATCH, int)
    prefill_chunk: int = _option(DEFAULT_PREFILL_CHUNK, int)
    prompt_cache_mb: int = _option(DEFAULT_PROMPT_CACHE_MB, int)
    max_concurrency: int = _option(1, int)
    max_queue: int = _option(16, int)
    default_max_tokens: int = _option(256, int)
    max_tokens_limit: int | None = _option(None, int)
    served_model_name: str | None = _option(None, str)
    admin_token: str | None = _option(None, str)
    api_key: str | None = _option(None, str)  # one key or several, comma-separated (the command line repeats --api-key)
    cors_origins: str | None = _option(None, str)  # comma-separated origins, or *
    max_body_bytes: int = _option(DEFAULT_MAX_BODY_BYTES, int)
    max_prompt_tokens: int | None = _option(None, int)
    max_messages: int = _option(DEFAULT_MAX_MESSAGES, int)
    request_timeout: float | None = _option(None, float)
    queue_timeout: float | None = _option(DEFAULT_QUEUE_TIMEOUT, float)
    shutdown_grace: float = _option(DEFAULT_SHUTDOWN_GRACE, float)
    acceptance_window: float = _option(600.0, float)
    speculation_off: bool = _option(False, bool)
    log_level: str = _option("info", str, LOG_LEVELS)
    drafter_options: dict[str, Any] = field(default_factory=dict)
    # the registered backends' options (dtype, weights, threads, compile, static_widths, ...; see
    # ``verispec.backends.registry``) by their names here, only those set
    backend_options: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # a drafter's or backend's option reads like any other (options.ngram_min, options.weights), at its
        # default unless set
        if name not in ("drafter_options", "backend_options"):
            option = all_options().get(name)
            if option is not None:
                return self.drafter_options.get(name, option.default)
            option = entry_options().get(name)
            if option is not None:
                return self.backend_options.get(name, option.entry_default())
        raise AttributeError(name)

    def __post_init__(self) -> None:
        # copies of the mappings given: ``replace(options, ...)`` and a Ray replica's ``args.threads = ...`` must
        # not write into the options they came from
        object.__setattr__(self, "drafter_options", dict(self.drafter_options))
        object.__setattr__(self, "backend_options", dict(self.backend_options))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS and name in entry_options():
            self.backend_options[name] = value
        else:
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ building
    @classmethod
    def names(cls) -> list[str]:
        """Every option name a mapping may use (drafter options included)."""
        return [f.name for f in fields(cls) if f.name not in _DICTS] + list(all_options()) + list(entry_options())

    @classmethod
    def from_args(cls, args: Any) -> "ServeOptions":
        """From parsed command-line arguments (an attribute per option)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in _DICTS}
        if isinstance(values.get("api_key"), list):  # --api-key repeated
            values["api_key"] = ",".join(values["api_key"])
        drafted = {dest: getattr(args, dest) for dest, o in all_options().items() if getattr(args, dest) != o.default}
        engine = {dest: getattr(args, dest) for dest, o in entry_options().items()
                  if hasattr(args, dest) and getattr(args, dest) != o.entry_default()}
        return cls(**values, drafter_options=drafted, backend_options=engine)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "ServeOptions":
        """From a mapping with names as on the command line (with - or _), values typed or as strings (``serve run
        ... key=value``), checked against each option's choices."""
        known = {f.name: f for f in fields(cls) if f.name not in _DICTS}
        drafter_opts = all_options()
        engine_opts = entry_options()
        values: dict[str, Any] = {}
        drafted: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for key, value in options.items():
            name = str(key).lstrip("-").replace("-", "_")
            if name in drafter_opts:
                option = drafter_opts[name]
                drafted[name] = parse_value(key, value, option.type)
                continue
            if name in engine_opts:
                engine[name] = engine_opts[name].parse(value, f"option {key!r}")
                continue
            if name not in known:
                raise InvalidRequest(f"unknown verispec serve option {key!r}; known: {', '.join(sorted(cls.names()))}")
            meta = known[name].metadata
            value = parse_value(key, value, meta["type"])
            choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
            if choices is not None and value is not None and value not in choices:
                raise InvalidRequest(f"option {key!r}: {value!r} is not one of {', '.join(map(str, choices))}")
            values[name] = value
        return cls(**values, drafter_options=drafted, backend_options=engine)

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults, flat (drafter options included)."""
        defaults = ServeOptions()
        found = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in _DICTS and getattr(self, f.name) != getattr(defaults, f.name)}
        found.update(self.drafter_options)
        found.update(self.backend_options)
        return found

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Refuse inconsistent options with a message that names the fix (before any model loads)."""
        for name, value, low in (("--port", self.port, 0), ("--max-concurrency", self.max_concurrency, 1),
                                 ("--max-batch", self.max_batch, 1), ("--prefill-chunk", self.prefill_chunk, 1),
                                 ("--prompt-cache-mb", self.prompt_cache_mb, 0),
                                 ("--max-queue", self.max_queue, 0),
                                 ("--default-max-tokens", self.default_max_tokens, 1), ("--k", self.k, 1),
                                 ("--max-tokens-limit", self.max_tokens_limit or 1, 1),
                                 ("--max-body-bytes", self.max_body_bytes, 1024),
                                 ("--max-prompt-tokens", self.max_prompt_tokens or 1, 1),
                                 ("--max-messages", self.max_messages, 1),
                                 ("--request-timeout", self.request_timeout or 1, 1e-3),
                                 ("--queue-timeout", self.queue_timeout or 1, 1e-3),
                                 ("--shutdown-grace", self.shutdown_grace, 0)):
            if value < low:
                raise InvalidRequest(f"{name} must be >= {low}, got {value}")
        if self.acceptance != STRICT:
            raise InvalidRequest("the server runs strict (lossless) acceptance only; drop --acceptance")
        if self.drafter != NONE and get_spec(self.drafter).needs_draft_model and not self.draft_model \
                and not default_draft(self.target):
            raise InvalidRequest(f"--drafter {self.drafter} needs --draft-model REF")
        if self.max_batch > 1 and self.max_concurrency > 1:
            raise InvalidRequest("--max-concurrency applies to unbatched serving (--max-batch 1); with batching, "
                                 "--max-batch is the number of requests generating at once")
        if self.max_batch > 1 and self.compile == "on":
            raise InvalidRequest("--compile speeds up one-token passes of unbatched sequences; batched passes stay "
                                 "eager. Add --max-batch 1 or drop --compile")
        if self.max_batch > 1:
            for spec in drafter_specs():
                options = options_from(self, spec.name)
                if (spec.name == self.drafter or options) and spec.drafts_trees(options):
                    flag = "--" + spec.option(spec.tree_option).flag if spec.tree_option else f"--drafter {spec.name}"
                    raise InvalidRequest(f"{flag} verifies one sequence per pass; add --max-batch 1 or drop {flag}")


_DICTS = ("drafter_options", "backend_options")  # where the registries' options live
_FIELDS = {f.name for f in fields(ServeOptions)}


class LocalSwitch:
    """The server-wide speculation switch, in this process. A scale-out deployment passes one whose state is
    shared by every replica (``verispec.ray``), so turning speculation off on one reaches all."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    async def get(self) -> bool:
        return self.enabled

    async def set(self, enabled: bool) -> bool:
        self.enabled = enabled
        return enabled


@dataclass
class ServerConfig:
    target: TargetModel
    drafters: dict[str, Callable[[], Drafter]]  # name -> factory of a fresh drafter (one per slot)
    deferred: frozenset[str] = frozenset()  # drafters built on a slot's first request for them (their model loads then)
    default_drafter: str = "ngram"
    k: int = 8
    k_policy: str = COST
    served_model_name: str | None = None
    max_batch: int = DEFAULT_MAX_BATCH  # requests decoded together, sharing each target pass (1: unbatched)
    max_concurrency: int = 1  # unbatched only (max_batch 1): slots each generating in its own thread
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per pass while other requests decode
    prompt_cache_mb: int = DEFAULT_PROMPT_CACHE_MB  # finished prompts' keys and values kept in memory (0: none)
    max_queue: int = 16
    default_max_tokens: int = 256
    max_tokens_limit: int | None = None  # the most tokens one request may ask for (None: the context window)
    admin_token: str | None = None
    api_keys: tuple[str, ...] = ()  # keys any route but /health needs (none: open)
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None  # None: the context window's limit only
    max_messages: int = DEFAULT_MAX_MESSAGES
    request_timeout: float | None = None  # seconds a generation may run (None: unbounded)
    queue_timeout: float | None = DEFAULT_QUEUE_TIMEOUT  # seconds a request may wait for a slot (None: unbounded)
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    window_seconds: float = 600.0
    speculation: bool = True
    extra_model_names: list[str] = field(default_factory=list)
    # where the server-wide off switch lives: in this process (None) or shared by many replicas (verispec.ray)
    switch: "LocalSwitch | None" = None
    # --compile auto on an unbatched transformers server whose step is not stored yet: compiled once it starts
    compile_job: "BackgroundCompile | None" = None


def build_server_config(options: ServeOptions) -> ServerConfig:
    """Load the target and drafters the options name, and return the server's configuration (one per process:
    the plain server, or each Ray Serve replica).

    Every registered drafter the target can run is offered (its options from ``options``), except one that needs
    a draft model when none is given, one whose weights are not found when it was not asked for by name or
    option (the EAGLE head of a target that ships none), or one whose spec says it is offered only when asked for
    (layerskip: its first use on a model measures which layers to skip for about a minute), or one that drafts trees
    on a batched server (trees verify one sequence per pass). On llama.cpp, the hidden states that drafters read before
    the final one come as llama.cpp's layer inputs (or, on a build without them, through a callback installed when
    the server starts with such a drafter); heads are offered there only when asked for (each loads a transformers
    copy of the embeddings)."""
    from ..backends import load_model

    layer_states = needs_layer_callback(options)  # what the drafters need of the target, before anything loads
    if options.backend == AUTO:  # resolved here when the options come from the environment, not the CLI
        from ..backends.choice import choose

        picked = choose(options.target, load_model, backend_options_from(options))
        log.warning(picked.summary())
        options = replace(options, backend=picked.backend)
    engine = get_backend(options.backend)
    load = backend_options_from(options)
    if options.max_batch > 1 and "compiled" in load:
        load["compiled"] = "off"  # compiled programs run unbatched sequences only: a batched server never loads them
    if engine.takes("sequences"):  # a KV sequence per batch row (unbatched: each slot's decoders keep theirs)
        load["sequences"] = max(8, options.max_batch + 1, 4 * options.max_concurrency)
    features = {"features": layer_states} if engine.takes("features") else {}
    target = load_model(options.target, backend=engine.name, **load, **features)
    draft_ref = options.draft_model or default_draft(options.target)  # a built-in target's own draft
    # loaded now when named or when the default drafter drafts with it; a built-in target's sibling otherwise waits
    # for the first request that asks for it (a start never pays for a model no request may use)
    wanted = bool(options.draft_model) or (options.drafter != NONE and get_spec(options.drafter).needs_draft_model)
    draft = load_model(draft_ref, backend=engine.name, **load) if draft_ref and wanted else None
    later = _Later(lambda: load_model(draft_ref, backend=engine.name, **load)) if draft_ref and not wanted else None
    drafters: dict[str, Callable[[], Drafter]] = {}
    deferred = set()
    for spec in drafter_specs():
        opts = options_from(options, spec.name)
        asked = spec.name == options.drafter or bool(opts)
        if spec.needs_draft_model and later is not None and spec.runs_on(target) and spec.offered_by_default \
                and not (options.max_batch > 1 and spec.drafts_trees(opts)):
            drafters[spec.name] = lambda spec=spec, opts=opts: spec.build(target, later(), **opts)
            deferred.add(spec.name)
            continue
        # on llama.cpp heads load a transformers copy of the embeddings: only those asked for (and inner layers only
        # where the target returns them: layer inputs, or the callback it was loaded with)
        borrows = getattr(target, "final_feature_layer", None) is not None
        unloaded = spec.hidden_states and ((borrows and not asked) or (
            not target.supports_features and (not asked or spec.inner_layers(options.target, opts))))
        if (spec.needs_draft_model and draft is None) or unloaded \
                or not spec.runs_on(target) or (not asked and not spec.offered_by_default) \
                or (options.max_batch > 1 and spec.drafts_trees(opts)):  # trees verify one sequence per pass
            continue
        try:
            first = spec.build(target, draft, **opts)  # checks now (a draft model's tokenizer), not per request
        except ModelNotFound:
            if asked:
                raise
            continue
        shared = {**opts, **(spec.share(first) if spec.share else {})}
        drafters[spec.name] = lambda spec=spec, shared=shared: spec.build(target, draft, **shared)
    compile_job = None
    if (load.get("compiled") == "auto" and load.get("dtype", "float32") == "float32"
            and target.compiles_steps and target.step is None and target.device.type == "cpu"):
        from .compiling import BackgroundCompile

        compile_job = BackgroundCompile(target, options.target)
    return ServerConfig(
        target=target, drafters=drafters, deferred=frozenset(deferred), compile_job=compile_job, default_drafter=options.drafter, k=options.k, k_policy=options.k_policy,
        served_model_name=options.served_model_name, max_batch=options.max_batch,
        max_concurrency=options.max_concurrency, prefill_chunk=options.prefill_chunk, max_queue=options.max_queue,
        prompt_cache_mb=options.prompt_cache_mb,
        default_max_tokens=options.default_max_tokens, max_tokens_limit=options.max_tokens_limit,
        admin_token=options.admin_token or os.environ.get(ADMIN_TOKEN_ENV),
        api_keys=split_keys(options.api_key) or split_keys(os.environ.get(API_KEY_ENV)),
        cors_origins=tuple(o.strip() for o in (options.cors_origins or "").split(",") if o.strip()),
        max_body_bytes=options.max_body_bytes, max_prompt_tokens=options.max_prompt_tokens,
        max_messages=options.max_messages, request_timeout=options.request_timeout,
        queue_timeout=options.queue_timeout, shutdown_grace=options.shutdown_grace,
        window_seconds=options.acceptance_window, speculation=not options.speculation_off,
    )


class _Later:
    """A value made on first use, once, whichever thread asks first (the others wait for it)."""

    def __init__(self, make: Callable[[], Any]):
        self._make, self._lock, self._value = make, threading.Lock(), None

    def __call__(self) -> Any:
        with self._lock:
            if self._value is None:
                log.warning("loading the draft model on the first request that drafts with it ...")
                self._value = self._make()
            return self._value
