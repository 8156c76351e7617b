"""The HTTP port's connection limits (``service.api.http_limits``; issue 31, row 2): a cap on
open connections (more are closed at once, counted, logged once per interval), a time limit on
a request's headers (slowloris), an idle time on keep-alive connections; raw loopback sockets
against a real server with lowered limits."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from pathlib import Path

import pytest

from harness import ServerThread, config_for, wait_until
from service.api import http_limits
from service.config import ConfigError, HttpLimits, parse

CAP, HEADER_SECONDS, IDLE_SECONDS, LOG_SECONDS = 4, 1.0, 2.0, 1.5
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def limited(reversal_repository: Path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(http_limits, "LOG_INTERVAL_SECONDS", LOG_SECONDS)
        with ServerThread(config_for(reversal_repository, "--http-max-connections", str(CAP),
                                     "--http-header-timeout", str(HEADER_SECONDS),
                                     "--http-idle-timeout", str(IDLE_SECONDS))) as s:
            yield s


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def answer(sock: socket.socket) -> bytes:
    """One response on a kept-alive connection: its status line and headers, then its body."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed after {out!r}"
        out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(1 << 16)
    return head


def seconds_to_close(sock: socket.socket, *, limit: float) -> float | None:
    """How long until the server closes ``sock`` (reading and dropping what it sends); None:
    still open after ``limit`` s."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(1 << 16):
            pass
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def open_count(server: ServerThread) -> float:
    return server.metric("nmt_http_connections_open")


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "connections refused" in r.getMessage()]


def test_connections_beyond_the_cap_are_closed_at_once(limited: ServerThread,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nmt.http")
    held = [connect(limited.http_port) for _ in range(CAP)]
    try:
        for sock in held:  # a request each: kept alive, so the idle time (not the header time) runs
            sock.sendall(HEALTHZ)
            assert answer(sock).startswith(b"HTTP/1.1 200")
        refused_before = limited.metric("nmt_http_connections_refused_total")
        for _ in range(10):
            with connect(limited.http_port) as extra:
                seconds = seconds_to_close(extra, limit=HEADER_SECONDS / 2)
                assert seconds is not None, "a connection beyond the cap stayed open"
        assert limited.metric("nmt_http_connections_refused_total") == refused_before + 10
        assert open_count(limited) == CAP
        assert len(refusal_lines(caplog)) == 1, refusal_lines(caplog)  # not one per connection
        wait_until(lambda: len(refusal_lines(caplog)) == 2, timeout=LOG_SECONDS + 3, what="the summary")
        assert "9 connections refused in the last 2 s" in refusal_lines(caplog)[1]
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: open_count(limited) == 0, timeout=5, what="the held connections closed")
    assert limited.http("GET", "/healthz").status == 200


def test_half_a_header_line_is_closed_after_the_header_timeout(limited: ServerThread) -> None:
    with connect(limited.http_port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        seconds = seconds_to_close(sock, limit=HEADER_SECONDS + 3)
    assert seconds is not None and HEADER_SECONDS * 0.8 < seconds < IDLE_SECONDS, seconds


def test_a_slow_second_request_is_timed_from_its_first_byte(limited: ServerThread) -> None:
    with connect(limited.http_port) as sock:
        sock.sendall(HEALTHZ)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_SECONDS * 0.6)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        seconds = seconds_to_close(sock, limit=IDLE_SECONDS + 3)
    assert seconds is not None and HEADER_SECONDS * 0.8 < seconds < HEADER_SECONDS * 1.6, seconds


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(limited: ServerThread) -> None:
    with connect(limited.http_port) as sock:
        seconds = seconds_to_close(sock, limit=HEADER_SECONDS + 3)
    assert seconds is not None and HEADER_SECONDS * 0.8 < seconds < IDLE_SECONDS, seconds


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(limited: ServerThread) -> None:
    with connect(limited.http_port) as sock:
        for _ in range(2):  # kept alive between requests
            sock.sendall(HEALTHZ)
            assert answer(sock).startswith(b"HTTP/1.1 200")
        seconds = seconds_to_close(sock, limit=IDLE_SECONDS + 3)
    assert seconds is not None and IDLE_SECONDS * 0.8 < seconds < IDLE_SECONDS + 2, seconds


def test_refusals_are_logged_once_per_interval() -> None:
    async def main() -> list[int]:
        throttled = http_limits.Throttled("%d refused in %.0f s", interval=0.2)
        for _ in range(50):
            throttled.note()
        await asyncio.sleep(0.3)
        throttled.note()  # within the second interval: waits for its end
        await asyncio.sleep(0.3)
        throttled.close()
        return counts

    counts: list[int] = []
    handler = logging.Handler()
    handler.emit = lambda record: counts.append(record.args[0])  # type: ignore[method-assign]
    http_limits.log.addHandler(handler)
    try:
        assert asyncio.run(main()) == [1, 49, 1]
    finally:
        http_limits.log.removeHandler(handler)


def test_the_cap_leaves_descriptors_for_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert http_limits.connection_cap(512) == 512
    assert http_limits.connection_cap(5000) == http_limits.connection_cap(0) == 768
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert http_limits.connection_cap(0) == 0


def test_flags_defaults_and_bad_values(capsys: pytest.CaptureFixture) -> None:
    assert parse([], env={}).http_limits == HttpLimits(header_timeout=10.0, idle_timeout=30.0,
                                                       max_connections=512)
    assert parse(["--http-idle-timeout", "5", "--http-max-connections", "0"], env={}).http_limits == \
        HttpLimits(idle_timeout=5.0, max_connections=0)
    with pytest.raises(SystemExit):
        parse(["--http-max-connections", "-1"], env={})
    assert "argument --http-max-connections: must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--http-header-timeout", "inf"], env={})
    assert "argument --http-header-timeout: must be a finite number >= 0, got 'inf'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"NMT_HTTP_IDLE_TIMEOUT: must be a number, got 'soon'"):
        parse([], env={"NMT_HTTP_IDLE_TIMEOUT": "soon"})


CHILD = """
import asyncio, os, sys
from aiohttp import web
from service.api.http_errors import JsonErrorsRunner
from service.api.http_limits import LimitedSite
from service.config import HttpLimits
from service.metrics import Metrics

async def ok(request):
    return web.Response(text="ok")

async def main():
    app = web.Application()
    app.add_routes([web.get("/", ok)])
    runner = JsonErrorsRunner(app)
    await runner.setup()
    await LimitedSite(runner, "127.0.0.1", 0, limits=HttpLimits(max_connections=0), metrics=Metrics()).start()
    spare = []
    try:  # every descriptor left taken: the next accept() fails with EMFILE
        while True:
            spare.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        print(runner.addresses[0][1], flush=True)
    await asyncio.sleep(float(sys.argv[1]))
    for fd in spare:
        os.close(fd)
    await asyncio.sleep(30)

asyncio.run(main())
"""


def test_out_of_descriptors_pauses_accepting_without_a_log_storm(tmp_path: Path) -> None:
    """asyncio's accept loop logs ``socket.accept() out of system resource`` thousands of times
    a second here; this one logs a line, waits, and serves the connections once descriptors
    are free again."""
    import subprocess
    import sys

    full_seconds = 1.5
    log = tmp_path / "child.log"
    with log.open("w") as err:
        # the limit set by the child itself: a preexec_fn forks this process, whose gRPC threads make that
        # unsafe (a full run once lost the child so, before it printed its port)
        limit = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        child = subprocess.Popen([sys.executable, "-c", limit + CHILD, str(full_seconds)], stdout=subprocess.PIPE,
                                 stderr=err, text=True)
    try:
        port = int(child.stdout.readline())
        socks = [connect(port) for _ in range(3)]
        for sock in socks:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in socks:  # answered once the child frees its descriptors
            assert answer(sock).startswith(b"HTTP/1.1 200")
            sock.close()
    finally:
        child.kill()
        child.wait()
    text = log.read_text()
    assert "out of system resource" not in text, text[:2000]
    assert text.count("no file descriptor for a new connection") == 1, text[:2000]
