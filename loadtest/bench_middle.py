"""The compiled middle of the step against the middle graph it replaces, on batches as busy as a server's.

    python loadtest/bench_middle.py models/en-fr/4 --texts build/corpus-v2/test.jsonl \
        [--rows 1 8 32 44 64 112 160] [--draws 3] [--rounds 7] [--threads 1]

Two engines of this tree as ``nmt serve`` builds them (fused kernels; the shortlist on, per row): the step's
middle by ``middle.c`` (``service/decoding/fused_middle.py``) and by ONNX Runtime (the middle graph, as
where the kernel is not offered). Each batch is drawn with chances proportional to source length
(``bench_packed.busy_batch``'s texts, ``--draws`` per row count), greedy, as the engine lays it out after
its first step; the step runs as a running batch's does (the state's product carried). The two take
turns: ``--rounds`` rounds of 20 runs of the whole step, and of the middle alone; medians. Every draw
also reports how many rows choose the same best word and the largest differences of the next state and
of the best log-probability. And the product a join needs (the query graph on 4 new texts' first states)
right after the compiled engine's step, as in a running engine: by ONNX Runtime's query session (the graph
engine's: its own copy of the weights, cold by then) and by the compiled engine's ``QueryKernel`` (the
middle's copy); medians of 20 each per round. Writes ``loadtest/results/bench_middle.{md,json}`` with the
CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest import step_graphs as sg  # noqa: E402
from loadtest.bench_packed import timed  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.decoding.shortlist import ShortlistChoice  # noqa: E402
from service.options import DecodingOptions  # noqa: E402

FORMS = ("graph", "compiled")
OUTPUTS = ["topk_log_probs", "topk_ids", "next_state"]


def engines(repository: Path, threads: int) -> dict[str, Engine]:
    built = {"compiled": Engine(repository, precision="int8", intra_op_threads=threads, shortlist=ShortlistChoice.ON)}
    with sg.graph_middle():
        built["graph"] = Engine(repository, precision="int8", intra_op_threads=threads, shortlist=ShortlistChoice.ON)
    assert built["compiled"].runtime.middle_form == "compiled", "the compiled middle did not load"
    assert built["graph"].runtime.middle_form == "graph"
    return built


def after(step: Callable[[], object], query: Any, new: np.ndarray, runs: int = 20) -> float:
    """ms of ``query``'s product of the states ``new`` run right after a step, as at a join (the median of ``runs``)."""
    times = []
    for _ in range(runs):
        step()
        started = time.perf_counter()
        query.run(None, {"state": new})
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def draw(built: dict[str, Engine], texts: list[str], lengths: np.ndarray, rows: int, seed: int, rounds: int,
         join: int = 4) -> dict:
    pick = np.random.default_rng(seed).choice(len(texts), size=rows, p=lengths / lengths.sum())
    steps, runs, got, queries = {}, {}, {}, {}  # runs: name -> a round's ms
    for form, engine in built.items():
        feed, candidates = sg.step_feed(engine, [texts[i] for i in pick], beam=1)
        step = engine.runtime.step_session(False, candidates)
        full = {**feed, **candidates.feed}
        product = step.product(full["state"])
        steps[form] = lambda s=step, f=full, p=product: (s.keep(f["state"], p), s.run(OUTPUTS, f))
        runs[f"{form} step"] = lambda s=steps[form]: timed(s)
        runs[f"{form} middle"] = lambda m=step.stages(full)["middle graph"]: timed(m)
        got[form], queries[form] = step.run(OUTPUTS, full), step.query
        if form == "compiled":
            new = np.resize(full["state"], (join, full["state"].shape[1]))  # a join's first states
    for form, query in queries.items():  # each after the compiled step, where ONNX Runtime's copy is cold
        runs[f"{form} join product"] = lambda q=query: after(steps["compiled"], q, new)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (runs if r % 2 == 0 else list(runs)[::-1]):  # taking turns, the order alternating
            ms[name].append(runs[name]())
    a, b = got["graph"], got["compiled"]
    return {"seed": seed, **{f"{name} ms": statistics.median(v) for name, v in ms.items()},
            "same_best": float(np.mean(a[1][:, 0] == b[1][:, 0])),
            "max_best_log_prob_diff": float(np.abs(a[0][:, 0] - b[0][:, 0]).max()),
            "max_next_state_diff": float(np.abs(a[2] - b[2]).max())}


def measure(args: argparse.Namespace) -> dict:
    built = engines(args.repository, args.threads)
    texts = [json.loads(line)["src_raw"] for line in args.texts.read_text().splitlines() if line.strip()]
    probe = built["graph"]
    lengths = np.array([len(probe.prepare_text(t, DecodingOptions(), 0).source_ids) for t in texts], dtype=float)
    out: dict = {"rows": {}}
    for rows in args.rows:
        out["rows"][rows] = [draw(built, texts, lengths, rows, seed, args.rounds) for seed in range(args.draws)]
        print(json.dumps({"rows": rows, "draws": out["rows"][rows]}), flush=True)
    return out


def markdown(r: dict, args: argparse.Namespace) -> str:
    lines = ["# The compiled middle against the middle graph (busy batches, the shortlist per row)", "",
             f"`python loadtest/bench_middle.py {args.repository} --texts {args.texts} --rows "
             f"{' '.join(map(str, args.rows))} --draws {args.draws} --rounds {args.rounds} --threads {args.threads}`",
             "", f"{platform.machine()}, CPU flags: {', '.join(r['cpu_flags'])}; int8 form **{r['int8_form']}**; "
             f"{args.threads} thread(s); onnxruntime {ort.__version__}. Greedy rows drawn with chances proportional "
             "to source length; ms: medians of rounds of 20 runs, the four runs taking turns. Step: the whole step "
             "as a running batch's (attention kernel, middle, shortlist kernel; the product carried). Join product: "
             "the query graph on 4 new states right after the compiled step (ONNX Runtime's session, the kernel).", "",
             "| rows | draw | graph step ms | compiled step ms | step ratio | graph middle ms | compiled middle ms "
             "| middle ratio | same best word | max best log-prob diff | max next-state diff | graph join product ms "
             "| compiled join product ms | join ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, draws in r["rows"].items():
        for d in draws:
            lines.append(f"| {rows} | {d['seed']} | {d['graph step ms']:.3f} | {d['compiled step ms']:.3f} | "
                         f"{d['graph step ms'] / d['compiled step ms']:.2f}x | {d['graph middle ms']:.3f} | "
                         f"{d['compiled middle ms']:.3f} | {d['graph middle ms'] / d['compiled middle ms']:.2f}x | "
                         f"{d['same_best']:.1%} | {d['max_best_log_prob_diff']:.2g} | {d['max_next_state_diff']:.2g} | "
                         f"{d['graph join product ms']:.3f} | {d['compiled join product ms']:.3f} | "
                         f"{d['graph join product ms'] / d['compiled join product ms']:.2f}x |")
        step, middle, join = (statistics.median(d[f"graph {part} ms"] / d[f"compiled {part} ms"] for d in draws)
                              for part in ("step", "middle", "join product"))
        lines.append(f"| {rows} | median | | | **{step:.2f}x** | | | **{middle:.2f}x** | | | | | | **{join:.2f}x** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path)
    p.add_argument("--texts", type=Path, required=True, help="a corpus split (.jsonl with src_raw)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 44, 64, 112, 160])
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_middle")
    args = p.parse_args(argv)
    return sg.write_results(args, measure(args), markdown)


if __name__ == "__main__":
    raise SystemExit(main())
