"""The fused attention kernel against the step it replaces, on batches as busy as a saturated server's.

    python loadtest/bench_fused.py models/en-fr/4 --texts build/corpus-v2/test.jsonl \
        [--rows 1 8 32 64 112 160] [--draws 3] [--rounds 5] [--threads 1] [--spinning off]

Two engines of this tree, as ``nmt serve`` builds them (this CPU's int8 form): ``--fused-attention
off`` (the step on ONNX Runtime's operators: packed attention where it pays, the padded step
elsewhere, as served) and on (``service/decoding/fused.py``: query graph, compiled kernel, rest
graph). A running batch holds texts for about as many steps as they are long, so each batch is
drawn with chances proportional to source length (``bench_packed.busy_batch``; ``--draws`` per
row count), encoded by the engine. The two steps take turns: ``--rounds`` rounds of 20 runs,
medians. Every draw also reports how many rows choose the same best word and the largest
log-probability difference. At the largest row count, the fused step's parts are timed alone
(query graph, attention kernel, middle graph, output kernel) and ONNX Runtime's profile (kernel ms by op type) is taken of the
graph before and of the two graphs after (``step_graphs.profile_served``). Writes ``loadtest/results/bench_fused.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest import step_graphs as sg  # noqa: E402
from loadtest.bench_packed import busy_batch, timed  # noqa: E402
from service.decoding import fused, packed  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.decoding.runtime import STEP_OUTPUTS  # noqa: E402
from service.options import DecodingOptions  # noqa: E402

NAMES = ["log_probs", *STEP_OUTPUTS]


def served(engine: Engine, feed: dict) -> tuple[object, dict]:
    """(session, feed) as the engine serves this layout (packed indices where it packs)."""
    context = engine.runtime.context(feed["annotations"], feed["keys"], feed["src_mask"])
    if context.packed is None:
        return engine.runtime.step_session(False), feed
    return engine.runtime.step_session(True), packed.to_packed(feed)


def parts(step: fused.FusedStep, feed: dict, rounds: int) -> dict[str, float]:
    """ms of each part of the fused step alone (``FusedStep.stages``), taking turns."""
    runs = step.stages(feed)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            ms[name].append(timed(run))
    return {name: statistics.median(v) for name, v in ms.items()}


def measure(args: argparse.Namespace) -> dict:
    engines = {form: Engine(args.repository, precision="int8", intra_op_threads=args.threads,
                            decoder_spinning=args.spinning == "on", fused_attention=form == "fused")
               for form in ("before", "fused")}
    assert engines["fused"].runtime.attention_form == "fused", "the kernel did not load"
    texts = [json.loads(line)["src_raw"] for line in args.texts.read_text().splitlines() if line.strip()]
    probe = Engine(args.repository, precision="int8", intra_op_threads=1, packed_attention=False,
                   fused_attention=False)  # padded feeds
    lengths = np.array([len(probe.prepare_text(t, DecodingOptions(), 0).source_ids) for t in texts], dtype=float)
    out: dict = {"rows": {}}
    for rows in args.rows:
        draws = []
        for seed in range(args.draws):
            feed = busy_batch(probe, texts, lengths, rows, seed)
            runs = {}
            for form, engine in engines.items():
                session, f = served(engine, feed)
                runs[form] = (session, f)
            got = {form: dict(zip(NAMES, s.run(NAMES, f))) for form, (s, f) in runs.items()}
            step, product = runs["fused"][0], runs["fused"][0].product(feed["state"])
            timings = {form: (lambda s=s, f=f: s.run(STEP_OUTPUTS, f)) for form, (s, f) in runs.items()}
            # as a running batch steps: the state's product carried from the step before (no query graph run)
            timings["carried"] = lambda: (step.keep(feed["state"], product), step.run(STEP_OUTPUTS, feed))
            ms: dict[str, list[float]] = {form: [] for form in timings}
            for _ in range(args.rounds):
                for form, run in timings.items():  # taking turns
                    ms[form].append(timed(run))
            a, b = got["before"], got["fused"]
            draws.append({"seed": seed, "columns": int(feed["src_mask"].shape[1]),
                          "real_share": float(feed["src_mask"].mean()),
                          "before_form": "packed" if "key_index" in runs["before"][1] else "padded",
                          "before_ms": statistics.median(ms["before"]), "fused_ms": statistics.median(ms["fused"]),
                          "carried_ms": statistics.median(ms["carried"]),
                          "same_best": float(np.mean(a["topk_ids"][:, 0] == b["topk_ids"][:, 0])),
                          "max_log_prob_diff": float(np.abs(a["log_probs"] - b["log_probs"]).max())})
            print(json.dumps({"rows": rows, **draws[-1]}), flush=True)
        out["rows"][rows] = draws
    feed = busy_batch(probe, texts, lengths, max(args.rows), 0)
    step = engines["fused"].runtime.step_session(False)
    out["parts"] = parts(step, feed, args.rounds)
    f = served(engines["before"], feed)[1]
    out["profile"] = {"before": sg.profile_served(engines["before"], f, threads=args.threads),
                      "fused": sg.profile_served(engines["fused"], feed, threads=args.threads)}
    return out


def markdown(r: dict, args: argparse.Namespace) -> str:
    lines = ["# Fused attention against the step it replaces (busy batches)", "",
             f"`python loadtest/bench_fused.py {args.repository} --texts {args.texts} --rows "
             f"{' '.join(map(str, args.rows))} --draws {args.draws} --rounds {args.rounds} --threads {args.threads} "
             f"--spinning {args.spinning}`", "",
             f"{platform.machine()}, CPU flags: {', '.join(r['cpu_flags'])}; int8 form **{r['int8_form']}**; "
             f"{args.threads} thread(s), spinning {args.spinning}; onnxruntime {ort.__version__}. Greedy rows drawn "
             "with chances proportional to source length; ms per step: medians of rounds of 20 runs, the two "
             "taking turns. Before: the step on ONNX Runtime's operators as served for the layout (packed "
             "attention where it pays).", "",
             "Fused: with its query graph run (a step after texts joined); carried: the state's product made by "
             "the step before (`FusedStep.product`), as a running batch's other steps.", "",
             "| rows | draw | columns | real positions | before (form) ms | fused ms | before / fused | carried ms "
             "| before / carried | same best word | max log-prob diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, draws in r["rows"].items():
        for d in draws:
            lines.append(f"| {rows} | {d['seed']} | {d['columns']} | {d['real_share']:.0%} | {d['before_ms']:.3f} "
                         f"({d['before_form']}) | {d['fused_ms']:.3f} | {d['before_ms'] / d['fused_ms']:.2f}x | "
                         f"{d['carried_ms']:.3f} | {d['before_ms'] / d['carried_ms']:.2f}x | "
                         f"{d['same_best']:.1%} | {d['max_log_prob_diff']:.2g} |")
        ratio = statistics.median(d["before_ms"] / d["fused_ms"] for d in draws)
        carried = statistics.median(d["before_ms"] / d["carried_ms"] for d in draws)
        lines.append(f"| {rows} | median | | | | | **{ratio:.2f}x** | | **{carried:.2f}x** | | |")
    rows = max(r["rows"])
    lines += ["", f"The fused step's parts alone, first draw at {rows} rows (ms): "
              + ", ".join(f"{name} {ms:.3f}" for name, ms in r["parts"].items()) + ".", "",
              f"Profile (ONNX Runtime's kernel ms per op type, first draw at {rows} rows; fused: its two "
              "graphs' ops and the compiled kernel, timed):", "",
              *sg.profile_table(r["profile"]["before"], r["profile"]["fused"], ("before", "fused"))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path)
    p.add_argument("--texts", type=Path, required=True, help="a corpus split (.jsonl with src_raw)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 112, 160])
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--spinning", choices=("on", "off"), default="off")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_fused")
    args = p.parse_args(argv)
    return sg.write_results(args, measure(args), markdown)


if __name__ == "__main__":
    raise SystemExit(main())
