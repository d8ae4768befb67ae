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
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
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
from .http import (RETRY_AFTER_S, APIError, CountRequests, GuardedStream, RequestTimeout, error_response,
                   unavailable, validation_message)
from .limits import Guard, bearer, body_too_large, key_matches
from .metrics import Metrics
from .pool import SlotPool
from .runs import DONE, BatchedRun, Job, ThreadedRun
from .schemas import (IGNORED, UNSUPPORTED_UNLESS, ChatCompletion, ChatRequest, Completion, CompletionRequest,
                      ErrorResponse, Health, ModelList, SpeculationState, SpeculationSwitch)

log = logging.getLogger("verispec.server")


class Slot(dict):
    """A slot's decoders by drafter name; those of deferred drafters are built on the slot's first request for them
    (a slot is used by one request at a time)."""

    def __init__(self, later: dict):
        super().__init__()
        self._later = later

    def __missing__(self, name: str) -> SpeculativeDecoder:
        if name not in self._later:
            raise KeyError(name)
        built = self[name] = self._later.pop(name)()
        return built


@dataclass
class Plan:
    """A request checked and not yet tokenized: what its jobs will be."""

    endpoint: str
    decoder_name: str
    disabled_by: str | None
    options: dict[str, Any]
    seeds: list


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
            engine = BatchEngine(target, max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
                                 prompt_cache_bytes=config.prompt_cache_mb << 20)
        self.pool = SlotPool(self._make_slot, config.max_batch if self.batched else config.max_concurrency,
                             config.max_queue)
        if self.batched:
            for decoder in self.pool.peek().values():  # every slot has the same drafters: check one
                engine.check_decoder(decoder)  # trees cannot share a pass: refused at start, not per request
            self.worker = BatchWorker(engine)
            self.metrics.watch_batch(engine)
        self.encoder = SpeculativeDecoder(target)  # checks requests (the engine's own checks); never generates
        # prompts are tokenized here, one at a time (a tokenizer is not shared between threads), off the event loop
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenize")
        self.closing = False  # set on SIGTERM: new requests get a 503 while running ones finish
        self.metrics.queue_depth.set_function(lambda: self.pool.waiting)
        self.token_cap = config.max_tokens_limit or target.context_length
        # the most choices (n) per request: its samples are rows of one batch, or, unbatched, admitted generations
        self.n_cap = config.max_batch if self.batched else self.pool.capacity

    def _make_slot(self) -> dict[str, SpeculativeDecoder]:
        config = self.config

        def decoder(factory):
            return lambda: SpeculativeDecoder(self.target, factory(), k=config.k, k_policy=config.k_policy)

        slot = Slot({name: decoder(factory) for name, factory in config.drafters.items() if name in config.deferred})
        slot[NONE] = SpeculativeDecoder(self.target, None, k=config.k, k_policy=config.k_policy)
        for name, factory in config.drafters.items():
            if name not in config.deferred:
                slot[name] = decoder(factory)()
        return slot

    async def speculation_on(self) -> bool:
        enabled = await self.switch.get()
        self.metrics.speculation.set(1 if enabled else 0)
        return enabled

    # ------------------------------------------------------------- generation
    def prepare(self, req, endpoint: str, speculation: bool) -> "Plan":
        """What a request asks for, checked before it is admitted and without tokenizing (cheap): the model and
        drafter it names, the number of choices, the token and message limits (a 4xx naming the parameter)."""
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
        messages = getattr(req, "messages", None)
        if messages is not None and len(messages) > config.max_messages:
            raise APIError(400, f"{len(messages)} messages is more than this server takes per request "
                                f"({config.max_messages}); send fewer, or start it with a larger --max-messages",
                           param="messages", code="too_many_messages")
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
        return Plan(endpoint, name, disabled_by, options, sample_seeds(req.seed, n))

    def encode(self, plan: "Plan", prompt, raw: bool) -> list[Job]:
        """The jobs an admitted request becomes (one per sample): its prompt tokenized and put through the
        engine's own checks (a 400 naming the parameter), and the prompt-token limit. Runs in the tokenizing thread,
        never on the event loop: a huge prompt takes its time there while every stream goes on."""
        try:
            checked = self.encoder.request(prompt, raw=raw, **plan.options)
        except InvalidRequest as exc:
            param = exc.param
            if param == "prompt" and plan.endpoint == "chat":
                param = "messages"
            raise APIError(400, str(exc), param=param, code=exc.code) from None
        limit = self.config.max_prompt_tokens
        if limit is not None and len(checked.ids) > limit:
            raise APIError(400, f"the prompt is {len(checked.ids)} tokens, more than this server takes ({limit}); "
                                "send a shorter one, or start the server with a larger --max-prompt-tokens",
                           param="messages" if plan.endpoint == "chat" else "prompt", code="prompt_too_long")
        return [Job(plan.endpoint, plan.decoder_name, checked.ids, {**plan.options, "seed": seed}, plan.disabled_by, i)
                for i, seed in enumerate(plan.seeds)]

    def admit(self, n: int) -> None:
        pool = self.pool
        if self.closing:
            raise unavailable("the server is shutting down; retry on another instance or after it restarts")
        if not pool.reserve(n):
            raise APIError(429, f"server busy: {pool.admitted} generations are running or queued (limit "
                                f"{pool.capacity}); retry after a short wait", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def acquire(self, n: int) -> list:
        """``n`` slots for an admitted request, waiting at most ``--queue-timeout`` (then a 503)."""
        timeout = self.config.queue_timeout
        try:
            return await asyncio.wait_for(self.pool.acquire(n), timeout)
        except asyncio.TimeoutError:
            self.metrics.queue_timeouts.inc()
            raise unavailable(f"no free slot within {timeout:g} s (--queue-timeout): the server is busy; retry after "
                              "a short wait") from None

    def problem(self) -> str | None:
        """Why this server cannot answer generation requests now (shutting down, its batch worker dead), or None.
        /health answers 503 with it, and a Ray replica's health check fails on it."""
        if self.closing:
            return "shutting_down"
        if self.worker is not None and not self.worker.alive:
            return "worker_stopped"
        return None

    def close(self) -> None:
        """Stop what runs beside the handlers: the batch worker, a background compile's child process, the
        tokenizing thread (the lifespan's end, after running requests finished or were cut)."""
        self.closing = True
        if self.worker is not None:
            self.worker.stop()
        if self.config.compile_job is not None:
            self.config.compile_job.stop()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)
        log.warning("shut down: admitting nothing, batch worker and background work stopped")

    async def deltas(self, jobs: list[Job], request: Request, slots: list) -> AsyncIterator[tuple[int, str]]:
        """``(sample index, text delta)`` of an admitted request's jobs, then ``(index, DONE)`` as each ends, stepped by the batch worker (its samples as
        rows of one batch) or, unbatched, in a worker thread (its samples one after another), on ``slots`` (taken
        by ``acquire``; given back here however this ends); stops when the client leaves, and past
        ``--request-timeout`` with a ``RequestTimeout``. Metrics move with every delta."""
        metrics, pool = self.metrics, self.pool
        arrived = time.perf_counter()
        deadline = None if self.config.request_timeout is None else arrived + self.config.request_timeout
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
                    if deadline is not None and time.perf_counter() > deadline:
                        metrics.request_timeouts.inc()
                        raise RequestTimeout(self.config.request_timeout)
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

    async def complete(self, jobs: list[Job], request: Request, slots: list) -> JSONResponse:
        try:
            async with aclosing(self.deltas(jobs, request, slots)) as steps:
                async for _ in steps:
                    pass
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        except RequestTimeout as exc:
            raise APIError(408, str(exc), "timeout_error", code="request_timeout") from None
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

    async def stream_events(self, jobs: list[Job], request: Request, slots: list,
                            include_usage: bool) -> AsyncIterator[str]:
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
            async with aclosing(self.deltas(jobs, request, slots)) as steps:
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
        except RequestTimeout as exc:
            yield sse({"error": {"message": str(exc), "type": "timeout_error", "param": None,
                                 "code": "request_timeout"}})
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - one failed generation must not take the server down
            log.exception("generation failed")
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                 "param": None, "code": None}})
            yield "data: [DONE]\n\n"

    async def respond(self, req, prompt, raw: bool, endpoint: str, request: Request):
        """Answer a generation request: checked (cheap), admitted (429 when full, 503 when shutting down), its
        prompt tokenized off the event loop, then given its slots (503 past --queue-timeout), all before the first
        byte of the answer, so each of these ends with its own status; then generated, streamed or whole."""
        plan = self.prepare(req, endpoint, await self.speculation_on())
        n = len(plan.seeds)
        self.admit(n)
        try:
            jobs = await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.encode, plan, prompt, raw)
            slots = await self.acquire(n if self.batched else 1)
        except BaseException:
            self.pool.unreserve(n)
            raise
        if not req.stream:
            try:
                return await self.complete(jobs, request, slots)  # the generation gives the slots back
            finally:
                self.pool.unreserve(n)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return GuardedStream(self.stream_events(jobs, request, slots, include_usage),
                             on_finish=lambda: self.pool.unreserve(n), on_unstarted=lambda: self.give_back(slots))

    def give_back(self, slots: list) -> None:
        """Slots taken for a stream whose body never started (its client left first)."""
        for slot in slots:
            self.pool.release(slot)

    def authorize(self, request: Request) -> None:
        token = self.config.admin_token
        if not token:
            return  # the API keys guard /admin, if the server has any (limits.Guard)
        if not key_matches(bearer(request.scope["headers"]), (token,)):
            raise APIError(401, "admin endpoints need 'Authorization: Bearer <admin token>'", "authentication_error")


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _server(request: Request) -> Server:
    return request.app.state.server


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    """The request body as ``schema``, every problem a 400 naming the parameter; a body over --max-body-bytes is a
    413 as soon as it passes the limit (one sent without a length is counted as it arrives)."""
    limit = _server(request).config.max_body_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, body_too_large(limit), code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
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
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


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
    (401, "missing or wrong API key (servers started with --api-key)"),
    (404, "unknown model"), (408, "the generation ran past --request-timeout"),
    (413, "request body over --max-body-bytes"), (429, "server busy: retry after Retry-After seconds"),
    (500, "a generation failed; the server keeps running"),
    (503, "shutting down, or no free slot within --queue-timeout: retry after Retry-After seconds"))}
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


@router.get("/health", response_model=Health, summary="Liveness, configuration and load",
            responses={503: {"model": Health, "description": "shutting down, or the batch worker has stopped"}})
async def health(request: Request):
    """200 while the server answers generation requests; 503 (the same body, ``status`` saying why) while it
    shuts down or after its batch worker died, so a load balancer or orchestrator takes it out of rotation."""
    server = _server(request)
    config, pool = server.config, server.pool
    problem = server.problem()
    body = {"status": problem or "ok", "model": server.served, "speculation": await server.speculation_on(),
            "default_drafter": config.default_drafter, "drafters": server.drafter_names, "k": config.k,
            "k_policy": config.k_policy, "running": pool.busy, "queued": pool.waiting,
            "admitted": pool.admitted, "capacity": pool.capacity, "max_batch": config.max_batch,
            "compiled_step": config.compile_job.state if config.compile_job else
            ("compiled" if server.target.step is not None else "eager")}
    if problem:
        return JSONResponse(body, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return body


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

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:  # after uvicorn's graceful wait (--shutdown-grace): running requests finished or were cut
            server.close()

    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API with lossless speculative decoding")
    app.add_middleware(CountRequests, metrics=server.metrics)
    # keys and the body bound in front of every route; CORS outermost, so a browser's preflight needs no key
    app.add_middleware(Guard, keys=config.api_keys, max_body_bytes=config.max_body_bytes,
                       admin_token=config.admin_token)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["Retry-After"])
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

