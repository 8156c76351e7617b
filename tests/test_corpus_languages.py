"""A corpus per pair: the target language's catalogs only (en-de, en-es), and fr-en turned around
from en-fr (same sentences per split, placeholders numbered in the new source's order, no evaluated
source that was trained on); every corpus manifest the repository keeps honours the held-out list."""

from __future__ import annotations

import json
from pathlib import Path

import polib
import pytest

from export.cli import corpus_main
from export.data import corpus
from export.data.catalogs import HELDOUT, CorpusError, find_catalogs
from export.data.pairs import read_split
from export.data.reverse import reverse

ROOT = Path(__file__).resolve().parents[1]


def _save(path: Path, entries: list[tuple[str, str]]) -> None:
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8", "Plural-Forms": "nplurals=2; plural=(n != 1);"}
    for msgid, msgstr in entries:
        po.append(polib.POEntry(msgid=msgid, msgstr=msgstr))
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(path))


@pytest.fixture()
def catalogs(tmp_path: Path) -> Path:
    root = tmp_path / "locale"
    english = [f"Delete {n} files from %s?" for n in ("the", "all", "some", "these", "those")]
    _save(root / "fr" / "LC_MESSAGES" / "app.po", [(e, e.replace("Delete", "Supprimer")) for e in english]
          + [("Open", "Ouvrir"), ("Open file", "Ouvrir"), ("Move %1$s to %2$s", "Déplacer %2$s depuis %1$s")])
    _save(root / "de_DE" / "LC_MESSAGES" / "app.po", [(e, e.replace("Delete", "Löschen")) for e in english])
    _save(root / "es" / "LC_MESSAGES" / "app.po", [("Open", "Abrir")])
    _save(root / "de" / "LC_MESSAGES" / f"{HELDOUT.domains[0]}.po", [("Held out", "Zurückgehalten")])
    return root


def test_each_language_reads_its_own_catalogs(catalogs: Path, tmp_path: Path) -> None:
    assert [p.parent.parent.name for p in find_catalogs([catalogs], language="de")] == ["de_DE"]
    manifest = corpus.build([catalogs], tmp_path / "de", language="de", log=lambda *_: None)
    assert manifest["languages"] == {"source": "en", "target": "de"}
    assert manifest["heldout"]["catalogs_skipped"] == 1
    targets = [p.tgt_raw for s in ("train", "valid", "test") for p in read_split(tmp_path / "de" / f"{s}.jsonl")]
    assert targets and all(t.startswith("Löschen") for t in targets)
    with pytest.raises(CorpusError, match="not one the corpus reads"):
        find_catalogs([catalogs], language="xx")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        corpus_main(["--language", "it", "--catalogs", str(catalogs), "--output", str(tmp_path / "it")])


def test_fr_en_turns_the_en_fr_corpus_around(catalogs: Path, tmp_path: Path) -> None:
    forward = tmp_path / "en-fr"
    corpus.build([catalogs], forward, language="fr", log=lambda *_: None)
    assert corpus_main(["--reverse", str(forward), "--output", str(tmp_path / "fr-en")]) == 0
    manifest = json.loads((tmp_path / "fr-en" / "manifest.json").read_text())
    assert manifest["languages"] == {"source": "fr", "target": "en"}
    trained = set()
    for split in ("train", "valid", "test"):
        there = {(p.tgt_raw, p.src_raw) for p in read_split(forward / f"{split}.jsonl")}
        back = read_split(tmp_path / "fr-en" / f"{split}.jsonl")
        assert {(p.src_raw, p.tgt_raw) for p in back} <= there  # the same sentences, turned around
        if split == "train":
            trained = {p.src.casefold() for p in back}
        else:
            assert not trained & {p.src.casefold() for p in back}
    moved = [p for s in ("train", "valid", "test") for p in read_split(tmp_path / "fr-en" / f"{s}.jsonl")
             if p.src_raw.startswith("Déplacer")]
    assert moved and moved[0].placeholders == ["%2$s", "%1$s"]  # numbered in the French source's order
    with pytest.raises(CorpusError, match="no corpus manifest"):
        reverse(tmp_path / "missing", tmp_path / "out")


@pytest.mark.parametrize("manifest", sorted(ROOT.glob("models/*/corpus-v2-manifest.json")), ids=str)
def test_no_shipped_corpus_read_a_held_out_catalog(manifest: Path) -> None:
    data = json.loads(manifest.read_text())
    for source in data["sources"]:
        domain = Path(source["path"].split(" + ")[0]).stem
        assert not HELDOUT.has_domain(domain), source["path"]
        package = source["package"].split("==")[0].split("=")[0].split(" ")[0]
        assert not HELDOUT.has_package(package), source["package"]
    assert data["languages"]["source"] != data["languages"]["target"]
