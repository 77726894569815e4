"""Who may talk to the server, and how every answer is marked: the `Guard` ASGI middleware.

For each HTTP request, in this order:
- a request id: the client's `x-request-id` when it is a short token, else a new one; every
  response carries it back (`x-request-id`), and the server log names it with each failure;
- the Host header against `allowed_hosts` (DNS rebinding: a web page whose name resolves to
  127.0.0.1 would otherwise reach a loopback server from the operator's browser); 400 otherwise;
- the API key: with one set, `Authorization: Bearer KEY` (compared with `hmac.compare_digest`,
  in constant time) or 401 with OpenAI's `invalid_api_key` body; `/health` is always open,
  `/metrics` too when `public_metrics`;
- bodies: POST bodies must be `application/json` (415 otherwise): a browser sends text/plain and
  form bodies cross-origin without a preflight, JSON it does not.
Anything that escapes the application becomes a 500 whose body names the request id and no
exception text; the traceback goes to the log with the id. CORS headers come only from the
`CORSMiddleware` that `app` adds when the operator names allowed origins.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchkv.serve.access import Access, host_name, key_matches
from batchkv.serve.protocol import APIError

log = logging.getLogger("batchkv.serve")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("batchkv_request_id", default="-")
OPEN_PATHS = frozenset({"/health"})
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def error_response(status: int, body: dict[str, Any], request_id: str) -> tuple[Message, Message]:
    """The two ASGI messages of a JSON error answer."""
    headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": msgspec.json.encode(body)}


def internal_error(request_id: str) -> APIError:
    """The 500 every unexpected failure answers: the request id, never the exception's text."""
    return APIError(500, f"internal error (request {request_id}; the server log has the detail)", type="server_error")


class Guard:
    """ASGI middleware applying `access` to every HTTP request (see the module docstring);
    `count(status)` is told of each refusal it answers."""

    def __init__(self, app: ASGIApp, access: Access, count: Callable[[int], None] = lambda status: None) -> None:
        self.app, self.access, self.count = app, access, count
        self.hosts = None if access.allowed_hosts is None else {host_name(h) for h in access.allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        request_id = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        started = False

        async def send_marked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            refusal = self.refusal(scope["method"], scope["path"], headers)
            if refusal is not None:
                log.info("request %s refused (%d): %s", request_id, refusal.status, refusal.message)
                self.count(refusal.status)
                for message in error_response(refusal.status, refusal.body(), request_id):
                    await send(message)
                return
            await self.app(scope, receive, send_marked)
        except ClientDisconnect:  # went away while its body was read: nobody to answer
            log.info("request %s: the client disconnected", request_id)
        except Exception:
            log.exception("request %s failed", request_id)
            if not started:  # else the client sees the stream end early
                for message in error_response(500, internal_error(request_id).body(), request_id):
                    await send(message)
        finally:
            REQUEST_ID.reset(token)

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> APIError | None:
        """The APIError a request gets before the application sees it, or None."""
        if self.hosts is not None and "host" in headers and host_name(headers["host"]) not in self.hosts:
            return APIError(
                400,
                f"the Host header {headers['host']!r} is not one this server answers to (it answers to "
                f"{', '.join(sorted(self.hosts))}; the server's --allowed-hosts)",
                code="invalid_host",
            )
        key = self.access.api_key
        open_path = path in OPEN_PATHS or (path == "/metrics" and self.access.public_metrics)
        if key is not None and not open_path and not key_matches(headers.get("authorization"), key):
            return APIError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>' with the server's key",
                code="invalid_api_key",
            )
        if method in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return APIError(
                    415,
                    f"the request body's Content-Type is {media or 'missing'!r}; this server reads "
                    "'application/json' only",
                    code="unsupported_media_type",
                )
        return None
