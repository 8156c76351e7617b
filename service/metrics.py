"""Prometheus metrics, all in one place; one registry per server instance.

No module-level registry: two servers in one process (the tests) each count
their own. Names carry base units (``_seconds``) and ``_total`` on counters.

Buckets, chosen for this workload (a small RNN on CPU, one to a few hundred
decoder rows per step, sentences of 3 to 200 pieces):

- ``REQUEST_SECONDS``: 2 ms (one short greedy text on an idle server) to 30 s
  (a full 64-text beam request under overload), about 2x apart.
- ``QUEUE_SECONDS``: 0.5 ms (the batch window) to 5 s; most mass should sit
  below the ``--max-wait-ms`` window; above it means the server is saturated.
- ``ENGINE_SECONDS`` (encode per ``add``, decode per step): 0.1 ms (a few rows)
  to 0.5 s (hundreds of rows, long sources, int8 off, slow CPU).
- ``ROWS``: powers of two up to 512, the useful range of ``--max-rows``.
- ``RATIO``: padding ratio = padding columns / all source columns of a step's rows
  ((padded - real) / padded), 0..1 by tenths.
- ``TOKENS``: powers of two up to 512 pieces (source limit 200, target cap 512);
  also used for decoder steps per request, which cannot exceed the target cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REQUEST_SECONDS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
QUEUE_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
ENGINE_SECONDS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RATIO = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MODEL_LABELS = ("name", "version", "sha256", "provider", "precision", "int8_form")


class Metrics:
    """Every ``nmt_*`` metric, registered on this instance's own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # protocol: "grpc" or "http" (service.api.http_server; its codes are the gRPC code names)
        self.requests = Counter("nmt_requests_total", "RPCs answered, by method, gRPC status code "
                                "and protocol", ["method", "code", "protocol"], registry=r)
        self.request_duration = Histogram("nmt_request_duration_seconds",
                                          "End-to-end RPC latency, by method and protocol",
                                          ["method", "protocol"],
                                          buckets=REQUEST_SECONDS, registry=r)
        self.queue_wait = Histogram("nmt_queue_wait_seconds", "Time a text waited before encoding",
                                    buckets=QUEUE_SECONDS, registry=r)
        self.encode_duration = Histogram("nmt_encode_duration_seconds",
                                         "Encoder run adding texts to the batch",
                                         buckets=ENGINE_SECONDS, registry=r)
        self.decode_duration = Histogram("nmt_decode_duration_seconds", "One decoder step",
                                         buckets=ENGINE_SECONDS, registry=r)
        self.batch_rows = Histogram("nmt_batch_rows", "Decoder rows per step", buckets=ROWS,
                                    registry=r)
        self.padding_ratio = Histogram("nmt_padding_ratio",
                                       "Padding / total source tokens of the rows in a step",
                                       buckets=RATIO, registry=r)
        self.decoder_steps = Histogram("nmt_decoder_steps",
                                       "Decoder steps per request (its longest text)",
                                       buckets=TOKENS, registry=r)
        self.source_tokens = Histogram("nmt_source_tokens", "Source pieces per text (EOS included)",
                                       buckets=TOKENS, registry=r)
        self.target_tokens = Histogram("nmt_target_tokens", "Target pieces of each best hypothesis",
                                       buckets=TOKENS, registry=r)
        self.generated_tokens = Counter("nmt_generated_tokens_total",
                                        "Target pieces of the best hypotheses returned", registry=r)
        self.queue_depth = Gauge("nmt_queue_depth", "Texts waiting to be encoded", registry=r)
        self.inflight_rows = Gauge("nmt_inflight_rows", "Decoder rows reserved by decoding texts",
                                   registry=r)
        self.deadline_exceeded = Counter("nmt_deadline_exceeded_total",
                                         "Requests stopped because their deadline passed", registry=r)
        self.cancelled = Counter("nmt_cancelled_total", "Requests the client cancelled", registry=r)
        self.model_info = Gauge("nmt_model_info", "Loaded model (value 1)", list(MODEL_LABELS),
                                registry=r)
        self.model_load_failures = Counter("nmt_model_load_failures_total",
                                           "Model versions refused at a rescan (checksum, graphs, warm-up)",
                                           ["name"], registry=r)
        self.model_watcher_failures = Counter("nmt_model_watcher_failures_total",
                                              "Rescans of --model-control poll that failed (the repository "
                                              "gone, a file system error); retried after a backoff",
                                              registry=r)
        # the HTTP port's connections (service.api.http_limits; --http-max-connections)
        self.http_connections_open = Gauge("nmt_http_connections_open", "HTTP connections open", registry=r)
        self.http_connections_refused = Counter("nmt_http_connections_refused_total",
                                                "HTTP connections closed at accept: the cap was reached",
                                                registry=r)
        self._model_labels: dict[tuple[str, str], tuple[str, ...]] = {}

    def set_model(self, **labels: str) -> None:
        values = tuple(labels[k] for k in MODEL_LABELS)
        self._model_labels[(labels["name"], labels["version"])] = values
        self.model_info.labels(*values).set(1)

    def forget_model(self, *, name: str, version: str) -> None:
        """The version is no longer served: its ``nmt_model_info`` series goes."""
        values = self._model_labels.pop((name, version), None)
        if values is not None:
            self.model_info.remove(*values)

    def serve(self, *, host: str, port: int) -> MetricsServer:
        """Start the /metrics HTTP endpoint in a daemon thread (port 0 = any free port)."""
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(httpd=httpd, thread=thread)


@dataclass(frozen=True)
class MetricsServer:
    """The running /metrics endpoint."""

    httpd: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
