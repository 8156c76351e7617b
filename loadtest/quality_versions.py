"""Two versions of a model side by side, through the serving engine, on the sentences neither trained on.

    python loadtest/quality_versions.py NEW=models/en-fr/4 OLD=<repository> --corpus build/corpus-v2 \
        --exclude-train build/corpus-v2/train.jsonl [--splits test long] [--beams 1 5]

``nmt compare`` does this for PyTorch checkpoints; this script needs only model repositories
(a retired version's graphs, from git history, when its checkpoint is gone). Each repository is
decoded by ``service.decoding.engine.Engine`` (int8, the served graphs, the whole vocabulary) on
every pair of ``<corpus>/<split>.jsonl`` whose source is not a training source
(``--exclude-train``, compared as ``nmt compare`` compares them: ``export.evaluate.evaluate.letters``),
greedy and beam N, and scored like ``nmt evaluate`` (sacreBLEU, chrF, placeholders restored).
Writes ``loadtest/results/quality_versions.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import sacrebleu

from quality_engine import translate_all  # this folder's script: the same decoding loop
from export.evaluate.evaluate import letters
from service.decoding.engine import Engine
from service.decoding.int8_form import reported_flags
from service.options import DecodingOptions

ROOT = Path(__file__).resolve().parents[1]


def held_out(corpus: Path, split: str, excluded: set[str], limit: int | None) -> list[dict]:
    pairs = [json.loads(line) for line in (corpus / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    return [p for p in pairs if letters(p["src"]) not in excluded][:limit]


def measure(systems: dict[str, Path], corpus: Path, splits: list[str], beams: list[int], *,
            excluded: set[str], threads: int, limit: int | None = None) -> list[dict]:
    engines = {name: Engine(repo, precision="int8", intra_op_threads=threads) for name, repo in systems.items()}
    rows = []
    for split in splits:
        pairs = held_out(corpus, split, excluded, limit)
        sources, refs = [p["src_raw"] for p in pairs], [p["tgt_raw"] for p in pairs]
        for beam in beams:
            for name, engine in engines.items():
                hyps, seconds = translate_all(engine, sources, DecodingOptions(beam_size=beam))
                rows.append({"system": name, "split": split, "beam_size": beam, "sentences": len(refs),
                             "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                             "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
                             "seconds": round(seconds, 1), "int8_form": engine.int8_form})
                print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    names = list(meta["systems"])
    lines = ["# Model versions side by side (serving engine, int8, sentences neither trained on)", "",
             f"Systems: {', '.join(f'{n} = `{p}`' for n, p in meta['systems'].items())}; corpus `{meta['corpus']}`, "
             f"training sources left out: {', '.join(f'`{t}`' for t in meta['exclude_train']) or 'none'}. "
             f"{meta['machine']}, CPU flags {', '.join(meta['flags']) or 'none'}.", "",
             "| split (sentences) | beam | " + " | ".join(f"{n} BLEU / chrF" for n in names)
             + f" | {names[0]} − {names[-1]} BLEU |", "|---|---:|" + "---|" * (len(names) + 1)]
    keyed = {(r["split"], r["beam_size"], r["system"]): r for r in rows}
    for split, beam in dict.fromkeys((r["split"], r["beam_size"]) for r in rows):
        cells = [keyed[split, beam, n] for n in names]
        lines.append(f"| {split} ({cells[0]['sentences']}) | {beam} | "
                     + " | ".join(f"{c['bleu']} / {c['chrf']}" for c in cells)
                     + f" | {cells[0]['bleu'] - cells[-1]['bleu']:+.2f} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("systems", nargs="+", help="NAME=REPOSITORY, the new one first")
    p.add_argument("--corpus", type=Path, required=True, help="corpus directory with <split>.jsonl")
    p.add_argument("--exclude-train", type=Path, action="append", default=[])
    p.add_argument("--splits", nargs="+", default=["test", "long"])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-sentences", type=int, help="the first N held-out pairs of each split (a smoke run)")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "quality_versions")
    args = p.parse_args(argv)
    systems = dict(s.split("=", 1) for s in args.systems)
    if len(systems) < 2:
        p.error("name at least two systems, NAME=REPOSITORY each")
    excluded = {letters(json.loads(line)["src"]) for t in args.exclude_train
                for line in t.read_text().splitlines() if line.strip()}
    rows = measure({n: Path(r) for n, r in systems.items()}, args.corpus, args.splits, args.beams,
                   excluded=excluded, threads=args.threads, limit=args.max_sentences)
    meta = {"systems": systems, "corpus": str(args.corpus), "exclude_train": [str(t) for t in args.exclude_train],
            "machine": f"{platform.processor() or platform.machine()}", "flags": reported_flags(),
            "command": "python loadtest/quality_versions.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
