"""Servers for tests and load tests: in-process on port 0, or ``nmt serve`` as a process.

One module for every test and script that starts a server, imported as ``harness``:
pytest puts ``tests/`` on ``sys.path`` (the test files sit in a directory without
``__init__.py``), and the scripts under ``loadtest/`` add it themselves
(``sys.path.insert(0, str(ROOT / "tests"))``). Not ``tests.harness``: a script run
as ``python loadtest/x.py`` has ``loadtest/`` on its path, not the repository root
(the editable install maps ``service`` and ``export`` only), and a top-level
``tests`` package that some distribution installs would shadow our directory.

It needs no pytest, and imports the server (and so ONNX Runtime) only when an
in-process server is made: ``loadtest/run_locust.py`` uses ``ServerProcess`` alone.

- ``ServerThread``: ``service.api.server.build`` on its own event loop in a
  background thread; tests talk to it with ordinary blocking clients.
- ``ServerProcess``: ``python -m service.cli serve`` on free ports, its output in a
  log file; up when health says SERVING; ``stop()`` sends SIGTERM, returns the exit code.
- ``wait_until``: the one poll helper.
- ``metric``, ``scrape``, ``http_request``, ``sse_events``: the HTTP clients
  (``tests/http_clients.py``), re-exported here.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from http_clients import HttpAnswer, http_request, metric, scrape, sse_events  # noqa: F401 (re-exported)
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG_DIGITS = " ".join("1234567890" * 3)  # 30 digits: about 30 decoder steps for the reversal model
LOG_TAIL_CHARS = 3000
T = TypeVar("T")


def served_version(tree: Path = ROOT, name: str = "en-fr") -> Path:
    """The version of ``name`` a checkout serves by default: the highest one it ships (the
    server's ``latest`` policy; ``service.config`` picks its own default so), e.g. ``models/en-fr/4``."""
    versions = [p for p in (tree / "models" / name).iterdir()
                if p.name.isdigit() and (p / "manifest.json").is_file()]
    if not versions:
        raise FileNotFoundError(f"{tree / 'models' / name}: no version with a manifest.json")
    return max(versions, key=lambda p: int(p.name))


def free_port() -> int:
    """A loopback port nothing listens on now, below the ephemeral range: a port the OS picks (``bind(0)``)
    is one it may also give the next outgoing connection before the server binds it (a hostile-soak run
    failed so: "address already in use")."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free loopback port below the ephemeral range")


def wait_until(condition: Callable[[], object], *, timeout: float, what: str, process=None,
               interval: float = 0.02) -> None:
    """Poll ``condition`` until it is true; AssertionError naming ``what`` after ``timeout`` s.

    ``process``: something with ``proc`` (a Popen) and ``log`` (its output file), such as a
    ``ServerProcess``; if it exits meanwhile, or on time-out, the error ends with its log tail.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.proc.poll() is not None:
            raise AssertionError(f"waiting for {what}: the process exited with {process.proc.returncode}"
                                 f"{log_tail(process.log)}")
        if condition():
            return
        if time.monotonic() >= deadline:
            tail = log_tail(process.log) if process is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{tail}")
        time.sleep(interval)


def log_tail(log: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
    if log is None or not log.exists():
        return ""
    return f"\n--- last of {log} ---\n{log.read_text(errors='replace')[-chars:]}"


def is_serving(channel: grpc.Channel, service: str = "") -> bool:
    """Health says SERVING (False while it cannot be reached)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=1)
    except grpc.RpcError:
        return False
    return reply.status == SERVING


def config_for(repository: Path, *extra: str):
    """The tests' server configuration: loopback, port 0 (HTTP: a free port; 0 is off), small
    limits; ``extra`` flags win."""
    from service.config import parse

    return parse(["--model-repository", str(repository), "--host", "127.0.0.1", "--port", "0",
                  "--metrics-port", "0", "--http-port", str(free_port()), "--max-texts", "8", "--max-beam", "4",
                  "--max-message-bytes", "65536", "--max-wait-ms", "5", *extra], env={})


class _Client:
    """A channel opened on first use and closed with the server; ``api`` is its Translator stub."""

    _channel: grpc.Channel | None = None

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def api(self) -> pb_grpc.TranslatorStub:
        return pb_grpc.TranslatorStub(self.channel)

    def metric(self, sample: str, /, **labels: str) -> float:
        """A sample from this server's /metrics (0 if absent)."""
        return metric(self.metrics_port, sample, **labels)

    def scrape(self, timeout: float = 10) -> str:
        return scrape(self.metrics_port, timeout)

    @property
    def http_url(self) -> str:
        """The HTTP/JSON API's base URL (``service.api.http_server``)."""
        return f"http://127.0.0.1:{self.http_port}"

    def http(self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None,
             timeout: float = 60) -> HttpAnswer:
        """One HTTP request to this server (``http_request``)."""
        return http_request(self.http_port, method, path, body, headers, timeout)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class ServerThread(_Client):
    """An App on its own event loop in a background thread.

    ``wait=False`` returns once the port is bound (``listening``), before start-up
    (warm-up) ends; then call ``wait_started``.
    """

    def __init__(self, config, engines: Sequence | None = None, *, wait: bool = True) -> None:
        self.config, self.engines = config, engines
        self.started, self.app, self.error = threading.Event(), None, None
        self.listening = threading.Event()  # the port is known (start-up may still run)
        self.grace = 0.0
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        if wait:
            self.wait_started()

    def wait_started(self, timeout: float = 300) -> None:
        if not self.started.wait(timeout):
            raise AssertionError(f"server not started after {timeout} s")
        if self.error:
            raise self.error

    async def _main(self) -> None:
        from service.api.server import build

        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            self.app = build(self.config, self.engines)
            self.listening.set()
            await self.app.start()
        except Exception as e:
            self.error = e
            self.listening.set()
            self.started.set()
            return
        self.started.set()
        await self._stop.wait()
        await self.app.stop(self.grace)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    @property
    def metrics_port(self) -> int:
        return self.app.metrics_port

    @property
    def http_port(self) -> int:
        return self.app.http.port

    def run_client(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine`` run to its end on a client event loop that stays open until the server
        has stopped. grpc.aio's completion queue serves every event loop of the process: a
        late event for a call of a closed client loop, handled by the server's loop, logs
        "Event loop is closed" with a traceback (``asyncio.run`` closes its loop at once)."""
        if self._client_loop is None:
            self._client_loop = asyncio.new_event_loop()
        return self._client_loop.run_until_complete(coroutine)

    def stop(self, grace: float = 0.0, *, wait: bool = True) -> None:
        self.grace = grace
        self.loop.call_soon_threadsafe(self._stop.set)
        if wait:
            self.thread.join(30)
            self._close_channel()
            if self._client_loop is not None:
                self._client_loop.close()  # not run again: it would serve the stopped server's events
                self._client_loop = None

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(_Client):
    """``python -m service.cli serve`` in a subprocess on free loopback ports.

    ``args``: further ``nmt serve`` flags. The process's stdout and stderr go to ``log``
    (unbuffered); its environment is this one's (PYTHONPATH included) plus ``env``; ``cwd``
    (default: this checkout) is where ``service`` is imported from, so another checkout's
    server (a previous release in a git worktree) can run beside this one.
    The constructor returns when health says SERVING, or raises AssertionError with
    the log's tail (and kills the process).
    """

    def __init__(self, repository: Path | str, log: Path, *args: str, env: dict[str, str] | None = None,
                 startup_timeout: float = 300, cwd: Path = ROOT) -> None:
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = log
        self.command = [sys.executable, "-m", "service.cli", "serve", "--model-repository", str(repository),
                        "--host", "127.0.0.1", "--port", str(self.port),
                        "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port), *args]
        with log.open("w") as out:
            self.proc = subprocess.Popen(self.command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.started = time.monotonic()
        try:
            wait_until(lambda: is_serving(self.channel), timeout=startup_timeout, what="health SERVING",
                       process=self, interval=0.2)
        except BaseException:
            self.kill()
            raise
        finally:
            self._close_channel()  # reopened on first use of ``channel`` or ``api``
        self.startup_seconds = time.monotonic() - self.started

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code once it exits (killed after ``timeout`` s: -SIGKILL)."""
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -signal.SIGKILL

    def kill(self) -> None:
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
