"""The encoder per text: one run for all joining texts, against runs of similar lengths.

    python loadtest/bench_encoder_runs.py models/en-fr/4 --texts build/corpus-v2/test.jsonl \
        [--counts 1 8 16 64] [--samples 40] [--rounds 5] [--threads 2]

The encoder's GRU computes every row of a run up to the run's longest source, so
a run of mixed lengths pays for its padding, and each run pays a fixed cost.
``Batch.add`` cuts the joining texts (sorted longest first) into runs that
minimise padded tokens plus ``layout.ENCODER_RUN_TOKENS`` per run. Here:

1. **Calibration.** ``Runtime.encode`` alone at several rows x source lengths; a
   least-squares fit (of relative errors) ``ms = fixed + per_token * rows * src_len`` gives the fixed
   cost in padded tokens (``fixed / per_token``), what ``ENCODER_RUN_TOKENS`` should be.
2. **Per text, through ``Batch.add``** (encoder runs and the context they fill):
   ``--samples`` random draws of N texts per round, each added to a fresh batch
   with the runs (``ENCODER_RUN_TOKENS``) and as one run (the cost set huge: the
   behaviour before), the two taking turns; medians over rounds of each round's
   mean. Two draws: test-split sentences as they come (every length), and
   sentences of 8-14 words (the issue's "8 texts of about 10 tokens").
   A third engine adds every draw as one run in u8 x u8 with ONNX Runtime's GRU (no fused
   encoder): the encoder as release f967d83 ran it (the same graphs), so ``runs / f967d83``
   is the issue's encoder ratio. (On a CPU whose form is u8 x u8 and without the fused encoder
   the two are the same engine, and the third is left out.)

Writes ``loadtest/results/bench_encoder_runs.{md,json}`` with the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.step_graphs import sources  # noqa: E402
from service.decoding import layout  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.decoding.int8_form import FormChoice, reported_flags  # noqa: E402
from service.options import DecodingOptions  # noqa: E402

ONE_RUN = 10**9  # a run cost no padding outweighs: every add is one encoder run


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def calibrate(engine: Engine, rounds: int) -> dict:
    """``Runtime.encode`` at rows x src_len, and the fitted fixed cost in padded tokens."""
    rng, points = np.random.default_rng(1), []
    for rows in (1, 4, 16, 64):
        for src_len in (4, 12, 24, 48):
            src = rng.integers(4, 8000, size=(rows, src_len)).astype(np.int64)
            lengths = np.full(rows, src_len, dtype=np.int64)
            engine.runtime.encode(src, lengths)
            reps = max(3, 400 // (rows * src_len // 8 + 1))
            ms = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(reps):
                    engine.runtime.encode(src, lengths)
                ms.append((time.perf_counter() - start) / reps * 1e3)
            points.append({"rows": rows, "src_len": src_len, "ms": statistics.median(ms)})
    tokens = np.array([p["rows"] * p["src_len"] for p in points], dtype=np.float64)
    ms = np.array([p["ms"] for p in points])
    per_token, fixed = np.polyfit(tokens, ms, 1, w=1 / ms)  # relative errors: small runs count as much
    return {"points": points, "fixed_ms": float(fixed), "per_token_ms": float(per_token),
            "fixed_tokens": float(fixed / per_token)}


def add_ms(engine: Engine, draws: list[list], run_tokens: int) -> float:
    """Mean ms of ``Batch.add`` over the draws (each a list of prepared texts), per text."""
    layout.ENCODER_RUN_TOKENS = run_tokens
    total, texts = 0.0, 0
    for prepared in draws:
        batch = engine.new_batch()
        start = time.perf_counter()
        batch.add([((0, i), p) for i, p in enumerate(prepared)])
        total += time.perf_counter() - start
        texts += len(prepared)
    return total / texts * 1e3


def compare(engine: Engine, pool: list[str], counts: list[int], args: argparse.Namespace,
            before: Engine | None = None) -> list[dict]:
    """Per N: ms/text with runs and as one run (and as f967d83 ran it, on ``before``), alternating."""
    rng = np.random.default_rng(0)
    prepared = [engine.prepare_text(t, DecodingOptions(), i) for i, t in enumerate(pool)]
    default, out = layout.ENCODER_RUN_TOKENS, []
    variants = [("runs", engine, default), ("one run", engine, ONE_RUN)]
    variants += [("f967d83", before, ONE_RUN)] if before is not None else []
    for n in counts:
        draws = [[prepared[i] for i in rng.choice(len(prepared), size=n, replace=False)]
                 for _ in range(args.samples)]
        for _, eng, cost in variants:
            add_ms(eng, draws[:2], cost)  # warm-up
        rounds: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for r in range(args.rounds):
            for name, eng, cost in variants[:: 1 if r % 2 == 0 else -1]:
                rounds[name].append(add_ms(eng, draws, cost))
        layout.ENCODER_RUN_TOKENS = default
        runs = [len(layout.encoder_runs(sorted((len(p.source_ids) for p in d), reverse=True))) for d in draws]
        real = [sum(len(p.source_ids) for p in d) for d in draws]
        padded = [len(d) * max(len(p.source_ids) for p in d) for d in draws]
        one, split = statistics.median(rounds["one run"]), statistics.median(rounds["runs"])
        row = {"texts": n, "one_run_ms_per_text": one, "runs_ms_per_text": split, "ratio": split / one,
               "mean_runs": statistics.fmean(runs), "real_share_one_run": sum(real) / sum(padded),
               "rounds": rounds}
        if before is not None:
            row["f967d83_ms_per_text"] = statistics.median(rounds["f967d83"])
            row["ratio_f967d83"] = split / row["f967d83_ms_per_text"]
        out.append(row)
    return out


def report(result: dict) -> str:
    cal = result["calibration"]
    lines = [f"# Encoder per text: runs of similar lengths against one run ({result['repository']})", "",
             f"Machine: {result['machine']}, CPU flags: {result['cpu_flags']}, int8 form {result.get('int8_form', '?')}, "
             f"{result['threads']} threads, "
             f"load before {result['load'][0]:.2f}, after {result['load'][1]:.2f}.", "",
             f"Calibration (`Runtime.encode`): {cal['fixed_ms']:.3f} ms per run + {cal['per_token_ms'] * 1e3:.1f} us "
             f"per padded token = **{cal['fixed_tokens']:.1f} padded tokens per run** "
             f"(`layout.ENCODER_RUN_TOKENS` = {result['run_tokens']}).", "",
             f"`Batch.add` per text, medians of {result['rounds']} alternating rounds of {result['samples']} draws:", "",
             "| texts | draw | one run ms/text | runs ms/text | runs / one run | mean runs | real tokens / padded (one run) "
             "| f967d83 (one run, u8 x u8) ms/text | runs / f967d83 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for draw, rows in result["draws"].items():
        lines += [f"| {r['texts']} | {draw} | {r['one_run_ms_per_text']:.3f} | {r['runs_ms_per_text']:.3f} | "
                  f"{r['ratio']:.2f}x | {r['mean_runs']:.1f} | {r['real_share_one_run']:.0%} | "
                  + (f"{r['f967d83_ms_per_text']:.3f} | {r['ratio_f967d83']:.2f}x |" if "ratio_f967d83" in r
                     else "(same form) | |") for r in rows]
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path)
    p.add_argument("--texts", type=Path, required=True, help="a corpus split (.jsonl with src_raw)")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8, 16, 64])
    p.add_argument("--samples", type=int, default=40, help="random draws of N texts per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_encoder_runs")
    args = p.parse_args(argv)
    engine = Engine(args.repository, precision="int8", intra_op_threads=args.threads)
    before = None  # f967d83's encoder: the shipped u8 x u8 form, every add one run
    if engine.int8_form != FormChoice.U8U8.value or engine.runtime.encoder_form == "fused":
        before = Engine(args.repository, precision="int8", intra_op_threads=args.threads,
                        int8_form=FormChoice.U8U8, fused_encoder=False)
    every = [json.loads(line)["src_raw"] for line in args.texts.read_text().splitlines() if line.strip()]
    load_before = os.getloadavg()[0]
    result = {"repository": str(args.repository), "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
              "cpu_flags": reported_flags(), "threads": args.threads, "rounds": args.rounds,
              "samples": args.samples, "run_tokens": layout.ENCODER_RUN_TOKENS,
              "calibration": calibrate(engine, args.rounds),
              "int8_form": engine.int8_form,
              "draws": {"test split": compare(engine, every, args.counts, args, before),
                        "8-14 words": compare(engine, sources(args.texts, 2000, np.random.default_rng(2)),
                                              args.counts, args, before)},
              "command": "python loadtest/bench_encoder_runs.py " + " ".join(argv or sys.argv[1:])}
    result["load"] = (load_before, os.getloadavg()[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
