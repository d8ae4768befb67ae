"""What keeps a server exposed on a network safe: its limits' defaults, the API-key check and the request-body
bound (an ASGI middleware in front of every route), and whether a host is loopback.

Every limit answers in OpenAI's error shape with a 4xx naming the limit and the option that raises it; 429 and 503
carry ``Retry-After``. Keys are compared in constant time (``hmac.compare_digest``, every key tried), so a timing
difference cannot tell how much of a guessed key was right.
"""

from __future__ import annotations

import hmac

from .http import error_response

API_KEY_ENV = "VERISPEC_API_KEY"  # one key or several, comma-separated
ADMIN_TOKEN_ENV = "VERISPEC_ADMIN_TOKEN"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413) before it is read whole
DEFAULT_MAX_MESSAGES = 256
DEFAULT_QUEUE_TIMEOUT = 60.0  # seconds a request may wait for a free slot before a 503
DEFAULT_SHUTDOWN_GRACE = 30.0  # seconds running requests get to finish after SIGTERM


def split_keys(text: str | None) -> tuple[str, ...]:
    """API keys from a comma-separated string (an option or $VERISPEC_API_KEY), blanks dropped."""
    return tuple(k.strip() for k in (text or "").split(",") if k.strip())


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


OPEN_PATHS = ("/health",)  # answered without a key: load balancers and orchestrators probe it


def key_matches(given: str | None, keys: tuple[str, ...]) -> bool:
    """Whether ``given`` is one of ``keys``, compared in constant time (all keys compared, whatever matched)."""
    if given is None:
        return False
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


def bearer(headers) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (ASGI headers: a list of byte pairs)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            text = value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class Guard:
    """ASGI middleware: every route but ``OPEN_PATHS`` (and CORS preflights) needs one of ``keys``, when there are
    any (``/admin`` routes take the admin token instead, when the server has one: ``Server.authorize``); a body
    whose declared length is over ``max_body_bytes`` gets a 413 before any of it is read (bodies without a length
    are counted as they are read: ``app.parse``)."""

    def __init__(self, app, keys: tuple[str, ...], max_body_bytes: int, admin_token: str | None) -> None:
        self.app, self.keys, self.max_body_bytes, self.admin_token = app, keys, max_body_bytes, admin_token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = scope.get("headers", [])
        guarded_elsewhere = path.startswith("/admin/") and self.admin_token
        if self.keys and path not in OPEN_PATHS and not guarded_elsewhere \
                and not key_matches(bearer(headers), self.keys):
            refusal = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with a key "
                                          "this server was started with (--api-key)", "authentication_error",
                                     code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        for name, value in headers:
            if name.lower() == b"content-length":
                length = int(value) if value.isdigit() else None
                if length is None or length > self.max_body_bytes:
                    refusal = error_response(400, "Content-Length is not a number") if length is None else \
                        error_response(413, body_too_large(self.max_body_bytes), code="request_too_large")
                    await refusal(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def body_too_large(limit: int) -> str:
    return (f"request body is larger than this server takes ({limit} bytes); send a shorter prompt, or start the "
            "server with a larger --max-body-bytes")

