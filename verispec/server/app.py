"""The OpenAI-compatible HTTP API over the engine. No algorithm code here: requests become engine calls.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with ``stream``), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET/POST /admin/speculation (the server-wide off switch).
Every error is OpenAI's shape {"error": {"message", "type", "param", "code"}} with a 4xx status for the
client's mistakes; a failure inside a generation is a 500 for that request only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from .. import __version__
from ..batching import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, BatchEngine, BatchWorker
from ..drafters import Drafter
from ..engine import SpeculativeDecoder
from ..errors import InvalidRequest
from ..models import LoadedModel
from ..sampling import SamplingParams
from .metrics import Metrics
from .pool import SlotPool
from .schemas import (IGNORED, UNSUPPORTED_UNLESS, ChatCompletion, ChatRequest, Completion, CompletionRequest, ErrorResponse,
                      Health, ModelList, SpeculationState, SpeculationSwitch)

log = logging.getLogger("verispec.server")
_DONE = object()


@dataclass
class ServerConfig:
    target: LoadedModel
    drafters: dict[str, Callable[[], Drafter]]  # name -> factory of a fresh drafter (one per slot)
    default_drafter: str = "ngram"
    k: int = 8
    k_policy: str = "cost"
    served_model_name: str | None = None
    max_batch: int = DEFAULT_MAX_BATCH  # requests decoded together, sharing each target pass (1: unbatched)
    max_concurrency: int = 1  # unbatched only (max_batch 1): slots each generating in its own thread
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per pass while other requests decode
    max_queue: int = 16
    default_max_tokens: int = 256
    max_tokens_limit: int | None = None  # the most tokens one request may ask for (None: the context window)
    admin_token: str | None = None
    window_seconds: float = 600.0
    speculation: bool = True
    extra_model_names: list[str] = field(default_factory=list)
    # where the server-wide off switch lives: in this process (None) or shared by many replicas (verispec.ray)
    switch: "LocalSwitch | None" = None


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


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"missing required parameter '{loc}'", loc or None
    return (f"invalid value for '{loc}': {msg}" if loc else msg), loc or None


class _GuardedStream(StreamingResponse):
    """A streaming response that runs ``on_finish`` however it ends, even if the body never started."""

    def __init__(self, body: AsyncIterator[str], on_finish: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_finish = on_finish

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_finish()


class _CountRequests:
    """ASGI middleware: count every response by route template and status (routes, not raw paths, so
    random 404 paths cannot blow up the label set)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status["code"])).inc()


@dataclass
class _Job:
    """One admitted request, ready to run on a slot."""

    endpoint: str
    decoder_name: str
    prompt_ids: list[int]
    options: dict[str, Any]
    disabled_by: str | None
    stream: Any = None


class _ThreadedRun:
    """An unbatched generation: the decoder's own stream, stepped in a worker thread."""

    def __init__(self, slot: dict[str, SpeculativeDecoder], pool: SlotPool) -> None:
        self.slot, self.pool = slot, pool
        self.stream = None
        self.stats = None

    @property
    def result(self):
        return self.stream.result if self.stream is not None else None

    async def start(self, job: "_Job") -> None:
        self.stream = self.slot[job.decoder_name].stream(job.prompt_ids, **job.options)
        self.stats = self.stream.stats
        self._steps = iter(self.stream)

    async def next(self):
        return await anyio.to_thread.run_sync(next, self._steps, _DONE)

    def close(self) -> None:
        if self.stream is not None and self.stream.result is None:
            self.stream.close()  # not executing: the worker thread has returned
        self.pool.release(self.slot)


class _BatchedRun:
    """A generation inside the batch engine: deltas arrive from the worker thread through an asyncio queue."""

    def __init__(self, worker: BatchWorker, slot: dict[str, SpeculativeDecoder], pool: SlotPool) -> None:
        self.worker, self.slot, self.pool = worker, slot, pool
        self.seq = None
        self.stats = None
        self._released = False

    @property
    def result(self):
        return self.seq.result if self.seq is not None else None

    async def start(self, job: "_Job") -> None:
        decoder = self.slot[job.decoder_name]
        request = decoder.request(job.prompt_ids, **job.options)  # InvalidRequest: a 400, before joining
        self.stats = request.stats
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        def done(seq) -> None:
            put(_DONE)
            loop.call_soon_threadsafe(self._release)

        self.seq = self.worker.submit(decoder, request, on_delta=put, on_done=done)

    async def next(self):
        item = await self._queue.get()
        if item is _DONE and self.seq.error is not None:
            raise self.seq.error
        return item

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.release(self.slot)

    def close(self) -> None:
        if self.seq is None:
            self._release()
        elif not (self.seq.result is not None or self.seq.error is not None):
            self.worker.cancel(self.seq)  # the slot comes back when the engine has dropped the sequence


def create_app(config: ServerConfig) -> FastAPI:
    target = config.target
    served = config.served_model_name or target.name
    model_names = {served, *config.extra_model_names}
    metrics = Metrics(config.window_seconds)
    switch = config.switch or LocalSwitch(config.speculation)
    metrics.speculation.set(1 if config.speculation else 0)

    async def speculation_on() -> bool:
        enabled = await switch.get()
        metrics.speculation.set(1 if enabled else 0)
        return enabled
    if config.default_drafter not in ("none", *config.drafters):
        raise ValueError(f"default drafter {config.default_drafter!r} is not among {list(config.drafters)}")

    def make_slot() -> dict[str, SpeculativeDecoder]:
        slot = {"none": SpeculativeDecoder(target, None, k=config.k, k_policy=config.k_policy)}
        for name, factory in config.drafters.items():
            slot[name] = SpeculativeDecoder(target, factory(), k=config.k, k_policy=config.k_policy)
        return slot

    batched = config.max_batch > 1
    worker = None
    if batched:
        if config.max_concurrency != 1:
            raise ValueError("max concurrency (threads of unbatched slots) applies with max batch 1 only; with "
                             "batching, max batch is the number of requests generating at once")
        for name, factory in config.drafters.items():
            if getattr(factory(), "tree_depth", None):
                raise ValueError(f"the {name} drafter verifies token trees, one sequence per pass; serve it with "
                                 "max batch 1 (--max-batch 1) or drop the tree option")
        engine = BatchEngine(target, max_batch=config.max_batch, prefill_chunk=config.prefill_chunk)
        worker = BatchWorker(engine)
        metrics.watch_batch(engine)
    pool = SlotPool(make_slot, config.max_batch if batched else config.max_concurrency, config.max_queue)
    encoder = SpeculativeDecoder(target)  # tokenization and validation only; never generates
    metrics.queue_depth.set_function(lambda: pool.waiting)

    app = FastAPI(title="verispec", version=__version__,
                  description="OpenAI-compatible API with lossless speculative decoding")
    app.add_middleware(_CountRequests, metrics=metrics)
    app.state.config, app.state.metrics, app.state.pool, app.state.worker = config, metrics, pool, worker

    # ------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = error_response(exc.status_code, str(exc.detail), kind)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # every method of the path (the path's routes are separate, one per method)
            methods = app.openapi().get("paths", {}).get(request.url.path, {})
            response.headers["Allow"] = ", ".join(m.upper() for m in methods)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, str(exc.errors()[0].get("msg", "invalid request")))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        log.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}; the server is still running",
                              "server_error")

    token_cap = config.max_tokens_limit or target.context_length

    async def parse(request: Request, schema: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON ({exc}); send a JSON object") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return schema.model_validate(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise APIError(400, message, param=param) from None

    # ------------------------------------------------------------- generation
    def prepare(req, prompt, raw: bool, endpoint: str, speculation: bool) -> _Job:
        if req.model not in model_names:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves {', '.join(sorted(model_names))}"
                           " (see GET /v1/models)", "not_found_error", "model", "model_not_found")
        opts = req.verispec
        if opts.drafter is not None and opts.drafter not in ("none", *config.drafters):
            raise APIError(400, f"drafter '{opts.drafter}' is not available; this server has: "
                                f"{', '.join(['none', *config.drafters])}", param="verispec.drafter")
        disabled_by = None
        if not speculation:
            name, disabled_by = "none", "server"
        elif not opts.speculation:
            name, disabled_by = "none", "request"
        else:
            name = opts.drafter or config.default_drafter
        try:
            SamplingParams(temperature=req.temperature, top_p=req.top_p)
            ids = encoder.encode(prompt, raw=raw)
        except InvalidRequest as exc:
            raise APIError(400, str(exc)) from None
        limit = target.context_length
        if limit is not None and len(ids) >= limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context window is {limit}; "
                                "shorten the prompt", param="messages" if endpoint == "chat" else "prompt",
                           code="context_length_exceeded")
        max_tokens = req.token_limit() or min(config.default_max_tokens, token_cap or config.default_max_tokens)
        if token_cap is not None and max_tokens > token_cap:
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{param} = {max_tokens} is more than this server allows per request "
                                f"({token_cap}); ask for fewer tokens", param=param)
        options = dict(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                       stop=req.stop, k=opts.k)
        return _Job(endpoint, name, ids, options, disabled_by)

    def admit() -> None:
        if not pool.reserve():
            raise APIError(429, f"server busy: {pool.admitted} requests are running or queued (limit "
                                f"{pool.capacity}); retry after a short wait", "rate_limit_error",
                           code="rate_limit_exceeded")

    async def deltas(job: _Job, request: Request) -> AsyncIterator[str]:
        """Text deltas of one admitted job, stepped by the batch worker (or, unbatched, in a worker thread of its
        own); stops when the client leaves. Metrics move with every delta."""
        arrived = time.perf_counter()
        slot = await pool.acquire()
        gone = False
        metrics.running.inc()
        run = _BatchedRun(worker, slot, pool) if batched else _ThreadedRun(slot, pool)
        try:
            job.stream = run
            await run.start(job)
            metrics.prompt_tokens.inc(len(job.prompt_ids))
            seen, first = 0, True
            while True:
                delta = await run.next()
                seen = metrics.observe_steps(run.stats, seen)
                if delta is _DONE:
                    break
                if first:
                    metrics.first_token.observe(time.perf_counter() - arrived)
                    first = False
                if await request.is_disconnected():
                    gone = True
                    return
                yield delta
            metrics.request_latency.labels(job.endpoint).observe(time.perf_counter() - arrived)
        except (asyncio.CancelledError, GeneratorExit):  # the server noticed the client leave first
            gone = True
            raise
        finally:
            if gone:
                metrics.disconnects.inc()
            metrics.running.dec()
            run.close()  # gives the slot back once the engine no longer uses its decoders

    def meta(job: _Job) -> dict:
        result = job.stream.result
        s = result.stats
        d = {key: v for key, v in s.to_dict().items() if not key.startswith("step_")}
        d.update(speculation=job.decoder_name != "none", speculation_disabled_by=job.disabled_by, seed=result.seed)
        return d

    def usage(job: _Job) -> dict:
        n = len(job.stream.result.token_ids)
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n,
                "total_tokens": len(job.prompt_ids) + n}

    async def complete(job: _Job, request: Request) -> JSONResponse:
        admit()
        try:
            async with aclosing(deltas(job, request)) as steps:
                async for _ in steps:
                    pass
        except InvalidRequest as exc:
            raise APIError(400, str(exc)) from None
        finally:
            pool.unreserve()
        if job.stream is None or job.stream.result is None:  # the client left; nobody reads this
            return error_response(499, "client closed the request", "client_closed_request")
        r = job.stream.result
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": r.finish_reason}
        if job.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": r.text}
        else:
            choice["text"] = r.text
        return JSONResponse({
            "id": f"{'chatcmpl' if job.endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if job.endpoint == "chat" else "text_completion",
            "created": int(time.time()), "model": served, "system_fingerprint": f"verispec-{__version__}",
            "choices": [choice], "usage": usage(job), "verispec": meta(job),
        })

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream_events(job: _Job, request: Request, include_usage: bool) -> AsyncIterator[str]:
        chat = job.endpoint == "chat"
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": served, "system_fingerprint": f"verispec-{__version__}"}
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        try:
            if chat:
                yield sse(chunk(None, role=True))
            async with aclosing(deltas(job, request)) as steps:
                async for delta in steps:
                    yield sse(chunk(delta))
            if job.stream is None or job.stream.result is None:
                return  # client gone
            yield sse({**chunk(None, job.stream.result.finish_reason), "verispec": meta(job)})
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(job)})
            yield "data: [DONE]\n\n"
        except InvalidRequest as exc:
            yield sse({"error": {"message": str(exc), "type": "invalid_request_error", "param": None, "code": None}})
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - one failed generation must not take the server down
            log.exception("generation failed")
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                 "param": None, "code": None}})
            yield "data: [DONE]\n\n"

    async def respond(req, prompt, raw: bool, endpoint: str, request: Request):
        job = prepare(req, prompt, raw, endpoint, await speculation_on())
        if not req.stream:
            return await complete(job, request)
        admit()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _GuardedStream(stream_events(job, request, include_usage), pool.unreserve)

    errors = {status: {"model": ErrorResponse, "description": why} for status, why in (
        (400, "invalid request: the message names the parameter and the fix"),
        (404, "unknown model"), (429, "server busy: retry after a short wait"),
        (500, "a generation failed; the server keeps running"))}
    streamed = {"text/event-stream": {
        "description": "with stream: true, server-sent events whose data are chunk objects (JSON), then [DONE]",
        "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}

    @app.post("/v1/chat/completions", response_model=None, summary="Chat completion (OpenAI-compatible)",
              responses={200: {"model": ChatCompletion, "content": streamed}, **errors})
    async def chat_completions(request: Request):
        req = await parse(request, ChatRequest)
        return await respond(req, req.chat(), False, "chat", request)

    @app.post("/v1/completions", response_model=None, summary="Text completion (OpenAI-compatible)",
              responses={200: {"model": Completion, "content": streamed}, **errors})
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        return await respond(req, req.prompt, True, "completion", request)

    # ------------------------------------------------------------- information and control
    @app.get("/v1/models", response_model=ModelList, summary="The model ids this server answers to")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "verispec"}
                                           for name in sorted(model_names)]}

    @app.get("/health", response_model=Health, summary="Liveness, configuration and load")
    async def health():
        return {"status": "ok", "model": served, "speculation": await speculation_on(),
                "default_drafter": config.default_drafter, "drafters": ["none", *config.drafters], "k": config.k,
                "k_policy": config.k_policy, "running": pool.busy, "queued": pool.waiting,
                "admitted": pool.admitted, "capacity": pool.capacity, "max_batch": config.max_batch}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def authorize(request: Request) -> None:
        if config.admin_token and request.headers.get("authorization") != f"Bearer {config.admin_token}":
            raise APIError(401, "admin endpoints need 'Authorization: Bearer <admin token>'",
                           "authentication_error")

    admin_errors = {401: {"model": ErrorResponse, "description": "missing or wrong admin token"},
                    400: errors[400]}

    @app.get("/admin/speculation", response_model=SpeculationState, responses=admin_errors,
             summary="Whether speculation is on server-wide")
    async def get_speculation(request: Request):
        authorize(request)
        return {"enabled": await speculation_on()}

    @app.post("/admin/speculation", response_model=SpeculationState, responses=admin_errors,
              summary="Turn speculation on or off server-wide (the off switch)")
    async def set_speculation(request: Request):
        authorize(request)
        body = await parse(request, SpeculationSwitch)
        enabled = await switch.set(body.enabled)
        metrics.speculation.set(1 if enabled else 0)
        log.warning("speculation turned %s server-wide", "on" if enabled else "off")
        return {"enabled": enabled}

    app.openapi = lambda: _openapi(app, sorted(model_names), ["none", *config.drafters], token_cap,
                                   target.vocab_size)
    return app


def _openapi(app: FastAPI, model_names: list[str], drafters: list[str], token_cap: int | None,
             vocab_size: int) -> dict:
    """FastAPI's schema plus the request bodies: the handlers read the body themselves (so that every error keeps
    OpenAI's shape and names its parameter), so the models are declared here, with the limits of this server
    (the model ids it serves, the most tokens per request)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest),
                        ("/admin/speculation", SpeculationSwitch)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        props = body.get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": model_names, "title": "Model"}
            # unknown parameters are refused; OpenAI's that change nothing here are accepted at their no-op values
            body["additionalProperties"] = False
            for name, allowed in UNSUPPORTED_UNLESS.items():
                if allowed:
                    values = [v for i, v in enumerate(allowed) if v not in allowed[:i]]  # 0 and 0.0 are one value
                    props[name] = {"enum": values, "description": "accepted only at this value"}
            for name in IGNORED:
                props[name] = {"description": "accepted and ignored"}
        for name in ("max_tokens", "max_completion_tokens"):
            prop = body.get("properties", {}).get(name)
            if prop is not None and token_cap is not None:
                for option in prop.get("anyOf", [prop]):
                    if option.get("type") == "integer":
                        option["maximum"] = token_cap
        for option in props.get("prompt", {}).get("anyOf", []):  # token ids: within the vocabulary
            if option.get("type") == "array" and option.get("items", {}).get("type") == "integer":
                option["items"]["maximum"] = vocab_size - 1
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    options = components.get("SpeculationOptions", {}).get("properties", {})
    if "drafter" in options:
        options["drafter"] = {"anyOf": [{"type": "string", "enum": drafters}, {"type": "null"}], "default": None,
                              "description": "a drafter this server was started with, or 'none'"}
    app.openapi_schema = schema
    return schema

