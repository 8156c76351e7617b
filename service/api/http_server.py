"""The HTTP/JSON transport beside gRPC: the same process, event loop, front door and metrics.

aiohttp on the gRPC server's event loop (``service.api.server.App`` starts and drains it).
Each route parses its JSON into plain values and calls the front door
(``service.api.frontend``: validation, admission, translation), as the gRPC transport
does; it imports no other transport. Bodies are the proto's messages in protobuf's JSON
mapping (``google.protobuf.json_format``, proto field names); errors are
``{"code": "<gRPC code name>", "message": "..."}`` with the message gRPC would send, and
the HTTP status ``frontend.STATUS`` gives the error's kind.

- ``POST /v1/translate``: ``TranslateRequest`` -> ``TranslateResponse``
- ``POST /v1/translate:stream``: server-sent events, ``partial`` ... then ``final``
  (or ``error``); each ``data`` a ``TranslateResponse`` (an error: the error body)
- ``GET /v1/models``: ``ListModelsResponse``; ``GET /healthz`` (alive), ``GET /readyz``
  (200 when health says SERVING and nothing makes the server unready, ``unready``: the
  model watcher failing; else 503 naming why)
- ``GET /``: the web page (``service/api/web/``), ``GET /web/<file>``: its files, by name
- errors before any route (the parser's): JSON too; the error bodies and ``HttpError``:
  ``service/api/http_errors.py``
- LibreTranslate's API (``/translate``, ``/languages``, ``/detect``, ``/frontend/settings``):
  ``service/api/libretranslate.py``, its own errors (``{"error": ...}``) and key check (``api_key``)

A deadline: ``X-Request-Timeout: <seconds>``. Authorization: one hook, ``authorize(headers)``,
called before anything else: ``auth.authorizer`` makes it from the token check gRPC makes
(the same token file, refusal message and ``nmt_auth_failures_total``), or ``auth.allow_all``
without tokens. TLS: ``ssl_context`` of ``HttpServer.start``, from the same files
(``auth.tls_context``; read at start, unlike gRPC's, which re-reads rotated files).
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from pathlib import Path
from typing import Awaitable, Callable, Mapping

from aiohttp import web

from service.api import convert
from service.api.auth import Authorize, allow_all
from service.api.frontend import OK, Admitted, Frontend, status
from service.api.http_errors import (HttpError, JsonErrorsRunner, error_body, error_response, read_body,
                                     route_error)
from service.api.http_limits import HttpLimits, LimitedSite
from service.api.http_json import BodyError, parse_request, sse, to_json
from service.api.libretranslate import LibreTranslate
from service.errors import ErrorKind, NmtError, invalid
from service.interface import Final, Partial

log = logging.getLogger("nmt.http")

WEB = Path(__file__).with_name("web")
WEB_FILES = frozenset(p.name for p in WEB.iterdir() if p.is_file())  # what /web/<file> serves
TIMEOUT_HEADER = "X-Request-Timeout"
RETRY_AFTER_SECONDS = 1
STREAM_KEY = web.RequestKey("nmt.stream", web.StreamResponse)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    """The HTTP transport over one front door: routes, the error mapping, metrics, draining."""

    def __init__(self, frontend: Frontend, *, max_body: int, authorize: Authorize = allow_all,
                 limits: HttpLimits = HttpLimits(), unready: Callable[[], str] = lambda: "") -> None:
        self.frontend, self.authorize, self.max_body, self.limits = frontend, authorize, max_body, limits
        self.unready = unready  # why a serving server is not ready ("": it is): /readyz says 503
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.draining = False
        self.inflight: set[asyncio.Task] = set()

    def routes(self) -> web.Application:
        web_app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        web_app.add_routes([
            web.post("/v1/translate", self._observed("Translate", self._translate),
                     expect_handler=self._expect),
            web.post("/v1/translate:stream", self._observed("TranslateStream", self._stream),
                     expect_handler=self._expect),
            web.get("/v1/models", self._observed("ListModels", self._models)),
            web.get("/healthz", self._healthz), web.get("/readyz", self._readyz),
            web.get("/", self._index), web.get("/web/{file}", self._web_file)])
        # LibreTranslate's API (/translate, /languages, /detect, /frontend/settings) over the same front door
        web_app.add_routes(LibreTranslate(self.frontend, self.authorize,
                                          keys_required=self.authorize is not allow_all).routes())
        return web_app

    async def start(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on ``port`` (0: not at all); TLS with ``ssl_context``."""
        if port == 0:
            return
        self.runner = JsonErrorsRunner(self.routes(), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=0.1)
        await self.runner.setup()
        site = LimitedSite(self.runner, host, port, ssl_context=ssl_context, limits=self.limits,
                           metrics=self.frontend.metrics)
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
            return error_response(NmtError(ErrorKind.UNAVAILABLE, "server shutting down"))
        task = asyncio.current_task()
        if task is not None:
            self.inflight.add(task)
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return route_error(request, e)
        finally:
            if task is not None:
                self.inflight.discard(task)

    def _too_large(self) -> HttpError:
        return HttpError(ErrorKind.RESOURCE_EXHAUSTED, f"request body must be at most {self.max_body} bytes",
                         http_status=413)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a body announced too large is refused before it is sent."""
        if (request.content_length or 0) > self.max_body:
            response = error_response(self._too_large())
            response.force_close()  # the body is not read: the connection cannot be reused
            return response
        if request.headers.get("Expect", "").lower() != "100-continue":
            return error_response(HttpError(ErrorKind.INVALID_ARGUMENT, "Expect must be 100-continue",
                                            http_status=417))
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer proper has not started
        return None

    def _observed(self, method: str, handler: Handler) -> Handler:
        """``handler`` timed and counted by code; errors answered by their kind's status."""
        async def observed(request: web.Request) -> web.StreamResponse:
            metrics, code = self.frontend.metrics, OK
            try:
                with metrics.request_duration.labels(method=method, protocol="http").time():
                    self.authorize(request.headers)
                    return await handler(request)
            except HttpError as e:  # before the front door: never on a stream, never retried
                code = status(e.kind).name
                return error_response(e)
            except BodyError as e:
                code = status(e.kind).name
                return error_response(NmtError(e.kind, str(e)))
            except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                code = status(ErrorKind.CANCELLED).name
                metrics.cancelled.inc()
                raise
            except Exception as e:  # NmtError by its kind; anything else is a bug
                error = self.frontend.failure(e, method=method)
                code = status(error.kind).name
                return await self._refuse(request, error)
            finally:
                metrics.requests.labels(method=method, code=code, protocol="http").inc()
        return observed

    @staticmethod
    async def _refuse(request: web.Request, error: NmtError) -> web.StreamResponse:
        """The error body; on an open event stream, as its last event."""
        stream = request.get(STREAM_KEY)
        if stream is not None:
            await stream.write(sse("error", error_body(error, ensure_ascii=True)))
            return stream
        retry = ({"Retry-After": str(RETRY_AFTER_SECONDS)} if error.kind is ErrorKind.RESOURCE_EXHAUSTED
                 else None)
        return error_response(error, headers=retry)

    async def _admit(self, request: web.Request) -> tuple[Admitted, float | None]:
        """The request, read, parsed and past the front door, and its deadline: JSON only, within
        the body limit."""
        timeout = request_timeout(request.headers)
        if request.content_type != "application/json":
            raise HttpError(ErrorKind.INVALID_ARGUMENT, "Content-Type must be application/json, "
                            f"got {request.content_type!r}", http_status=415)
        if (request.content_length or 0) > self.max_body:
            raise self._too_large()
        try:
            body = await read_body(request)
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        message = parse_request(body)
        client = self.frontend.client(authorization=request.headers.get("Authorization"),
                                      peer=request.remote or "", client_id=request.headers.get("X-Client-Id"))
        return self.frontend.admit_request(texts=message.texts, options=convert.options(message.options),
                                           model=message.model, source_language=message.source_language,
                                           target_language=message.target_language, client=client), timeout

    async def _translate(self, request: web.Request) -> web.StreamResponse:
        admitted, timeout = await self._admit(request)
        translations = await self.frontend.translate(admitted, timeout=timeout)
        return web.Response(body=to_json(convert.response(translations, admitted.model.manifest)),
                            content_type="application/json")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """The first event decides the status (a full queue is still a 429); then events."""
        admitted, timeout = await self._admit(request)
        prepared, manifest = admitted.prepared, admitted.model.manifest
        events = self.frontend.stream(admitted, timeout=timeout)
        try:
            event = await anext(events)
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                 "Cache-Control": "no-cache"})
            await stream.prepare(request)
            request[STREAM_KEY] = stream
            while True:
                if isinstance(event, Partial):
                    await stream.write(sse("partial", to_json(convert.partial(event, prepared, manifest))))
                elif isinstance(event, Final):
                    await stream.write(sse("final", to_json(convert.response(event.translations, manifest))))
                    break
                event = await anext(events)
        finally:
            await events.aclose()
        await stream.write_eof()
        return stream

    async def _models(self, request: web.Request) -> web.StreamResponse:
        listing = convert.model_list(self.frontend.served(), provider=self.frontend.config.provider.value)
        return web.Response(body=to_json(listing), content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "alive"})

    async def _readyz(self, request: web.Request) -> web.StreamResponse:
        if not self.frontend.ready:
            return error_response(NmtError(ErrorKind.UNAVAILABLE, "not serving: warming up or draining"))
        why = self.unready()
        if why:
            return error_response(NmtError(ErrorKind.UNAVAILABLE, f"not ready: {why}"))
        return web.json_response({"status": "SERVING"})

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(WEB / "index.html")

    async def _web_file(self, request: web.Request) -> web.StreamResponse:
        """One file of the page, by name (``WEB_FILES``): nothing else is looked up on disk."""
        name = request.match_info["file"]
        if name not in WEB_FILES:
            raise web.HTTPNotFound()
        return web.FileResponse(WEB / name)
