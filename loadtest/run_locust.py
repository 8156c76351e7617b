"""``make loadtest``: start ``nmt serve``, run Locust headless against it, stop it.

    python loadtest/run_locust.py --users 8 --time 180            # one run
    python loadtest/run_locust.py --users 1,2,4,8,16,32 --time 60 \
        --wait 0,0 --chart loadtest/RESULTS.png                   # a sweep: table and chart

Each run writes Locust's CSV (``<prefix>_stats.csv``, ...), JSON
(``<prefix>.json``) and HTML (``<prefix>.html``) reports under ``--output``
(default ``loadtest/results/locust/``), plus the server's log and a copy of its
``/metrics`` at the end. Texts per second and tokens per second come from the
server's own counters, read before and after each run. The exit status is
Locust's (non-zero on any failure or a missed target), or 1 if the server did
not start or did not stop cleanly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from report import Step, chart, load_step, table, write_summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the server harness the tests use (tests/harness.py)

from harness import ServerProcess  # noqa: E402
from service.config import DEFAULT_MODEL_REPOSITORY  # noqa: E402

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
DEFAULT_TEXTS = ROOT / "build" / "corpus" / "test.jsonl"
STARTUP_SECONDS = 300  # model load and warm-up on a busy 2-core machine (until health SERVING)
STOP_SECONDS = 60  # the server's grace period (10 s by default) plus a margin
TEXTS_METRIC = "nmt_source_tokens_count"  # one observation per text translated
TOKENS_METRIC = "nmt_generated_tokens_total"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", default=os.environ.get("NMT_MODEL_REPOSITORY", str(DEFAULT_MODEL_REPOSITORY)))
    p.add_argument("--server", help="host:port of a running server (default: start one here)")
    p.add_argument("--metrics", help="host:port of that server's /metrics (for texts/s, tokens/s)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `nmt serve` flag for the started server, e.g. --server-arg=--precision=int8")
    p.add_argument("--texts", default=str(DEFAULT_TEXTS) if DEFAULT_TEXTS.exists() else "",
                   help="JSONL split with src_raw (default: build/corpus/test.jsonl, else built-in texts)")
    p.add_argument("--users", default="8", help="concurrent users, or a comma list for a sweep")
    p.add_argument("--spawn-rate", type=float, default=0, help="users started per second (0 = all at once)")
    p.add_argument("--time", type=int, default=60, help="seconds per run")
    p.add_argument("--wait", default=os.environ.get("NMT_LOCUST_WAIT", "0,0.2"),
                   help="think time min,max seconds (0,0 = closed loop)")
    p.add_argument("--weights", default=os.environ.get("NMT_LOCUST_WEIGHTS", ""), help="task weights")
    p.add_argument("--max-p99-ms", type=float, help="fail the run if p99 exceeds this")
    p.add_argument("--output", type=Path, default=ROOT / "loadtest" / "results" / "locust")
    p.add_argument("--prefix", default="locust", help="report file name prefix")
    p.add_argument("--chart", type=Path, help="sweep chart (PNG) of throughput and p50/p99 latency")
    return p.parse_args(argv)


def start_server(args: argparse.Namespace) -> ServerProcess:
    log = args.output / f"{args.prefix}_server.log"
    server = ServerProcess(args.model_repository, log, *args.server_arg, startup_timeout=STARTUP_SECONDS)
    print(f"server SERVING on {server.address} after {server.startup_seconds:.1f} s (log: {log})", flush=True)
    return server


def scrape(metrics: str | None) -> tuple[str, dict[str, float]]:
    """The /metrics text and the two counters used for texts/s and tokens/s."""
    if not metrics:
        return "", {}
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    wanted = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name in (TEXTS_METRIC, TOKENS_METRIC)}
    return text, wanted


def run_locust(args: argparse.Namespace, *, address: str, users: int, prefix: str) -> int:
    rate = args.spawn_rate or users
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
               "-u", str(users), "-r", str(rate), "-t", f"{args.time}s", "--stop-timeout", "30",
               "--host", address, "--csv", str(args.output / prefix),
               "--html", str(args.output / f"{prefix}.html"),
               "--json-file", str(args.output / prefix)]  # Locust adds .json
    env = {**os.environ, "NMT_LOCUST_TEXTS": args.texts, "NMT_LOCUST_WAIT": args.wait,
           "NMT_LOCUST_WEIGHTS": args.weights, "PYTHONPATH": str(ROOT)}
    if args.max_p99_ms:
        env["NMT_LOCUST_MAX_P99_MS"] = str(args.max_p99_ms)
    if not args.texts:
        env.pop("NMT_LOCUST_TEXTS")
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def run_all(args: argparse.Namespace, *, address: str, metrics: str | None) -> tuple[int, list[Step]]:
    """One Locust run per user count; Locust's worst exit status and the steps."""
    counts = [int(u) for u in args.users.split(",")]
    worst, steps = 0, []
    for users in counts:
        prefix = args.prefix if len(counts) == 1 else f"{args.prefix}_u{users}"
        _, before = scrape(metrics)
        code = run_locust(args, address=address, users=users, prefix=prefix)
        text, after = scrape(metrics)
        if text:
            (args.output / f"{prefix}_metrics.txt").write_text(text)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (TEXTS_METRIC, TOKENS_METRIC)}
        steps.append(load_step(args.output / f"{prefix}.json", users=users,
                               texts=delta[TEXTS_METRIC], tokens=delta[TOKENS_METRIC]))
        worst = worst or code
    return worst, steps


def main(argv: list[str]) -> int:
    args = parse(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    server = None
    if args.server:
        address, metrics = args.server, args.metrics
    else:
        server = start_server(args)
        address, metrics = server.address, f"127.0.0.1:{server.metrics_port}"
    try:
        code, steps = run_all(args, address=address, metrics=metrics)
    finally:
        stopped = server.stop(timeout=STOP_SECONDS) if server else 0
    write_summary(steps, args.output / f"{args.prefix}_summary.json")
    print(table(steps), end="")
    if args.chart:
        chart(steps, args.chart, title=f"nmt-serve {'/'.join(Path(args.model_repository).parts[-2:])}: Locust mix, "
                                      f"{args.time} s per step")
    if stopped != 0:
        print(f"server exited with {stopped} after SIGTERM", file=sys.stderr)
    return code or (1 if stopped != 0 else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
