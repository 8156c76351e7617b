"""``nmt serve``: the Translator gRPC service (grpc.aio), health, reflection, metrics.

The official grpc.aio shape: ``build`` makes the server (tests bind port 0),
``App.start`` runs it, SIGTERM -> NOT_SERVING -> ``server.stop(grace)`` ->
in-flight calls finish -> exit 0. Protobuf lives only here, at the edge; the
scheduler and the engine see dataclasses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from service.api import convert
from service.api.auth import AuthInterceptor, TlsFiles, TokenFile
from service.api.wire import SERVICE_NAME, Undecodable, add_translator
from service.config import ServeConfig
from service.app import Model, ServedModels, load_engines
from service.errors import ErrorKind, NmtError, invalid
from service.interface import Engine, Final, Partial, Prepared
from service.metrics import Metrics, MetricsServer
from service.models.attention import has_attention
from service.options import validate_request
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc
from service.scheduling.scheduler import Scheduler
from service.text import placeholders

log = logging.getLogger("nmt.server")

GRPC_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
}
"""The one mapping from error kinds to gRPC status codes."""

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""HTTP status of each gRPC code (grpc-gateway's); the HTTP API derives an error kind's status
as ``HTTP_STATUS[GRPC_CODES[kind]]``, so a new kind needs only its gRPC code."""

WARMUP_TEXT = "Hello world"
MAX_PENDING_REQUESTS = 20_000
"""Calls gRPC core may hold before the servicer takes them (``grpc.server.max_pending_requests``
and its hard limit; defaults 1000 and 3000). Above them core ends calls CANCELLED, unseen and
uncounted: a burst of 2,000 got 165-211 of those. Measured (``loadtest/flood.py``, one channel,
beam 5, long text; ``loadtest/results/flood.md``): 2,000 and 5,000 concurrent calls, 0 CANCELLED,
every refusal counted. A pending call holds its headers and what HTTP/2 flow control let in of
its message, as it would once taken; the queue of work stays bounded by --max-queued-work."""


def server_options(config: ServeConfig) -> list[tuple[str, int]]:
    """The grpc.aio server's channel arguments."""
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0),  # a busy port must fail, not be shared
               ("grpc.server.max_pending_requests", MAX_PENDING_REQUESTS),
               ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_REQUESTS)]
    if config.max_connection_age > 0:  # GOAWAY after the age; calls in flight get the grace
        options += [("grpc.max_connection_age_ms", int(config.max_connection_age * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(config.grace_period * 1000))]
    return options


class App:
    """The server and everything it owns: models, schedulers, health, metrics."""

    def __init__(self, config: ServeConfig, engines: Sequence[Engine]) -> None:
        self.config, self.metrics = config, Metrics()
        self.models = ServedModels(config, engines, self.metrics)
        self.health = health_aio.HealthServicer()
        security = config.security
        self.tls = TlsFiles(security) if security.tls else None  # first: a bad file stops us here
        tokens = TokenFile(security.auth_token_file) if security.auth_token_file else None
        interceptors = [AuthInterceptor(tokens, self.metrics)] if tokens else []
        self.server = grpc.aio.server(options=server_options(config), interceptors=interceptors)
        add_translator(TranslatorServicer(self), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if security.reflection:
            reflection.enable_server_reflection(
                [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], self.server)
        address = f"{config.host}:{config.port}"
        self.port = (self.server.add_secure_port(address, self.tls.credentials()) if self.tls
                     else self.server.add_insecure_port(address))
        self.metrics_server: MetricsServer | None = None
        self._tasks: set[asyncio.Task] = set()  # the poller and SIGHUP rescans
        self.serving = False  # health SERVING: the HTTP API's /readyz
        # HTTP/JSON beside gRPC (--http-port; 0 = off), with the same TLS files and tokens.
        # Imported here: http_server imports this module.
        from service.api.http_server import HttpServer, authorizer, tls_context
        self.http = HttpServer(self, authorize=authorizer(interceptors[0] if interceptors else None))
        self.http_tls = tls_context(security)

    def prepare(self, request: pb.TranslateRequest) -> tuple[Model, list[Prepared]]:
        """Validate the whole request (once, here, for gRPC and HTTP), then tokenize its texts."""
        options = validate_request(request.texts, convert.options(request.options), self.config.limits)
        for i, text in enumerate(request.texts):
            placeholders.check_count(text, f"texts[{i}]")
        model = self.models.get(request.model)
        if options.return_attention and not has_attention(model.manifest.attention):
            raise invalid("options.return_attention", f"false for model {model.ref!r} (its attention is "
                          f"{model.manifest.attention!r}: no alignments)", True)
        refuse_if_full(model.scheduler, len(request.texts) * options.beam_size)
        return model, [model.engine.prepare_text(text, options, i) for i, text in enumerate(request.texts)]

    def list_models(self) -> pb.ListModelsResponse:
        cfg = self.config
        return pb.ListModelsResponse(models=[
            convert.model_info(m.manifest, precision=m.engine.precision, provider=cfg.provider,
                               is_default=i == 0) for i, m in enumerate(self.models.all)])

    def rescan(self) -> None:
        """Look at the model repository again, in the background (SIGHUP)."""
        task = asyncio.get_running_loop().create_task(self.models.rescan())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def metrics_port(self) -> int:
        return self.metrics_server.port if self.metrics_server else 0

    async def start(self) -> None:
        """Serve; health says SERVING only after every model translated a warm-up text."""
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.models.start()
        self.metrics_server = self.metrics.serve(host=self.config.metrics_host,
                                                 port=self.config.metrics_port)
        await self.server.start()
        await self.http.start(self.config.host, self.config.http_port,
                              ssl_context=self.http_tls)
        warmup_ms = await self.models.warm_up() * 1000
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.serving = True
        if self.config.model_control == "poll":
            poller = asyncio.get_running_loop().create_task(self.models.poll(self.config.poll_seconds))
            self._tasks.add(poller)
            poller.add_done_callback(self._tasks.discard)
        sc = self.config.scheduler
        sec = self.config.security
        access = ("mTLS" if sec.tls_client_ca_file else "TLS" if sec.tls else "plaintext") + (
            ", tokens" if sec.auth_token_file else ", no tokens")
        log.info("serving %s on %s:%d (%s; metrics %s:%d/metrics) on %s, %s-level batching "
                 "(max_rows=%d max_tokens=%d max_wait=%.1fms max_queued_work=%d), warm-up %.0f ms, "
                 "HTTP :%d",
                 ", ".join(f"{m.ref} ({m.engine.precision})" for m in self.models.all), self.config.host,
                 self.port, access, self.config.metrics_host, self.metrics_port, self.config.provider,
                 "step" if sc.step_level else "request", sc.max_rows, sc.max_tokens,
                 sc.max_wait * 1000, sc.max_queued_work, warmup_ms, self.http.port)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace`` seconds."""
        self.serving = False
        await self.health.enter_graceful_shutdown()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(self.server.stop(grace), self.http.stop(grace))
        await self.models.close()
        if self.metrics_server is not None:
            self.metrics_server.close()


class TranslatorServicer(pb_grpc.TranslatorServicer):
    """The three RPCs; validation, metrics and the error mapping around each."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def Translate(self, request: pb.TranslateRequest, context: grpc.aio.ServicerContext
                        ) -> pb.TranslateResponse:
        async with self._rpc("Translate", request, context):
            model, prepared = self.app.prepare(request)
            translations = await model.scheduler.translate(prepared, timeout=context.time_remaining())
            return convert.response(translations, model.manifest)

    async def TranslateStream(self, request: pb.TranslateRequest, context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[pb.TranslateResponse]:
        async with self._rpc("TranslateStream", request, context):
            model, prepared = self.app.prepare(request)
            events = model.scheduler.stream(prepared, timeout=context.time_remaining())
            try:
                async for event in events:
                    if isinstance(event, Partial):
                        yield convert.partial(event, prepared, model.manifest)
                    elif isinstance(event, Final):
                        yield convert.response(event.translations, model.manifest)
            finally:
                await events.aclose()

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        async with self._rpc("ListModels", request, context):
            return self.app.list_models()

    @asynccontextmanager
    async def _rpc(self, method: str, request: object, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[None]:
        """Time the call, count it by status code, map NmtError to its gRPC code, log it."""
        metrics, code, started = self.app.metrics, grpc.StatusCode.OK, time.perf_counter()
        try:
            with metrics.request_duration.labels(method=method, protocol="grpc").time():
                if isinstance(request, Undecodable):
                    log.warning("%s: undecodable request from %s: %s", method, context.peer(),
                                request.reason)
                    raise NmtError(ErrorKind.INVALID_ARGUMENT, f"request must be a valid "
                                   f"{request.message} (protobuf wire format, UTF-8 strings), got "
                                   "bytes that do not parse")
                yield
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:  # gRPC saw it before the scheduler
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                metrics.deadline_exceeded.inc()
            else:
                code = grpc.StatusCode.CANCELLED
                metrics.cancelled.inc()
            raise
        except Exception as e:  # NmtError by its kind; anything else is a bug, and the server goes on
            code, message = answer(e, metrics, method)
            await context.abort(code, message)
        finally:
            metrics.requests.labels(method=method, code=code.name, protocol="grpc").inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s peer=%s texts=%d code=%s %.1f ms", method, context.peer(),
                          len(getattr(request, "texts", ())), code.name,
                          (time.perf_counter() - started) * 1000)


def answer(error: Exception, metrics: Metrics, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message that answer ``error`` on either protocol: an NmtError by its kind
    (a deadline the scheduler saw first is counted), anything else as INTERNAL, logged."""
    if isinstance(error, NmtError):
        if error.kind is ErrorKind.DEADLINE_EXCEEDED:
            metrics.deadline_exceeded.inc()
        return GRPC_CODES[error.kind], error.message
    log.exception("%s failed", method, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


def refuse_if_full(scheduler: Scheduler, least: int) -> None:
    """RESOURCE_EXHAUSTED before tokenizing when even the request's least work (each row one
    step) would pass --max-queued-work: under a flood a refusal costs a comparison, not a
    tokenization. Read without the scheduler's lock: advisory; submit() decides exactly."""
    state = scheduler.state
    limit = state.config.max_queued_work
    if least <= limit < state.work + least:  # larger than the limit alone: submit() says so
        raise NmtError(ErrorKind.RESOURCE_EXHAUSTED,
                       f"server overloaded: queued work would be at least {state.work + least} "
                       f"(estimated rows x steps; this request at least {least}), above the limit "
                       f"max_queued_work={limit}; retry later")


def build(config: ServeConfig, engines: Sequence[Engine] | None = None) -> App:
    """The server, not yet started (call inside the event loop that will run it)."""
    return App(config, load_engines(config) if engines is None else engines)
