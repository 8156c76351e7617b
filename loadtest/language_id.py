"""Which language-identification library for LibreTranslate's ``source: auto``? Accuracy and time
on our own test splits, restricted to the languages a server would serve.

    python loadtest/language_id.py [--corpora build] [--per-language 1500] [--out loadtest/results]

Reads the English sources of ``corpus-v2/test.jsonl`` and the French, German and Spanish
targets of ``corpus-v2``, ``corpus-v2-en-de`` and ``corpus-v2-en-es`` (``make model PAIR=...``
builds them), the same sampled messages for every library, and scores each library installed:
``py3langid`` (what the server uses: ``service/text/language_id.py``) and, when installed
(``pip install lingua-language-detector``), lingua; restricted to {en, fr} (what the shipped
en-fr + fr-en pair needs) and to {en, fr, de, es}. Writes ``language_id.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from service.decoding.int8_form import reported_flags

SIDES = {"en": ("corpus-v2", "src_raw"), "fr": ("corpus-v2", "tgt_raw"), "de": ("corpus-v2-en-de", "tgt_raw"),
         "es": ("corpus-v2-en-es", "tgt_raw")}


def sample(corpora: Path, n: int) -> dict[str, list[str]]:
    out = {}
    for lang, (corpus, side) in SIDES.items():
        rows = [json.loads(line) for line in (corpora / corpus / "test.jsonl").open(encoding="utf-8")]
        random.Random(0).shuffle(rows)
        out[lang] = [r[side] for r in rows[:n]]
    return out


def detectors(languages: list[str]) -> dict:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier
    langid = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    langid.set_languages(languages)
    found = {"py3langid": lambda text: langid.classify(text)[0]}
    try:
        from lingua import Language, LanguageDetectorBuilder
    except ImportError:
        return found
    names = {"en": Language.ENGLISH, "fr": Language.FRENCH, "de": Language.GERMAN, "es": Language.SPANISH}
    lingua = LanguageDetectorBuilder.from_languages(*(names[c] for c in languages)).build()
    codes = {v: k for k, v in names.items()}
    found["lingua"] = lambda text: codes.get(lingua.detect_language_of(text))
    return found


def score(detect, data: dict[str, list[str]], languages: list[str]) -> dict:
    right = total = short = short_right = 0
    per = {}
    started = time.perf_counter()
    for lang in languages:
        hits = [detect(text) == lang for text in data[lang]]
        per[lang] = round(100 * sum(hits) / len(hits), 1)
        right, total = right + sum(hits), total + len(hits)
        few = [h for h, text in zip(hits, data[lang]) if len(text.split()) <= 3]
        short, short_right = short + len(few), short_right + sum(few)
    seconds = time.perf_counter() - started
    return {"accuracy": round(100 * right / total, 1), "per_language": per,
            "accuracy_1_3_words": round(100 * short_right / max(short, 1), 1),
            "ms_per_text": round(1000 * seconds / total, 3), "texts": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpora", type=Path, default=Path("build"))
    p.add_argument("--per-language", type=int, default=1500)
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = p.parse_args()
    data = sample(args.corpora, args.per_language)
    rows = []
    for languages in (["en", "fr"], ["en", "fr", "de", "es"]):
        for name, detect in detectors(languages).items():
            rows.append({"library": name, "languages": languages, **score(detect, data, languages)})
            print(rows[-1])
    machine = {"cpu": platform.processor() or platform.machine(), "flags": reported_flags()}
    (args.out / "language_id.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    lines = ["# Language identification for `source: auto` (loadtest/language_id.py)", "",
             f"CPU flags: {machine['flags']}. {args.per_language} test-split messages per language, the same "
             "for every library. Times measured while a training ran niced in the background: compare them within one run only.", "",
             "| library | languages | accuracy % | per language % | 1-3 words % | ms / text |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {', '.join(r['languages'])} | {r['accuracy']} | "
              f"{', '.join(f'{k} {v}' for k, v in r['per_language'].items())} | {r['accuracy_1_3_words']} | "
              f"{r['ms_per_text']} |" for r in rows]
    (args.out / "language_id.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
