"""Translation quality of the serving engine itself (fp32 vs int8), on a test split.

    python loadtest/quality_engine.py build/en-fr/3 build/corpus-v2/test.jsonl [--beam 5] [--record]

Decodes every source with ``service.decoding.engine.Engine`` (the path users hit) in
each precision and scores it like ``nmt evaluate`` (sacreBLEU and chrF,
detokenized, placeholders restored, against the catalog translations). Writes
``loadtest/results/quality_engine.md`` and ``.json``; with ``--record``, also the
repository's ``manifest.json`` field ``quality.engine`` (per precision and search:
BLEU, chrF, sentences), which ``ListModels`` reports and which decides the
server's default precision (``README``: int8 when within 0.3 BLEU of fp32).
The manifest file itself carries no checksum of its own, so its files stay valid.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sacrebleu

from service.decoding.engine import Engine
from service.models.manifest import MANIFEST, load_manifest, write_manifest
from service.options import DecodingOptions

BATCH = 32


def translate_all(engine: Engine, sources: list[str], options: DecodingOptions) -> tuple[list[str], float]:
    start = time.perf_counter()
    out: list[str] = []
    for b in range(0, len(sources), BATCH):
        out += [t.hypotheses[0].text for t in engine.translate(sources[b:b + BATCH], options)]
    return out, time.perf_counter() - start


def comparison_parser(description: str, out: Path) -> argparse.ArgumentParser:
    """The arguments of a script comparing two engines on corpus splits (``compare_engines``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path)
    p.add_argument("corpus", type=Path, help="corpus directory with <split>.jsonl")
    p.add_argument("--splits", nargs="+", default=["test", "long"])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=out)
    return p


def compare_engines(engines: dict, corpus: Path, splits: list[str], beam: int, label: str,
                    same_key: str) -> list[dict]:
    """Every split decoded greedy and with ``beam`` by each of two ``engines`` (name -> Engine), scored;
    one row each (``label``: the engine's name), the second engine's row with ``same_key``: the share
    of its translations identical to the first's."""
    rows = []
    for split in splits:
        pairs = [json.loads(line) for line in (corpus / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        sources, refs = [p["src_raw"] for p in pairs], [p["tgt_raw"] for p in pairs]
        for size in sorted({1, beam}):
            hyps = {}
            for name, engine in engines.items():
                hyps[name], seconds = translate_all(engine, sources, DecodingOptions(beam_size=size))
                rows.append({"split": split, "beam_size": size, label: name, "sentences": len(refs),
                             "bleu": round(sacrebleu.corpus_bleu(hyps[name], [refs]).score, 2),
                             "chrf": round(sacrebleu.corpus_chrf(hyps[name], [refs]).score, 2),
                             "seconds": round(seconds, 1)})
                print(rows[-1], flush=True)
            first, second = hyps.values()
            rows[-1][same_key] = round(sum(a == b for a, b in zip(first, second)) / len(refs), 4)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path)
    p.add_argument("test_split", type=Path)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    p.add_argument("--record", action="store_true", help="write the figures into the manifest's quality.engine")
    args = p.parse_args()
    pairs = [json.loads(line) for line in args.test_split.read_text().splitlines() if line.strip()]
    sources, refs = [p["src_raw"] for p in pairs], [p["tgt_raw"] for p in pairs]
    rows, outputs = [], {}
    precisions = [p for p in ("fp32", "int8") if p in load_manifest(args.repository, verify=False).graphs]
    for precision in precisions:
        engine = Engine(args.repository, precision=precision, intra_op_threads=args.threads)
        for beam in sorted({1, args.beam}):
            hyps, seconds = translate_all(engine, sources, DecodingOptions(beam_size=beam))
            outputs[(precision, beam)] = hyps
            rows.append({"precision": precision, "beam_size": beam, "sentences": len(hyps),
                         "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                         "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
                         "seconds": round(seconds, 1)})
            print(rows[-1], flush=True)
    for row in rows:
        fp32, hyps = outputs.get(("fp32", row["beam_size"])), outputs[(row["precision"], row["beam_size"])]
        row["identical_to_fp32"] = (None if fp32 is None  # a pruned repository has no fp32 graphs
                                    else round(sum(a == b for a, b in zip(fp32, hyps)) / len(sources), 4))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality_engine.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"# Engine quality ({args.repository}, {args.test_split.name}, {len(sources)} sentences)", "",
             "| precision | beam | BLEU | chrF | identical to fp32 | seconds |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['precision']} | {r['beam_size']} | {r['bleu']} | {r['chrf']} | "
              f"{'-' if r['identical_to_fp32'] is None else format(r['identical_to_fp32'], '.1%')} | "
              f"{r['seconds']} |" for r in rows]
    (args.out / "quality_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.record:
        record(args.repository, rows, args.test_split.name)


def record(repository: Path, rows: list[dict], split: str) -> None:
    """``quality.engine.<precision>.<greedy|beamN>`` = {bleu, chrf, sentences} in the manifest."""
    path = repository / MANIFEST
    manifest = json.loads(path.read_text())
    engine = manifest.setdefault("quality", {}).setdefault("engine", {})
    for r in rows:
        search = "greedy" if r["beam_size"] == 1 else f"beam{r['beam_size']}"
        engine.setdefault(r["precision"], {})[search] = {"bleu": r["bleu"], "chrf": r["chrf"],
                                                         "sentences": r["sentences"], "split": split}
    write_manifest(repository, manifest)


if __name__ == "__main__":
    main()
