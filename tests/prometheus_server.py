"""A real Prometheus server for tests/test_observability.py: started on a free loopback port,
scraping the server under test, queried over its HTTP API; and the bounded waits the tests use."""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from harness import free_port, wait_until

SCRAPE_INTERVAL = "1s"


class Prometheus:
    """A Prometheus server on loopback scraping one target every second."""

    def __init__(self, root: Path, target: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        config = root / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": "nmt", "static_configs": [{"targets": [target]}]}]}))
        self.log = root / "prometheus.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"], stdout=out, stderr=out)
        wait_until(self.ready, timeout=60, what="Prometheus ready", process=self, interval=0.2)
        wait_until(lambda: self.values('up{job="nmt"}') == [1.0], timeout=30, what="first scrape",
                   process=self, interval=0.2)

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return json.load(urllib.request.urlopen(url, timeout=10))
        except urllib.error.HTTPError as e:  # 400 on a parse error: the body says why
            return json.load(e)

    def values(self, expr: str) -> list[float]:
        reply = self.query(expr)
        assert reply["status"] == "success", (expr, reply)
        return [float(r["value"][1]) for r in reply["data"]["result"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        finally:
            self.proc.kill()


# Under CPU load a scrape can come late or time out, and a query right after the load then finds
# no series: the tests wait for the data they need, up to this long, instead of a fixed time.
SERIES_TIMEOUT = 30.0  # well inside RATE_WINDOW after the load, so rates still cover it


def wait_for_scrape_after(p: Prometheus, moment: float, *, timeout: float = SERIES_TIMEOUT) -> None:
    """Until Prometheus holds a scrape of the server taken at or after ``moment`` (Unix time)."""
    def scraped() -> bool:
        return max(p.values("timestamp(nmt_queue_depth)"), default=-math.inf) >= moment
    wait_until(scraped, timeout=timeout, what="a scrape after the load", process=p, interval=0.2)


def wait_for_data(p: Prometheus, exprs: list[str], *, timeout: float = SERIES_TIMEOUT) -> dict[str, list[float]]:
    """Each query's values once every one has a finite value, polled together up to ``timeout``;
    the queries still empty then map to what they last returned (so a test can name them)."""
    found: dict[str, list[float]] = {}
    deadline = time.monotonic() + timeout
    while True:
        for expr in exprs:
            if not any(math.isfinite(v) for v in found.get(expr, [])):
                found[expr] = p.values(expr)
        if all(any(math.isfinite(v) for v in found[e]) for e in exprs) or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)
