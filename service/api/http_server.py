"""HTTP/JSON beside gRPC: the same process, event loop, validation, scheduler, limits and metrics.

aiohttp on the gRPC server's event loop (``App.start`` starts it, ``App.stop`` drains it).
Bodies are the proto's messages in protobuf's JSON mapping (``google.protobuf.json_format``,
proto field names); errors are ``{"code": "<gRPC code name>", "message": "..."}`` with the
message gRPC would send, and the HTTP status ``HTTP_STATUS[GRPC_CODES[kind]]``.

- ``POST /v1/translate``: ``TranslateRequest`` -> ``TranslateResponse``
- ``POST /v1/translate:stream``: server-sent events, ``partial`` ... then ``final``
  (or ``error``); each ``data`` a ``TranslateResponse`` (an error: the error body)
- ``GET /v1/models``: ``ListModelsResponse``; ``GET /healthz`` (alive), ``GET /readyz``
  (200 when health says SERVING, else 503)
- ``GET /``: the web page (``service/api/web/``)

A deadline: ``X-Request-Timeout: <seconds>``. Authorization: one hook, ``authorize(headers)``,
called before anything else: ``authorizer`` makes it from the gRPC side's ``AuthInterceptor``
(the same token file, refusal message and ``nmt_auth_failures_total``), or ``allow_all``
without tokens. TLS: ``ssl_context`` of ``HttpServer.start``, from the same files
(``tls_context``; read at start, unlike gRPC's, which re-reads rotated files).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping, NamedTuple

import grpc
from aiohttp import web

from service.api import convert
from service.api.auth import REFUSAL, AuthInterceptor, refusal_reason
from service.api.grpc_server import HTTP_STATUS, answer
from service.api.http_json import BodyError, parse_request, sse, to_json
from service.config import SecurityConfig
from service.errors import ErrorKind, NmtError, invalid
from service.interface import Final, Partial
from service.proto.nmt.v1 import translation_pb2 as pb

if TYPE_CHECKING:
    from service.api.grpc_server import App

log = logging.getLogger("nmt.http")

WEB = Path(__file__).with_name("web")
TIMEOUT_HEADER = "X-Request-Timeout"
RETRY_AFTER_SECONDS = 1
STREAM_KEY = web.RequestKey("nmt.stream", web.StreamResponse)

Authorize = Callable[[Mapping[str, str]], None]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def allow_all(headers: Mapping[str, str]) -> None:
    """The authorization hook until bearer tokens land: every request passes. A real hook
    raises ``NmtError`` (its kind's gRPC code UNAUTHENTICATED answers 401)."""


class Header(NamedTuple):
    """An HTTP header in the shape of gRPC metadata (for ``auth.refusal_reason``)."""

    key: str
    value: str


def authorizer(interceptor: AuthInterceptor | None) -> Authorize:
    """The HTTP hook of the gRPC side's token check (``allow_all`` without tokens)."""
    if interceptor is None:
        return allow_all

    def authorize(headers: Mapping[str, str]) -> None:
        metadata = [Header("authorization", v) for k, v in headers.items() if k.lower() == "authorization"]
        reason = refusal_reason(metadata, interceptor.tokens)
        if reason is not None:
            interceptor.failures.labels(reason).inc()
            raise NmtError(ErrorKind.UNAUTHENTICATED, REFUSAL)
    return authorize


def tls_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """HTTPS from the gRPC side's files (client certificates required with client CAs)."""
    if not security.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
    if security.tls_client_ca_file is not None:
        context.load_verify_locations(security.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class HttpError(Exception):
    """A refusal before the request reaches the shared path (body, content type, route)."""

    def __init__(self, code: grpc.StatusCode, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.status = HTTP_STATUS[code] if status is None else status


def error_response(code: grpc.StatusCode, message: str, status: int | None = None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    body = json.dumps({"code": code.name, "message": message}, ensure_ascii=False).encode()
    return web.Response(status=HTTP_STATUS[code] if status is None else status, body=body,
                        content_type="application/json", headers=headers)


def request_timeout(headers: Mapping[str, str]) -> float | None:
    """The client's deadline in seconds (``X-Request-Timeout``), None without one."""
    text = headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise invalid(TIMEOUT_HEADER, "a number of seconds > 0", text)
    return value


class HttpServer:
    """The HTTP front end of one ``App``: routes, the shared error mapping, metrics, draining."""

    def __init__(self, app: App, *, authorize: Authorize = allow_all) -> None:
        self.app, self.authorize = app, authorize
        self.max_body = app.config.max_message_bytes
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.draining = False
        self.inflight: set[asyncio.Task] = set()

    def routes(self) -> web.Application:
        web_app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        web_app.add_routes([
            web.post("/v1/translate", self._observed("Translate", self._translate)),
            web.post("/v1/translate:stream", self._observed("TranslateStream", self._stream)),
            web.get("/v1/models", self._observed("ListModels", self._models)),
            web.get("/healthz", self._healthz), web.get("/readyz", self._readyz),
            web.get("/", self._index)])
        web_app.router.add_static("/web/", WEB, show_index=False)
        return web_app

    async def start(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on ``port`` (0: not at all); TLS with ``ssl_context``."""
        if port == 0:
            return
        self.runner = web.AppRunner(self.routes(), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context, reuse_port=False)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self, grace: float) -> None:
        """Refuse new requests (503), let in-flight ones finish within ``grace`` s, close."""
        if self.runner is None:
            return
        self.draining = True
        if self.inflight:
            await asyncio.wait(set(self.inflight), timeout=grace)
        await self.runner.cleanup()
        self.runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer an HTTP error is JSON; draining refuses; in-flight requests tracked."""
        if self.draining and request.path != "/healthz":  # alive until the port closes
            return error_response(grpc.StatusCode.UNAVAILABLE, "server shutting down")
        task = asyncio.current_task()
        if task is not None:
            self.inflight.add(task)
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return self._route_error(request, e)
        finally:
            if task is not None:
                self.inflight.discard(task)

    @staticmethod
    def _route_error(request: web.Request, e: web.HTTPException) -> web.Response:
        where = f"{request.method} {request.path}"
        if isinstance(e, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(e.allowed_methods))
            return error_response(grpc.StatusCode.UNIMPLEMENTED, f"{where}: method not allowed "
                                  f"(allowed: {allowed})", status=405, headers={"Allow": allowed})
        if isinstance(e, web.HTTPNotFound):
            return error_response(grpc.StatusCode.NOT_FOUND, f"{where}: no such path")
        return error_response(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {e.reason}", status=e.status)

    def _observed(self, method: str, handler: Handler) -> Handler:
        """``handler`` timed and counted by code; errors answered by their kind's status."""
        async def observed(request: web.Request) -> web.StreamResponse:
            metrics, code = self.app.metrics, grpc.StatusCode.OK
            try:
                with metrics.request_duration.labels(method=method, protocol="http").time():
                    self.authorize(request.headers)
                    return await handler(request)
            except HttpError as e:
                code = e.code
                return error_response(e.code, e.message, e.status)
            except BodyError as e:
                code = e.code
                return error_response(e.code, str(e))
            except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                code = grpc.StatusCode.CANCELLED
                metrics.cancelled.inc()
                raise
            except Exception as e:  # NmtError by its kind; anything else is a bug
                code, message = answer(e, metrics, method)
                return await self._refuse(request, code, message)
            finally:
                metrics.requests.labels(method=method, code=code.name, protocol="http").inc()
        return observed

    @staticmethod
    async def _refuse(request: web.Request, code: grpc.StatusCode, message: str) -> web.StreamResponse:
        """The error body; on an open event stream, as its last event."""
        stream = request.get(STREAM_KEY)
        if stream is not None:
            await stream.write(sse("error", json.dumps({"code": code.name, "message": message}).encode()))
            return stream
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)} if code is grpc.StatusCode.RESOURCE_EXHAUSTED else None
        return error_response(code, message, headers=retry)

    async def _body(self, request: web.Request) -> tuple[pb.TranslateRequest, float | None]:
        """The request message and deadline: JSON only, within the body limit."""
        timeout = request_timeout(request.headers)
        if request.content_type != "application/json":
            raise HttpError(grpc.StatusCode.INVALID_ARGUMENT, "Content-Type must be application/json, "
                            f"got {request.content_type!r}", status=415)
        too_large = HttpError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"request body must be at most {self.max_body} bytes", status=413)
        if (request.content_length or 0) > self.max_body:
            raise too_large
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        return parse_request(body), timeout

    async def _translate(self, request: web.Request) -> web.StreamResponse:
        message, timeout = await self._body(request)
        model, prepared = self.app.prepare(message)
        translations = await model.scheduler.translate(prepared, timeout=timeout)
        return web.Response(body=to_json(convert.response(translations, model.manifest)),
                            content_type="application/json")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """The first event decides the status (a full queue is still a 429); then events."""
        message, timeout = await self._body(request)
        model, prepared = self.app.prepare(message)
        events = model.scheduler.stream(prepared, timeout=timeout)
        try:
            event = await anext(events)
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                 "Cache-Control": "no-cache"})
            await stream.prepare(request)
            request[STREAM_KEY] = stream
            while True:
                if isinstance(event, Partial):
                    await stream.write(sse("partial", to_json(convert.partial(event, prepared, model.manifest))))
                elif isinstance(event, Final):
                    await stream.write(sse("final", to_json(convert.response(event.translations, model.manifest))))
                    break
                event = await anext(events)
        finally:
            await events.aclose()
        await stream.write_eof()
        return stream

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=to_json(self.app.list_models()), content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "alive"})

    async def _readyz(self, request: web.Request) -> web.StreamResponse:
        if self.app.serving:
            return web.json_response({"status": "SERVING"})
        return error_response(grpc.StatusCode.UNAVAILABLE, "not serving: warming up or draining")

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(WEB / "index.html")
