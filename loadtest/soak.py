"""Soak test: mixed load on ``nmt serve`` for N minutes; RSS and latency sampled over time.

    python loadtest/soak.py --minutes 5                  # starts nmt serve on loopback
    python loadtest/soak.py --minutes 30 --clients 8 --out loadtest/results/soak.md

Bounded in time (``--minutes``) and loopback only (the server it starts binds 127.0.0.1).
The mix: short and long greedy texts, beam search with n-best, multi-text requests,
streams, and hostile calls (invalid fields, undecodable bytes, an unknown 10 KB model name)
that must be refused without cost. Every ``--sample`` seconds it records the server's RSS
(/proc/<pid>/status VmRSS); per minute, the p50/p99 latency of good calls and the status
counts. Writes a Markdown table (and JSON beside it) and exits 1 if any call ended INTERNAL,
UNKNOWN or CANCELLED, or the server died.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import ServerProcess  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402

SHORT = ["Open the file", "Save changes?", "File not found", "Delete %d selected items?",
         "Cannot open %(filename)s: %(reason)s", "Unknown option %s", "Print the version and exit"]
LONG = ["The server returned an invalid response while downloading %s; the download was cancelled.",
        "Your session has expired. Please log in again to continue working on this document.",
        "Are you sure you want to remove <b>%(name)s</b> from the list of trusted devices?"]
BAD_CODES = {"INTERNAL", "UNKNOWN", "CANCELLED"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Load:
    """Closed-loop clients on one channel each; records (time, kind, code, ms)."""

    def __init__(self, address: str, clients: int, until: float, seed: int) -> None:
        self.address, self.until = address, until
        self.records: list[tuple[float, str, str, float]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(random.Random(seed + i),))
                        for i in range(clients)]

    def call(self, stub: pb_grpc.TranslatorStub, raw: grpc.UnaryUnaryMultiCallable,
             rng: random.Random) -> str:
        kind = rng.choices(["short", "long", "beam", "batch", "stream", "hostile"], [6, 2, 2, 1, 1, 1])[0]
        if kind == "short":
            stub.Translate(pb.TranslateRequest(texts=[rng.choice(SHORT)]), timeout=60)
        elif kind == "long":
            stub.Translate(pb.TranslateRequest(texts=[rng.choice(LONG)]), timeout=60)
        elif kind == "beam":
            stub.Translate(pb.TranslateRequest(texts=[rng.choice(SHORT + LONG)], options=pb.DecodingOptions(
                beam_size=4, num_hypotheses=3)), timeout=60)
        elif kind == "batch":
            stub.Translate(pb.TranslateRequest(texts=rng.choices(SHORT, k=7) + [rng.choice(LONG)]),
                           timeout=60)
        elif kind == "stream":
            list(stub.TranslateStream(pb.TranslateRequest(texts=[rng.choice(LONG)]), timeout=60))
        else:
            hostile = rng.choice([lambda: raw(b"\x0a\x02\xff\xfe", timeout=10),
                                  lambda: stub.Translate(pb.TranslateRequest(texts=["\u200b"]), timeout=10),
                                  lambda: stub.Translate(pb.TranslateRequest(texts=["a"], model="m" * 10_000),
                                                         timeout=10)])
            hostile()
        return kind

    def run(self, rng: random.Random) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.TranslatorStub(channel)
            raw = channel.unary_unary("/nmt.v1.Translator/Translate", request_serializer=None,
                                      response_deserializer=None)
            while time.monotonic() < self.until:
                started, kind, code = time.monotonic(), "?", "OK"
                try:
                    kind = self.call(stub, raw, rng)
                except grpc.RpcError as e:
                    code = e.code().name
                    kind = "hostile" if code in ("INVALID_ARGUMENT", "NOT_FOUND") else kind
                with self.lock:
                    self.records.append((started, kind, code, (time.monotonic() - started) * 1000))


def minute_rows(records: list[tuple[float, str, str, float]], start: float, minutes: int) -> list[dict]:
    rows = []
    for m in range(minutes):
        window = [r for r in records if start + 60 * m <= r[0] < start + 60 * (m + 1)]
        good = [ms for _, kind, code, ms in window if code == "OK" and kind != "hostile"]
        rows.append({"minute": m + 1, "calls": len(window), "p50_ms": round(quantile(good, 0.5), 1),
                     "p99_ms": round(quantile(good, 0.99), 1),
                     "codes": dict(Counter(code for _, _, code, _ in window))})
    return rows


def markdown(rows: list[dict], rss: list[tuple[float, float]], args: argparse.Namespace, died: bool) -> str:
    first_minute = next((v for t, v in rss if t >= 60), rss[0][1])
    lines = [f"# Soak: {args.minutes} min, {args.clients} closed-loop clients, mixed load", "",
             f"Model repository `{args.model_repository}`; server started by `loadtest/soak.py` on loopback.",
             "", "| minute | calls | p50 ms | p99 ms | RSS MiB (end of minute) | status codes |",
             "|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        at = [v for t, v in rss if t <= 60 * row["minute"]]
        lines.append(f"| {row['minute']} | {row['calls']} | {row['p50_ms']} | {row['p99_ms']} | "
                     f"{at[-1] if at else float('nan'):.1f} | {row['codes']} |")
    growth = rss[-1][1] - first_minute
    lines += ["", f"RSS: {rss[0][1]:.1f} MiB at start, {first_minute:.1f} after the first minute, "
              f"{rss[-1][1]:.1f} at the end: {growth:+.1f} MiB after the first minute.",
              f"p50 drift (last minute - first): {rows[-1]['p50_ms'] - rows[0]['p50_ms']:+.1f} ms; "
              f"p99 drift: {rows[-1]['p99_ms'] - rows[0]['p99_ms']:+.1f} ms.",
              f"Server {'DIED' if died else 'stayed up'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--sample", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--model-repository", default=str(ROOT / "models" / "en-fr" / "1"))
    p.add_argument("--out", default=str(ROOT / "loadtest" / "results" / "soak.md"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    server = ServerProcess(args.model_repository, Path("/tmp") / f"nmt-soak-{int(time.time())}.log")
    start = time.monotonic()
    load = Load(server.address, args.clients, start + 60 * args.minutes, args.seed)
    rss: list[tuple[float, float]] = []
    try:
        for t in load.threads:
            t.start()
        while time.monotonic() < load.until and server.proc.poll() is None:
            rss.append((time.monotonic() - start, rss_mib(server.proc.pid)))
            time.sleep(args.sample)
        for t in load.threads:
            t.join(120)
        died = server.proc.poll() is not None
    finally:
        server.stop()
    rows = minute_rows(load.records, start, args.minutes)
    text = markdown(rows, rss, args, died)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"minutes": rows, "rss_mib": rss}, indent=1))
    print(text)
    bad = sum(1 for r in load.records if r[2] in BAD_CODES)
    return 1 if bad or died else 0


if __name__ == "__main__":
    sys.exit(main())
