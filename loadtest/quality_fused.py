"""Does a fused kernel cost BLEU? The serving engine with and without it, on two splits.

    python loadtest/quality_fused.py REPOSITORY CORPUS [--kernel attention|encoder|middle] [--splits test long]
        [--beam 5] [--threads 2]

Decodes every source of ``CORPUS/<split>.jsonl`` with ``service.decoding.engine.Engine``
(int8, the served graphs, this CPU's int8 form) twice: the step's attention by ONNX Runtime's
operators (packed attention, the form before) and by the compiled kernel
(``service/decoding/fused.py``: its own tanh, sums in another order), greedy and beam ``--beam``,
and scores them like ``nmt evaluate`` (sacreBLEU, chrF). ``--kernel encoder``: the encoder's GRU
by ONNX Runtime (fp32) and by the compiled kernel (``service/decoding/fused_encoder.py``: int8
recurrence), the step fused in both. ``--kernel middle``: the served defaults with the step's middle
by ONNX Runtime and by ``middle.c`` (``service/decoding/fused_middle.py``). Also counts the translations that are
the same text (the JSON also keeps each run's seconds: not a speed figure, see ``bench_fused.py``). Writes ``loadtest/results/quality_fused[_encoder|_middle].{md,json}`` with the CPU's flags.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from quality_engine import compare_engines, comparison_parser  # this folder's script: the same decoding loop
from step_graphs import graph_middle  # and its helpers
from service.decoding.engine import Engine
from service.decoding.int8_form import reported_flags

FORMS = {"graph": False, "fused": True}


def measure(repository: Path, corpus: Path, splits: list[str], beam: int, threads: int, kernel: str) -> list[dict]:
    if kernel == "middle":  # the served defaults (the shortlist per row), with and without the compiled middle
        with graph_middle():
            graph = Engine(repository, precision="int8", intra_op_threads=threads)
        engines = {"graph": graph, "fused": Engine(repository, precision="int8", intra_op_threads=threads)}
        assert engines["fused"].runtime.middle_form == "compiled", "the compiled middle did not load: nothing to compare"
        return compare_engines(engines, corpus, splits, beam, kernel, "identical")
    engines = {form: Engine(repository, precision="int8", intra_op_threads=threads,
                            **{"fused_attention": True, "fused_encoder": True, f"fused_{kernel}": on})
               for form, on in FORMS.items()}  # the other kernel fused in both
    forms = {"attention": engines["fused"].runtime.attention_form, "encoder": engines["fused"].runtime.encoder_form}
    assert forms[kernel] == "fused", "the kernels did not load: nothing to compare"
    return compare_engines(engines, corpus, splits, beam, kernel, "identical")


WHAT = {"attention": "graph: ONNX Runtime's operators (packed attention); fused: the compiled kernels (attention, "
                      "output layer); the encoder fused in both.",
        "encoder": "graph: ONNX Runtime's fp32 GRU; fused: the compiled kernel (int8 recurrence); the step fused in both.",
        "middle": "graph: the step's middle (GRU cell, deep output, products) by ONNX Runtime; fused: the compiled "
                  "kernel (middle.c); the served defaults otherwise (the shortlist per row)."}


def markdown(rows: list[dict], repository: Path, meta: dict, command: str, kernel: str) -> str:
    lines = [f"# Fused {kernel} quality ({repository})", "", f"`{command}`", "",
             f"int8 engine ({meta['int8_form']}), {meta['machine']}, CPU flags {', '.join(meta['flags']) or 'none'}. "
             + WHAT[kernel], "",
             "| split | beam | BLEU graph | BLEU fused | chrF graph | chrF fused | same text |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(rows[::2], rows[1::2]):
        lines.append(f"| {a['split']} ({a['sentences']}) | {a['beam_size']} | {a['bleu']} | {b['bleu']} | "
                     f"{a['chrf']} | {b['chrf']} | {b['identical']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = comparison_parser(__doc__, Path("loadtest/results/quality_fused"))
    parser.add_argument("--kernel", choices=["attention", "encoder", "middle"], default="attention")
    args = parser.parse_args(argv)
    if args.kernel != "attention" and args.out == parser.get_default("out"):
        args.out = args.out.with_name(f"quality_fused_{args.kernel}")
    rows = measure(args.repository, args.corpus, args.splits, args.beam, args.threads, args.kernel)
    form = Engine(args.repository, precision="int8", intra_op_threads=1).int8_form
    meta = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "flags": reported_flags(),
            "int8_form": str(form)}
    command = (f"python loadtest/quality_fused.py {args.repository} {args.corpus} --kernel {args.kernel} "
               f"--splits {' '.join(args.splits)} --beam {args.beam}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, args.repository, meta, command, args.kernel)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
