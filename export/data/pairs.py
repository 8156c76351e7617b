"""Sentence pairs: one catalog entry or parallel line made into a protected, filtered pair.

``make_pair`` normalizes a source and its translation, protects their
placeholders (``service.text.placeholders``) and drops what training must not
see, naming the reason; ``catalog_pairs`` and ``parallel_pairs`` read the
inputs; ``read_split`` reads a split file the corpus builder
(``export.data.corpus``) wrote.
"""

from __future__ import annotations

import csv
import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from export.data.catalogs import CorpusError, _load, _nplurals, entry_texts
from service.text import placeholders


@dataclass(frozen=True)
class CorpusConfig:
    """Filters and split of the corpus builder."""

    max_chars: int = 200  # longer sources or targets are dropped
    max_ratio: float = 3.0  # drop pairs whose character lengths differ more than this
    valid_per_mille: int = 15  # share of sources (by hash) in the validation split
    test_per_mille: int = 20  # share of sources (by hash) in the test split
    long_min_words: int = 20  # a source of this many words (whitespace-separated) or more is "long"
    long_max_chars: int = 600  # longest source or target of the long set
    long_per_mille: int = 0  # share (by hash, after the valid share) of long sources moved out of train
    long_buckets: tuple[int, ...] = (20, 30, 40)  # lower bounds, in words, of the long set's buckets


@dataclass(frozen=True)
class Pair:
    """One aligned pair, as written to the split files."""

    src: str  # source with placeholders replaced by reserved tokens
    tgt: str  # target, the same tokens in place of the same placeholders
    placeholders: list[str]  # placeholder k of the source, verbatim
    src_raw: str  # the source line as the catalog has it (whitespace normalized)
    tgt_raw: str  # the catalog's translation of it


@dataclass
class CatalogStats:
    """What one catalog contributed (for the corpus manifest)."""

    path: str
    package: str
    license: str
    entries: int = 0
    pairs: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    long_only: int = 0  # pairs over max_chars kept for the long set only
    license_file: str = ""


def split_lines(src: str, tgt: str) -> list[tuple[str, str]] | None:
    """Aligned lines of a multi-line entry, or None when the line counts differ."""
    s_lines, t_lines = src.strip("\n").split("\n"), tgt.strip("\n").split("\n")
    if len(s_lines) != len(t_lines):
        return None
    return list(zip(s_lines, t_lines))


def normalize(text: str) -> str:
    """NFC, one space for any run of whitespace, no edge spaces."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def make_pair(src: str, tgt: str, config: CorpusConfig, max_chars: int | None = None) -> Pair | str:
    """A protected pair, or the reason it is dropped (``max_chars``: default ``config.max_chars``)."""
    src, tgt = normalize(src), normalize(tgt)
    max_chars = config.max_chars if max_chars is None else max_chars
    if not src or not tgt:
        return "empty"
    if src == tgt:
        return "untranslated"
    if len(src) > max_chars or len(tgt) > max_chars:
        return "too_long"
    if max(len(src), len(tgt)) > config.max_ratio * min(len(src), len(tgt)) + 10:
        return "length_ratio"
    protected = placeholders.protect(src)
    if len(protected.placeholders) >= placeholders.MAX_PLACEHOLDERS:
        return "too_many_placeholders"
    tgt_protected = placeholders.protect_target(tgt, protected.placeholders)
    if tgt_protected is None:
        return "placeholder_mismatch"
    if not re.search(r"[^\W\d_]", placeholders.restore(protected.text, ())):
        return "no_words"  # only placeholders, digits or punctuation
    return Pair(src=protected.text, tgt=tgt_protected,
                placeholders=list(protected.placeholders), src_raw=src, tgt_raw=tgt)


def words(text: str) -> int:
    """Whitespace-separated words (placeholders count)."""
    return len(text.split())


def long_candidate(src: str, tgt: str, config: CorpusConfig) -> Pair | None:
    """A pair over ``max_chars`` that the long set can still take (long, up to ``long_max_chars``)."""
    made = make_pair(src, tgt, config, max_chars=config.long_max_chars)
    if isinstance(made, Pair) and words(made.src_raw) >= config.long_min_words:
        return made
    return None


def catalog_pairs(path: Path, config: CorpusConfig, stats: CatalogStats,
                  long_only: list[Pair] | None = None) -> list[Pair]:
    """Every usable pair of one catalog, dropped ones counted by reason in ``stats``.

    Pairs dropped as too long that the long set can take are appended to ``long_only``.
    """
    catalog = _load(path)
    nplurals = _nplurals(catalog)
    dropped: Counter[str] = Counter()
    pairs: list[Pair] = []
    for entry in catalog:
        if not entry.msgid:
            continue  # the header
        stats.entries += 1
        for src, tgt in entry_texts(entry, nplurals):
            lines = split_lines(src, tgt)
            if lines is None:
                dropped["line_count_mismatch"] += 1
                continue
            for s, t in lines:
                made = make_pair(s, t, config)
                if isinstance(made, Pair):
                    pairs.append(made)
                elif made != "empty" or s.strip() or t.strip():
                    dropped[made] += 1
                    if made == "too_long" and long_only is not None:
                        extra = long_candidate(s, t, config)
                        if extra is not None:
                            long_only.append(extra)
                            stats.long_only += 1
    stats.pairs = len(pairs)
    stats.dropped = dict(sorted(dropped.items()))
    return pairs


def parallel_pairs(path: Path, target: Path | None = None) -> list[tuple[str, str]]:
    """Plain parallel data: a TSV (source<TAB>target) or two line-aligned files."""
    if not path.is_file():
        raise CorpusError(f"{path}: parallel data file does not exist")
    if target is None:
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        bad = next((i for i, r in enumerate(rows, 1) if len(r) != 2), None)
        if bad is not None:
            raise CorpusError(f"{path}: line {bad} does not have exactly two tab-separated fields")
        return [(r[0], r[1]) for r in rows]
    if not target.is_file():
        raise CorpusError(f"{target}: parallel data file does not exist")
    src = path.read_text(encoding="utf-8").splitlines()
    tgt = target.read_text(encoding="utf-8").splitlines()
    if len(src) != len(tgt):
        raise CorpusError(f"{target}: {len(tgt)} lines, but {path} has {len(src)}")
    return list(zip(src, tgt))


def read_split(path: Path) -> list[Pair]:
    """Pairs of one split file."""
    if not path.is_file():
        raise CorpusError(f"{path}: split file does not exist")
    with path.open(encoding="utf-8") as f:
        return [Pair(**json.loads(line)) for line in f if line.strip()]
