"""The HTTP port's connection limits, like those gRPC core keeps for its port: a cap on open
connections, a time limit on a request's headers, an idle time on keep-alive connections.

``LimitedSite`` is the listening socket of ``HttpServer`` (in place of ``web.TCPSite``), with
an accept loop of its own, because asyncio's (``selector_events._accept_connection``) has two
faults under a connection flood:

- It accepts without limit: every idle connection holds a file descriptor until the process
  has none left, and then ``/metrics``, gRPC and HTTP stop answering.
- On ``EMFILE`` it keeps calling ``accept()`` for the rest of its backlog (100 tries), each one
  logged and each scheduling another restart a second later: thousands of log lines a second.

Here, at ``--http-max-connections`` (lowered to what ``ulimit -n`` leaves, a quarter kept for
the rest of the process), a new connection is accepted and closed at once, before any protocol
or handler exists; the refusals are counted (``nmt_http_connections_refused_total``) and logged
once per ``LOG_INTERVAL_SECONDS`` with their number. Out of descriptors, accepting pauses for
``ACCEPT_RETRY_SECONDS``, logged the same way.

``LimitedHandler`` closes a connection whose request headers are not complete within
``--http-header-timeout`` (counted from the connect, then from a later request's first byte:
a slowloris client), and gives aiohttp ``--http-idle-timeout`` as its keep-alive time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
from typing import Callable

from aiohttp import web

from service.api.http_errors import JsonErrorsHandler
from service.config import HttpLimits
from service.metrics import Metrics

log = logging.getLogger("nmt.http")

LOG_INTERVAL_SECONDS = 10.0  # at most one line per interval for refusals, and for EMFILE
ACCEPT_RETRY_SECONDS = 0.5  # accepting pauses this long when the process is out of descriptors
FD_RESERVE = 64  # descriptors kept, at least, for everything but HTTP connections (or a quarter)
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Throttled:
    """A warning logged at most once per ``interval`` seconds, with the events counted since:
    the first at once, the rest summed into a line at the end of each interval."""

    def __init__(self, message: str, *, interval: float | None = None) -> None:
        self.message = message  # with %d (the events) then %.0f (the interval's seconds)
        self.interval = LOG_INTERVAL_SECONDS if interval is None else interval
        self.pending = 0
        self._flush_handle: asyncio.TimerHandle | None = None

    def note(self) -> None:
        self.pending += 1
        if self._flush_handle is None:
            self._flush()

    def _flush(self) -> None:
        self._flush_handle = None
        if self.pending:
            log.warning(self.message, self.pending, self.interval)
            self.pending = 0
            self._flush_handle = asyncio.get_running_loop().call_later(self.interval, self._flush)

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None


def connection_cap(configured: int) -> int:
    """``configured`` (0: no cap), lowered where the open-files limit (``ulimit -n``) cannot hold
    that many connections besides what the rest of the process needs; logged once."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    room = max(soft - max(FD_RESERVE, soft // 4), 1)
    if configured == 0 or configured > room:
        log.warning("HTTP: at most %d connections at once, not %s (--http-max-connections): the "
                    "process may open %d files (ulimit -n), some kept for models, gRPC and /metrics",
                    room, configured or "unlimited", soft)
        return room
    return configured


class Slot:
    """One admitted connection's place under the cap; ``release`` once it is gone (idempotent)."""

    __slots__ = ("gate", "held")

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate, self.held = gate, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.gate.open -= 1
            self.gate.metrics.http_connections_open.dec()


class ConnectionGate:
    """Counts open HTTP connections against the cap (``connection_cap``)."""

    def __init__(self, cap: int, metrics: Metrics) -> None:
        self.cap, self.metrics, self.open = cap, metrics, 0
        self.refusals = Throttled(f"HTTP: %d connections refused in the last %.0f s: {cap} were open "
                                  "(--http-max-connections)")

    def admit(self) -> Slot | None:
        if self.cap and self.open >= self.cap:
            self.metrics.http_connections_refused.inc()
            self.refusals.note()
            return None
        self.open += 1
        self.metrics.http_connections_open.inc()
        return Slot(self)


class LimitedHandler(JsonErrorsHandler):
    """aiohttp's per-connection handler, with a time limit on request headers and a slot
    released when the connection goes.

    It reads aiohttp's ``_waiter`` (pending: between requests) and ``_request_count`` (requests
    parsed so far): aiohttp (3.14) has no header time limit of its own."""

    def __init__(self, manager: web.Server, *, slot: Slot, header_timeout: float, **kwargs: object) -> None:
        super().__init__(manager, **kwargs)
        self.slot, self.header_timeout = slot, header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        self._headers_counted = 0  # _request_count when the header timer started

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        between_requests = self._waiter is not None and not self._waiter.done()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # whole headers: the handler's time starts
            self._stop_header_timer()
        elif data and between_requests and self._header_deadline is None:
            self._start_header_timer()  # a later request's first bytes

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_timer()
        self.slot.release()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self.header_timeout > 0:
            self._headers_counted = self._request_count
            self._header_deadline = self._loop.call_later(self.header_timeout, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self._request_count == self._headers_counted and not self._force_close:
            log.debug("HTTP: closed a connection from %s: no whole request headers within %.1f s",
                      self.peername, self.header_timeout)
            self.force_close()


class LimitedSite(web.TCPSite):
    """``web.TCPSite`` with the accept loop of this module (see its doc) and ``LimitedHandler``
    connections."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, limits: HttpLimits,
                 metrics: Metrics, **kwargs: object) -> None:
        super().__init__(runner, host, port, reuse_port=False, **kwargs)
        self.limits = limits
        self.gate = ConnectionGate(connection_cap(limits.max_connections), metrics)
        self.out_of_files = Throttled("HTTP: no file descriptor for a new connection %d times in "
                                      f"%.0f s; accepting pauses {ACCEPT_RETRY_SECONDS} s each time")
        self._connecting: set[asyncio.Task] = set()  # connections before their handler (a TLS handshake)

    async def start(self) -> None:
        """Bind as ``web.TCPSite`` does; accept with ``_accept``, not asyncio's loop."""
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._runner.server, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=False, start_serving=False)
        for sock in self._server._sockets:  # the sockets themselves (``sockets`` wraps them)
            sock.listen(self._backlog)
            loop.add_reader(sock.fileno(), self._accept, sock)

    async def stop(self) -> None:
        for task in list(self._connecting):
            task.cancel()
        self.gate.refusals.close()
        self.out_of_files.close()
        await super().stop()  # closes the listening sockets (and removes their readers)

    def _accept(self, sock: socket.socket) -> None:
        """Accept what is waiting (at most a backlog's worth per call, like asyncio)."""
        loop = asyncio.get_running_loop()
        for _ in range(self._backlog):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                if e.errno in OUT_OF_FILES:
                    self._pause(sock)
                else:  # rare (a firewall's EPERM, say): the next connection is tried as usual
                    log.warning("HTTP: accept() failed: %s", e)
                return
            slot = self.gate.admit()
            if slot is None:
                conn.close()  # at the cap: no protocol, no handler, no buffer
                continue
            task = loop.create_task(self._connect(conn, slot))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    def _pause(self, sock: socket.socket) -> None:
        """Out of descriptors: stop reading the listening socket for a while (once, not once per
        try), so that connections closing meanwhile free some."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())
        self.out_of_files.note()
        loop.call_later(ACCEPT_RETRY_SECONDS, self._resume, sock)

    def _resume(self, sock: socket.socket) -> None:
        if sock.fileno() != -1:  # not closed by stop() meanwhile
            asyncio.get_running_loop().add_reader(sock.fileno(), self._accept, sock)

    async def _connect(self, conn: socket.socket, slot: Slot) -> None:
        """The connection's transport and handler (after the TLS handshake, with TLS, which gets
        the header time limit too); its slot released if that fails."""
        conn.setblocking(False)
        handshake = self.limits.header_timeout if self._ssl_context and self.limits.header_timeout else None
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self._handler_factory(slot), conn, ssl=self._ssl_context, ssl_handshake_timeout=handshake)
        except BaseException as e:  # a failed TLS handshake, a reset, stop() cancelling
            conn.close()
            slot.release()
            if not isinstance(e, (OSError, asyncio.TimeoutError)):
                raise
            log.debug("HTTP: a connection failed before its first request: %s", type(e).__name__)

    def _handler_factory(self, slot: Slot) -> Callable[[], LimitedHandler]:
        server = self._runner.server
        assert server is not None
        kwargs = {**server._kwargs, "keepalive_timeout": self.limits.idle_timeout}
        return lambda: LimitedHandler(server, loop=server._loop, slot=slot,
                                      header_timeout=self.limits.header_timeout, **kwargs)
