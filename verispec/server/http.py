"""OpenAI's error shape and the HTTP plumbing of the server: errors, a stream that always cleans up, request counting."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Callable

import anyio

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from .metrics import Metrics


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


class RequestTimeout(Exception):
    """A generation ran past the server's --request-timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the generation ran past this server's request timeout ({seconds:g} s) and was stopped; "
                         "ask for fewer tokens, or start the server with a larger --request-timeout")


RETRY_AFTER_S = 1  # what 429 and 503 answers tell a client to wait before retrying


def unavailable(message: str) -> APIError:
    """A 503 that tells the client when to retry."""
    return APIError(503, message, "service_unavailable", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status,
                        headers=headers)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"missing required parameter '{loc}'", loc or None
    return (f"invalid value for '{loc}': {msg}" if loc else msg), loc or None


class GuardedStream(StreamingResponse):
    """A streaming response that closes its body and runs ``on_finish`` however it ends, even if the body never
    started.

    Closing the body matters when the response is cancelled while it waits to send a chunk (Ray Serve cancels a
    replica's request when its client leaves): the body generator is then left paused, not closed, and its
    generation would go on, unseen, until the garbage collector found it (a CI run once waited a minute for it)."""

    def __init__(self, body: AsyncIterator[str], on_finish: Callable[[], None],
                 on_unstarted: Callable[[], None] | None = None) -> None:
        self._started = False

        async def tracked() -> AsyncIterator[str]:
            self._started = True
            async with aclosing(body) as items:
                async for item in items:
                    yield item

        super().__init__(tracked(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_finish, self._on_unstarted = on_finish, on_unstarted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                if not self._started and self._on_unstarted is not None:
                    self._on_unstarted()  # the body's own cleanup never ran: what it holds is given back here
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):  # the request may be cancelled: closing must still run
                        await aclose()
            finally:
                self._on_finish()


class CountRequests:
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
