"""English→French parallel corpus from gettext catalogs (and plain parallel data).

Reads every French catalog (``.po`` or ``.mo``) under the given directories,
turns each translated entry into aligned sentence pairs, protects their
placeholders, filters, deduplicates, and splits train/valid/test by a hash of
the normalized source, so a sentence stays in its split when the corpus grows.
Output (deterministic: two runs give identical files):

    <out>/train.jsonl, valid.jsonl, test.jsonl   one pair per line
    <out>/manifest.json                          catalogs, packages, licenses, counts
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import sys
import unicodedata
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path


from export.catalogs import (DEFAULT_EXCLUDE, CorpusError, LANGUAGE_DIRS, SYSTEM_LOCALE_DIR, _describe,  # noqa: F401
                             _load, _nplurals, _package_files, default_roots, entry_texts,
                             find_catalogs)
from service.text import placeholders

@dataclass(frozen=True)
class CorpusConfig:
    """Filters and split of the corpus builder."""

    max_chars: int = 200  # longer sources or targets are dropped
    max_ratio: float = 3.0  # drop pairs whose character lengths differ more than this
    valid_per_mille: int = 15  # share of sources (by hash) in the validation split
    test_per_mille: int = 20  # share of sources (by hash) in the test split


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


# ---------------------------------------------------------------- discovery


def split_lines(src: str, tgt: str) -> list[tuple[str, str]] | None:
    """Aligned lines of a multi-line entry, or None when the line counts differ."""
    s_lines, t_lines = src.strip("\n").split("\n"), tgt.strip("\n").split("\n")
    if len(s_lines) != len(t_lines):
        return None
    return list(zip(s_lines, t_lines))


def normalize(text: str) -> str:
    """NFC, one space for any run of whitespace, no edge spaces."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def make_pair(src: str, tgt: str, config: CorpusConfig) -> Pair | str:
    """A protected pair, or the reason it is dropped."""
    src, tgt = normalize(src), normalize(tgt)
    if not src or not tgt:
        return "empty"
    if src == tgt:
        return "untranslated"
    if len(src) > config.max_chars or len(tgt) > config.max_chars:
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


def catalog_pairs(path: Path, config: CorpusConfig, stats: CatalogStats) -> list[Pair]:
    """Every usable pair of one catalog, dropped ones counted by reason in ``stats``."""
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


# ---------------------------------------------------------------- dedup and split


def deduplicate(pairs: list[Pair]) -> list[Pair]:
    """One pair per source: its most frequent translation (ties: the smallest)."""
    by_src: dict[str, Counter[str]] = defaultdict(Counter)
    first: dict[tuple[str, str], Pair] = {}
    for p in pairs:
        by_src[p.src][p.tgt] += 1
        first.setdefault((p.src, p.tgt), p)
    out = []
    for src in sorted(by_src):
        tgt = min(by_src[src].items(), key=lambda kv: (-kv[1], kv[0]))[0]
        out.append(first[(src, tgt)])
    return out


def split_of(src: str, config: CorpusConfig) -> str:
    """train/valid/test, by a hash of the normalized (case-folded) source."""
    bucket = int(hashlib.sha256(src.casefold().encode()).hexdigest()[:8], 16) % 1000
    if bucket < config.test_per_mille:
        return "test"
    if bucket < config.test_per_mille + config.valid_per_mille:
        return "valid"
    return "train"


def write_corpus(pairs: list[Pair], out: Path, sources: list[dict], config: CorpusConfig,
                 dropped: dict[str, int]) -> dict:
    """Write the split files and the manifest; returns the manifest."""
    if not pairs:
        raise CorpusError(f"{out}: the corpus is empty (no usable pairs in the inputs)")
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[Pair]] = {"train": [], "valid": [], "test": []}
    for p in deduplicate(pairs):
        splits[split_of(p.src, config)].append(p)
    for name, items in splits.items():
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for p in items:
                f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    manifest = {
        "languages": {"source": "en", "target": "fr"},
        "config": asdict(config),
        "splits": {k: len(v) for k, v in splits.items()},
        "pairs_before_dedup": len(pairs),
        "dropped": dict(sorted(dropped.items())),
        "sources": sources,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def build(roots: list[Path], out: Path, *, config: CorpusConfig = CorpusConfig(),
          parallel: list[tuple[Path, Path | None]] = (), exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
          log=print) -> dict:
    """The whole corpus: catalogs under ``roots`` plus plain parallel files."""
    pairs: list[Pair] = []
    sources: list[dict] = []
    dropped: Counter[str] = Counter()
    if roots:
        owners = _package_files(roots)
        for path in find_catalogs(roots, exclude=exclude):
            package, lic = _describe(path, owners)
            stats = CatalogStats(path=str(path), package=package, license=lic)
            pairs += catalog_pairs(path, config, stats)
            dropped.update(stats.dropped)
            sources.append(asdict(stats))
    for src_path, tgt_path in parallel:
        stats = CatalogStats(path=str(src_path) + (f" + {tgt_path}" if tgt_path else ""),
                             package="parallel data", license="unknown")
        reasons: Counter[str] = Counter()
        for s, t in parallel_pairs(src_path, tgt_path):
            stats.entries += 1
            made = make_pair(s, t, config)
            if isinstance(made, Pair):
                pairs.append(made)
                stats.pairs += 1
            else:
                reasons[made] += 1
        stats.dropped = dict(sorted(reasons.items()))
        dropped.update(reasons)
        sources.append(asdict(stats))
    manifest = write_corpus(pairs, out, sources, config, dict(dropped))
    log(f"corpus: {len(sources)} sources, {len(pairs)} pairs, "
        f"{sum(manifest['splits'].values())} after dedup {manifest['splits']} -> {out}")
    return manifest


def read_split(path: Path) -> list[Pair]:
    """Pairs of one split file."""
    if not path.is_file():
        raise CorpusError(f"{path}: split file does not exist")
    with path.open(encoding="utf-8") as f:
        return [Pair(**json.loads(line)) for line in f if line.strip()]


if __name__ == "__main__":  # pragma: no cover
    build([Path(a) for a in sys.argv[2:]] or default_roots(), Path(sys.argv[1]))
