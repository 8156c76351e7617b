"""Does the lexical shortlist cost BLEU? The serving engine with and without it, on two splits.

    python loadtest/quality_shortlist.py REPOSITORY CORPUS [--splits test long] [--beam 5] [--record]

Decodes every source of ``CORPUS/<split>.jsonl`` with ``service.decoding.engine.Engine``
(int8, the served graphs) twice: ``--shortlist off`` (the whole vocabulary) and
``on`` (``service/decoding/shortlist.py``), greedy and beam ``--beam``, and scores
them like ``nmt evaluate`` (sacreBLEU, chrF, placeholders restored). Writes
``loadtest/results/quality_shortlist.{md,json}``; with ``--record`` also the
manifest's ``shortlist.bleu.<split>.<greedy|beamN>`` = {full, shortlist}, from which
``--shortlist auto`` decides (on when no figure loses more than 0.3 BLEU).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from quality_engine import compare_engines, comparison_parser  # this folder's script: the same decoding loop
from service.decoding.engine import Engine
from service.decoding.int8_form import reported_flags
from service.decoding.shortlist import ShortlistChoice
from service.models.manifest import MANIFEST, write_manifest

def measure(repository: Path, corpus: Path, splits: list[str], beam: int, threads: int) -> list[dict]:
    engines = {mode.value: Engine(repository, precision="int8", intra_op_threads=threads, shortlist=mode)
               for mode in (ShortlistChoice.OFF, ShortlistChoice.ON)}
    return compare_engines(engines, corpus, splits, beam, "shortlist", "identical_to_full")


def markdown(rows: list[dict], repository: Path, meta: dict) -> str:
    lines = [f"# Shortlist quality ({repository})", "",
             f"int8 engine, {meta['machine']}, CPU flags {', '.join(meta['flags']) or 'none'}; shortlist "
             f"{json.dumps(meta['shortlist'])}.", "",
             "| split | beam | BLEU full | BLEU shortlist | chrF full | chrF shortlist | identical | s full | s shortlist |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for off, on in zip(rows[::2], rows[1::2]):
        lines.append(f"| {off['split']} ({off['sentences']}) | {off['beam_size']} | {off['bleu']} | {on['bleu']} | "
                     f"{off['chrf']} | {on['chrf']} | {on['identical_to_full']:.1%} | {off['seconds']} | "
                     f"{on['seconds']} |")
    return "\n".join(lines) + "\n"


def record(repository: Path, rows: list[dict]) -> None:
    path = repository / MANIFEST
    manifest = json.loads(path.read_text())
    bleu = manifest["shortlist"].setdefault("bleu", {})
    for off, on in zip(rows[::2], rows[1::2]):
        search = "greedy" if off["beam_size"] == 1 else f"beam{off['beam_size']}"
        bleu.setdefault(off["split"], {})[search] = {"full": off["bleu"], "shortlist": on["bleu"],
                                                    "sentences": off["sentences"]}
    write_manifest(repository, manifest)


def main(argv: list[str] | None = None) -> int:
    p = comparison_parser(__doc__, Path("loadtest/results"))
    p.add_argument("--record", action="store_true", help="write the figures into the manifest's shortlist.bleu")
    args = p.parse_args(argv)
    rows = measure(args.repository, args.corpus, args.splits, args.beam, args.threads)
    shortlist = json.loads((args.repository / MANIFEST).read_text()).get("shortlist", {})
    meta = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "flags": reported_flags(),
            "shortlist": {k: v for k, v in shortlist.items() if k != "bleu"}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality_shortlist.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, args.repository, meta)
    (args.out / "quality_shortlist.md").write_text(text)
    print(text)
    if args.record:
        record(args.repository, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
