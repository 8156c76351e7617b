"""The engine's ceiling: what the engine alone decodes against what the service serves.

    git worktree add /tmp/base f967d83        # optional: the release the targets compare with
    python loadtest/bench_ceiling.py --texts build/corpus-v2/test.jsonl [--previous /tmp/base] \
        [--rows 112] [--rounds 3] [--duration 8] [--clients 128] [--out ...]

In alternating rounds, one at a time on this machine:

- **engine alone**: a process of its own runs the serving engine (``Engine`` as ``nmt serve``
  builds it by default: the served model, int8, ONNX Runtime's global pool, spinning, no
  shortlist) in the engine thread's loop with nothing else: a batch of ``--rows`` texts
  (greedy, the default options; the rows a saturated server's steps run, ``bench_cpu_split.py``),
  each step followed by one join of as many new texts as finished. The texts are tokenized
  before the clock starts; no gRPC, no event loop, no scheduler, no rendering;
- **this service** (and the ``--previous`` checkout's, with its own defaults and model):
  ``nmt serve`` saturated by ``--clients`` closed-loop gRPC clients, one and then eight texts
  per call (``bench_release.each_shape``, as ``bench_release.py`` measures a release).

Reported: medians of the rounds, and the ratios. The engine alone bounds what any serving layer
around this engine can reach on this machine: a service target above it needs a faster engine.
Writes ``--out`` ``.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "loadtest"))

from bench_release import SHAPES, each_shape, serve, served_version, write_results  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402


def engine_loop(repository: Path, texts: list[str], *, rows: int, duration: float) -> dict:
    """The engine thread's loop alone (see the module's docstring): texts/s, steps/s, shares."""
    from service.decoding.engine import Engine
    from service.models.manifest import load_manifest
    from service.options import DecodingOptions

    manifest = load_manifest(repository)  # nmt serve's defaults: --precision auto, one pool, spinning
    engine = Engine(manifest, precision=manifest.default_precision()[0], shared_pool=True)
    prepared = [engine.prepare_text(t, DecodingOptions(), 0) for t in texts]
    source, keys = itertools.cycle(prepared), itertools.count()

    def new(n: int) -> list:
        return [((next(keys), 0), next(source)) for _ in range(n)]

    warm = engine.new_batch()
    warm.add(new(rows))
    for _ in range(20):
        warm.step()
    batch = engine.new_batch()
    batch.add(new(rows))
    done = steps = row_steps = 0
    in_steps = in_joins = 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        a, row_steps = time.perf_counter(), row_steps + batch.live_rows
        finished = batch.step()
        b = time.perf_counter()
        if finished:
            batch.add(new(len(finished)))
        in_steps, in_joins = in_steps + b - a, in_joins + time.perf_counter() - b
        steps, done = steps + 1, done + len(finished)
    wall = time.perf_counter() - start
    return {"texts_per_s": done / wall, "steps_per_s": steps / wall, "in_steps": in_steps / wall,
            "in_joins": in_joins / wall, "step_ms": 1e3 * in_steps / max(steps, 1),
            "rows_per_step": row_steps / max(steps, 1)}


def engine_round(repository: Path, texts: Path, *, rows: int, duration: float, max_texts: int = 1000) -> dict:
    """``engine_loop`` in a process of its own (ONNX Runtime's global pool is per process)."""
    out = subprocess.run([sys.executable, __file__, "--engine-loop", str(repository), "--texts", str(texts),
                          "--rows", str(rows), "--duration", str(duration), "--max-texts", str(max_texts)],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace, texts: list[str]) -> dict:
    repository = ROOT / args.model if args.model else served_version(ROOT)
    trees = {"this": ROOT, **({"previous": args.previous.resolve()} if args.previous else {})}
    rounds: dict = {"engine alone": [], **{f"{name} service": {n: [] for n in SHAPES} for name in trees}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        rounds["engine alone"].append(engine_round(repository, args.texts, rows=args.rows, duration=args.duration,
                                                   max_texts=args.max_texts))
        print(f"round {r} engine alone: {rounds['engine alone'][-1]['texts_per_s']:.0f} texts/s", flush=True)
        for name, tree in trees.items():
            server = serve(tree, f"ceiling_{name}", args.out.parent, args.model if name == "this" else None)
            try:
                for n, got in each_shape(server.address, texts, clients=args.clients, duration=args.duration,
                                         seed=r, label=f"round {r} {name} service"):
                    rounds[f"{name} service"][n].append(got)
            finally:
                server.stop()
    return {"rounds": rounds, "flags": reported_flags(), "cpus": os.cpu_count(), "rows": args.rows,
            "model": os.path.relpath(repository, ROOT), "previous": str(args.previous or "")}


def markdown(r: dict, args: argparse.Namespace) -> str:
    engine = {k: statistics.median(x[k] for x in r["rounds"]["engine alone"]) for k in r["rounds"]["engine alone"][0]}
    prev = " --previous " + r["previous"] if r["previous"] else ""
    out = ["# The engine alone against the service", "",
           f"`python loadtest/bench_ceiling.py --texts {args.texts}{prev} --rows {args.rows} --rounds {args.rounds} "
           f"--duration {args.duration:g} --clients {args.clients}`; {r['model']}; {r['cpus']} CPUs, CPU flags "
           f"{', '.join(r['flags']) or 'none'}. Alternating rounds, medians.", "",
           f"Engine alone at {r['rows']} rows: **{engine['texts_per_s']:.0f} texts/s** "
           f"({engine['steps_per_s']:.0f} steps/s "
           f"of {engine['step_ms']:.2f} ms on {engine['rows_per_step']:.0f} rows; {engine['in_steps']:.0%} of the time "
           f"in steps, {engine['in_joins']:.0%} in joins). "
           "Per round: " + ", ".join(f"{x['texts_per_s']:.0f}" for x in r["rounds"]["engine alone"]) + ".", "",
           "| service | texts per call | texts/s | per round | engine alone / service |", "|---|---:|---:|---|---:|"]
    for name, shapes in r["rounds"].items():
        if name == "engine alone":
            continue
        for n, rs in shapes.items():
            tps = statistics.median(x["texts_per_s"] for x in rs)
            out.append(f"| {name.removesuffix(' service')} | {n} | {tps:.0f} | "
                       + ", ".join(f"{x['texts_per_s']:.0f}" for x in rs) + f" | {engine['texts_per_s'] / tps:.2f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=Path, required=True, help="test split (jsonl with src_raw)")
    p.add_argument("--previous", type=Path, help="a checkout of the previous release: its service too")
    p.add_argument("--model", help="a model of this checkout (relative to it); default: the version it serves")
    p.add_argument("--rows", type=int, default=112, help="the engine alone's batch (rows a saturated server steps)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--max-texts", type=int, default=1000)
    p.add_argument("--engine-loop", type=Path, help=argparse.SUPPRESS)  # a round's engine process
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_ceiling")
    args = p.parse_args(argv)
    lines = args.texts.read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["src_raw"] for line in lines if line.strip()][: args.max_texts]
    if args.engine_loop:
        print(json.dumps(engine_loop(args.engine_loop, texts, rows=args.rows, duration=args.duration)))
        return 0
    result = run(args, texts)
    return write_results(args.out, result, markdown(result, args))


if __name__ == "__main__":
    sys.exit(main())
