"""Corpus v2: held-out catalogs never read, Debian packages in the corpus, cross-source dedup, the long
set. (Fetching and unpacking the Debian packages: ``test_debian_catalogs.py``.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polib
import pytest

from export.cli import corpus_main
from export.data import catalogs, corpus
from export.data.pairs import normalize, read_split

ROOT = Path(__file__).resolve().parents[1]
SHARED_HELDOUT = ROOT.parent / "shared" / "heldout-exclude.txt"
V2_MANIFEST = ROOT / "models" / "en-fr" / "corpus-v2-manifest.json"
QUIET = {"log": lambda *_: None}


def _save(path: Path, entries: list[tuple[str, str]]) -> None:
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8",
                   "Plural-Forms": "nplurals=2; plural=(n > 1);", "Language": "fr"}
    po.extend(polib.POEntry(msgid=s, msgstr=t) for s, t in entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".mo":
        po.save_as_mofile(str(path))
    else:
        po.save(str(path))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _splits(out: Path) -> dict[str, list[dict]]:
    return {s: _read(out / f"{s}.jsonl") for s in ("train", "valid", "test", "long")}


def _debian_dir(root: Path, package: str, version: str, license: str) -> Path:
    """A package directory as export/data/debian_catalogs.py leaves it."""
    pkg = root / package
    pkg.mkdir(parents=True)
    (pkg / catalogs.DEBIAN_MARKER).write_text(json.dumps(
        {"package": package, "version": version, "source": package, "license": license,
         "license_file": f"{package}/usr/share/doc/{package}/copyright"}))
    return pkg / "usr" / "share" / "locale" / "fr" / "LC_MESSAGES"


# ---------------------------------------------------------------- held out for evaluation


def test_heldout_list_is_the_shared_one_and_in_default_exclude() -> None:
    if SHARED_HELDOUT.is_file():
        assert catalogs.HELDOUT_FILE.read_text() == SHARED_HELDOUT.read_text()
    held = catalogs.HELDOUT
    for domain in ("util-linux", "aptitude", "grub", "mc", "lynx", "gawk", "sudo", "sudoers", "nano", "kbd",
                   "cpio", "dialog"):
        assert domain in held.domains
        assert domain in catalogs.DEFAULT_EXCLUDE
    for package in ("util-linux-locales", "aptitude-common", "grub-common", "mc-data", "lynx-common",
                    "sudo-ldap", "libdialog"):
        assert held.has_package(package)
    assert set(catalogs.DEFAULT_EXCLUDE) == set(catalogs.NOT_MESSAGES) | set(held.domains)


HELD_SENTENCES = {"util-linux": ("Mount the filesystem now", "Monter le système de fichiers maintenant"),
                  "sudoers": ("Edit the sudoers file safely", "Modifier le fichier sudoers sans risque"),
                  "grub": ("Boot the selected entry", "Démarrer l'entrée sélectionnée")}


@pytest.fixture()
def mixed_catalogs(tmp_path: Path) -> Path:
    """Allowed and held-out catalogs side by side, system-style and Debian-style."""
    root = tmp_path / "cat"
    lc = root / "locale" / "fr" / "LC_MESSAGES"
    _save(lc / "app.po", [("Open the file", "Ouvrir le fichier"), ("Close the window", "Fermer la fenêtre")])
    for domain, pair in HELD_SENTENCES.items():
        _save(lc / f"{domain}{'.mo' if domain == 'util-linux' else '.po'}", [pair])
    ok = _debian_dir(root / "debian", "coreutils", "9.1-1", "GPL-3+")
    _save(ok / "coreutils.mo", [("Remove the directory", "Supprimer le répertoire")])
    held = _debian_dir(root / "debian", "mc-data", "3:4.8.29-2", "GPL-3+")  # a held-out package ...
    _save(held / "mc-extra.mo", [("Show hidden files in panels", "Afficher les fichiers cachés")])  # ... any domain
    return root


@pytest.mark.parametrize("exclude", [catalogs.DEFAULT_EXCLUDE, ()])
def test_heldout_catalogs_never_reach_the_corpus(mixed_catalogs: Path, tmp_path: Path, exclude) -> None:
    out = tmp_path / "out"
    manifest = corpus.build([mixed_catalogs], out, exclude=exclude, **QUIET)
    stems = {Path(s["path"]).stem for s in manifest["sources"]}
    assert stems == {"app", "coreutils"}
    assert manifest["heldout"]["catalogs_skipped"] == 4
    assert manifest["heldout"]["list"] == "export/data/heldout-exclude.txt"
    text = (out / "manifest.json").read_text()
    for name in (*catalogs.HELDOUT.domains, *catalogs.HELDOUT.packages):
        assert f"/{name}." not in text and f'"{name}' not in text
    sources = {p["src_raw"] for pairs in _splits(out).values() for p in pairs}
    assert "Remove the directory" in sources and "Open the file" in sources
    held = {s for s, _ in HELD_SENTENCES.values()} | {"Show hidden files in panels"}
    assert not sources & held


def test_cli_exclude_cannot_bring_heldout_back(mixed_catalogs: Path, tmp_path: Path) -> None:
    assert corpus_main(["--catalogs", str(mixed_catalogs), "--exclude", "--output", str(tmp_path / "o")]) == 0
    sources = {p["src_raw"] for pairs in _splits(tmp_path / "o").values() for p in pairs}
    assert "Mount the filesystem now" not in sources and "Show hidden files in panels" not in sources


def test_debian_package_and_licence_in_manifest(mixed_catalogs: Path, tmp_path: Path) -> None:
    manifest = corpus.build([mixed_catalogs], tmp_path / "out", **QUIET)
    deb = next(s for s in manifest["sources"] if Path(s["path"]).stem == "coreutils")
    assert deb["package"] == "coreutils=9.1-1 (Debian)"
    assert deb["license"] == "GPL-3+"
    assert deb["license_file"] == "coreutils/usr/share/doc/coreutils/copyright"


# ---------------------------------------------------------------- dedup across sources


def test_same_source_in_several_catalogs_kept_once_in_one_split(tmp_path: Path) -> None:
    root = tmp_path / "cat"
    sentences = [f"Remove the selected item number {i}" for i in range(200)]
    _save(root / "a" / "fr" / "LC_MESSAGES" / "a.po", [(s, f"Supprimer l'élément {i}") for i, s in enumerate(sentences)])
    _save(root / "b" / "fr" / "LC_MESSAGES" / "b.mo", [(s, f"Supprimer l'élément {i}") for i, s in enumerate(sentences)])
    _save(root / "c" / "fr" / "LC_MESSAGES" / "c.po",  # a case variant, another translation
          [(s.lower(), f"Retirer l'élément {i}") for i, s in enumerate(sentences)]
          + [(sentences[0], "Enlever l'élément 0")])  # outvoted by a and b
    manifest = corpus.build([root], tmp_path / "out", **QUIET)
    assert manifest["pairs_before_dedup"] == 601
    where: dict[str, list[str]] = {}
    for split, pairs in _splits(tmp_path / "out").items():
        if split == "long":
            continue
        for p in pairs:
            where.setdefault(p["src_raw"], []).append(split)
            if p["src_raw"] == sentences[0]:
                assert p["tgt_raw"] == "Supprimer l'élément 0"
    assert len(where) == 400 and all(len(v) == 1 for v in where.values())  # each source once
    for s in sentences:
        assert where[s] == where[s.lower()]  # case variants share a split
        assert where[s][0] == corpus.split_of(normalize(s), corpus.CorpusConfig())


# ---------------------------------------------------------------- the long set

WORDS = ["the", "file", "system", "option", "value", "window", "server", "user", "message", "list", "remove", "install", "update", "configuration", "package", "network", "device", "display", "print"]


def _long_sentence(i: int, n: int) -> str:
    return f"Item {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n - 2)) + "."


def test_long_set_rule(tmp_path: Path) -> None:
    root = tmp_path / "cat" / "fr" / "LC_MESSAGES"
    entries = [(_long_sentence(i, 20 + i % 60), f"Élément {i} : " + "texte " * (20 + i % 60)) for i in range(3000)]
    entries += [(f"Short message {i}", f"Message court {i}") for i in range(500)]
    entries += [("word " * 150, "mot " * 150)]  # over long_max_chars: dropped everywhere
    _save(root / "help.po", entries)
    config = corpus.CorpusConfig()
    manifest = corpus.build([tmp_path / "cat"], tmp_path / "out", config=config, **QUIET)
    splits = _splits(tmp_path / "out")
    long = splits["long"]
    assert long == sorted(long, key=lambda p: p["src"])
    assert read_split(tmp_path / "out" / "long.jsonl")  # the Pair format
    trained = {p["src"].casefold() for s in ("train", "valid") for p in splits[s]}
    assert not trained & {p["src"].casefold() for p in long}
    test_srcs = {p["src"] for p in splits["test"]}
    for p in long:
        n = len(p["src_raw"].split())
        assert n >= 20 and len(p["src_raw"]) <= config.long_max_chars
        too_long = max(len(p["src_raw"]), len(p["tgt_raw"])) > config.max_chars
        assert too_long or corpus.split_of(p["src"], config) == "test"
        assert (p["src"] in test_srcs) == (not too_long)  # short enough: also in test, by the v1 rule
    over = [s for s, t in entries if corpus.make_pair(s, t, config) == "too_long"
            and corpus.long_candidate(s, t, config) is not None]
    assert 0 < len(over) < 3000 and manifest["long"]["over_max_chars"] == len(over)
    assert set(over) <= {p["src_raw"] for p in long}
    assert not any(p["src_raw"].startswith("word word") for p in long)
    assert manifest["long"]["pairs"] == len(long) == sum(manifest["long"]["buckets"].values())
    assert list(manifest["long"]["buckets"]) == ["20-29", "30-39", "40+"]
    assert manifest["long"]["buckets"]["40+"] == sum(1 for p in long if len(p["src_raw"].split()) >= 40)
    assert manifest["long"]["moved_from_train"] == 0  # long_per_mille = 0: only the test share
    assert min(manifest["long"]["buckets"].values()) > 0

    # a dedicated share takes long sources out of train, never out of valid or test
    wide = corpus.CorpusConfig(long_per_mille=300)
    more = corpus.build([tmp_path / "cat"], tmp_path / "wide", config=wide, **QUIET)
    wsplits = _splits(tmp_path / "wide")
    assert more["long"]["moved_from_train"] > 0
    assert more["long"]["pairs"] == manifest["long"]["pairs"] + more["long"]["moved_from_train"]
    assert [p["src"] for p in wsplits["valid"]] == [p["src"] for p in splits["valid"]]
    assert [p["src"] for p in wsplits["test"]] == [p["src"] for p in splits["test"]]
    assert len(wsplits["train"]) == len(splits["train"]) - more["long"]["moved_from_train"]
    wtrained = {p["src"].casefold() for s in ("train", "valid") for p in wsplits[s]}
    assert not wtrained & {p["src"].casefold() for p in wsplits["long"]}


def test_long_buckets() -> None:
    config = corpus.CorpusConfig()
    assert [corpus.long_bucket(n, config) for n in (20, 29, 30, 39, 40, 200)] == \
        ["20-29", "20-29", "30-39", "30-39", "40+", "40+"]


# ---------------------------------------------------------------- the committed v2 manifest


@pytest.mark.skipif(not V2_MANIFEST.is_file(), reason="no committed corpus v2 manifest")
def test_committed_v2_manifest_has_no_heldout_catalog() -> None:
    manifest = json.loads(V2_MANIFEST.read_text())
    held = catalogs.HELDOUT
    for source in manifest["sources"]:
        assert not held.has_domain(Path(source["path"]).stem), source["path"]
        name = source["package"].split(" ")[0].split("==")[0].split("=")[0]
        assert not held.has_package(name), source["package"]
        assert not any(f"/{p}/" in source["path"] for p in held.packages), source["path"]
    # where the list was when the corpus was last built (for en-fr/4, after export/ was grouped by stage),
    # and the same list today
    assert manifest["heldout"]["list"] == "export/data/heldout-exclude.txt"
    listed = Path(__file__).resolve().parents[1] / manifest["heldout"]["list"]
    assert hashlib.sha256(listed.read_bytes()).hexdigest() == manifest["heldout"]["sha256"]
    assert min(manifest["long"]["buckets"].values()) >= 50
    assert manifest["splits"]["train"] >= 2 * 57065  # v1: 57,065 train pairs
