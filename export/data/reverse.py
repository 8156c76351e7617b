"""A corpus turned around: fr→en from the en→fr corpus (``nmt corpus --reverse``).

Every split keeps its sentences (so fr→en and en→fr are scored on the same
sentence pairs), but each pair is made again from the catalog's raw texts with
the French side as the source (``make_pair``): the placeholders are numbered in
the new source's order and the filters see the new direction. One pair per new
source within a split (``deduplicate``). French sources are not unique across
the original splits (two English messages may share a translation), so a
valid, test or long pair whose new source (case-folded) is also a train source
is dropped: no evaluated source was trained on, as in the forward corpus.

    nmt corpus --reverse build/corpus-v2 --output build/corpus-v2-fr-en
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from export.data.catalogs import CorpusError
from export.data.corpus import _write_pairs, deduplicate
from export.data.pairs import CorpusConfig, Pair, make_pair, read_split

SPLITS = ("train", "valid", "test", "long")


def _turn(pairs: list[Pair], config: CorpusConfig, max_chars: int, dropped: Counter) -> list[Pair]:
    out = []
    for p in pairs:
        made = make_pair(p.tgt_raw, p.src_raw, config, max_chars=max_chars)
        if isinstance(made, Pair):
            out.append(made)
        else:
            dropped[made] += 1
    return deduplicate(out)


def reverse(corpus: Path, out: Path, log=print) -> dict:
    """Write the reversed corpus of ``corpus`` into ``out``; returns its manifest."""
    path = corpus / "manifest.json"
    if not path.is_file():
        raise CorpusError(f"{path}: no corpus manifest (build the forward corpus first)")
    forward = json.loads(path.read_text(encoding="utf-8"))
    config = CorpusConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in forward["config"].items()})
    dropped: Counter[str] = Counter()
    splits = {name: _turn(read_split(corpus / f"{name}.jsonl"), config,
                          config.long_max_chars if name == "long" else config.max_chars, dropped)
              for name in SPLITS}
    trained = {p.src.casefold() for p in splits["train"]}
    seen_in_train = Counter()
    for name in ("valid", "test", "long"):
        kept = [p for p in splits[name] if p.src.casefold() not in trained]
        seen_in_train[name] = len(splits[name]) - len(kept)
        splits[name] = kept
    if not splits["train"]:
        raise CorpusError(f"{corpus}: the reversed corpus is empty")
    out.mkdir(parents=True, exist_ok=True)
    for name, items in splits.items():
        _write_pairs(out / f"{name}.jsonl", items)
    langs = forward.get("languages", {"source": "en", "target": "fr"})
    manifest = {
        "languages": {"source": langs["target"], "target": langs["source"]},
        "reversed_from": {"corpus": str(corpus), "languages": langs,
                          "manifest_sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
        "config": asdict(config),
        "splits": {k: len(splits[k]) for k in ("train", "valid", "test")},
        "long": {"pairs": len(splits["long"])},
        "dropped": dict(sorted(dropped.items())),
        "dropped_source_in_train": dict(seen_in_train),
        "heldout": forward.get("heldout", {}),
        "sources": forward.get("sources", []),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    log(f"corpus: reversed {corpus} -> {out}: {manifest['splits']}, long {len(splits['long'])}, "
        f"dropped {dict(dropped)}, evaluated sources also in train dropped {dict(seen_in_train)}")
    return manifest
