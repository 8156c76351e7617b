"""Build a model repository's lexical shortlist from its training corpus (``nmt shortlist``).

For each source piece, the target pieces that most often translate it: every
(source piece, target piece) pair of a training sentence pair is counted once
per pair, and a source piece keeps the ``per_source`` targets of highest Dice
coefficient ``2 c(s, t) / (c(s) + c(t))`` seen at least ``min_count`` times (the
pieces it co-occurs with *specifically*, not "de" and "la", which the frequent
list brings anyway). The ``frequent`` most frequent target pieces are given to
every text. Marian builds the same two lists from fast_align's lexical table
(``--shortlist``); co-occurrence needs no aligner.

Writes ``shortlist.npz`` (``offsets``, ``ids``, ``frequent``; read by
``service.decoding.shortlist.load_shortlist``) into the repository, and records it
in the manifest (``files`` with its sha256, and ``shortlist``: the parameters
and the coverage of the reference pieces on the validation split).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import sentencepiece as spm

from service.decoding.shortlist import always_ids
from service.models.manifest import MANIFEST, sha256_file, write_manifest

FILE = "shortlist.npz"


@dataclass(frozen=True)
class ShortlistConfig:
    per_source: int = 64  # targets kept per source piece
    frequent: int = 1000  # most frequent target pieces, given to every text
    min_count: int = 2  # pairs seen fewer times are noise


def _pieces(path: Path, source: spm.SentencePieceProcessor, target: spm.SentencePieceProcessor
            ) -> tuple[list[list[int]], list[list[int]]]:
    """Source and target piece ids of a corpus split (placeholders already protected)."""
    src, tgt = [], []
    with path.open(encoding="utf-8") as f:
        for line in f:
            pair = json.loads(line)
            src.append(source.encode(pair["src"]))
            tgt.append(target.encode(pair["tgt"]))
    return src, tgt


def cooccurrence(src: Iterable[list[int]], tgt: Iterable[list[int]], src_vocab: int, tgt_vocab: int
                 ) -> np.ndarray:
    """(src_vocab, tgt_vocab) int64: sentence pairs in which both pieces occur."""
    codes = []
    for s, t in zip(src, tgt):
        s_ids, t_ids = np.unique(np.asarray(s, dtype=np.int64)), np.unique(np.asarray(t, dtype=np.int64))
        codes.append((s_ids[:, None] * tgt_vocab + t_ids[None, :]).reshape(-1))
    flat = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
    return np.bincount(flat, minlength=src_vocab * tgt_vocab).reshape(src_vocab, tgt_vocab)


def build(counts: np.ndarray, target_counts: np.ndarray, config: ShortlistConfig
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets (src_vocab + 1,), ids, frequent) from the co-occurrence and target counts."""
    source_counts = counts.max(axis=1)  # sentences containing the piece (its pair with itself, roughly)
    offsets, ids = [0], []
    for s in range(counts.shape[0]):
        row = counts[s]
        seen = np.flatnonzero(row >= config.min_count)
        if len(seen):
            dice = 2 * row[seen] / (source_counts[s] + target_counts[seen])
            ids.append(seen[np.argsort(-dice, kind="stable")[: config.per_source]])
        offsets.append(offsets[-1] + (len(ids[-1]) if len(seen) else 0))
    frequent = np.argsort(-target_counts, kind="stable")[: config.frequent]
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    small = counts.shape[1] <= np.iinfo(np.uint16).max + 1  # half the file for vocabularies up to 65,536
    return (np.asarray(offsets, dtype=np.int64), flat.astype(np.uint16 if small else np.int32),
            np.sort(frequent).astype(np.int32))


def coverage(offsets: np.ndarray, ids: np.ndarray, frequent: np.ndarray, always: Iterable[int],
             src: list[list[int]], tgt: list[list[int]]) -> dict[str, float]:
    """Share of reference target pieces inside their text's candidates, and the mean candidates."""
    base = np.union1d(frequent, np.fromiter(always, dtype=np.int64))
    covered = total = 0
    sizes = []
    for s, t in zip(src, tgt):
        own = np.union1d(base, np.concatenate([ids[offsets[p]:offsets[p + 1]] for p in set(s)] or [base]))
        covered += int(np.isin(t, own).sum())
        total += len(t)
        sizes.append(len(own))
    return {"reference_pieces_covered": round(covered / max(total, 1), 5),
            "mean_candidates": round(float(np.mean(sizes)) if sizes else 0.0, 1)}


def write(repository: Path, corpus: Path, config: ShortlistConfig = ShortlistConfig()) -> dict:
    """Build from ``corpus``/train.jsonl, measure on valid.jsonl, write into ``repository``."""
    manifest = json.loads((repository / MANIFEST).read_text())
    tokenizers = manifest["tokenizers"]
    source = spm.SentencePieceProcessor(model_file=str(repository / tokenizers["source"]))
    target = spm.SentencePieceProcessor(model_file=str(repository / tokenizers["target"]))
    src, tgt = _pieces(corpus / "train.jsonl", source, target)
    counts = cooccurrence(src, tgt, source.get_piece_size(), target.get_piece_size())
    target_counts = np.bincount(np.concatenate([np.asarray(t, dtype=np.int64) for t in tgt]),
                                minlength=target.get_piece_size())
    offsets, ids, frequent = build(counts, target_counts, config)
    out = repository / FILE
    with out.open("wb") as f:  # np.savez_compressed would store a timestamp: not reproducible
        np.savez(f, offsets=offsets, ids=ids, frequent=frequent)
    valid_src, valid_tgt = _pieces(corpus / "valid.jsonl", source, target)
    measured = coverage(offsets, ids, frequent, always_ids(target), valid_src, valid_tgt)
    manifest["files"][FILE] = sha256_file(out)
    manifest["shortlist"] = {"file": FILE, **asdict(config), "valid": measured}
    write_manifest(repository, manifest)
    return manifest["shortlist"]


def main(argv: list[str]) -> int:
    """``nmt shortlist REPOSITORY --corpus DIR``."""
    import argparse

    p = argparse.ArgumentParser(prog="nmt shortlist", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path, help="model repository (its manifest and tokenizers)")
    p.add_argument("--corpus", type=Path, required=True, help="corpus directory: train.jsonl, valid.jsonl")
    p.add_argument("--per-source", type=int, default=ShortlistConfig.per_source)
    p.add_argument("--frequent", type=int, default=ShortlistConfig.frequent)
    p.add_argument("--min-count", type=int, default=ShortlistConfig.min_count)
    args = p.parse_args(argv)
    for name in ("per_source", "frequent", "min_count"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for path in (args.repository / MANIFEST, args.corpus / "train.jsonl", args.corpus / "valid.jsonl"):
        if not path.is_file():
            p.error(f"{path}: no such file")
    record = write(args.repository, args.corpus, ShortlistConfig(
        per_source=args.per_source, frequent=args.frequent, min_count=args.min_count))
    print(json.dumps(record))
    return 0
