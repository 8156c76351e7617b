"""Debian packages' catalogs (``export.data.debian_catalogs``): pinned specs, licences from the
copyright files, unpacking only the catalogs of the corpus languages (fr, de, es), apt-get's errors in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from export.data import catalogs, corpus, debian_catalogs
from test_corpus_v2 import QUIET, _save


def test_debian_license_from_copyright(tmp_path: Path) -> None:
    dep5 = tmp_path / "dep5"
    dep5.write_text("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
                    "Files: *\nCopyright: 2020 Someone\nLicense: GPL-3+\n\n"
                    "Files: po/*\nCopyright: translators\nLicense: LGPL-2.1+\n\n"
                    "License: GPL-3+\n text\n")
    assert catalogs.debian_license(dep5) == "LGPL-2.1+"  # the stanza covering po/
    dep5.write_text(dep5.read_text().replace("po/*", "src/*"))
    assert catalogs.debian_license(dep5) == "GPL-3+"
    text = tmp_path / "old"
    text.write_text("This package is free software; you can redistribute it under the terms of the\n"
                    "GNU General Public License as published by the Free Software Foundation; either\n"
                    "version 2 of the License, or (at your option) any later version.\n")
    assert catalogs.debian_license(text) == "GPL-2+ (from copyright text)"
    text.write_text("Released under the terms of the GPL; see /usr/share/common-licenses/GPL-3.\n")
    assert catalogs.debian_license(text) == "GPL-3 (from copyright text)"
    assert catalogs.debian_license(tmp_path / "missing") == "unknown"


def test_debian_specs_must_be_pinned_and_not_heldout() -> None:
    assert debian_catalogs.parse_specs(["tar=1.34", "coreutils=9.1-1"]) == [("coreutils", "9.1-1"), ("tar", "1.34")]
    for spec, message in [("coreutils", "not a pinned"), ("util-linux-locales=2.38.1-5", "reserved for evaluation"),
                          ("mc=3:4.8.29-2", "reserved for evaluation"), ("sudo=1.9.13p3-1", "reserved")]:
        with pytest.raises(catalogs.CorpusError, match=message):
            debian_catalogs.parse_specs([spec])
    with pytest.raises(catalogs.CorpusError, match="given twice"):
        debian_catalogs.parse_specs(["tar=1.34", "tar=1.35"])


def _build_deb(tmp_path: Path, name: str, version: str, doc_link: str | None = None) -> Path:
    tree = tmp_path / f"tree-{name}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: t <t@example.org>\n"
        f"Description: test\n")
    _save(tree / "usr/share/locale/fr/LC_MESSAGES" / f"{name}.mo", [("Print the version", "Afficher la version")])
    _save(tree / "usr/share/locale/de/LC_MESSAGES" / f"{name}.mo", [("Print the version", "Version ausgeben")])
    _save(tree / "usr/share/locale/it/LC_MESSAGES" / f"{name}.mo", [("Print the version", "Stampa la versione")])
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin" / name).write_text("#!/bin/sh\n")
    doc = tree / "usr/share/doc"
    doc.mkdir(parents=True)
    if doc_link:
        (doc / name).symlink_to(doc_link)
    else:
        (doc / name).mkdir()
        (doc / name / "copyright").write_text(
            "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
            "Files: *\nCopyright: 2024 T\nLicense: GPL-2+\n")
    debs = tmp_path / "pkgs-debs"
    debs.mkdir(exist_ok=True)
    deb = debs / f"{name}_{version.replace(':', '%3a')}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
                   check=True, capture_output=True)
    return deb


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_debian_unpack_keeps_the_corpus_languages_catalogs_and_licence(tmp_path: Path) -> None:
    _build_deb(tmp_path, "tool", "1:2.0-1")
    _build_deb(tmp_path, "tool-l10n", "1:2.0-1", doc_link="tool")
    out = tmp_path / "pkgs"
    (out / "stale").mkdir(parents=True)
    (out / "stale" / catalogs.DEBIAN_MARKER).write_text("{}")  # a package no longer pinned: removed
    records = debian_catalogs.fetch(["tool=1:2.0-1", "tool-l10n=1:2.0-1"], out, **QUIET)  # .debs present: no apt
    assert [r["package"] for r in records] == ["tool", "tool-l10n"]
    assert not (out / "stale").exists()
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["tool-l10n/debian-package.json",  # French and German (the corpus's languages), no Italian
                     "tool-l10n/usr/share/locale/de/LC_MESSAGES/tool-l10n.mo",
                     "tool-l10n/usr/share/locale/fr/LC_MESSAGES/tool-l10n.mo",
                     "tool/debian-package.json", "tool/usr/share/doc/tool/copyright",
                     "tool/usr/share/locale/de/LC_MESSAGES/tool.mo", "tool/usr/share/locale/fr/LC_MESSAGES/tool.mo"]
    l10n = json.loads((out / "tool-l10n" / catalogs.DEBIAN_MARKER).read_text())
    assert l10n["license"] == "GPL-2+" and l10n["license_file"] == "tool/usr/share/doc/tool/copyright"
    manifest = corpus.build([out], tmp_path / "corpus", **QUIET)
    assert {s["package"] for s in manifest["sources"]} == {"tool=1:2.0-1 (Debian)", "tool-l10n=1:2.0-1 (Debian)"}
    with pytest.raises(catalogs.CorpusError, match="expected tool=1:2.0-2"):
        deb = tmp_path / "pkgs-debs" / "tool_1%3a2.0-1_all.deb"
        deb.rename(tmp_path / "pkgs-debs" / "tool_1%3a2.0-2_all.deb")  # a file whose name lies
        debian_catalogs.fetch(["tool=1:2.0-2"], out, **QUIET)


def test_a_version_missing_from_the_package_lists_says_to_update_them(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def apt_get(argv, **kwargs):  # what apt-get download says when its lists predate a point release
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 100, "", "E: Version '2.6.2' for 'apt' was not found\n")

    monkeypatch.setattr(debian_catalogs.subprocess, "run", apt_get)
    with pytest.raises(catalogs.CorpusError, match=r"Version '2\.6\.2' for 'apt' was not found.*apt-get update"):
        debian_catalogs.download([("apt", "2.6.2")], tmp_path / "debs", **QUIET)
    assert calls == [["apt-get", "download", "-q", "apt=2.6.2"]]
