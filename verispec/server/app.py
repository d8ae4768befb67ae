"""The OpenAI-compatible HTTP API over the engine. No algorithm code here: requests become engine calls.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with ``stream``), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET/POST /admin/speculation (the server-wide off switch).
Every error is OpenAI's shape {"error": {"message", "type", "param", "code"}} with a 4xx status for the
client's mistakes; a failure inside a generation is a 500 for that request only.

The handlers are module-level functions on one router; what they share (the target, the slots, the batch worker,
the metrics) is a ``Server`` kept in ``app.state.server``. A request is checked by the engine's own ``request``
(the same checks a Python caller gets), before it is admitted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..version import __version__
from ..batching import BatchEngine, BatchWorker, join_siblings, sample_seeds
from ..drafters import NONE, drafter_names, get_spec
from ..engine import SpeculativeDecoder
from ..errors import InvalidRequest
from .config import LocalSwitch, ServerConfig
from .http import APIError, CountRequests, GuardedStream, error_response, validation_message
from .metrics import Metrics
from .pool import SlotPool
from .runs import DONE, BatchedRun, Job, ThreadedRun
from .schemas import (IGNORED, UNSUPPORTED_UNLESS, ChatCompletion, ChatRequest, Completion, CompletionRequest,
                      ErrorResponse, Health, ModelList, SpeculationState, SpeculationSwitch)

log = logging.getLogger("verispec.server")


class Server:
    """What the handlers share: the configuration, the slots of decoders, the batch worker, the metrics and the
    speculation switch; and the steps of answering a generation request."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        target = self.target = config.target
        self.served = config.served_model_name or target.name
        self.model_names = {self.served, *config.extra_model_names}
        self.drafter_names = [NONE, *config.drafters]
        self.metrics = Metrics(config.window_seconds)
        self.switch = config.switch or LocalSwitch(config.speculation)
        self.metrics.speculation.set(1 if config.speculation else 0)
        if config.default_drafter not in self.drafter_names:
            raise ValueError(f"default drafter {config.default_drafter!r} is not among {list(config.drafters)}")
        self.batched = config.max_batch > 1
        self.worker: BatchWorker | None = None
        if self.batched:
            if config.max_concurrency != 1:
                raise ValueError("max concurrency (threads of unbatched slots) applies with max batch 1 only; with "
                                 "batching, max batch is the number of requests generating at once")
            engine = BatchEngine(target, max_batch=config.max_batch, prefill_chunk=config.prefill_chunk)
        self.pool = SlotPool(self._make_slot, config.max_batch if self.batched else config.max_concurrency,
                             config.max_queue)
        if self.batched:
            for decoder in self.pool.peek().values():  # every slot has the same drafters: check one
                engine.check_decoder(decoder)  # trees cannot share a pass: refused at start, not per request
            self.worker = BatchWorker(engine)
            self.metrics.watch_batch(engine)
        self.encoder = SpeculativeDecoder(target)  # checks requests (the engine's own checks); never generates
        self.metrics.queue_depth.set_function(lambda: self.pool.waiting)
        self.token_cap = config.max_tokens_limit or target.context_length
        # the most choices (n) per request: its samples are rows of one batch, or, unbatched, admitted generations
        self.n_cap = config.max_batch if self.batched else self.pool.capacity

    def _make_slot(self) -> dict[str, SpeculativeDecoder]:
        config = self.config
        slot = {NONE: SpeculativeDecoder(self.target, None, k=config.k, k_policy=config.k_policy)}
        for name, factory in config.drafters.items():
            slot[name] = SpeculativeDecoder(self.target, factory(), k=config.k, k_policy=config.k_policy)
        return slot

    async def speculation_on(self) -> bool:
        enabled = await self.switch.get()
        self.metrics.speculation.set(1 if enabled else 0)
        return enabled

    # ------------------------------------------------------------- generation
    def prepare(self, req, prompt, raw: bool, endpoint: str, speculation: bool) -> list[Job]:
        """The jobs a request becomes (one per sample, ``n``), checked: the model and drafter it names, then the
        engine's own checks of the prompt and options (a 400 naming the parameter)."""
        config = self.config
        if req.model not in self.model_names:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves "
                                f"{', '.join(sorted(self.model_names))} (see GET /v1/models)", "not_found_error",
                           "model", "model_not_found")
        opts = req.verispec
        if opts.drafter is not None and opts.drafter not in self.drafter_names:
            hint = ""
            if opts.drafter in drafter_names():
                spec = get_spec(opts.drafter)
                hint = (f" ({opts.drafter} drafts token trees, which verify one sequence per pass: a server offers it "
                        f"when started with --max-batch 1)" if self.batched and spec.drafts_trees(spec.defaults())
                        else f" (a server offers {opts.drafter} when started with --drafter {opts.drafter} or one of "
                             "its options)")
            raise APIError(400, f"drafter '{opts.drafter}' is not available; this server has: "
                                f"{', '.join(self.drafter_names)}{hint}", param="verispec.drafter")
        n = req.n
        if n > self.n_cap:
            how = (f"decodes at once (max batch {config.max_batch}); ask for at most {self.n_cap} choices or start "
                   f"the server with --max-batch {n}" if self.batched else
                   f"admits at once ({self.n_cap}); ask for at most {self.n_cap} choices or raise --max-queue")
            raise APIError(400, f"n = {n} is more than this server {how}", param="n")
        disabled_by = None
        if not speculation:
            name, disabled_by = NONE, "server"
        elif not opts.speculation:
            name, disabled_by = NONE, "request"
        else:
            name = opts.drafter or config.default_drafter
        cap = self.token_cap
        max_tokens = req.token_limit() or min(config.default_max_tokens, cap or config.default_max_tokens)
        for param in ("max_completion_tokens", "max_tokens"):  # both are checked, also the one that is not used
            asked = getattr(req, param, None)
            if cap is not None and asked is not None and asked > cap:
                raise APIError(400, f"{param} = {asked} is more than this server allows per request "
                                    f"({cap}); ask for fewer tokens", param=param)
        options = dict(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                       stop=req.stop, k=opts.k)
        try:
            checked = self.encoder.request(prompt, raw=raw, **options)
        except InvalidRequest as exc:
            param = exc.param
            if param == "prompt" and endpoint == "chat":
                param = "messages"
            raise APIError(400, str(exc), param=param, code=exc.code) from None
        return [Job(endpoint, name, checked.ids, {**options, "seed": seed}, disabled_by, i)
                for i, seed in enumerate(sample_seeds(req.seed, n))]

    def admit(self, n: int) -> None:
        pool = self.pool
        if not pool.reserve(n):
            raise APIError(429, f"server busy: {pool.admitted} generations are running or queued (limit "
                                f"{pool.capacity}); retry after a short wait", "rate_limit_error",
                           code="rate_limit_exceeded")

    async def deltas(self, jobs: list[Job], request: Request) -> AsyncIterator[tuple[int, str]]:
        """``(sample index, text delta)`` of an admitted request's jobs, then ``(index, DONE)`` as each ends, stepped by the batch worker (its samples as
        rows of one batch) or, unbatched, in a worker thread (its samples one after another); stops when the client
        leaves. Metrics move with every delta."""
        metrics, pool = self.metrics, self.pool
        arrived = time.perf_counter()
        slots = await pool.acquire(len(jobs) if self.batched else 1)
        decoders = [slot[job.decoder_name] for slot, job in zip(slots, jobs)]
        join_siblings(decoders, {} if len(jobs) > 1 else None)  # samples draft from each other's text
        gone, first = False, True
        metrics.running.inc(len(jobs))
        metrics.prompt_tokens.inc(len(jobs[0].prompt_ids))  # prefilled once; the other samples copy it
        runs: list = []
        try:
            steps = self._batched(jobs, slots, runs) if self.batched else self._threaded(jobs, slots[0], runs)
            seen = [0] * len(jobs)
            async with aclosing(steps) as deltas:
                async for i, delta in deltas:
                    seen[i] = metrics.observe_steps(runs[i].stats, seen[i])
                    if delta is DONE:  # sample i has finished (its result is set)
                        yield i, delta
                        continue
                    if first:
                        metrics.first_token.observe(time.perf_counter() - arrived)
                        first = False
                    if await request.is_disconnected():
                        gone = True
                        return
                    yield i, delta
            metrics.request_latency.labels(jobs[0].endpoint).observe(time.perf_counter() - arrived)
        except (asyncio.CancelledError, GeneratorExit):  # the server noticed the client leave first
            gone = True
            raise
        finally:
            if gone:
                metrics.disconnects.inc()
            metrics.running.dec(len(jobs))
            for run in runs:
                run.close()  # a batched run gives its slot back once the engine no longer uses its decoders
            if not self.batched:
                pool.release(slots[0])

    async def _batched(self, jobs: list[Job], slots, runs: list) -> AsyncIterator[tuple[int, Any]]:
        queue: asyncio.Queue = asyncio.Queue()
        # every slot gets its run before any starts: closing a run that never started gives its slot back
        runs += [BatchedRun(self.worker, slot, self.pool, queue, job.index) for job, slot in zip(jobs, slots)]
        for job, run in zip(jobs, runs):
            job.stream = run
            await run.start(job)
        live = len(jobs)
        while live:
            i, item = await queue.get()
            if item is DONE:
                if runs[i].seq.error is not None:
                    raise runs[i].seq.error
                live -= 1
            yield i, item

    async def _threaded(self, jobs: list[Job], slot, runs: list) -> AsyncIterator[tuple[int, Any]]:
        for job in jobs:
            run = ThreadedRun(slot)
            runs.append(run)
            job.stream = run
            await run.start(job)
            while True:
                delta = await run.next()
                yield job.index, delta
                if delta is DONE:
                    break

    @staticmethod
    def meta(job: Job) -> dict:
        result = job.stream.result
        d = {key: v for key, v in result.stats.to_dict().items() if not key.startswith("step_")}
        d.update(speculation=job.decoder_name != NONE, speculation_disabled_by=job.disabled_by, seed=result.seed)
        return d

    @classmethod
    def meta_of(cls, jobs: list[Job]) -> dict:
        """The ``verispec`` field: one sample's stats, or with ``n`` > 1 each sample's under ``choices``."""
        if len(jobs) == 1:
            return cls.meta(jobs[0])
        job = jobs[0]
        return {"speculation": job.decoder_name != NONE, "speculation_disabled_by": job.disabled_by,
                "choices": [cls.meta(j) for j in jobs]}

    @staticmethod
    def usage(jobs: list[Job]) -> dict:
        prompt = len(jobs[0].prompt_ids)  # once: the samples share the prompt
        n = sum(len(job.stream.result.token_ids) for job in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    def _base(self, endpoint: str, chunk: bool) -> dict:
        chat = endpoint == "chat"
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.served, "system_fingerprint": f"verispec-{__version__}"}

    @staticmethod
    def _finished(jobs: list[Job]) -> bool:
        return all(job.stream is not None and job.stream.result is not None for job in jobs)

    async def complete(self, jobs: list[Job], request: Request) -> JSONResponse:
        self.admit(len(jobs))
        try:
            async with aclosing(self.deltas(jobs, request)) as steps:
                async for _ in steps:
                    pass
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        finally:
            self.pool.unreserve(len(jobs))
        if not self._finished(jobs):  # the client left; nobody reads this
            return error_response(499, "client closed the request", "client_closed_request")
        choices = []
        for job in jobs:
            r = job.stream.result
            choice: dict[str, Any] = {"index": job.index, "logprobs": None, "finish_reason": r.finish_reason}
            if job.endpoint == "chat":
                choice["message"] = {"role": "assistant", "content": r.text}
            else:
                choice["text"] = r.text
            choices.append(choice)
        return JSONResponse({**self._base(jobs[0].endpoint, False), "choices": choices, "usage": self.usage(jobs),
                             "verispec": self.meta_of(jobs)})

    async def stream_events(self, jobs: list[Job], request: Request, include_usage: bool) -> AsyncIterator[str]:
        chat = jobs[0].endpoint == "chat"
        base = self._base(jobs[0].endpoint, True)
        extra = {"usage": None} if include_usage else {}

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        try:
            if chat:
                for job in jobs:
                    yield sse(chunk(job.index, None, role=True))
            async with aclosing(self.deltas(jobs, request)) as steps:
                async for i, delta in steps:
                    if delta is DONE:  # this sample is finished: its last chunk, with its stats
                        job = jobs[i]
                        yield sse({**chunk(i, None, job.stream.result.finish_reason), "verispec": self.meta(job)})
                    else:
                        yield sse(chunk(i, delta))
            if not self._finished(jobs):
                return  # client gone
            if include_usage:
                yield sse({**base, "choices": [], "usage": self.usage(jobs)})
            yield "data: [DONE]\n\n"
        except InvalidRequest as exc:
            yield sse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param,
                                 "code": exc.code}})
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - one failed generation must not take the server down
            log.exception("generation failed")
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                 "param": None, "code": None}})
            yield "data: [DONE]\n\n"

    async def respond(self, req, prompt, raw: bool, endpoint: str, request: Request):
        jobs = self.prepare(req, prompt, raw, endpoint, await self.speculation_on())
        if not req.stream:
            return await self.complete(jobs, request)
        self.admit(len(jobs))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n = len(jobs)
        return GuardedStream(self.stream_events(jobs, request, include_usage), lambda: self.pool.unreserve(n))

    def authorize(self, request: Request) -> None:
        token = self.config.admin_token
        if token and request.headers.get("authorization") != f"Bearer {token}":
            raise APIError(401, "admin endpoints need 'Authorization: Bearer <admin token>'", "authentication_error")


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _server(request: Request) -> Server:
    return request.app.state.server


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    """The request body as ``schema``, every problem a 400 naming the parameter."""
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
        message, param = validation_message(exc)
        raise APIError(400, message, param=param) from None


# ----------------------------------------------------------------- errors
async def _api_error(request: Request, exc: APIError):
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)


async def _http_error(request: Request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = error_response(exc.status_code, str(exc.detail), kind)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # every method of the path (the path's routes are separate, one per method)
        methods = request.app.openapi().get("paths", {}).get(request.url.path, {})
        response.headers["Allow"] = ", ".join(m.upper() for m in methods)
    return response


async def _validation_error(request: Request, exc: RequestValidationError):
    return error_response(400, str(exc.errors()[0].get("msg", "invalid request")))


async def _server_error(request: Request, exc: Exception):
    log.exception("request failed")
    return error_response(500, f"internal error: {type(exc).__name__}; the server is still running", "server_error")


# ----------------------------------------------------------------- routes
router = APIRouter()
ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "invalid request: the message names the parameter and the fix"),
    (404, "unknown model"), (429, "server busy: retry after a short wait"),
    (500, "a generation failed; the server keeps running"))}
ADMIN_ERRORS = {401: {"model": ErrorResponse, "description": "missing or wrong admin token"}, 400: ERRORS[400]}
STREAMED = {"text/event-stream": {
    "description": "with stream: true, server-sent events whose data are chunk objects (JSON), then [DONE]",
    "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}


@router.post("/v1/chat/completions", response_model=None, summary="Chat completion (OpenAI-compatible)",
             responses={200: {"model": ChatCompletion, "content": STREAMED}, **ERRORS})
async def chat_completions(request: Request):
    req = await parse(request, ChatRequest)
    return await _server(request).respond(req, req.chat(), False, "chat", request)


@router.post("/v1/completions", response_model=None, summary="Text completion (OpenAI-compatible)",
             responses={200: {"model": Completion, "content": STREAMED}, **ERRORS})
async def completions(request: Request):
    req = await parse(request, CompletionRequest)
    return await _server(request).respond(req, req.prompt, True, "completion", request)


@router.get("/v1/models", response_model=ModelList, summary="The model ids this server answers to")
async def models(request: Request):
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "verispec"}
                                       for name in sorted(_server(request).model_names)]}


@router.get("/health", response_model=Health, summary="Liveness, configuration and load")
async def health(request: Request):
    server = _server(request)
    config, pool = server.config, server.pool
    return {"status": "ok", "model": server.served, "speculation": await server.speculation_on(),
            "default_drafter": config.default_drafter, "drafters": server.drafter_names, "k": config.k,
            "k_policy": config.k_policy, "running": pool.busy, "queued": pool.waiting,
            "admitted": pool.admitted, "capacity": pool.capacity, "max_batch": config.max_batch,
            "compiled_step": config.compile_job.state if config.compile_job else
            ("compiled" if getattr(server.target, "step", None) is not None else "eager")}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
async def prometheus(request: Request):
    return Response(generate_latest(_server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/admin/speculation", response_model=SpeculationState, responses=ADMIN_ERRORS,
            summary="Whether speculation is on server-wide")
async def get_speculation(request: Request):
    server = _server(request)
    server.authorize(request)
    return {"enabled": await server.speculation_on()}


@router.post("/admin/speculation", response_model=SpeculationState, responses=ADMIN_ERRORS,
             summary="Turn speculation on or off server-wide (the off switch)")
async def set_speculation(request: Request):
    server = _server(request)
    server.authorize(request)
    body = await parse(request, SpeculationSwitch)
    enabled = await server.switch.set(body.enabled)
    server.metrics.speculation.set(1 if enabled else 0)
    log.warning("speculation turned %s server-wide", "on" if enabled else "off")
    return {"enabled": enabled}


def create_app(config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``config`` (a ``Server`` in ``app.state.server``)."""
    server = Server(config)
    app = FastAPI(title="verispec", version=__version__,
                  description="OpenAI-compatible API with lossless speculative decoding")
    app.add_middleware(CountRequests, metrics=server.metrics)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(router)
    app.state.server = server
    if config.compile_job is not None:
        config.compile_job.start()
    app.state.config, app.state.metrics, app.state.pool, app.state.worker = (config, server.metrics, server.pool,
                                                                             server.worker)
    app.openapi = lambda: _openapi(app, sorted(server.model_names), server.drafter_names, server.token_cap,
                                   server.target.vocab_size, server.n_cap)
    return app


def _openapi(app: FastAPI, model_names: list[str], drafters: list[str], token_cap: int | None,
             vocab_size: int, n_cap: int) -> dict:
    """FastAPI's schema plus the request bodies: the handlers read the body themselves (so that every error keeps
    OpenAI's shape and names its parameter), so the models are declared here, with the limits of this server
    (the model ids it serves, the most tokens and choices per request)."""
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
        if "n" in props:
            props["n"]["maximum"] = min(props["n"].get("maximum", n_cap), n_cap)
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

