"""HTTP errors raised before any route runs: the parser's (a bad request line, a header too
long, a bad chunk, a corrupt gzip body) and the ones aiohttp answers itself.

aiohttp answers these with ``text/plain`` and logs a traceback holding the bad line, which
may be a client's ``Authorization`` header (``Bearer <token>\\x00``). Here they get the
transport's JSON error body and the closest status (414 for a request line too long, 431 for
a header too long or too many), one log line without the request's bytes, and never an echo
of them.

The routes' errors are JSON the same way: ``HttpError`` (a refusal before the front door, with
its own HTTP status), ``error_body``/``error_response`` (any ``NmtError``, by its kind's
status; ``WWW-Authenticate: Bearer`` on a 401) and ``route_error`` (no such path, a method
not allowed).
"""

from __future__ import annotations

import json
import logging
from typing import Awaitable, Callable, Mapping, TypeVar

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestPayloadError

from service.api.frontend import status as kind_status
from service.errors import ErrorKind, NmtError

log = logging.getLogger("nmt.http")
T = TypeVar("T")

REASONS = {400: "malformed HTTP request", 413: "request body too large",
           414: "request line (URL) too long", 431: "request header fields too large",
           500: "internal error", 504: "request handler timed out"}
KINDS = {413: ErrorKind.RESOURCE_EXHAUSTED, 500: ErrorKind.INTERNAL, 504: ErrorKind.DEADLINE_EXCEEDED}
"""The error kind of each status (the rest: INVALID_ARGUMENT), named by ``frontend.STATUS``."""


def parser_status(exc: BaseException | None, status: int) -> int:
    """The closest status for a parser error: a line too long is the URL's (414) while no
    header was read, else a header's (431)."""
    if isinstance(exc, LineTooLong):  # the parser names no part: a URL starts with "/" or a scheme
        line = bytes(exc.args[0][:16]) if exc.args and isinstance(exc.args[0], (bytes, bytearray)) else b""
        return 414 if line.startswith(b"/") or b"://" in line else 431
    if isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower():
        return 431
    if isinstance(exc, HttpProcessingError) and exc.code in REASONS:
        return exc.code
    return status


def json_error(status: int, message: str) -> web.Response:
    code = kind_status(KINDS.get(status, ErrorKind.INVALID_ARGUMENT)).name
    body = json.dumps({"code": code, "message": message}).encode()
    response = web.Response(status=status, body=body, content_type="application/json")
    response.force_close()
    return response


class HttpError(NmtError):
    """A refusal before the request reaches the front door (body, content type, route), with
    an HTTP status of its own where HTTP has a closer one than its kind's (413, 415, 405);
    ``close``: the answer closes the connection (the rest of the request cannot be framed)."""

    def __init__(self, kind: ErrorKind, message: str, *, http_status: int | None = None,
                 close: bool = False) -> None:
        super().__init__(kind, message)
        self.http_status = kind_status(kind).http if http_status is None else http_status
        self.close = close


async def read_body(request: web.Request, read: Callable[[], Awaitable[T]] | None = None) -> T | bytes:
    """The request's body (``read``: another reader of it, ``request.post`` for a form). One
    that cannot be read (a bad chunk, a corrupt gzip stream) is the client's fault: an
    ``HttpError`` 400 whose answer closes the connection. The payload is marked finished first:
    aiohttp would otherwise linger after the answer, reading the rest of a payload that already
    failed, and log its stored error as an unhandled exception."""
    try:
        return await (read or request.read)()
    except RequestPayloadError as e:
        request.content.feed_eof()
        raise HttpError(ErrorKind.INVALID_ARGUMENT, "request body could not be read: "
                        f"{str(e).splitlines()[-1].strip()[:120]}", http_status=400, close=True) from None


def error_body(error: NmtError, *, ensure_ascii: bool = False) -> bytes:
    """``{"code": "<its kind's gRPC code name>", "message": ...}``."""
    return json.dumps({"code": kind_status(error.kind).name, "message": error.message},
                      ensure_ascii=ensure_ascii).encode()


def error_response(error: NmtError, headers: Mapping[str, str] | None = None) -> web.Response:
    http_status = error.http_status if isinstance(error, HttpError) else kind_status(error.kind).http
    if error.kind is ErrorKind.UNAUTHENTICATED:  # RFC 6750: the scheme the client must use
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    response = web.Response(status=http_status, body=error_body(error), content_type="application/json",
                            headers=headers)
    if isinstance(error, HttpError) and error.close:
        response.force_close()
    return response


def route_error(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's routing refusals (no such path, a method not allowed) as JSON errors."""
    where = f"{request.method} {request.path}"
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        return error_response(HttpError(ErrorKind.UNIMPLEMENTED, f"{where}: method not allowed "
                                        f"(allowed: {allowed})", http_status=405),
                              headers={"Allow": allowed})
    if isinstance(e, web.HTTPNotFound):
        return error_response(NmtError(ErrorKind.NOT_FOUND, f"{where}: no such path"))
    return error_response(HttpError(ErrorKind.INVALID_ARGUMENT, f"{where}: {e.reason}",
                                    http_status=e.status))


class JsonErrorsHandler(web_protocol.RequestHandler):
    """aiohttp's per-connection handler, its errors answered in JSON (see the module's doc)."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        status = parser_status(exc, status)
        reason = REASONS.get(status, "malformed HTTP request")
        if isinstance(exc, ConnectionError):  # the client went away (an aborted stream): not an error
            log.debug("HTTP client %s went away: %s", request.remote, type(exc).__name__)
        elif status >= 500:
            log.error("HTTP %d from %s: %s", status, request.remote, type(exc).__name__ if exc else reason)
        else:  # the client's fault: one line, none of its bytes (they may hold a token)
            log.info("HTTP %d from %s: %s (%s)", status, request.remote, reason,
                     type(exc).__name__ if exc else "-")
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; the connection is closed")
        return json_error(status, reason)


class JsonErrorsServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return JsonErrorsHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorsRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser errors in JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorsServer  # the same server; only its handler factory differs
        return server
