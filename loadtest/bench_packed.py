"""Packed attention against the padded step, on batches as busy as a saturated server's.

    python loadtest/bench_packed.py models/en-fr/4 --texts build/corpus-v2/test.jsonl \
        [--rows 1 8 32 128] [--draws 5] [--rounds 5] [--threads 2] [--spinning off] [--draw short]

A running batch holds texts for about as many steps as they are long, so a busy
batch is drawn from the split with each text's chance proportional to its
source length (``--draws`` batches per row count); ``--draw short`` instead draws texts of 8 to
14 words with equal chances (little padding: ``bench_step.py``'s batches). Each batch is added to a
serving ``Batch`` (real encoder outputs, padded as the service pads them,
``layout.width``), then the served step graph (this CPU's int8 form) runs on it
as shipped (padded, scores every column) and with packed attention
(``service.decoding.packed``), in separate sessions with the server's options,
taking turns: ``--rounds`` rounds of 20 runs each, medians. Every draw also
checks that both give the same bits. ONNX Runtime's profiler (kernel ms by op
type) on the first draw at the largest row count, each form. The "served" column is the form the
runtime serves for that layout (``packed.pays``: packed only up to ``PACKED_SHARE_MAX``).

Writes ``loadtest/results/bench_packed.{md,json}`` with the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest import step_graphs as sg  # noqa: E402
from service.decoding import packed  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402
from service.decoding.runtime import STEP_OUTPUTS, _session_options  # noqa: E402
from service.options import DecodingOptions  # noqa: E402

RUNS = 20  # step runs per timing


def busy_batch(engine: Engine, texts: list[str], lengths: np.ndarray, rows: int, seed: int,
               draw: str = "length") -> dict:
    """A padded step feed of ``rows`` greedy rows drawn with chances proportional to length
    (``draw`` "length") or equal chances among texts of 8 to 14 words ("short")."""
    if draw == "short":
        words = np.array([len(t.split()) for t in texts])
        chances = ((words >= 8) & (words <= 14)).astype(float)
    else:
        chances = lengths
    pick = np.random.default_rng(seed).choice(len(texts), size=rows, p=chances / chances.sum())
    return sg.step_feed(engine, [texts[i] for i in pick], beam=1)[0]  # the engine pads (packed off)


def timed(run, runs: int = RUNS) -> float:
    run()
    start = time.perf_counter()
    for _ in range(runs):
        run()
    return (time.perf_counter() - start) / runs * 1e3


def measure(args: argparse.Namespace) -> dict:
    engine = Engine(args.repository, precision="int8", intra_op_threads=args.threads, packed_attention=False)
    step = sg.served_step_graph(engine)
    graphs = {"padded": step.SerializeToString(), "packed": packed.pack_attention(step).SerializeToString()}
    options = _session_options(args.threads, spinning=args.spinning == "on")
    sessions = {form: ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
                for form, graph in graphs.items()}
    texts = [json.loads(line)["src_raw"] for line in args.texts.read_text().splitlines() if line.strip()]
    lengths = np.array([len(engine.prepare_text(t, DecodingOptions(), 0).source_ids) for t in texts], dtype=float)
    out: dict = {"rows": {}}
    for rows in args.rows:
        draws = []
        for seed in range(args.draws):
            feed = busy_batch(engine, texts, lengths, rows, seed, args.draw)
            feeds = {"padded": feed, "packed": packed.to_packed(feed)}
            results = {form: sessions[form].run(STEP_OUTPUTS, feeds[form]) for form in sessions}
            same = all(np.array_equal(a, b) for a, b in zip(results["padded"], results["packed"]))
            ms: dict[str, list[float]] = {form: [] for form in sessions}
            for _ in range(args.rounds):
                for form in sessions:  # taking turns
                    ms[form].append(timed(lambda: sessions[form].run(STEP_OUTPUTS, feeds[form])))
            mask = feed["src_mask"]
            draws.append({"seed": seed, "columns": int(mask.shape[1]), "real_share": float(mask.mean()),
                          "packed_share": len(feeds["packed"]["key_rows"]) / mask.size, "bit_identical": same,
                          "served": "packed" if packed.pays(packed.feed_lengths(mask), mask.shape[1]) else "padded",
                          "padded_ms": statistics.median(ms["padded"]), "packed_ms": statistics.median(ms["packed"])})
            print(json.dumps({"rows": rows, **draws[-1]}), flush=True)
        out["rows"][rows] = draws
    first = busy_batch(engine, texts, lengths, max(args.rows), 0, args.draw)
    feeds = {"padded": first, "packed": packed.to_packed(first)}
    out["profile"] = {form: sg.profile_ops(graphs[form], feeds[form], threads=args.threads) for form in graphs}
    return out


def markdown(r: dict, args: argparse.Namespace) -> str:
    lines = ["# Packed attention against the padded step (busy batches)", "",
             f"`python loadtest/bench_packed.py {args.repository} --texts {args.texts} --rows "
             f"{' '.join(map(str, args.rows))} --draws {args.draws} --rounds {args.rounds} --spinning {args.spinning} "
             f"--draw {args.draw}`",
             "",
             f"{platform.machine()}, CPU flags: {', '.join(r['cpu_flags'])}; int8 form **{r['int8_form']}**; "
             f"{r['threads']} thread(s), spinning {args.spinning}; onnxruntime {ort.__version__}. "
             + ("Greedy rows drawn with chances proportional to source length" if args.draw == "length" else
                "Greedy rows of texts of 8 to 14 words drawn with equal chances")
             + "; ms per step run: medians of rounds of 20 runs, forms taking turns. Served: the form the runtime "
             f"serves for the layout (packed up to {packed.PACKED_SHARE_MAX:.0%} of the positions).", "",
             "| rows | draw | columns | real positions | packed positions | padded ms | packed ms | padded / packed "
             "| same bits | served |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for rows, draws in r["rows"].items():
        for d in draws:
            lines.append(f"| {rows} | {d['seed']} | {d['columns']} | {d['real_share']:.0%} | {d['packed_share']:.0%} | "
                         f"{d['padded_ms']:.3f} | {d['packed_ms']:.3f} | {d['padded_ms'] / d['packed_ms']:.2f}x | "
                         f"{'yes' if d['bit_identical'] else '**no**'} | {d['served']} |")
        ratio = statistics.median(d["padded_ms"] / d["packed_ms"] for d in draws)
        lines.append(f"| {rows} | median | | | | | | **{ratio:.2f}x** | | |")
    lines += ["", f"Profile (kernel ms per op type, first draw at {max(r['rows'])} rows):", "",
              *sg.profile_table(r["profile"]["padded"], r["profile"]["packed"], ("padded", "packed"), top=14)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path)
    p.add_argument("--texts", type=Path, required=True, help="a corpus split (.jsonl with src_raw)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--draws", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spinning", choices=("on", "off"), default="off",
                   help="the sessions' pools spin between operators (the server's decoder does); off by default: "
                        "two spinning pools in one process take turns badly (at 1 row the same step timed 0.26 "
                        "or 0.43 ms)")
    p.add_argument("--draw", choices=("length", "short"), default="length",
                   help="length: chances proportional to source length (busy batches); short: 8-14 words, equal")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_packed")
    args = p.parse_args(argv)
    result = measure(args)
    engine_form = Engine(args.repository, precision="int8", intra_op_threads=1).int8_form
    result.update({"cpu_flags": reported_flags(), "threads": args.threads, "int8_form": engine_form})
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    args.out.with_suffix(".md").write_text(markdown(result, args))
    print(markdown(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
