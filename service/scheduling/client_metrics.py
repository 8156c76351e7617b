"""Per-client gauges: who holds the decoder rows and the queue (``nmt_client_rows``,
``nmt_client_queued_work``), labelled by model version and client.

A client is a token's identity (``token:<sha256 prefix>``, never the token), else the peer
address, or, with ``--trust-client-id``, the ``x-client-id`` the caller gives. The busiest
``MAX_CLIENTS`` clients of a model get their own series; the rest add up under ``other``, so
that a crowd of addresses cannot grow Prometheus' series without bound. A client's series leave
when it has nothing queued or decoding.
"""

from __future__ import annotations

from typing import Mapping

from prometheus_client import Gauge

from service.metrics import Metrics

MAX_CLIENTS = 20
OTHER = "other"


class ClientGauges:
    """The two gauges on a ``Metrics`` registry (made once per registry, shared by its schedulers)."""

    def __init__(self, metrics: Metrics) -> None:
        self.rows = Gauge("nmt_client_rows", "Decoder rows of a client's texts decoding, by model and client",
                          ["model", "client"], registry=metrics.registry)
        self.work = Gauge("nmt_client_queued_work", "Estimated work (rows x steps) of a client's queued texts, "
                          "by model and client", ["model", "client"], registry=metrics.registry)
        self.shown: dict[str, set[str]] = {}  # model -> the client labels it has series for

    @classmethod
    def of(cls, metrics: Metrics) -> ClientGauges:
        gauges = getattr(metrics, "_client_gauges", None)
        if gauges is None:
            gauges = cls(metrics)
            metrics._client_gauges = gauges
        return gauges

    def set(self, model: str, rows: Mapping[str, int], work: Mapping[str, int]) -> None:
        """This model's clients now: the busiest by name, the rest as ``other``; departed ones removed."""
        clients = sorted(set(rows) | set(work), key=lambda c: -(rows.get(c, 0) + work.get(c, 0)))
        named, rest = clients[:MAX_CLIENTS], clients[MAX_CLIENTS:]
        values = {c or "-": (rows.get(c, 0), work.get(c, 0)) for c in named}
        if rest:
            values[OTHER] = (sum(rows.get(c, 0) for c in rest), sum(work.get(c, 0) for c in rest))
        for label, (r, w) in values.items():
            self.rows.labels(model, label).set(r)
            self.work.labels(model, label).set(w)
        for label in self.shown.get(model, set()) - set(values):
            self.rows.remove(model, label)
            self.work.remove(model, label)
        self.shown[model] = set(values)
