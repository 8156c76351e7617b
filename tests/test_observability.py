"""Observability end to end: ``nmt serve`` as a process, scraped by promtool, a real
Prometheus and the dashboard's queries (the Locust load test: ``tests/test_locust.py``).

Metric values for a known sequence of requests are checked in test_api.py;
here: the exposition is valid for Prometheus' own tools, scraping does not get
in the way of translating, and every dashboard query returns data from a real
Prometheus that scraped the service under load. Loopback only, bounded in time.
Tests that need Debian's ``prometheus`` package (promtool, prometheus) skip
without it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from harness import ROOT, ServerProcess
from prometheus_server import Prometheus, wait_for_data, wait_for_scrape_after
from service.metrics import Metrics
from service.proto.nmt.v1 import translation_pb2 as pb

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "nmt-serve.json"
DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
RATE_WINDOW = "1m"  # stands in for Grafana's $__rate_interval; covers the whole short load
LOAD_SECONDS = 6.0
SCRAPE_TEST_SECONDS = 2.0
STARTUP_SECONDS = 240
SHORT = pb.DecodingOptions(max_decoding_length=8)  # an untrained model would decode to the cap

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus not installed (apt-get install prometheus)")


class Server(ServerProcess):
    """``nmt serve`` in a subprocess (the harness's), plus a timed short request."""

    def translate(self, text: str = "Open the file") -> float:
        """Seconds one short request takes."""
        started = time.perf_counter()
        self.api.Translate(pb.TranslateRequest(texts=[text], options=SHORT), timeout=60)
        return time.perf_counter() - started


@pytest.fixture(scope="module")
def server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tiny_repository, tmp_path_factory.mktemp("observability") / "server.log", "--max-wait-ms", "5",
               startup_timeout=STARTUP_SECONDS)
    yield s
    try:
        assert s.stop() == 0, s.log_text()[-2000:]
    finally:
        s.kill()


def drive_load(server: Server, seconds: float) -> None:
    """A few threads of mixed traffic: greedy, beam with n-best, streams, and bad input."""
    errors: list[BaseException] = []

    def request(i: int) -> None:
        if i % 7 == 1:  # INVALID_ARGUMENT: the dashboard's error panels need an error
            bad = pb.TranslateRequest(texts=["x"], options=pb.DecodingOptions(beam_size=10_000))
            try:
                server.api.Translate(bad, timeout=30)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
                return
            raise AssertionError("beam_size=10000 was accepted")
        if i % 5 == 2:
            list(server.api.TranslateStream(pb.TranslateRequest(texts=["Save the file"], options=SHORT),
                                            timeout=60))
            return
        options = SHORT if i % 2 else pb.DecodingOptions(beam_size=3, num_hypotheses=2, max_decoding_length=8)
        server.api.Translate(pb.TranslateRequest(texts=["Delete %s files?", "Open the file"], options=options),
                             timeout=60)

    def worker(seed: int) -> None:  # thread 1 starts with the bad request, thread 2 with a stream
        end, i = time.monotonic() + seconds, seed
        while time.monotonic() < end:
            try:
                request(i)
            except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
                errors.append(e)
                return
            i += 1
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- the exposition and the gRPC path ------------------------------------------------------

@needs_promtool
def test_promtool_accepts_the_scraped_metrics(server: Server) -> None:
    drive_load(server, 1.0)  # labelled families (method, code) appear once used
    text = server.scrape()
    assert 'nmt_requests_total{code="INVALID_ARGUMENT",method="Translate",protocol="grpc"}' in text
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_stalled_metrics_client_blocks_neither_grpc_nor_other_scrapes(server: Server) -> None:
    ok = dict(method="Translate", code="OK")
    before = server.metric("nmt_requests_total", **ok)
    stalled = [socket.create_connection(("127.0.0.1", server.metrics_port)) for _ in range(2)]
    try:
        stalled[0].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        reply = server.api.Translate(pb.TranslateRequest(texts=["Open the file"], options=SHORT), timeout=30)
        assert len(reply.translations) == 1 and reply.translations[0].hypotheses[0].tokens
        assert server.metric("nmt_requests_total", **ok) == before + 1  # another scrape, answered
        for s in stalled:  # and both stalled clients are still connected, waiting, unanswered
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in stalled:
            s.close()


def test_scraping_hard_does_not_slow_translation(server: Server) -> None:
    """Scraping 20 times a second (100x a usual 5 s interval) leaves gRPC latency near its baseline."""
    def latencies(seconds: float) -> list[float]:
        end, found = time.monotonic() + seconds, []
        while time.monotonic() < end or len(found) < 5:
            found.append(server.translate())
        return found
    server.translate()
    baseline = statistics.median(latencies(SCRAPE_TEST_SECONDS))
    stop, scrapes = threading.Event(), []

    def scrape_often() -> None:
        while not stop.is_set():
            scrapes.append(len(server.scrape()))
            stop.wait(0.05)
    scraper = threading.Thread(target=scrape_often)
    scraper.start()
    try:
        loaded = statistics.median(latencies(SCRAPE_TEST_SECONDS))
    finally:
        stop.set()
        scraper.join()
    assert len(scrapes) >= 10
    assert loaded <= 2 * baseline + 0.05, (baseline, loaded)


# ---- the dashboard --------------------------------------------------------------------------

def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, Grafana's interval variables filled in."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$__rate_interval", RATE_WINDOW).replace("$__interval", RATE_WINDOW))
            for p in panels for t in p["targets"]]


def exported_names() -> set[str]:
    """Every sample name the server's metrics produce (families and their suffixes)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    return {f.name + s for f in Metrics().registry.collect() for s in suffixes[f.type]}


def test_dashboard_panels_use_only_exported_metrics_and_the_provisioned_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    uid = re.search(r"^\s*uid:\s*(\S+)", DATASOURCE.read_text(), re.M).group(1)
    names = exported_names()
    assert {"nmt_request_duration_seconds_bucket", "nmt_queue_depth", "nmt_padding_ratio_sum"} <= names
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid and panel["targets"], panel["title"]
    for title, expr in dashboard_queries():
        used = set(re.findall(r"\bnmt_[a-z_]+", expr))
        assert used and used <= names, (title, used - names)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in ("p99", "requests/s", "tokens/s", "by grpc code", "queue depth", "rows per", "padding"):
        assert wanted in titles


@needs_promtool
def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_queries())]}]}
    path = tmp_path / "rules.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- a real Prometheus ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prometheus(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus after it scraped the server through a short mixed load."""
    p = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{server.metrics_port}")
    try:
        drive_load(server, LOAD_SECONDS)
        wait_for_scrape_after(p, time.time())
        yield p
    finally:
        p.stop()


class LateSeries:
    """Stands in for a Prometheus whose first answers after a loaded scrape hold no series."""

    def __init__(self, empty_answers: int, value: float) -> None:
        self.empty_answers, self.value, self.asked = empty_answers, value, 0
        self.proc, self.log = types.SimpleNamespace(poll=lambda: None), None  # what wait_until reads

    def values(self, expr: str) -> list[float]:
        self.asked += 1
        return [] if self.asked <= self.empty_answers else [self.value]


def test_the_waits_outlast_series_that_come_late() -> None:
    moment = time.time()
    late = LateSeries(empty_answers=3, value=moment + 5)
    wait_for_scrape_after(late, moment, timeout=10)  # no IndexError on an empty answer
    assert late.asked == 4
    late = LateSeries(empty_answers=3, value=1.0)
    assert wait_for_data(late, ["a", "b"], timeout=10) == {"a": [1.0], "b": [1.0]}
    never = LateSeries(empty_answers=10**9, value=1.0)  # bounded, and says what stayed empty
    assert wait_for_data(never, ["a"], timeout=0.5) == {"a": []}
    with pytest.raises(AssertionError, match="timed out after 0.5 s waiting for a scrape after the load"):
        wait_for_scrape_after(never, moment, timeout=0.5)


@needs_prometheus
def test_prometheus_quantile_over_the_latency_histogram(prometheus: Prometheus) -> None:
    expr = f"histogram_quantile(0.99, sum by (le) (rate(nmt_request_duration_seconds_bucket[{RATE_WINDOW}])))"
    p99 = wait_for_data(prometheus, [expr])[expr]
    assert len(p99) == 1 and 0 < p99[0] < math.inf


@needs_prometheus
def test_every_dashboard_query_returns_data(prometheus: Prometheus) -> None:
    queries = dashboard_queries()
    found = wait_for_data(prometheus, [expr for _, expr in queries])
    empty = [(title, expr, found[expr]) for title, expr in queries
             if not any(math.isfinite(v) for v in found[expr])]
    assert not empty
