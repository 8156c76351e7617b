"""Decoder step and encoder of a shipped model repository, against their int8 product floors.

    python loadtest/bench_step.py [models/en-fr/4] --texts build/corpus-v2/test.jsonl \
        [--rows 32 64 160 512] [--beam 5] [--threads 2] [--rounds 7] [--steps 20] \
        [--encoder-texts 1 8 64] [--profile 160]

Runs on what ships (int8 graphs only is enough), as the server runs it: the int8
form this CPU gets (``service.decoding.int8_form``: u8 x s8 with VNNI or AMX, u8 x u8
elsewhere), the full-vocabulary step, and the shortlist step where the repository
has a shortlist (its candidates: real test sentences, ``rows / beam`` of them).
Each is timed against its *product floor* in the same form (``step_graphs``; the
shortlist per row's: the output product cut to the always-words and a row's mean own words): the
ratio step / floor is what the glue around the products costs. Engines take turns
in blocks of ``--steps`` runs for ``--rounds`` rounds; reported: the median over
rounds of each block's median. Then the encoder per text at ``--encoder-texts``
texts of 8 to 14 words, and with ``--profile ROWS`` ONNX Runtime's per-op profile
of both steps at that row count. Writes ``loadtest/results/bench_step.{md,json}``.
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
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtest"))

import step_graphs as sg  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402
from service.decoding.shortlist import shortlist_graph  # noqa: E402

WARMUP = 3


def measure(runs: dict[str, sg.Run], rounds: int, steps: int) -> dict[str, float]:
    """Median over rounds of each engine's median ms in a block of ``steps`` runs."""
    blocks: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times = []
            for i in range(WARMUP + steps):
                start = time.perf_counter()
                run()
                if i >= WARMUP:
                    times.append((time.perf_counter() - start) * 1e3)
            blocks[name].append(statistics.median(times))
    return {name: statistics.median(b) for name, b in blocks.items()}


def step_row(engines: dict, served: onnx.ModelProto, texts: list[str], rows: int, args: argparse.Namespace,
             rng: np.random.Generator) -> dict:
    beam = args.beam if rows % args.beam == 0 else 1
    batch = texts[: rows // beam]
    feed, _ = sg.step_feed(engines["full"], batch, beam=beam)
    runs = {"step": sg.step_run(engines["full"], feed, None), "floor": sg.floor_run(served, rows, args.threads, rng)}
    row = {"rows": rows, "beam": beam}
    if "shortlist" in engines:
        feed_s, candidates = sg.step_feed(engines["shortlist"], batch, beam=beam)
        runs["shortlist step"] = sg.step_run(engines["shortlist"], feed_s, candidates)
        if candidates.gathered or candidates.per_row:  # per row: the always-words and a row's mean own words
            width = candidates.width if candidates.gathered else int(
                candidates.always + candidates.feed["row_counts"].mean())
            runs["shortlist floor"] = sg.floor_run(served, rows, args.threads, rng, output_width=width)
        row["candidates"] = candidates.width
    row.update(measure(runs, args.rounds, args.steps))
    return row


def encoder_rows(engine, texts: list[str], args: argparse.Namespace) -> list[dict]:
    """The encoder as served, and (where it is the fused encoder) ONNX Runtime's GRU beside it, alternating."""
    graph = None
    if engine.runtime.encoder_form == "fused":
        graph = Engine(args.repository, precision="int8", intra_op_threads=args.threads, fused_encoder=False)
    out = []
    for count in args.encoder_texts:
        runs = {"encoder": sg.encoder_run(engine, texts[:count])}
        if graph is not None:
            runs["graph encoder"] = sg.encoder_run(graph, texts[:count])
        ms = measure(runs, args.rounds, args.steps)
        out.append({"texts": count, "ms": ms["encoder"], "ms_per_text": ms["encoder"] / count,
                    "form": engine.runtime.encoder_form, **({"graph_ms": ms["graph encoder"]} if graph else {})})
    return out


def profiles(engines: dict, served: onnx.ModelProto, texts: list[str], args: argparse.Namespace) -> dict:
    rows = args.profile
    batch = texts[: rows // args.beam]
    feed, _ = sg.step_feed(engines["full"], batch, beam=args.beam)
    out = {"step": sg.profile_served(engines["full"], feed, threads=args.threads)}  # as served for this layout
    if "shortlist" in engines:
        feed_s, candidates = sg.step_feed(engines["shortlist"], batch, beam=args.beam)
        if engines["shortlist"].runtime.attention_form == "fused":
            out["shortlist step"] = sg.profile_served(engines["shortlist"], feed_s, threads=args.threads,
                                                      candidates=candidates)
        else:
            graph = shortlist_graph(served, gather=candidates.gathered)[0]
            out["shortlist step"] = sg.profile_ops(graph.SerializeToString(), {**feed_s, **candidates.feed},
                                                   threads=args.threads)
    return out


def report(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Decoder step and encoder ({m['repository']})", "",
             f"`{m['command']}`", "",
             f"{m['cpu']}; CPU flags: {', '.join(m['flags']) or 'none'}; int8 form **{m['int8_form']}**; "
             f"{m['threads']} thread(s); onnxruntime {m['onnxruntime']}. ms per run: median over {m['rounds']} "
             f"rounds of each engine's median over {m['steps']} runs, engines alternating. Floors: the step's "
             "int8 products alone, same form, weights and rows.", "",
             "| rows | beam | step ms | floor ms | step / floor | shortlist candidates | shortlist step ms | "
             "shortlist floor ms | shortlist step / floor | full / shortlist |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["steps"]:
        s, sf = x.get("shortlist step"), x.get("shortlist floor")
        cells = [f"{x['rows']}", f"{x['beam']}", f"{x['step']:.3f}", f"{x['floor']:.3f}", f"{x['step'] / x['floor']:.2f}",
                 f"{x.get('candidates', '-')}", f"{s:.3f}" if s else "-", f"{sf:.3f}" if sf else "-",
                 f"{s / sf:.2f}" if s and sf else "-", f"{x['step'] / s:.2f}x" if s else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Encoder (texts of 8 to 14 words; graph: ONNX Runtime's GRU, where the served one is fused):", "",
              "| texts | encoder | ms per run | ms per text | graph ms per run | served / graph |",
              "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {e['texts']} | {e.get('form', '-')} | {e['ms']:.3f} | {e['ms_per_text']:.3f} | "
              + (f"{e['graph_ms']:.3f} | {e['ms'] / e['graph_ms']:.2f}x |" if "graph_ms" in e else "- | - |")
              for e in r["encoder"]]
    for name, ops in r.get("profile", {}).items():
        total = sum(ops.values())
        lines += ["", f"Profile of the {name} at {m['profile']} rows (mean kernel ms per op type; "
                  f"{total:.3f} ms in all):", "", "| op | ms | share |", "|---|---:|---:|"]
        lines += [f"| {op} | {ms:.3f} | {ms / total:.1%} |" for op, ms in list(ops.items())[:14]]
    lines += ["", f"Load average (1 min) before / after: {m['load'][0]:.2f} / {m['load'][1]:.2f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path, nargs="?", default=ROOT / "models" / "en-fr" / "3")
    p.add_argument("--texts", type=Path, help="corpus split (jsonl with src_raw); default: digit strings")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 160, 512])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--encoder-texts", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--profile", type=int, default=0, help="also profile both steps at this many rows")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_step")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    load = [os.getloadavg()[0]]
    engines = sg.engines(args.repository, args.threads)
    served = sg.served_step_graph(engines["full"])
    texts = sg.sources(args.texts, max(max(args.rows), max(args.encoder_texts)), rng)
    result = {"steps": [step_row(engines, served, texts, rows, args, rng) for rows in args.rows],
              "encoder": encoder_rows(engines["full"], texts, args)}
    if args.profile:
        result["profile"] = profiles(engines, served, texts, args)
    load.append(os.getloadavg()[0])
    result["meta"] = {"repository": str(args.repository), "cpu": f"{platform.machine()}, {os.cpu_count()} CPUs",
                      "flags": reported_flags(),
                      "int8_form": engines["full"].int8_form, "threads": args.threads, "rounds": args.rounds,
                      "steps": args.steps, "onnxruntime": ort.__version__, "profile": args.profile, "load": load,
                      "command": "python loadtest/bench_step.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
