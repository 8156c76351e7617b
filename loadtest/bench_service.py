"""Service benchmark: closed-loop concurrency sweep and step- vs request-level batching.

    python loadtest/bench_service.py --model-repository models/en-fr/4 \
        --texts data/corpus/test.jsonl            # the real model, test split
    python loadtest/bench_service.py --model-repository /tmp/reversal --digits --quick

What it measures, in this order (one process at a time on the CPU):

1. The engine alone, in this process: idle latency of one short text
   (median); its batched throughput (texts/s translating ``--max-rows`` texts
   per ``Engine.translate`` call), the ceiling the service is compared with, is
   measured in ``--rounds`` rounds, each followed by the service at the
   highest concurrency (the ratio: median of the rounds).
2. ``nmt serve --batching step`` in a subprocess: closed-loop clients (each
   sends its next one-text request when the previous one is answered) at
   concurrency 1, 8, 32, 128; throughput and p50/p95/p99 latency.
3. A mixed-length workload (80% short texts, 20% long ones made by joining
   ``--long-factor`` texts), open loop (Poisson arrivals) at the same offered
   load against ``--batching step`` and then ``--batching request``: the
   latency of the short requests shows what step-level batching buys.

4. HTTP/JSON against gRPC on the same server, in the same run: idle latency of one short
   text (median, the two protocols alternating text by text) and saturated throughput
   (closed loop at the highest concurrency, ``--rounds`` paired rounds). ``--protocols-only``
   runs just this (into ``loadtest/results/bench_protocols.*``).

Writes ``loadtest/results/bench_service.json`` and ``.md`` (and each server's log,
``bench_service_<batching>_server.log``, beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the server harness the tests use (tests/harness.py)

from harness import ServerProcess  # noqa: E402
from service_load import closed_loop, cpu_seconds, http_closed_loop, idle_both, idle_latency, open_loop  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.options import DecodingOptions, Limits  # noqa: E402

STARTUP_SECONDS = 120


def load_texts(args: argparse.Namespace) -> list[str]:
    if args.digits:  # the reversal model's domain: 3 to 12 digits
        rng = random.Random(0)
        return [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 12))) for _ in range(500)]
    lines = Path(args.texts).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["src_raw"] if line.startswith("{") else line for line in lines]
    return [t for t in texts if t.strip()]


def engine_baseline(args: argparse.Namespace, short: list[str]) -> tuple[Engine, dict]:
    """The engine in this process, and its idle latency for one short text (median)."""
    engine = Engine(Path(args.model_repository), precision=args.precision, provider="cpu",
                    intra_op_threads=args.threads or None, limits=Limits(),
                    decoder_spinning=args.decoder_spinning == "on")
    options = DecodingOptions()
    engine.translate(short[:4], options)  # warm-up
    single = []
    for text in short[:50]:
        start = time.perf_counter()
        engine.translate([text], options)
        single.append(time.perf_counter() - start)
    return engine, {"single_text_ms": statistics.median(single) * 1000, "batch_texts": args.max_rows}


def engine_batched(engine: Engine, texts: list[str], *, batch: int, duration: float, seed: int) -> float:
    """Texts/s of the engine alone translating ``batch`` random texts per call for ``duration``."""
    rng, done, start = random.Random(seed), 0, time.perf_counter()
    while time.perf_counter() - start < duration:
        engine.translate([rng.choice(texts) for _ in range(batch)], DecodingOptions())
        done += batch
    return done / (time.perf_counter() - start)


def start_server(args: argparse.Namespace, batching: str) -> ServerProcess:
    """``nmt serve`` in a subprocess on free ports (the tests' harness), up once health says SERVING."""
    flags = ["--batching", batching, "--precision", args.precision, "--max-rows", str(args.max_rows),
             "--threads", str(args.threads), "--decoder-spinning", args.decoder_spinning,
             *(["--max-wait-ms", str(args.max_wait_ms)] if args.max_wait_ms is not None else [])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_name(f"{args.out.name}_{batching}_server.log")
    return ServerProcess(args.model_repository, log, *flags, startup_timeout=STARTUP_SECONDS)


def compare_protocols(args: argparse.Namespace, server: ServerProcess, short: list[str],
                      texts: list[str]) -> dict:
    """HTTP against gRPC: idle latency, then paired saturation rounds (gRPC, HTTP, ...)."""
    idle = asyncio.run(idle_both(server.address, server.http_url, short[:50]))
    top, rounds = max(args.concurrency), []
    asyncio.run(http_closed_loop(server.http_url, texts, concurrency=top, duration=1))  # warm-up
    for i in range(args.rounds):  # who goes first alternates: drift hits both sides alike
        run_grpc = lambda: asyncio.run(closed_loop(server.address, texts, concurrency=top,  # noqa: E731
                                                   duration=args.duration))
        run_http = lambda: asyncio.run(http_closed_loop(server.http_url, texts,  # noqa: E731
                                                        concurrency=top, duration=args.duration))
        if i % 2 == 0:
            g, h = run_grpc(), run_http()
        else:
            h, g = run_http(), run_grpc()
        rounds.append({"grpc": g, "http": h, "ratio": h["texts_per_s"] / g["texts_per_s"]})
    return {"idle": idle, "idle_ratio": idle["http_ms"] / idle["grpc_ms"], "concurrency": top,
            "saturation": rounds, "saturation_ratio": statistics.median(x["ratio"] for x in rounds)}


def protocols_markdown(c: dict) -> list[str]:
    idle = c["idle"]
    lines = ["", "HTTP/JSON against gRPC, the same server and run (idle: one short text at a time, "
             f"median, alternating; saturated: closed loop at {c['concurrency']} clients, paired rounds):", "",
             "| | gRPC | HTTP | HTTP / gRPC |", "|---|---:|---:|---:|",
             f"| idle latency ms | {idle['grpc_ms']:.1f} | {idle['http_ms']:.1f} | {c['idle_ratio']:.2f} |"]
    lines += [f"| round {i + 1} texts/s | {x['grpc']['texts_per_s']:.0f} | {x['http']['texts_per_s']:.0f} | "
              f"{x['ratio']:.2f} |" for i, x in enumerate(c["saturation"])]
    lines += ["", f"HTTP / gRPC: idle latency {c['idle_ratio']:.2f} (target <= 1.5), saturated throughput "
              f"{c['saturation_ratio']:.2f} (median of the rounds; target >= 0.8).", ""]
    return lines


def run_protocols(args: argparse.Namespace) -> dict:
    """``--protocols-only``: the step-level server, HTTP against gRPC, nothing else."""
    texts = load_texts(args)
    short, _ = mixed_texts(texts, args.long_factor)
    server = start_server(args, "step")
    try:
        return {"model_repository": args.model_repository, "precision": args.precision,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "duration_s": args.duration,
                "protocols": compare_protocols(args, server, short, texts)}
    finally:
        server.stop()


def mixed_texts(texts: list[str], factor: int) -> tuple[list[str], list[str]]:
    by_length = sorted(texts, key=len)
    short = by_length[: len(by_length) // 2]
    rng = random.Random(3)
    long = [" ".join(rng.choice(by_length[len(by_length) // 2:]) for _ in range(factor))
            for _ in range(200)]
    return short, [t[: Limits().max_text_chars] for t in long]


def run(args: argparse.Namespace) -> dict:
    texts = load_texts(args)
    short, long = mixed_texts(texts, args.long_factor)
    engine, baseline = engine_baseline(args, short)
    result = {"model_repository": args.model_repository, "precision": args.precision,
              "threads": args.threads, "decoder_spinning": args.decoder_spinning,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "duration_s": args.duration,
              "engine": baseline}
    server = start_server(args, "step")
    try:
        result["idle_ms"] = asyncio.run(idle_latency(server.address, short[:50]))
        result["sweep"] = []
        for c in args.concurrency:
            server_cpu, start = cpu_seconds(server.proc.pid), time.perf_counter()
            point = asyncio.run(closed_loop(server.address, texts, concurrency=c, duration=args.duration))
            point["server_cpus"] = (cpu_seconds(server.proc.pid) - server_cpu) / (time.perf_counter() - start)
            result["sweep"].append(point)
        # saturated service vs engine alone: paired rounds, one after the other (the idle server
        # uses no CPU meanwhile), so that the machine's drift hits both sides of each ratio alike
        top = max(args.concurrency)
        result["saturation"] = []
        for i in range(args.rounds):
            alone = engine_batched(engine, texts, batch=args.max_rows, duration=args.duration, seed=i)
            served = asyncio.run(closed_loop(server.address, texts, concurrency=top, duration=args.duration))
            result["saturation"].append({"engine_texts_per_s": alone, "service_texts_per_s": served["texts_per_s"],
                                         "ratio": served["texts_per_s"] / alone})
        result["engine"]["batched_texts_per_s"] = statistics.median(
            x["engine_texts_per_s"] for x in result["saturation"])
        capacity = asyncio.run(closed_loop(server.address, short * 4 + long, concurrency=32,
                                           duration=args.duration))["texts_per_s"]
        rate = args.mixed_load * capacity
        result["mixed"] = {"capacity_per_s": capacity, "step": asyncio.run(
            open_loop(server.address, short, long, rate=rate, duration=args.duration * 2))}
        result["protocols"] = compare_protocols(args, server, short, texts)
    finally:
        server.stop()
    server = start_server(args, "request")
    try:
        result["mixed"]["request"] = asyncio.run(
            open_loop(server.address, short, long, rate=rate, duration=args.duration * 2))
    finally:
        server.stop()
    return result


def markdown(r: dict) -> str:
    e, m = r["engine"], r["mixed"]
    rounds = r["saturation"]
    ratio = statistics.median(x["ratio"] for x in rounds)
    idle = r["idle_ms"]
    lines = [f"# Service benchmark ({r['model_repository']}, {r['precision']}, {r['machine']})", "",
             f"Engine alone: one short text {e['single_text_ms']:.1f} ms (median; the service: "
             f"{idle:.1f} ms for the same texts one at a time); batched "
             f"{e['batched_texts_per_s']:.0f} texts/s ({e['batch_texts']} texts per call; median of the "
             "rounds below).", "",
             "CPU columns: cores busy on average in the server process and in this load generator "
             f"(the machine has {os.cpu_count()}).", "",
             "| concurrency | requests | errors | texts/s | p50 ms | p95 ms | p99 ms | server CPUs | client CPUs |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['concurrency']} | {s['requests']} | {s['errors']} | {s['texts_per_s']:.0f} | "
              f"{s['p50_ms']:.1f} | {s['p95_ms']:.1f} | {s['p99_ms']:.1f} | {s['server_cpus']:.2f} | "
              f"{s['client_cpus']:.2f} |" for s in r["sweep"]]
    lines += ["", f"Saturated throughput, {len(rounds)} paired rounds (the engine alone, {e['batch_texts']} texts "
              f"per call, then the service at {max(x['concurrency'] for x in r['sweep'])} closed-loop clients):", "",
              "| round | engine texts/s | service texts/s | service / engine |", "|---:|---:|---:|---:|"]
    lines += [f"| {i + 1} | {x['engine_texts_per_s']:.0f} | {x['service_texts_per_s']:.0f} | {x['ratio']:.2f} |"
              for i, x in enumerate(rounds)]
    lines += ["", f"Saturated service / engine batched throughput (median of the rounds): {ratio:.2f}; "
              f"idle latency / engine: {idle / e['single_text_ms']:.2f}.", "",
              f"Mixed workload (80% short, 20% long), open loop at {m['step']['offered_per_s']:.1f} "
              f"requests/s (capacity {m['capacity_per_s']:.1f}/s at concurrency 32):", "",
              "| batching | answered/s | errors | short p50 | short p99 | long p50 | long p99 |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in ("step", "request"):
        x = m[mode]
        lines.append(f"| {mode} | {x['answered_per_s']:.1f} | {x['errors']} | {x['short']['p50_ms']:.1f} | "
                     f"{x['short']['p99_ms']:.1f} | {x['long']['p50_ms']:.1f} | {x['long']['p99_ms']:.1f} |")
    ratio = m["step"]["short"]["p99_ms"] / m["request"]["short"]["p99_ms"]
    lines += ["", f"Short-request p99, step-level / request-level: {ratio:.2f}.", ""]
    if "protocols" in r:
        lines += protocols_markdown(r["protocols"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", required=True)
    p.add_argument("--texts", help="test split (jsonl with src_raw) or a text file, one per line")
    p.add_argument("--digits", action="store_true", help="digit strings (the reversal model)")
    p.add_argument("--precision", default="int8", choices=("fp32", "int8"), help="int8: what ships")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    p.add_argument("--max-rows", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = default)")
    p.add_argument("--decoder-spinning", choices=("on", "off"), default="on",
                   help="as nmt serve's flag, for the engine baseline too")
    p.add_argument("--rounds", type=int, default=3, help="paired engine/service saturation rounds")
    p.add_argument("--max-wait-ms", type=float, help="nmt serve --max-wait-ms (default: its default)")
    p.add_argument("--long-factor", type=int, default=4, help="texts joined into one long text")
    p.add_argument("--mixed-load", type=float, default=0.6, help="offered load / measured capacity")
    p.add_argument("--quick", action="store_true", help="2 s measurements (a smoke run)")
    p.add_argument("--protocols-only", action="store_true",
                   help="only HTTP against gRPC (into loadtest/results/bench_protocols.*)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "loadtest" / "results" / ("bench_protocols" if args.protocols_only else "bench_service")
    if not args.digits and not args.texts:
        p.error("give --texts FILE or --digits")
    if args.quick:
        args.duration = 2.0
    result = run_protocols(args) if args.protocols_only else run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result) if not args.protocols_only else "\n".join(
        [f"# HTTP/JSON against gRPC ({result['model_repository']}, {result['precision']}, "
         f"{result['machine']}, {result['duration_s']:.0f} s per measurement)"]
        + protocols_markdown(result["protocols"]))
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
