"""Idle latency: one short text at a time, this checkout against a previous release, alternating.

    python loadtest/bench_idle.py --previous /tmp/base --texts build/corpus-v2/test.jsonl \
        [--rounds 3] [--requests 100] [--this-flags "--shortlist on"]

Each server (``nmt serve`` of its own checkout, its own default model, the tests' harness)
answers ``--requests`` one-text requests, one after the other, per round; the servers take turns.
Reported: the median latency of each (median over rounds of each round's median), with
``--this-flags`` as a third server. Writes ``loadtest/results/bench_idle.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import ServerProcess, served_version  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402


def latencies(server: ServerProcess, texts: list[str]) -> list[float]:
    out = []
    server.api.Translate(pb.TranslateRequest(texts=texts[:1]), timeout=60)  # warm-up
    for text in texts:
        start = time.perf_counter()
        server.api.Translate(pb.TranslateRequest(texts=[text]), timeout=60)
        out.append((time.perf_counter() - start) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--previous", type=Path, required=True)
    p.add_argument("--texts", type=Path, required=True)
    p.add_argument("--model", help="relative to each checkout; default: the version it serves by default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--this-flags", default="--shortlist on")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_idle")
    args = p.parse_args(argv)
    pairs = [json.loads(line) for line in args.texts.read_text().splitlines() if line.strip()]
    texts = [x["src_raw"] for x in pairs if 4 <= len(x["src_raw"].split()) <= 12][: args.requests]
    servers = {"previous": (args.previous.resolve(), []), "this": (ROOT, []),
               f"this {args.this_flags}": (ROOT, shlex.split(args.this_flags))}
    medians: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, (tree, flags) in servers.items():
            log = args.out.with_name(f"bench_idle_{name.replace(' ', '_')}_server.log")
            model = tree / args.model if args.model else served_version(tree)
            server = ServerProcess(model, log, *flags, env={"PYTHONPATH": str(tree)}, cwd=tree)
            try:
                medians[name].append(statistics.median(latencies(server, texts)))
            finally:
                server.stop()
    result = {"median_ms": {n: statistics.median(v) for n, v in medians.items()}, "rounds": medians,
              "cpu": f"{platform.machine()}, {os.cpu_count()} CPUs", "flags": reported_flags(), "requests": len(texts)}
    base = result["median_ms"]["previous"]
    lines = ["# Idle latency, one short text at a time", "",
             f"`python loadtest/bench_idle.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
             f"{result['cpu']}, CPU flags {', '.join(result['flags']) or 'none'}; {len(texts)} texts of 4 to 12 "
             f"words per round, {args.rounds} alternating rounds, median of the rounds' medians.", "",
             "| server | median ms | against previous | per round |", "|---|---:|---:|---|"]
    lines += [f"| {n} | {m:.2f} | {m / base:.2f}x | {', '.join(f'{x:.2f}' for x in medians[n])} |"
              for n, m in result["median_ms"].items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
