"""``nmt serve``'s server: the served models, the front door, metrics, and the transports around them.

Layering::

    main ──► server.App ─┬─► grpc_server.GrpcServer ─┬─► frontend.Frontend ──► app.ServedModels
                         └─► http_server.HttpServer ─┘

``App`` is the one place that knows every transport: it makes them over one ``Frontend``,
starts them, says when the server is ready (gRPC health, HTTP ``/readyz``: SERVING only
after every model translated a warm-up text; ``/readyz`` also 503 while the model watcher
fails), and drains them on SIGTERM
(NOT_SERVING -> refuse new calls -> in-flight calls finish within the grace period).
A transport imports the front door, never ``App`` nor another transport.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, Sequence

from service.api.auth import TlsFiles, TokenCheck, TokenFile, authorizer, tls_context
from service.api.frontend import Frontend
from service.api.grpc_server import GrpcServer
from service.api.http_server import HttpServer
from service.app import ServedModels, load_engines
from service.config import Batching, ModelControl, ServeConfig
from service.interface import Engine
from service.metrics import Metrics, MetricsServer
from service.scheduling.admission import SMALL_LANE_SCALE

log = logging.getLogger("nmt.server")


class App:
    """The server and everything it owns: models, the front door, both transports, metrics."""

    def __init__(self, config: ServeConfig, engines: Sequence[Engine]) -> None:
        self.config, self.metrics = config, Metrics()
        self.models = ServedModels(config, engines, self.metrics)
        self.frontend = Frontend(config=config, models=self.models, metrics=self.metrics)
        security = config.security
        tls = TlsFiles(security) if security.tls else None  # first: a bad file stops us here
        tokens = (TokenCheck(TokenFile(security.auth_token_file), self.metrics)
                  if security.auth_token_file else None)
        self.grpc = GrpcServer(self.frontend, config=config, tls=tls, tokens=tokens)
        # HTTP/JSON beside gRPC (--http-port; 0 = off), with the same TLS files and tokens
        self.http = HttpServer(self.frontend, max_body=config.max_message_bytes,
                               authorize=authorizer(tokens), limits=config.http_limits,
                               unready=self._unready)
        self.http_tls = tls_context(security)
        self.metrics_server: MetricsServer | None = None
        self._tasks: set[asyncio.Task] = set()  # the poller and SIGHUP rescans

    @property
    def port(self) -> int:
        """The gRPC port (bound when the App was made)."""
        return self.grpc.port

    @property
    def metrics_port(self) -> int:
        return self.metrics_server.port if self.metrics_server else 0

    def _unready(self) -> str:
        """Why ``/readyz`` says 503 though the models serve: the model watcher failing. gRPC health
        stays SERVING then (every loaded model still translates; only new versions wait)."""
        error = self.models.watcher.error
        return f"the model watcher is failing (rescan failed: {error}); the loaded models still serve" if error else ""

    def rescan(self) -> None:
        """Look at the model repository again, in the background (SIGHUP)."""
        self._background(self.models.rescan())

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` until it ends or ``stop`` cancels it."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Serve; ready only after every model translated a warm-up text."""
        await self.grpc.set_serving(False)
        self.models.start()
        self.metrics_server = self.metrics.serve(host=self.config.metrics_host,
                                                 port=self.config.metrics_port)
        await self.grpc.start()
        await self.http.start(self.config.host, self.config.http_port, ssl_context=self.http_tls)
        warmup_ms = await self.models.warm_up() * 1000
        await self.grpc.set_serving(True)
        self.frontend.ready = True
        if self.config.model_control is ModelControl.POLL:
            self._background(self.models.poll(self.config.poll_seconds))
        self._log_serving(warmup_ms)

    def _log_serving(self, warmup_ms: float) -> None:
        config, sc, sec = self.config, self.config.scheduler, self.config.security
        access = ("mTLS" if sec.tls_client_ca_file else "TLS" if sec.tls else "plaintext") + (
            ", tokens" if sec.auth_token_file else ", no tokens")
        log.info("serving %s on %s:%d (%s; metrics %s:%d/metrics) on %s, %s-level batching "
                 "(max_rows=%d max_tokens=%d%s max_wait=%.1fms max_queued_work=%d), warm-up %.0f ms, "
                 "HTTP :%d",
                 ", ".join(f"{m.ref} ({m.engine.precision})" for m in self.models.all), config.host,
                 self.port, access, config.metrics_host, self.metrics_port, config.provider,
                 Batching.STEP if sc.step_level else Batching.REQUEST, sc.max_rows, sc.max_tokens,
                 f", small requests' lane x{SMALL_LANE_SCALE}" if sc.small_rows else "", sc.max_wait * 1000,
                 sc.max_queued_work, warmup_ms, self.http.port)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace`` seconds."""
        self.frontend.ready = False
        await self.grpc.draining()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(self.grpc.stop(grace), self.http.stop(grace))
        await self.models.close()
        if self.metrics_server is not None:
            self.metrics_server.close()


def build(config: ServeConfig, engines: Sequence[Engine] | None = None) -> App:
    """The server, not yet started (call inside the event loop that will run it)."""
    return App(config, load_engines(config) if engines is None else engines)
