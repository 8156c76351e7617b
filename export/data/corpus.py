"""English→French (or →German, →Spanish) parallel corpus from gettext catalogs (and plain parallel data).

Reads every catalog of the target language (``.po`` or ``.mo``; French by default) under the given directories,
turns each translated entry into aligned sentence pairs, protects their
placeholders, filters, deduplicates, and splits train/valid/test by a hash of
the normalized source, so a sentence stays in its split when the corpus grows.
Catalogs of the held-out domains and packages (export/data/heldout-exclude.txt) are
never read. Sources of 20 words and more whose hash falls in the test share, or
too long for training (over max_chars, up to long_max_chars), also form the
long-message set, which no train or valid source equals.
Output (deterministic: two runs give identical files):

    <out>/train.jsonl, valid.jsonl, test.jsonl   one pair per line
    <out>/long.jsonl                             long-message test set, same format
    <out>/manifest.json                          catalogs, packages, licenses, counts
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

from export.data.catalogs import (
    DEFAULT_EXCLUDE,
    LANGUAGES,  # noqa: F401  (the CLI reads corpus.LANGUAGES)
    HELDOUT,
    HELDOUT_FILE,
    CorpusError,
    _package_files,
    default_roots,
    describe,
    find_catalogs,
)
from export.data.pairs import (
    CatalogStats,
    CorpusConfig,
    Pair,
    catalog_pairs,
    long_candidate,
    make_pair,
    parallel_pairs,
    words,
)


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


def hash_bucket(src: str) -> int:
    """0..999 from a hash of the normalized (case-folded) source: the split rule."""
    return int(hashlib.sha256(src.casefold().encode()).hexdigest()[:8], 16) % 1000


def split_of(src: str, config: CorpusConfig) -> str:
    """train/valid/test, by a hash of the normalized (case-folded) source."""
    bucket = hash_bucket(src)
    if bucket < config.test_per_mille:
        return "test"
    if bucket < config.test_per_mille + config.valid_per_mille:
        return "valid"
    return "train"


def in_long_share(src: str, config: CorpusConfig) -> bool:
    """The hash share whose long sources are held out for the long set: the test
    share, plus ``long_per_mille`` right after the valid share (taken from train)."""
    bucket = hash_bucket(src)
    after_valid = config.test_per_mille + config.valid_per_mille
    return bucket < config.test_per_mille or after_valid <= bucket < after_valid + config.long_per_mille


def long_bucket(n_words: int, config: CorpusConfig) -> str:
    """The long set's length bucket of a source of ``n_words`` words: "20-29", ..., "40+"."""
    bounds = config.long_buckets
    for lo, hi in itertools.pairwise(bounds):
        if lo <= n_words < hi:
            return f"{lo}-{hi - 1}"
    return f"{bounds[-1]}+"


def split_pairs(pairs: list[Pair], long_only: list[Pair], config: CorpusConfig
                ) -> tuple[dict[str, list[Pair]], list[Pair], dict]:
    """Deduplicated train/valid/test splits, the long set and its counts.

    One pair per source across all catalogs (``deduplicate``), in the split of
    its hash, so one sentence never lands in two splits. A source of
    ``long_min_words`` words or more whose hash is in the long share
    (``in_long_share``) also goes to the long set: it stays in test when its
    hash is in the test share, and leaves train otherwise. Sources too long for
    the splits (``long_only``, over ``max_chars``) join the long set too, unless
    the splits already have that source. No long source, case-folded, equals a
    train or valid one.
    """
    splits: dict[str, list[Pair]] = {"train": [], "valid": [], "test": []}
    long: list[Pair] = []
    moved = 0
    kept = deduplicate(pairs)
    for p in kept:
        split = split_of(p.src, config)
        if words(p.src_raw) >= config.long_min_words and in_long_share(p.src, config):
            long.append(p)
            if split == "train":
                moved += 1
                continue
        splits[split].append(p)
    trained = {p.src.casefold() for s in ("train", "valid") for p in splits[s]}
    in_splits = {p.src for p in kept}
    extra = [p for p in deduplicate(long_only) if p.src not in in_splits and p.src.casefold() not in trained]
    long = sorted(long + extra, key=lambda p: p.src)
    leaked = [p.src_raw for p in long if p.src.casefold() in trained]
    if leaked:  # cannot happen with the hash rule; the long set's promise is checked, not assumed
        raise CorpusError(f"long set: {len(leaked)} sources also in train/valid, e.g. {leaked[0]!r}")
    buckets = Counter(long_bucket(words(p.src_raw), config) for p in long)
    labels = [long_bucket(b, config) for b in config.long_buckets]
    info = {
        "rule": (f"sources of {config.long_min_words}+ words whose hash is in the test share"
                 + (f" or the {config.long_per_mille} per mille after the valid share" if config.long_per_mille else "")
                 + f", and those over max_chars (up to {config.long_max_chars} characters); "
                 "none equals (case-folded) a train or valid source"),
        "pairs": len(long),
        "also_in_test": sum(1 for p in long if split_of(p.src, config) == "test" and p.src in in_splits),
        "moved_from_train": moved,
        "over_max_chars": len(extra),
        "buckets": {label: buckets.get(label, 0) for label in labels},
    }
    return splits, long, info


def _write_pairs(path: Path, pairs: list[Pair]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in pairs:
            f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")


def write_corpus(pairs: list[Pair], out: Path, sources: list[dict], config: CorpusConfig,
                 dropped: dict[str, int], long_only: list[Pair] = (), heldout: dict | None = None,
                 language: str = "fr") -> dict:
    """Write the split files, the long set and the manifest; returns the manifest."""
    if not pairs:
        raise CorpusError(f"{out}: the corpus is empty (no usable pairs in the inputs)")
    out.mkdir(parents=True, exist_ok=True)
    splits, long, long_info = split_pairs(pairs, list(long_only), config)
    for name, items in splits.items():
        _write_pairs(out / f"{name}.jsonl", items)
    _write_pairs(out / "long.jsonl", long)
    manifest = {
        "languages": {"source": "en", "target": language},
        "config": asdict(config),
        "splits": {k: len(v) for k, v in splits.items()},
        "long": long_info,
        "pairs_before_dedup": len(pairs),
        "dropped": dict(sorted(dropped.items())),
        "heldout": heldout or {},
        "sources": sources,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def build(roots: list[Path], out: Path, *, config: CorpusConfig = CorpusConfig(),
          parallel: list[tuple[Path, Path | None]] = (), exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
          log=print, language: str = "fr") -> dict:
    """The whole corpus, English to ``language``: catalogs under ``roots`` plus plain parallel files.

    Catalogs of a held-out domain or shipped by a held-out package
    (``export/data/heldout-exclude.txt``) are skipped whatever ``exclude`` says.
    """
    pairs: list[Pair] = []
    long_only: list[Pair] = []
    sources: list[dict] = []
    dropped: Counter[str] = Counter()
    skipped: list[Path] = []
    if roots:
        owners = _package_files(roots)
        for path in find_catalogs(roots, exclude=exclude, heldout_skipped=skipped, language=language):
            origin = describe(path, owners)
            if HELDOUT.has_package(origin.name):
                skipped.append(path)
                continue
            stats = CatalogStats(path=str(path), package=origin.package, license=origin.license,
                                 license_file=origin.license_file)
            pairs += catalog_pairs(path, config, stats, long_only)
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
                extra = long_candidate(s, t, config) if made == "too_long" else None
                if extra is not None:
                    long_only.append(extra)
                    stats.long_only += 1
        stats.dropped = dict(sorted(reasons.items()))
        dropped.update(reasons)
        sources.append(asdict(stats))
    heldout = {"list": f"export/data/{HELDOUT_FILE.name}",
               "sha256": hashlib.sha256(HELDOUT_FILE.read_bytes()).hexdigest(),
               "catalogs_skipped": len(skipped)}
    manifest = write_corpus(pairs, out, sources, config, dict(dropped), long_only, heldout, language)
    log(f"corpus: {len(sources)} sources, {len(pairs)} pairs, "
        f"{sum(manifest['splits'].values())} after dedup {manifest['splits']}, "
        f"long set {manifest['long']['pairs']} {manifest['long']['buckets']}, "
        f"{len(skipped)} held-out catalogs skipped -> {out}")
    return manifest


if __name__ == "__main__":  # pragma: no cover
    build([Path(a) for a in sys.argv[2:]] or default_roots(), Path(sys.argv[1]))
