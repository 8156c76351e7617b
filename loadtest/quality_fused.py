"""Does the fused attention kernel cost BLEU? The serving engine with and without it, on two splits.

    python loadtest/quality_fused.py REPOSITORY CORPUS [--splits test long] [--beam 5] [--threads 2]

Decodes every source of ``CORPUS/<split>.jsonl`` with ``service.decoding.engine.Engine``
(int8, the served graphs, this CPU's int8 form) twice: the step's attention by ONNX Runtime's
operators (packed attention, the form before) and by the compiled kernel
(``service/decoding/fused.py``: its own tanh, sums in another order), greedy and beam ``--beam``,
and scores them like ``nmt evaluate`` (sacreBLEU, chrF). Also counts the translations that are
the same text (the JSON also keeps each run's seconds: not a speed figure, see ``bench_fused.py``). Writes ``loadtest/results/quality_fused.{md,json}`` with the CPU's flags.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from quality_engine import compare_engines, comparison_parser  # this folder's script: the same decoding loop
from service.decoding.engine import Engine
from service.decoding.int8_form import reported_flags

FORMS = {"graph": False, "fused": True}


def measure(repository: Path, corpus: Path, splits: list[str], beam: int, threads: int) -> list[dict]:
    engines = {form: Engine(repository, precision="int8", intra_op_threads=threads, fused_attention=on)
               for form, on in FORMS.items()}
    assert engines["fused"].runtime.attention_form == "fused", "the kernels did not load: nothing to compare"
    return compare_engines(engines, corpus, splits, beam, "attention", "identical")


def markdown(rows: list[dict], repository: Path, meta: dict, command: str) -> str:
    lines = [f"# Fused attention quality ({repository})", "", f"`{command}`", "",
             f"int8 engine ({meta['int8_form']}), {meta['machine']}, CPU flags {', '.join(meta['flags']) or 'none'}. "
             "graph: ONNX Runtime's operators (packed attention); fused: the compiled kernels (attention, output "
             "layer).", "",
             "| split | beam | BLEU graph | BLEU fused | chrF graph | chrF fused | same text |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(rows[::2], rows[1::2]):
        lines.append(f"| {a['split']} ({a['sentences']}) | {a['beam_size']} | {a['bleu']} | {b['bleu']} | "
                     f"{a['chrf']} | {b['chrf']} | {b['identical']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = comparison_parser(__doc__, Path("loadtest/results/quality_fused")).parse_args(argv)
    rows = measure(args.repository, args.corpus, args.splits, args.beam, args.threads)
    form = Engine(args.repository, precision="int8", intra_op_threads=1).int8_form
    meta = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "flags": reported_flags(),
            "int8_form": str(form)}
    command = (f"python loadtest/quality_fused.py {args.repository} {args.corpus} --splits {' '.join(args.splits)} "
               f"--beam {args.beam}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, args.repository, meta, command)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
