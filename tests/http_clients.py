"""Blocking HTTP clients of a running server, for tests and load-test scripts: a /metrics
sample, a JSON request to the HTTP/JSON API, a server-sent event stream parsed.

Imported through ``harness`` (which re-exports every name here), or as ``http_clients``
from ``tests/`` on ``sys.path``, like ``harness``; it needs no pytest and no server code.
"""

from __future__ import annotations

import http.client
import json
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def metric(metrics_port: int, sample: str, /, **labels: str) -> float:
    """One sample from a live /metrics endpoint: the first with these labels, 0 if absent."""
    text = scrape(metrics_port)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def scrape(metrics_port: int, timeout: float = 10) -> str:
    """The /metrics text."""
    return urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout).read().decode()


@dataclass
class HttpAnswer:
    """An HTTP answer: status, headers (names in lower case), body; ``json()`` parses it."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(port: int, method: str, path: str, body: object = None,
                 headers: dict[str, str] | None = None, timeout: float = 60) -> HttpAnswer:
    """One request to 127.0.0.1:``port``: ``body`` bytes as given, anything else as JSON
    (``Content-Type: application/json`` unless ``headers`` say otherwise)."""
    headers = dict(headers or {})
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        reply = conn.getresponse()
        return HttpAnswer(reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read())
    finally:
        conn.close()


def sse_events(body: bytes) -> list[tuple[str, Any]]:
    """(event, parsed data) of a server-sent event stream, in order."""
    events = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events
