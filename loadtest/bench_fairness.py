"""Fairness under heavy clients (issue 31, row 3): a light client's latency while three clients
loop heavy requests, with ``--fairness on`` (rows shared between clients) and ``off`` (one queue in
arrival order, the scheduler before fairness), alternating rounds.

    python loadtest/bench_fairness.py [--model models/en-fr/<served version>] [--texts build/corpus-v2/test.jsonl] \
        [--rounds 2] [--seconds 30] [--server-flags "--max-rows 256"]

Each client has its own token (``--auth-token-file``: the token is who a client is). The heavy
clients loop requests of 64 texts x beam 16 with a 2 s deadline; the light client sends one text,
greedy, one request after the other. Per round and setting: the light client's p50/p99 alone
(before the heavy ones start) and under load, and the heavy clients' translated texts per second
and deadline failures. Reported: medians over rounds; the targets are light p99 under load at most
4x its p99 alone, and heavy texts/s with fairness within 20 % of without. Loopback only; every
loop stops by itself. Writes ``loadtest/results/bench_fairness.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import ServerProcess, scrape, served_version  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402
from service_load import percentiles  # noqa: E402

HEAVY_CLIENTS, HEAVY_TEXTS, HEAVY_BEAM = 3, 64, 16


LIGHT_INTERVAL = 0.2
"""The light client sends a request every 200 ms (or when the last is answered, if later): the
same demand with and without fairness, so that the heavy clients' throughput compares."""


async def light(stub, token: str, texts: list[str], stop_at: float) -> list[float]:
    latencies, i = [], 0
    while time.perf_counter() < stop_at:
        start = time.perf_counter()
        await stub.Translate(pb.TranslateRequest(texts=[texts[i % len(texts)]]), timeout=30,
                             metadata=(("authorization", f"Bearer {token}"),))
        latencies.append(time.perf_counter() - start)
        i += 1
        await asyncio.sleep(max(0.0, start + LIGHT_INTERVAL - time.perf_counter()))
    return latencies


async def heavy(stub, token: str, texts: list[str], stop_at: float, seed: int, deadline: float) -> tuple[int, int]:
    done = failed = 0
    i = seed * HEAVY_TEXTS
    options = pb.DecodingOptions(beam_size=HEAVY_BEAM)
    while time.perf_counter() < stop_at:
        batch = [texts[(i + k) % len(texts)] for k in range(HEAVY_TEXTS)]
        i += HEAVY_TEXTS
        try:
            await stub.Translate(pb.TranslateRequest(texts=batch, options=options), timeout=deadline,
                                 metadata=(("authorization", f"Bearer {token}"),))
            done += len(batch)
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            failed += 1
    return done, failed


def row_steps(server: ServerProcess) -> float:
    """Decoder rows x steps the server has run (``nmt_batch_rows_sum``): the engine's work."""
    found = re.search(r"^nmt_batch_rows_sum ([0-9.e+]+)$", scrape(server.metrics_port), re.M)
    return float(found.group(1)) if found else 0.0


async def one_round(server: ServerProcess, tokens: list[str], short: list[str], long: list[str], seconds: float,
                    deadline: float) -> dict:
    address = server.address
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        await light(stub, tokens[0], short, time.perf_counter() + 2)  # warm-up
        alone = await light(stub, tokens[0], short, time.perf_counter() + seconds / 3)
        stop_at = time.perf_counter() + seconds
        work = row_steps(server)
        heavy_tasks = [asyncio.create_task(heavy(stub, tokens[1 + k], long, stop_at, k, deadline))
                       for k in range(HEAVY_CLIENTS)]
        await asyncio.sleep(2)  # the heavy clients fill the server first
        loaded = await light(stub, tokens[0], short, stop_at)
        results = await asyncio.gather(*heavy_tasks)
        work = row_steps(server) - work
    return {"alone": percentiles(alone), "loaded": percentiles(loaded), "light_requests": len(loaded),
            "row_steps_per_s": work / seconds,
            "heavy_texts_per_s": sum(d for d, _ in results) / seconds,
            "heavy_deadline_failures": sum(f for _, f in results)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=served_version().relative_to(ROOT))
    p.add_argument("--texts", type=Path, default=ROOT / "build/corpus-v2/test.jsonl")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--heavy-deadline", type=float, default=2.0, help="the heavy requests' deadline, seconds")
    p.add_argument("--server-flags", default="", help="more `nmt serve` flags for both settings (--max-rows 256)")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_fairness")
    args = p.parse_args(argv)
    pairs = [json.loads(line)["src_raw"] for line in args.texts.read_text().splitlines() if line.strip()]
    short = [t for t in pairs if 3 <= len(t.split()) <= 10][:200]
    long = [t for t in pairs if len(t.split()) >= 6][:2000]
    tokens = [f"bench-client-{k}-{os.urandom(6).hex()}" for k in range(1 + HEAVY_CLIENTS)]
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "tokens"
        token_file.write_text("\n".join(tokens) + "\n")
        for _ in range(args.rounds):
            for setting in ("on", "off"):
                server = ServerProcess(ROOT / args.model, Path(tmp) / f"server-{setting}.log", "--fairness", setting,
                                       "--auth-token-file", str(token_file), "--max-texts", str(HEAVY_TEXTS),
                                       "--max-beam", str(HEAVY_BEAM), *shlex.split(args.server_flags))
                try:
                    rows[setting].append(asyncio.run(one_round(server, tokens, short, long, args.seconds,
                                                               args.heavy_deadline)))
                finally:
                    server.stop()
                print(setting, rows[setting][-1], flush=True)
    report(args, rows, argv)
    return 0


def report(args, rows: dict[str, list[dict]], argv) -> None:
    def med(setting: str, *path: str) -> float:
        values = []
        for r in rows[setting]:
            for key in path:
                r = r[key]
            values.append(r)
        return statistics.median(values)
    result = {s: {"light_alone_p50_ms": med(s, "alone", "p50_ms"), "light_alone_p99_ms": med(s, "alone", "p99_ms"),
                  "light_loaded_p50_ms": med(s, "loaded", "p50_ms"), "light_loaded_p99_ms": med(s, "loaded", "p99_ms"),
                  "heavy_texts_per_s": med(s, "heavy_texts_per_s"), "row_steps_per_s": med(s, "row_steps_per_s"),
                  "heavy_deadline_failures": med(s, "heavy_deadline_failures")} for s in rows}
    machine = {"cpu": f"{platform.machine()}, {os.cpu_count()} CPUs", "flags": reported_flags()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "medians": result, "rounds": rows},
                                                        indent=1) + "\n")
    lines = ["# Fairness: a light client beside three heavy ones (loadtest/bench_fairness.py)", "",
             f"`python loadtest/bench_fairness.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
             f"{machine['cpu']}, CPU flags {', '.join(machine['flags']) or 'none'}; {args.rounds} alternating "
             f"rounds of {args.seconds:.0f} s, medians. Heavy: {HEAVY_CLIENTS} clients looping {HEAVY_TEXTS} texts x "
             f"beam {HEAVY_BEAM}, {args.heavy_deadline:.0f} s deadline; light: one text, greedy, every {LIGHT_INTERVAL * 1000:.0f} ms (or when answered, if later). "
             "Row-steps/s: decoder rows x steps the engine ran (everyone's), whether or not a deadline "
             "later threw the work away.", "",
             "| --fairness | light alone p50 / p99 ms | light loaded p50 / p99 ms | loaded p99 / alone p99 | "
             "heavy texts/s | heavy deadline failures | row-steps/s |", "|---|---|---|---:|---:|---:|---:|"]
    for s, r in result.items():
        lines.append(f"| {s} | {r['light_alone_p50_ms']:.0f} / {r['light_alone_p99_ms']:.0f} | "
                     f"{r['light_loaded_p50_ms']:.0f} / {r['light_loaded_p99_ms']:.0f} | "
                     f"{r['light_loaded_p99_ms'] / r['light_alone_p99_ms']:.1f}x | {r['heavy_texts_per_s']:.1f} | "
                     f"{r['heavy_deadline_failures']:.0f} | {r['row_steps_per_s']:.0f} |")
    ratios = [f"{key}: {result['on'][key] / result['off'][key]:.2f}x" for key in ("heavy_texts_per_s", "row_steps_per_s")
              if result["off"][key]]
    lines += ["", f"With fairness against without: {', '.join(ratios)}."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
