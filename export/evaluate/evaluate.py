"""Evaluation with the PyTorch reference decoders: sacreBLEU, chrF, BLEU by length, heatmaps.

Scores are measured as users see them: detokenized output with placeholders
restored, against the original catalog translations. BLEU is also given on
the sentences without placeholders (a restored ``%(name)s`` is several easy
tokens for BLEU and inflates it) and on placeholder-normalized text.

Writes ``<output>/results.json``, ``results.md``, ``<decoder>.txt`` outputs
and ``heatmap-<k>.png`` attention plots.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import sacrebleu
import torch

from export.data.pairs import Pair, read_split
from export.evaluate.heatmaps import heatmap
from export.train.checkpoint import load_checkpoint
from export.train.model import RNNSearch
from export.train.search import beam_search, greedy
from export.train.training import collate
from service.text import placeholders
from service.text.tokenizer import Tokenizer

LENGTH_BUCKETS = ((1, 5), (6, 10), (11, 15), (16, 20), (21, 30), (31, 1000))  # source words
HEATMAP_SENTENCES = (
    "Unknown error",  # adjective-noun inversion: erreur inconnue
    "Show hidden files",
    "Delete the selected %s files?",
    "Could not open the configuration file {path}",
)


@dataclass(frozen=True)
class Decoded:
    """One decoder's output on a split."""

    name: str  # "greedy", "beam5"
    texts: list[str]  # as users see them (placeholders restored)
    normalized: list[str]  # with reserved placeholder tokens, for the normalized BLEU
    seconds: float
    unknown: tuple[tuple[str, ...], ...] = ()  # per sentence, the source's runs with no vocabulary piece


def unknown_runs(tok: Tokenizer, source: str) -> tuple[str, ...]:
    """The runs of ``source`` the tokenizer protects because the vocabulary has no piece for them
    (emoji, rare symbols): its protected strings that are not placeholders."""
    return tuple(x for x in tok.encode(source).placeholders if placeholders.find(x) != [x])


def kept_runs(texts: list[str], unknown: tuple[tuple[str, ...], ...]) -> tuple[int, int]:
    """(runs in the sources, runs found as often in the translations)."""
    total = kept = 0
    for text, runs in zip(texts, unknown):
        for run in set(runs):
            total += runs.count(run)
            kept += min(runs.count(run), text.count(run))
    return total, kept


def decode(model: RNNSearch, tok: Tokenizer, sources: list[str], *, beam_size: int,
           batch_size: int = 64) -> Decoded:
    """Translate ``sources`` (raw messages) in length-sorted batches."""
    encoded = [tok.encode(s) for s in sources]
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i].ids))
    texts, normalized = [""] * len(sources), [""] * len(sources)
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        src, lengths, _, _ = collate([(encoded[i].ids, [tok.target.eos_id()]) for i in idx])
        if beam_size == 1:
            tokens = [h.tokens for h in greedy(model, src, lengths)]
        else:
            tokens = [hs[0].tokens for hs in beam_search(model, src, lengths, beam_size=beam_size)]
        for i, t in zip(idx, tokens):
            texts[i] = tok.decode(t, encoded[i].placeholders)
            normalized[i] = tok.target.decode(t)
    name = "greedy" if beam_size == 1 else f"beam{beam_size}"
    return Decoded(name, texts, normalized, time.perf_counter() - start,
                   unknown=tuple(unknown_runs(tok, s) for s in sources))


def letters(text: str) -> str:
    """A source reduced to its lower-case letters and spaces (for the near-duplicate check)."""
    return " ".join(re.sub(r"[^\w ]|[\d_]", " ", text.lower()).split())


def _bleu(decoded: Decoded, refs: list[str], idx: list[int]) -> float | None:
    if not idx:
        return None
    return round(sacrebleu.corpus_bleu([decoded.texts[i] for i in idx], [[refs[i] for i in idx]]).score, 2)


def scores(decoded: Decoded, pairs: list[Pair], train_letters: set[str]) -> dict:
    """``train_letters``: the train sources reduced by ``letters``; test sentences that
    match one differ from a training source only by case, digits, punctuation or
    placeholders, and are left out of ``bleu_unseen``."""
    refs = [p.tgt_raw for p in pairs]
    plain = [i for i, p in enumerate(pairs) if not p.placeholders]
    unseen = [i for i, p in enumerate(pairs) if letters(p.src) not in train_letters]
    by_length = {}
    for lo, hi in LENGTH_BUCKETS:
        idx = [i for i, p in enumerate(pairs) if lo <= len(p.src_raw.split()) <= hi]
        if idx:
            bleu = sacrebleu.corpus_bleu([decoded.texts[i] for i in idx], [[refs[i] for i in idx]])
            by_length[f"{lo}-{hi if hi < 1000 else ''}"] = {"sentences": len(idx), "bleu": round(bleu.score, 2)}
    kept = sum(sorted(p.placeholders) == sorted(_placeholders_in(t, p)) for t, p in zip(decoded.texts, pairs))
    runs, runs_kept = kept_runs(decoded.texts, decoded.unknown)
    return {
        "bleu": round(sacrebleu.corpus_bleu(decoded.texts, [refs]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(decoded.texts, [refs]).score, 2),
        "bleu_without_placeholders": _bleu(decoded, refs, plain),
        "sentences_without_placeholders": len(plain),
        "bleu_unseen": _bleu(decoded, refs, unseen),
        "sentences_unseen": len(unseen),
        "bleu_normalized": round(sacrebleu.corpus_bleu(decoded.normalized, [[p.tgt for p in pairs]]).score, 2),
        "placeholders_kept": round(kept / len(pairs), 4),
        "unknown_runs": runs,  # characters with no vocabulary piece, protected as placeholders are
        "unknown_kept": round(runs_kept / runs, 4) if runs else None,
        "bleu_by_source_words": by_length,
        "seconds": round(decoded.seconds, 1),
    }


def _share(kept: float | None, runs: int | None) -> str:
    """"98.00 % of 50" for the runs with no vocabulary piece kept; "none" when the split has none."""
    return f"{kept:.2%} of {runs}" if runs else "none"


def _placeholders_in(text: str, pair: Pair) -> list[str]:
    return placeholders.find(text) if pair.placeholders else []


def markdown(results: dict) -> str:
    lines = ["| decoder | BLEU | chrF | BLEU w/o placeholders | BLEU unseen | BLEU normalized "
             "| placeholders kept | unknown kept | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["decoders"].items():
        lines.append(f"| {name} | {r['bleu']} | {r['chrf']} | {r['bleu_without_placeholders']} | "
                     f"{r['bleu_unseen']} | {r['bleu_normalized']} | {r['placeholders_kept']:.2%} "
                     f"| {_share(r.get('unknown_kept'), r.get('unknown_runs'))} | {r['seconds']} |")
    lines += ["", "BLEU by source length (words):", "",
              "| words | sentences | " + " | ".join(results["decoders"]) + " |",
              "|---|---|" + "---|" * len(results["decoders"])]
    first = next(iter(results["decoders"].values()))
    for bucket, v in first["bleu_by_source_words"].items():
        row = [str(r["bleu_by_source_words"][bucket]["bleu"]) for r in results["decoders"].values()]
        lines.append(f"| {bucket} | {v['sentences']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def evaluate(checkpoint: Path, corpus_dir: Path, output: Path, *, split: str = "test", beam_size: int = 5,
             max_sentences: int | None = None, heatmaps: tuple[str, ...] = HEATMAP_SENTENCES,
             threads: int = 2, log=print) -> dict:
    torch.set_num_threads(threads)
    ckpt = load_checkpoint(checkpoint)
    model = ckpt.model()
    output.mkdir(parents=True, exist_ok=True)
    for name, data in ckpt.tokenizers.items():
        (output / name).write_bytes(data)
    tok = Tokenizer(output / "source.model", output / "target.model")
    pairs = read_split(corpus_dir / f"{split}.jsonl")[:max_sentences]
    train_file = corpus_dir / "train.jsonl"
    train_letters = {letters(p.src) for p in read_split(train_file)} if train_file.exists() else set()
    results = {"checkpoint": str(checkpoint), "split": split, "sentences": len(pairs),
               "parameters": model.num_parameters(), "model_config": ckpt.config.to_dict(),
               "train_state": ckpt.extra.get("train_state", {}), "decoders": {}, "heatmaps": []}
    for beam in sorted({1, beam_size}):
        decoded = decode(model, tok, [p.src_raw for p in pairs], beam_size=beam)
        (output / f"{decoded.name}.txt").write_text("\n".join(decoded.texts) + "\n")
        results["decoders"][decoded.name] = scores(decoded, pairs, train_letters)
        log(f"{decoded.name}: {results['decoders'][decoded.name]}")
    for k, sentence in enumerate(heatmaps):
        translation = heatmap(model, tok, sentence, output / f"heatmap-{k}.png")
        results["heatmaps"].append({"file": f"heatmap-{k}.png", "source": sentence, "translation": translation})
    (output / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    (output / "results.md").write_text(markdown(results))
    return results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nmt evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--corpus", type=Path, required=True, help="corpus directory (test.jsonl)")
    p.add_argument("--split", default="test", choices=("train", "valid", "test", "long"),
                   help="long: the long-message set that nmt corpus holds out (long.jsonl)")
    p.add_argument("--output", "-o", type=Path, required=True)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--max-sentences", type=int)
    p.add_argument("--heatmap", action="append", help="sentence to plot (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    results = evaluate(args.checkpoint, args.corpus, args.output, split=args.split, beam_size=args.beam,
                       max_sentences=args.max_sentences,
                       heatmaps=tuple(args.heatmap) if args.heatmap else HEATMAP_SENTENCES,
                       threads=args.threads)
    print(markdown(results))
    return 0
