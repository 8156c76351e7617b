"""Corpus builder on tiny catalogs written by the test (.po and compiled .mo)."""

from __future__ import annotations

import json
from pathlib import Path

import polib
import pytest

from export.cli import corpus_main
from export.data import corpus


def _catalog(entries: list[polib.POEntry]) -> polib.POFile:
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8",
                   "Plural-Forms": "nplurals=2; plural=(n > 1);", "Language": "fr"}
    po.extend(entries)
    return po


ENTRIES = [
    polib.POEntry(msgid="Delete %s files?", msgstr="Supprimer %s fichiers ?"),
    polib.POEntry(msgid="Open", msgstr="Ouvrir", msgctxt="menu"),
    polib.POEntry(msgid="Open", msgstr="Ouvert", msgctxt="state"),
    polib.POEntry(msgid="%d file", msgid_plural="%d files", msgstr_plural={0: "%d fichier", 1: "%d fichiers"}),
    polib.POEntry(msgid="Usage: tool [OPTION]\nPrint the version\n",
                  msgstr="Utilisation : tool [OPTION]\nAfficher la version\n"),
    polib.POEntry(msgid="First line\nSecond line", msgstr="Une seule ligne"),  # counts differ: dropped
    polib.POEntry(msgid="Hello %(name)s", msgstr="Bonjour %(nom)s"),  # placeholder mismatch: dropped
    polib.POEntry(msgid="Untranslated", msgstr=""),
    polib.POEntry(msgid="OK", msgstr="OK"),  # copied: dropped
    polib.POEntry(msgid="Fuzzy one", msgstr="Flou", flags=["fuzzy"]),
    polib.POEntry(msgid="Click <b>{name}</b> now", msgstr="Cliquez <b>{name}</b> maintenant"),
    polib.POEntry(msgid="x" * 300, msgstr="y" * 300),  # too long: dropped
]


@pytest.fixture()
def catalogs(tmp_path: Path) -> Path:
    root = tmp_path / "locale"
    (root / "fr" / "LC_MESSAGES").mkdir(parents=True)
    (root / "de" / "LC_MESSAGES").mkdir(parents=True)
    po = _catalog(ENTRIES)
    po.save(str(root / "fr" / "LC_MESSAGES" / "app.po"))
    po.save_as_mofile(str(root / "fr" / "LC_MESSAGES" / "app.mo"))  # the .po wins over its .mo
    mo_only = _catalog([polib.POEntry(msgid="Save the file", msgstr="Enregistrer le fichier"),
                        polib.POEntry(msgid="%d item", msgid_plural="%d items",
                                      msgstr_plural={0: "%d élément", 1: "%d éléments"})])
    mo_only.save_as_mofile(str(root / "fr" / "LC_MESSAGES" / "other.mo"))
    _catalog([polib.POEntry(msgid="Open", msgstr="Öffnen")]).save(str(root / "de" / "LC_MESSAGES" / "app.po"))
    return root


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _all_pairs(out: Path) -> dict[str, dict]:
    return {p["src_raw"]: p for s in ("train", "valid", "test") for p in _read(out / f"{s}.jsonl")}


def test_extracts_entries_plurals_contexts_and_lines(catalogs: Path, tmp_path: Path) -> None:
    manifest = corpus.build([catalogs], tmp_path / "out", log=lambda *_: None)
    pairs = _all_pairs(tmp_path / "out")
    assert pairs["Delete %s files?"]["src"] == "Delete ｟0｠ files?"
    assert pairs["Delete %s files?"]["tgt"] == "Supprimer ｟0｠ fichiers ?"
    assert pairs["%d files"]["tgt_raw"] == "%d fichiers"  # plural form
    assert pairs["%d file"]["tgt_raw"] == "%d fichier"  # singular form
    assert pairs["%d items"]["tgt_raw"] == "%d éléments"  # plural read from a .mo
    assert pairs["Save the file"]["tgt_raw"] == "Enregistrer le fichier"
    assert pairs["Print the version"]["tgt_raw"] == "Afficher la version"  # multi-line split
    assert pairs["Open"]["tgt_raw"] in ("Ouvrir", "Ouvert")  # contexts: one pair per source
    assert pairs["Click <b>{name}</b> now"]["placeholders"] == ["<b>", "{name}", "</b>"]
    for dropped in ("First line", "Hello %(name)s", "Untranslated", "OK", "Fuzzy one", "x" * 300):
        assert dropped not in pairs
    assert manifest["dropped"]["placeholder_mismatch"] == 1
    assert manifest["dropped"]["line_count_mismatch"] == 1
    assert manifest["dropped"]["untranslated"] == 1
    assert manifest["dropped"]["too_long"] == 1
    assert [Path(s["path"]).name for s in manifest["sources"]] == ["app.po", "other.mo"]
    assert all("Öffnen" != p["tgt_raw"] for p in pairs.values())


def test_deterministic_and_split_stable_when_corpus_grows(catalogs: Path, tmp_path: Path) -> None:
    corpus.build([catalogs], tmp_path / "a", log=lambda *_: None)
    corpus.build([catalogs], tmp_path / "b", log=lambda *_: None)
    for name in ("train.jsonl", "valid.jsonl", "test.jsonl", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    tsv = tmp_path / "more.tsv"
    tsv.write_text("".join(f"message number {i}\tmessage numéro {i}\n" for i in range(300)))
    corpus.build([catalogs], tmp_path / "c", parallel=[(tsv, None)], log=lambda *_: None)
    before = {s: {p["src"] for p in _read(tmp_path / "a" / f"{s}.jsonl")} for s in ("train", "valid", "test")}
    after = {s: {p["src"] for p in _read(tmp_path / "c" / f"{s}.jsonl")} for s in ("train", "valid", "test")}
    for split in before:
        assert before[split] <= after[split]
    assert all(after[s] for s in after)  # 300 more sources reach every split


def test_plain_parallel_data(tmp_path: Path) -> None:
    src, tgt = tmp_path / "a.en", tmp_path / "a.fr"
    src.write_text("Open the file\nClose %s\n")
    tgt.write_text("Ouvrir le fichier\nFermer %s\n")
    corpus.build([], tmp_path / "out", parallel=[(src, tgt)], log=lambda *_: None)
    pairs = _all_pairs(tmp_path / "out")
    assert pairs["Close %s"]["tgt"] == "Fermer ｟0｠"
    tgt.write_text("Ouvrir le fichier\n")
    with pytest.raises(corpus.CorpusError, match="1 lines, but .* has 2"):
        corpus.parallel_pairs(src, tgt)


@pytest.mark.parametrize("setup, message", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: d, "no French .po/.mo catalogs found"),
])
def test_bad_catalog_directories(tmp_path: Path, capsys: pytest.CaptureFixture, setup, message: str) -> None:
    path = setup(tmp_path)
    assert corpus_main(["--catalogs", str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and str(path) in err


def test_corrupt_mo_and_empty_corpus(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lc = tmp_path / "fr" / "LC_MESSAGES"
    lc.mkdir(parents=True)
    (lc / "bad.mo").write_bytes(b"\x00not a catalog at all" * 4)
    assert corpus_main(["--catalogs", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.mo" in err and "cannot read catalog" in err
    (lc / "bad.mo").unlink()
    _catalog([polib.POEntry(msgid="OK", msgstr="OK")]).save(str(lc / "empty.po"))
    assert corpus_main(["--catalogs", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    assert "corpus is empty" in capsys.readouterr().err
