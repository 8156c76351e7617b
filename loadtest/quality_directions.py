"""Both directions of a language pair on the same sentences: fr->en and en->fr, side by side.

    python loadtest/quality_directions.py models/fr-en/1 models/en-fr/3 build/corpus-v2-fr-en \
        [--splits test long] [--beam 5] [--examples 8]

fr-en's corpus is en-fr's turned around (``nmt corpus --reverse``; its test and long pairs
are en-fr's, less those whose French side is a French source in training), so each of its
pairs is scored in both directions, and neither model trained on the source it translates.
Each served engine (int8, as the server
runs it) translates its side of every pair (``forward``: ``src_raw`` -> ``tgt_raw``;
``backward``: ``tgt_raw`` -> ``src_raw``), scored as ``loadtest/quality_engine.py`` scores
(sacreBLEU and chrF against the catalog's text, placeholders restored). Writes
``loadtest/results/quality_directions.{md,json}`` with a few example pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sacrebleu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.quality_engine import translate_all  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402
from service.options import DecodingOptions  # noqa: E402


def score(engine: Engine, sources: list[str], references: list[str], beam: int) -> tuple[dict, list[str]]:
    hyps, seconds = translate_all(engine, sources, DecodingOptions(beam_size=beam))
    return {"bleu": round(sacrebleu.corpus_bleu(hyps, [references]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(hyps, [references]).score, 2),
            "sentences": len(sources), "seconds": round(seconds, 1)}, hyps


def direction_name(engine: Engine) -> str:
    languages = engine.manifest.raw.get("languages", {})
    return f"{languages.get('source', '?')}->{languages.get('target', '?')}"


def report(result: dict) -> str:
    f, b = result["forward"], result["backward"]
    lines = [f"# {f} and {b} on the same sentences (int8 engines, beam {result['beam']})", "",
             f"`{result['command']}`; CPU flags {', '.join(result['cpu_flags'])}. Each split's pairs are the "
             "same sentences in both directions (fr-en's corpus is en-fr's reversed).", "",
             f"| split | sentences | {f} BLEU / chrF | {b} BLEU / chrF |", "|---|---:|---:|---:|"]
    for split, row in result["splits"].items():
        lines.append(f"| {split} | {row['forward']['sentences']} | {row['forward']['bleu']:.2f} / "
                     f"{row['forward']['chrf']:.2f} | {row['backward']['bleu']:.2f} / {row['backward']['chrf']:.2f} |")
    lines += ["", "Examples (test split): the catalog's pair, then each model's translation.", "",
              f"| source ({f}) | target ({f}) | {f} | {b} |", "|---|---|---|---|"]
    cell = lambda t: t.replace("|", "\\|")  # noqa: E731
    lines += [f"| {cell(e['source'])} | {cell(e['target'])} | {cell(e['forward'])} | {cell(e['backward'])} |"
              for e in result["examples"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("forward", type=Path, help="the model of the corpus's direction (fr-en)")
    p.add_argument("backward", type=Path, help="the model of the reverse direction (en-fr)")
    p.add_argument("corpus", type=Path, help="the forward direction's corpus (test.jsonl, long.jsonl)")
    p.add_argument("--splits", nargs="+", default=["test", "long"])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "quality_directions")
    args = p.parse_args(argv)
    forward, backward = (Engine(path, precision="int8", intra_op_threads=2) for path in (args.forward, args.backward))
    result = {"forward": direction_name(forward), "backward": direction_name(backward), "beam": args.beam,
              "cpu_flags": reported_flags(), "splits": {}, "examples": [],
              "command": "python loadtest/quality_directions.py " + " ".join(argv or sys.argv[1:])}
    for split in args.splits:
        pairs = [json.loads(line) for line in (args.corpus / f"{split}.jsonl").read_text().splitlines() if line]
        src, tgt = [x["src_raw"] for x in pairs], [x["tgt_raw"] for x in pairs]
        there, there_hyps = score(forward, src, tgt, args.beam)
        back, back_hyps = score(backward, tgt, src, args.beam)
        result["splits"][split] = {"forward": there, "backward": back}
        if split == "test":
            step = max(1, len(pairs) // max(1, args.examples))
            result["examples"] = [{"source": src[i], "target": tgt[i], "forward": there_hyps[i], "backward": back_hyps[i]}
                                  for i in range(0, len(pairs), step)][: args.examples]
        print(split, result["splits"][split], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
