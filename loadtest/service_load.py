"""The service benchmarks' load generators: closed and open loops over gRPC and HTTP/JSON.

Used by ``bench_service.py`` (and ``bench_two_models.py``): each client sends its next request
when the last is answered (closed loop), or requests arrive as a Poisson process (open loop);
every function returns throughput and latency percentiles. Loopback addresses only; each loop
stops by itself after ``duration`` seconds.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path

import aiohttp
import grpc

from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

SHORT_FRACTION = 0.8  # of the open loop's requests: short texts, the rest long

def percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"p50_ms": float("nan"), "p95_ms": float("nan"), "p99_ms": float("nan")}
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {"p50_ms": q[49] * 1000, "p95_ms": q[94] * 1000, "p99_ms": q[98] * 1000}


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (or of its thread ``tid``) so far (Linux /proc;
    NaN elsewhere)."""
    stat = Path(f"/proc/{pid}/stat") if tid is None else Path(f"/proc/{pid}/task/{tid}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def idle_latency(address: str, texts: list[str]) -> float:
    """Median latency of the engine baseline's short texts, sent one at a time (same texts)."""
    latencies = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        await stub.Translate(pb.TranslateRequest(texts=texts[:4]), timeout=60)  # warm-up
        for text in texts:
            start = time.perf_counter()
            await stub.Translate(pb.TranslateRequest(texts=[text]), timeout=60)
            latencies.append(time.perf_counter() - start)
    return statistics.median(latencies) * 1000


async def drive(send, texts: list[str], *, concurrency: int, duration: float) -> dict:
    """``concurrency`` clients, each sending its next one-text request when the last is
    answered; ``send(text)`` is one call, True when it succeeded."""
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration

    async def client(seed: int) -> None:
        nonlocal errors
        rng = random.Random(seed)
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            if await send(rng.choice(texts)):
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1
    begin, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed, cpu = time.perf_counter() - begin, time.process_time() - cpu
    return {"concurrency": concurrency, "requests": len(latencies), "errors": errors,
            "texts_per_s": len(latencies) / elapsed, "client_cpus": cpu / elapsed, **percentiles(latencies)}


async def closed_loop(address: str, texts: list[str], *, concurrency: int, duration: float) -> dict:
    """``drive`` over gRPC, one channel."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)

        async def send(text: str) -> bool:
            try:
                await stub.Translate(pb.TranslateRequest(texts=[text]), timeout=60)
                return True
            except grpc.aio.AioRpcError:
                return False
        return await drive(send, texts, concurrency=concurrency, duration=duration)


async def open_loop(address: str, short: list[str], long: list[str], *, rate: float,
                    duration: float) -> dict:
    """Poisson arrivals at ``rate`` requests/s; 80% short, 20% long; latency by kind."""
    rng = random.Random(2)
    latencies: dict[str, list[float]] = {"short": [], "long": []}
    errors = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)

        async def one(kind: str, text: str) -> None:
            nonlocal errors
            start = time.perf_counter()
            try:
                await stub.Translate(pb.TranslateRequest(texts=[text]), timeout=120)
                latencies[kind].append(time.perf_counter() - start)
            except grpc.aio.AioRpcError:
                errors += 1
        tasks, begin = [], time.perf_counter()
        next_at = begin
        while next_at < begin + duration:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            kind = "short" if rng.random() < SHORT_FRACTION else "long"
            tasks.append(asyncio.create_task(one(kind, rng.choice(short if kind == "short" else long))))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
    return {"offered_per_s": rate, "answered_per_s": sum(map(len, latencies.values())) / elapsed,
            "errors": errors, "short": {"n": len(latencies["short"]), **percentiles(latencies["short"])},
            "long": {"n": len(latencies["long"]), **percentiles(latencies["long"])}}


# ---- HTTP/JSON against gRPC (service/api/http_server.py): the same server, the same run ------

async def idle_both(address: str, url: str, texts: list[str]) -> dict:
    """Median latency of one short text over gRPC and over HTTP, alternating text by text."""
    latencies: dict[str, list[float]] = {"grpc": [], "http": []}
    async with grpc.aio.insecure_channel(address) as channel, aiohttp.ClientSession(url) as session:
        stub = pb_grpc.TranslatorStub(channel)

        async def grpc_call(text: str) -> None:
            await stub.Translate(pb.TranslateRequest(texts=[text]), timeout=60)

        async def http_call(text: str) -> None:
            async with session.post("/v1/translate", json={"texts": [text]}) as reply:
                reply.raise_for_status()
                await reply.read()
        calls = {"grpc": grpc_call, "http": http_call}
        for name, call in calls.items():  # warm-up
            await call(texts[0])
        for text in texts:
            for name, call in calls.items():
                start = time.perf_counter()
                await call(text)
                latencies[name].append(time.perf_counter() - start)
    return {f"{name}_ms": statistics.median(values) * 1000 for name, values in latencies.items()}


async def http_closed_loop(url: str, texts: list[str], *, concurrency: int, duration: float) -> dict:
    """``drive`` over HTTP/JSON (``POST /v1/translate``), one connection per client."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector) as session:
        async def send(text: str) -> bool:
            async with session.post("/v1/translate", json={"texts": [text]}) as reply:
                await reply.read()
                return reply.status == 200
        return await drive(send, texts, concurrency=concurrency, duration=duration)
