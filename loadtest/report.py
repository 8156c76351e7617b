"""Summaries of Locust runs: figures from ``--json-file`` output, a table and a chart.

Locust's JSON holds, per request name, the counts of response times rounded
the way Locust rounds them (exact below 100 ms, then to 2 significant digits);
percentiles here are computed from those counts, as Locust computes its own.
The CSV can miss the last second of a run; the JSON cannot.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Step:
    """One Locust run (or one step of a sweep) against one server."""

    users: int  # concurrent Locust users
    seconds: float  # from the first request sent to the last one answered
    requests: int  # RPCs answered (all task kinds)
    failures: int  # RPCs answered with an error, plus task exceptions
    rps: float  # requests per second
    p50_ms: float  # median latency over all requests
    p95_ms: float
    p99_ms: float
    texts_per_s: float  # texts translated per second (server metrics; 0 if not measured)
    tokens_per_s: float  # target pieces generated per second (server metrics; 0 if not measured)


def percentile(times: Counter, fraction: float) -> float:
    """The smallest response time with at least ``fraction`` of the requests at or under it."""
    total = sum(times.values())
    if not total:
        return 0.0
    seen = 0
    for ms in sorted(times):
        seen += times[ms]
        if seen >= fraction * total:
            return float(ms)
    return float(max(times))


def summarize(stats: list[dict], *, users: int, texts: float = 0.0, tokens: float = 0.0) -> Step:
    """A Step from Locust's JSON stats (a list of per-name entries); ``texts``/``tokens``
    are the server's counter increases over the run."""
    times: Counter = Counter()
    for entry in stats:
        times.update({float(ms): n for ms, n in entry["response_times"].items()})
    requests = sum(e["num_requests"] for e in stats)
    failures = sum(e["num_failures"] for e in stats)
    started = min((e["start_time"] for e in stats), default=0.0)
    ended = max((e["last_request_timestamp"] or started for e in stats), default=0.0)
    seconds = max(ended - started, 1e-9)
    return Step(users=users, seconds=round(seconds, 2), requests=requests, failures=failures,
                rps=round(requests / seconds, 2), p50_ms=percentile(times, 0.50),
                p95_ms=percentile(times, 0.95), p99_ms=percentile(times, 0.99),
                texts_per_s=round(texts / seconds, 2), tokens_per_s=round(tokens / seconds, 1))


def load_step(path: Path, *, users: int, texts: float = 0.0, tokens: float = 0.0) -> Step:
    return summarize(json.loads(path.read_text()), users=users, texts=texts, tokens=tokens)


def table(steps: list[Step]) -> str:
    """A Markdown table, one row per step."""
    rows = ["| users | requests | failures | requests/s | texts/s | tokens/s | p50 ms | p95 ms | p99 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {s.users} | {s.requests} | {s.failures} | {s.rps:.1f} | {s.texts_per_s:.1f} | "
             f"{s.tokens_per_s:.0f} | {s.p50_ms:.0f} | {s.p95_ms:.0f} | {s.p99_ms:.0f} |" for s in steps]
    return "\n".join(rows) + "\n"


def chart(steps: list[Step], path: Path, *, title: str) -> None:
    """Throughput and p50/p99 latency against users, on two y axes (log-2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [s.users for s in steps]
    fig, left = plt.subplots(figsize=(7, 4.4), dpi=120)
    left.plot(users, [s.rps for s in steps], "o-", color="tab:blue", label="requests/s")
    left.set_xscale("log", base=2)
    left.set_xticks(users, [str(u) for u in users])
    left.set_xlabel("concurrent users (closed loop)")
    left.set_ylabel("requests/s", color="tab:blue")
    left.set_ylim(bottom=0)
    right = left.twinx()
    right.plot(users, [s.p50_ms for s in steps], "s--", color="tab:orange", label="p50 latency")
    right.plot(users, [s.p99_ms for s in steps], "^--", color="tab:red", label="p99 latency")
    right.set_ylabel("latency (ms)")
    right.set_ylim(bottom=0)
    lines = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(lines, [ln.get_label() for ln in lines], loc="upper center", bbox_to_anchor=(0.5, -0.16),
                ncol=3, frameon=False)
    left.set_title(title)
    left.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_summary(steps: list[Step], path: Path) -> None:
    path.write_text(json.dumps([asdict(s) for s in steps], indent=2) + "\n")


def read_summary(path: Path) -> list[Step]:
    return [Step(**s) for s in json.loads(path.read_text())]
