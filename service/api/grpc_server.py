"""The gRPC transport: the Translator service (grpc.aio), health and reflection, over the front door.

The official grpc.aio shape: ``GrpcServer`` makes the server and binds its port (tests bind
port 0), ``start`` runs it, and on SIGTERM ``service.api.server.App`` says NOT_SERVING,
then ``stop(grace)`` lets in-flight calls finish. Each RPC parses its protobuf request
into plain values, calls the front door (``service.api.frontend``: validation, admission,
translation) and answers an error with the gRPC code ``frontend.STATUS`` gives its kind.
Protobuf lives only at this edge (and in ``convert``); this module imports no other
transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from service.api import convert
from service.api.auth import AuthInterceptor, TlsFiles, TokenCheck
from service.api.frontend import Admitted, Frontend, status
from service.api.wire import SERVICE_NAME, Undecodable, add_translator
from service.config import ServeConfig
from service.errors import ErrorKind, NmtError
from service.interface import Final, Partial
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

log = logging.getLogger("nmt.server")

MAX_PENDING_REQUESTS = 20_000
"""Calls gRPC core may hold before the servicer takes them (``grpc.server.max_pending_requests``
and its hard limit; defaults 1000 and 3000). Above them core ends calls CANCELLED, unseen and
uncounted: a burst of 2,000 got 165-211 of those. Measured (``loadtest/flood.py``, one channel,
beam 5, long text; ``loadtest/results/flood.md``): 2,000 and 5,000 concurrent calls, 0 CANCELLED,
every refusal counted. A pending call holds its headers and what HTTP/2 flow control let in of
its message, as it would once taken; the queue of work stays bounded by --max-queued-work."""


class ClientGone(logging.Filter):
    """gRPC core's traceback for a call whose status could not be sent because the client had
    closed it (a cancel that landed after the servicer's last message and before core saw the
    close: grpc.aio logs ``ExecuteBatchError raised in core`` with a traceback when its
    ``client_closed`` flag is not yet set). The client is gone and nothing was lost, so the record
    becomes one DEBUG line, as grpc.aio logs a cancel it saw in time. Any other record passes
    unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ == "ExecuteBatchError" and "SendStatusFromServerOperation" in str(error):
            record.msg, record.args = "%s (the client closed the call before its status was sent)", (
                record.getMessage(),)
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


CLIENT_GONE = ClientGone()
"""Installed on grpc.aio's logger by every ``GrpcServer`` (``addFilter`` keeps one copy)."""


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


class GrpcServer:
    """The grpc.aio server: Translator, health, reflection, on ``config.host:config.port``
    (bound here: ``port`` is known before ``start``)."""

    def __init__(self, frontend: Frontend, *, config: ServeConfig, tls: TlsFiles | None,
                 tokens: TokenCheck | None) -> None:
        security, self.tls = config.security, tls  # TLS files re-read when they change
        interceptors = [AuthInterceptor(tokens, frontend.metrics)] if tokens else []
        self.server = grpc.aio.server(options=server_options(config), interceptors=interceptors)
        logging.getLogger("grpc._cython.cygrpc").addFilter(CLIENT_GONE)
        self.health = health_aio.HealthServicer()
        add_translator(TranslatorServicer(frontend), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if security.reflection:
            reflection.enable_server_reflection(
                [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], self.server)
        address = f"{config.host}:{config.port}"
        self.port = (self.server.add_secure_port(address, self.tls.credentials()) if self.tls
                     else self.server.add_insecure_port(address))

    async def set_serving(self, serving: bool) -> None:
        """Health of the server ("") and of the Translator service."""
        health = health_pb2.HealthCheckResponse
        answer = health.SERVING if serving else health.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, answer)

    async def draining(self) -> None:
        """NOT_SERVING for good: load balancers stop sending calls before the port closes."""
        await self.health.enter_graceful_shutdown()

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish within ``grace`` seconds."""
        await self.server.stop(grace)


class TranslatorServicer(pb_grpc.TranslatorServicer):
    """The three RPCs over the front door; metrics and the error mapping around each."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def _admit(self, request: pb.TranslateRequest, context: grpc.aio.ServicerContext) -> Admitted:
        metadata = dict(context.invocation_metadata() or ())
        client = self.frontend.client(authorization=metadata.get("authorization"), peer=context.peer() or "",
                                      client_id=metadata.get("x-client-id"))
        return self.frontend.admit_request(texts=request.texts, options=convert.options(request.options),
                                           model=request.model, source_language=request.source_language,
                                           target_language=request.target_language, client=client)

    async def Translate(self, request: pb.TranslateRequest, context: grpc.aio.ServicerContext
                        ) -> pb.TranslateResponse:
        async with self._rpc("Translate", request, context):
            admitted = self._admit(request, context)
            translations = await self.frontend.translate(admitted, timeout=context.time_remaining())
            return convert.response(translations, admitted.model.manifest)

    async def TranslateStream(self, request: pb.TranslateRequest, context: grpc.aio.ServicerContext) -> None:
        """Written with ``context.write``, not yielded: a write the client's cancel beat is then
        ours to see (the client went away: CANCELLED, no log), where a yielded message's failed
        write was logged by gRPC core with a traceback."""
        async with self._rpc("TranslateStream", request, context):
            admitted = self._admit(request, context)
            manifest = admitted.model.manifest
            events = self.frontend.stream(admitted, timeout=context.time_remaining())
            try:
                async for event in events:
                    if isinstance(event, Partial):
                        await self._write(context, convert.partial(event, admitted.prepared, manifest))
                    elif isinstance(event, Final):
                        await self._write(context, convert.response(event.translations, manifest))
            finally:
                await events.aclose()

    @staticmethod
    async def _write(context: grpc.aio.ServicerContext, message: pb.TranslateResponse) -> None:
        if context.cancelled() or context.done():
            raise asyncio.CancelledError()
        try:
            await context.write(message)
        except Exception as e:
            # gRPC core's failed send (``cygrpc.ExecuteBatchError``, a private class: matched by
            # name) means the stream is closed: the client cancelled while we wrote
            if type(e).__name__ == "ExecuteBatchError" or context.cancelled() or context.done():
                raise asyncio.CancelledError() from None
            raise

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        async with self._rpc("ListModels", request, context):
            return convert.model_list(self.frontend.served(), provider=self.frontend.config.provider.value)

    @asynccontextmanager
    async def _rpc(self, method: str, request: object, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[None]:
        """Time the call, count it by status code, answer an error with its kind's code, log it."""
        metrics, code, started = self.frontend.metrics, grpc.StatusCode.OK, time.perf_counter()
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
            error = self.frontend.failure(e, method=method)
            code = status(error.kind).grpc
            await context.abort(code, error.message)
        finally:
            metrics.requests.labels(method=method, code=code.name, protocol="grpc").inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s peer=%s texts=%d code=%s %.1f ms", method, context.peer(),
                          len(getattr(request, "texts", ())), code.name,
                          (time.perf_counter() - started) * 1000)
