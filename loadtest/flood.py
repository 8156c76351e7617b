"""A flood of concurrent Translate calls on one channel: every call must be answered, the
excess RESOURCE_EXHAUSTED (counted by the server), none CANCELLED by gRPC core.

    python loadtest/flood.py                       # starts nmt serve on loopback (free ports)
    python loadtest/flood.py --calls 5000 --beam 5 --json loadtest/results/flood.json
    python loadtest/flood.py --server 127.0.0.1:50051 --metrics-port 9464   # a running server

Bounded: one burst of ``--calls`` calls, each with a deadline of ``--timeout`` seconds;
loopback only (the started server binds 127.0.0.1; ``--server`` must be a loopback address).
Prints status counts, the latency of refusals and of answers, and the server's own counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import ServerProcess, metric  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402

LONG_TEXT = ("The server returned an invalid response while downloading the update; check your "
             "network connection, make sure that the proxy settings are correct, and try again "
             "later, or contact your administrator if the problem persists after several attempts.")
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(stub: pb_grpc.TranslatorStub, request: pb.TranslateRequest, timeout: float
              ) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        await stub.Translate(request, timeout=timeout)
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    return code, (time.perf_counter() - started) * 1000


async def flood(address: str, calls: int, beam: int, text: str, timeout: float) -> list[tuple[str, float]]:
    """``calls`` concurrent Translate calls on one channel; (code, milliseconds) of each."""
    request = pb.TranslateRequest(texts=[text], options=pb.DecodingOptions(beam_size=beam))
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.TranslatorStub(channel)
        return await asyncio.gather(*(one(stub, request, timeout) for _ in range(calls)))


def summary(results: list[tuple[str, float]], counted: dict[str, float], seconds: float) -> dict:
    codes = Counter(code for code, _ in results)
    by = {code: [ms for c, ms in results if c == code] for code in codes}
    refused = by.get("RESOURCE_EXHAUSTED", [])
    ok = by.get("OK", [])
    return {"calls": len(results), "codes": dict(codes), "seconds": round(seconds, 2),
            "refused_ms": {"p50": round(quantile(refused, 0.5), 1), "p99": round(quantile(refused, 0.99), 1),
                           "max": round(max(refused, default=float("nan")), 1)},
            "ok_ms": {"p50": round(quantile(ok, 0.5), 1), "p99": round(quantile(ok, 0.99), 1)},
            "server_counted": counted,
            "mean_refused_ms": round(statistics.fmean(refused), 1) if refused else None}


def server_counts(metrics_port: int) -> dict[str, float]:
    return {code: metric(metrics_port, "nmt_requests_total", method="Translate", code=code)
            for code in ("OK", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each call, seconds")
    p.add_argument("--text", default=LONG_TEXT)
    p.add_argument("--model-repository", default=str(ROOT / "models" / "en-fr" / "1"))
    p.add_argument("--server", default="", help="a running server (loopback) instead of starting one")
    p.add_argument("--metrics-port", type=int, default=0, help="its metrics port (with --server)")
    p.add_argument("--serve-args", default="", help="extra nmt serve flags for the started server")
    p.add_argument("--json", default="", help="write the summary here too")
    args = p.parse_args(argv)
    if args.server and not args.server.startswith(LOOPBACK):
        p.error("--server must be a loopback address (this is a flood)")
    log = Path("/tmp") / f"nmt-flood-{int(time.time())}.log"
    server = None if args.server else ServerProcess(args.model_repository, log, *args.serve_args.split())
    address = args.server or server.address
    metrics_port = args.metrics_port or (server.metrics_port if server else 0)
    try:
        before = server_counts(metrics_port) if metrics_port else {}
        started = time.perf_counter()
        results = asyncio.run(flood(address, args.calls, args.beam, args.text, args.timeout))
        seconds = time.perf_counter() - started
        after = server_counts(metrics_port) if metrics_port else {}
    finally:
        if server is not None:
            server.stop()
    counted = {k: after[k] - before.get(k, 0) for k in after}
    out = summary(results, counted, seconds)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if out["codes"].get("CANCELLED") or out["codes"].get("UNKNOWN") else 0


if __name__ == "__main__":
    sys.exit(main())
