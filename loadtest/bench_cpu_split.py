"""Where a saturated server's CPU goes: each thread of ``nmt serve``, the clients, the engine's time.

    python loadtest/bench_cpu_split.py --texts build/corpus-v2/test.jsonl \
        [--model models/en-fr/4] [--clients 128] [--duration 10] [--rounds 3] [--out ...]

``nmt serve`` of this checkout with its defaults (``--model``: a model of this
checkout instead of the version it serves by default); closed-loop gRPC clients
(``bench_release.saturate``) at one and then eight texts per call, ``--rounds``
rounds of ``--duration`` seconds each (after a warm-up). Around every round:

- the CPU time of every thread of the server and of its child processes
  (``/proc/<pid>/task/*/stat``), grouped: the event loop (the main thread: gRPC, HTTP,
  tokenizing, answering), the driver thread (``nmt-driver``: it speaks to the engine
  process), the engine thread (``nmt-engine``, in process: ONNX Runtime's calling thread and
  the batch's Python), the engine process (every thread of the server's children), gRPC
  core's own threads (``event_engine`` and the like), and the other threads (ONNX Runtime's
  pool workers, grpc.aio's poller, the metrics server); and this process's CPU (the clients);
- the server's ``/metrics``: decoder steps, rows per step, and the wall time the
  engine thread spent in decoder steps and in joins (encoder runs and the context
  they fill); the rest of its wall time is its Python between them and its waits.

With ``--bins-ms MS``, one more round per shape is sampled in bins of MS milliseconds
(``thread_bins``: every thread's time on CPU read every ``MS / 5`` ms by a process of its own): the
bins sorted by the engine's cores, with every group's mean beside them, and the longest stretch in
which the engine (nearly) idled: the phases that a round's averages hide.

Reports medians of the rounds. Linux only (``/proc``). Writes ``--out`` ``.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "loadtest"))

from bench_release import descendants, saturate, serve, write_results  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from service_load import cpu_seconds  # noqa: E402
import thread_bins  # noqa: E402
from service.decoding.int8_form import FormChoice, cpu_flags, decide, reported_flags  # noqa: E402
from service.scheduling.remote import DRIVER_THREAD  # noqa: E402
from service.scheduling.scheduler import ENGINE_THREAD  # noqa: E402

SHAPES = (1, 8)
GROUPS = ("event loop", "driver thread", "engine thread", "engine process", "gRPC core threads", "other threads")
GRPC_CORE_THREADS = ("event_engine", "default-execut", "resolver-execu", "grpc", "timer")  # their names' starts
METRICS = ("nmt_decode_duration_seconds_sum", "nmt_decode_duration_seconds_count",
           "nmt_encode_duration_seconds_sum", "nmt_encode_duration_seconds_count", "nmt_batch_rows_sum")


def group_of(pid: int, process: int, tid: int, name: str) -> str:
    """The ``GROUPS`` entry of thread ``tid`` (named ``name``) of ``process``, the server being ``pid``."""
    if process != pid:
        return "engine process"
    if tid == pid:
        return "event loop"
    if name == DRIVER_THREAD:
        return "driver thread"
    if name == ENGINE_THREAD:
        return "engine thread"
    return "gRPC core threads" if name.startswith(GRPC_CORE_THREADS) else "other threads"


def server_threads(pid: int) -> dict[tuple[int, str], float]:
    """(tid, group) -> CPU seconds so far, for every thread of process ``pid`` and of its children."""
    out = {}
    for process, tid, name, _ in thread_bins.threads((pid, *descendants(pid))):
        seconds = cpu_seconds(process, tid)
        if not math.isnan(seconds):  # the thread was still there
            out[(tid, group_of(pid, process, tid, name))] = seconds
    return out


def metrics(server) -> Counter:
    """The ``METRICS`` samples of the server's /metrics, summed over their labels."""
    out: Counter = Counter()
    for family in text_string_to_metric_families(server.scrape()):
        for sample in family.samples:
            if sample.name in METRICS:
                out[sample.name] += sample.value
    return out


def one_round(server, texts: list[str], per_call: int, args: argparse.Namespace, seed: int) -> dict:
    """One measured round: texts/s, cores per group and per busiest thread, the engine's wall split."""
    pid = server.proc.pid
    before, metrics_before = server_threads(pid), metrics(server)
    client_before, start = cpu_seconds(os.getpid()), time.perf_counter()
    result = asyncio.run(saturate(server.address, texts, per_call=per_call, clients=args.clients,
                                  duration=args.duration, seed=seed))
    wall = time.perf_counter() - start
    after, metrics_after = server_threads(pid), metrics(server)
    client = cpu_seconds(os.getpid()) - client_before
    used = {key: (after[key] - before.get(key, 0.0)) / wall for key in after}
    groups = {g: sum(v for (_, group), v in used.items() if group == g) for g in GROUPS}
    m = {k: metrics_after[k] - metrics_before[k] for k in METRICS}
    steps, joins = m["nmt_decode_duration_seconds_count"], m["nmt_encode_duration_seconds_count"]
    return {"texts_per_s": result["texts_per_s"], "client_cores": client / wall, "server_cores": sum(used.values()),
            "groups": groups, "busiest": sorted(((g, v) for (_, g), v in used.items()), key=lambda x: -x[1])[:4],
            "steps_per_s": steps / wall, "rows_per_step": m["nmt_batch_rows_sum"] / max(steps, 1),
            "step_ms": 1e3 * m["nmt_decode_duration_seconds_sum"] / max(steps, 1),
            "joins_per_s": joins / wall, "join_ms": 1e3 * m["nmt_encode_duration_seconds_sum"] / max(joins, 1),
            "engine_in_steps": m["nmt_decode_duration_seconds_sum"] / wall,
            "engine_in_joins": m["nmt_encode_duration_seconds_sum"] / wall}


def bins_round(server, texts: list[str], per_call: int, args: argparse.Namespace) -> dict:
    """One more round, its threads sampled in bins of ``--bins-ms`` (``thread_bins``)."""
    pid = server.proc.pid
    paths = thread_bins.schedstat_paths((pid, *descendants(pid)), lambda process, tid, name: group_of(
        pid, process, tid, name))
    paths.update(thread_bins.schedstat_paths([os.getpid()], lambda *_: "clients"))
    bin_s = args.bins_ms / 1000
    rows = thread_bins.start_sampling(list(paths), args.duration - 1, bin_s / 5, delay=0.5)  # inside the load
    result = asyncio.run(saturate(server.address, texts, per_call=per_call, clients=args.clients,
                                  duration=args.duration, seed=7))
    bins = thread_bins.binned(rows(), list(paths.values()), bin_s)
    engine = "engine process" if any(b.get("engine process", 0) for b in bins) else "engine thread"
    return {"texts_per_s": result["texts_per_s"], "bins": len(bins), "engine": engine,
            "by_busy": thread_bins.by_busy(bins, engine), "longest_idle": thread_bins.longest_below(bins, engine, 0.2)}


def run(args: argparse.Namespace) -> dict:
    lines = Path(args.texts).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["src_raw"] for line in lines if line.strip()][: args.max_texts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = serve(ROOT, "cpu_split", args.out.parent, args.model)
    rounds: dict[int, list[dict]] = {n: [] for n in SHAPES}
    sampled: dict[int, dict] = {}
    try:
        for per_call in SHAPES:
            asyncio.run(saturate(server.address, texts, per_call=per_call, clients=args.clients,
                                 duration=3, seed=99))  # warm-up: the batch fills, the pool spins
            for r in range(args.rounds):
                got = one_round(server, texts, per_call, args, seed=r)
                rounds[per_call].append(got)
                print(f"{per_call}/call round {r}: {got['texts_per_s']:.0f} texts/s, server "
                      f"{got['server_cores']:.2f} cores, clients {got['client_cores']:.2f}", flush=True)
            if args.bins_ms:
                sampled[per_call] = bins_round(server, texts, per_call, args)
    finally:
        server.stop()
    return {"rounds": rounds, "bins": sampled, "flags": reported_flags(), "int8_form": decide(FormChoice.AUTO, cpu_flags())[0].value,
            "cpus": os.cpu_count(), "clients": args.clients, "duration": args.duration,
            "model": args.model or "(served by default)"}


def markdown(r: dict, args: argparse.Namespace) -> str:
    out = ["# Where a saturated server's CPU goes", "",
           f"`python loadtest/bench_cpu_split.py --texts {args.texts} --rounds {args.rounds} --duration {args.duration:g} "
           f"--clients {args.clients}{f' --bins-ms {args.bins_ms:g}' if args.bins_ms else ''}`; model {r['model']}; {r['cpus']} CPUs, CPU flags {', '.join(r['flags']) or 'none'}, "
           f"int8 form {r['int8_form']}; `nmt serve` defaults. Medians of {args.rounds} rounds. Cores: CPU seconds "
           "per second of wall time.", "",
           "| texts per call | texts/s | clients (cores) | server (cores) | " + " | ".join(GROUPS) + " |",
           "|---:|---:|---:|---:|" + "---:|" * len(GROUPS)]
    med = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k not in ("groups", "busiest")}
           for n, rs in r["rounds"].items()}
    for n, rs in r["rounds"].items():
        groups = [statistics.median(x["groups"][g] for x in rs) for g in GROUPS]
        out.append(f"| {n} | {med[n]['texts_per_s']:.0f} | {med[n]['client_cores']:.2f} | {med[n]['server_cores']:.2f} | "
                   + " | ".join(f"{g:.2f}" for g in groups) + " |")
    out += ["", "The engine's wall time (from the server's `/metrics`; with the engine process the encoder runs are "
            "timed in either process, the server process's beside the child's steps, and the shares may pass 100 %):", "",
            "| texts per call | steps/s | rows per step | step ms | in steps | joins/s | join ms | in joins | rest |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, m in med.items():
        rest = 1 - m["engine_in_steps"] - m["engine_in_joins"]
        out.append(f"| {n} | {m['steps_per_s']:.0f} | {m['rows_per_step']:.1f} | {m['step_ms']:.2f} | "
                   f"{m['engine_in_steps']:.0%} | {m['joins_per_s']:.0f} | {m['join_ms']:.2f} | "
                   f"{m['engine_in_joins']:.0%} | {rest:.0%} |")
    out += ["", "Busiest threads per round (cores): " + "; ".join(
        f"{n}/call " + ", ".join(f"{g} {v:.2f}" for g, v in rs[0]["busiest"]) for n, rs in r["rounds"].items())]
    return "\n".join(out + bins_markdown(r["bins"], args)) + "\n"


def bins_markdown(sampled: dict, args: argparse.Namespace) -> list[str]:
    out = []
    for n, b in sampled.items():
        names = list(b["by_busy"][0]["means"])
        out += ["", f"{n}/call, one more round in {args.bins_ms:g} ms bins ({b['bins']} bins, "
                f"{b['texts_per_s']:.0f} texts/s under the sampler), by the {b['engine']}'s cores in a bin; "
                "each group's mean cores there:", "",
                f"| {b['engine']} cores | share of bins | " + " | ".join(names) + " | total |",
                "|---|---:|" + "---:|" * (len(names) + 1)]
        for row in b["by_busy"]:
            low, high = row["range"]
            span = f"{low:g}-{high:g}" if high is not None else f"{low:g} or more"
            out.append(f"| {span} | {row['share']:.0%} | " + " | ".join(
                f"{row['means'][g]:.2f}" for g in names) + f" | {row['total']:.2f} |")
        out += ["", f"Longest stretch with the {b['engine']} under 0.2 cores: {b['longest_idle']} bins "
                f"({b['longest_idle'] * args.bins_ms:g} ms)."]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=Path, required=True, help="test split (jsonl with src_raw)")
    p.add_argument("--model", help="a model of this checkout (relative to it); default: the version it serves")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per round")
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--max-texts", type=int, default=1000)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_cpu_split")
    p.add_argument("--bins-ms", type=float, default=0.0, help="one more round per shape in bins of this many ms")
    args = p.parse_args(argv)
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("bench_cpu_split needs Linux's /proc")
    result = run(args)
    return write_results(args.out, result, markdown(result, args))


if __name__ == "__main__":
    sys.exit(main())
