"""Finding and reading French gettext catalogs (``.po`` / ``.mo``) for the corpus builder.

``find_catalogs`` walks the given directories for French catalogs;
``_describe`` names the package that ships one (for the corpus manifest's
licences); ``entry_texts`` gives an entry's (source, target) texts, plural
forms included.
"""

from __future__ import annotations

import fnmatch
import re
import sysconfig
from importlib import metadata
from pathlib import Path

import polib


class CorpusError(Exception):
    """A one-line problem with the corpus inputs, naming the path."""

SYSTEM_LOCALE_DIR = Path("/usr/share/locale")
LANGUAGE_DIRS = ("fr", "fr_FR")  # a catalog counts when its directory is one of these
DEFAULT_EXCLUDE = ("iso_*",)
"""iso-codes catalogs are tables of language and country names, not messages."""


def default_roots() -> list[Path]:
    """The system locale directory plus the installed Python packages."""
    roots = [SYSTEM_LOCALE_DIR] if SYSTEM_LOCALE_DIR.is_dir() else []
    return roots + [Path(sysconfig.get_paths()["purelib"])]


def find_catalogs(roots: list[Path], exclude: tuple[str, ...] = DEFAULT_EXCLUDE) -> list[Path]:
    """French catalogs under ``roots``; a ``.po`` wins over its compiled ``.mo``.

    ``exclude`` holds glob patterns of gettext domains (file stems) to skip.
    """
    found: dict[Path, Path] = {}
    for root in roots:
        if not root.exists():
            raise CorpusError(f"{root}: catalog directory does not exist")
        if not root.is_dir():
            raise CorpusError(f"{root}: not a directory")
        for path in sorted(root.rglob("LC_MESSAGES/*.[pm]o")):
            if path.parent.parent.name not in LANGUAGE_DIRS or not path.is_file():
                continue
            if any(fnmatch.fnmatch(path.stem, pat) for pat in exclude):
                continue
            stem = path.with_suffix("")
            if stem not in found or path.suffix == ".po":
                found[stem] = path
    if not found:
        raise CorpusError(f"{', '.join(map(str, roots))}: no French .po/.mo catalogs found")
    return sorted(found.values())


def _package_files(roots: list[Path]) -> dict[Path, metadata.Distribution]:
    """Catalog path -> the installed distribution that ships it (site-packages and ``roots``)."""
    owners: dict[Path, metadata.Distribution] = {}
    dists = list(metadata.distributions()) + list(metadata.distributions(path=[str(r) for r in roots]))
    for dist in dists:
        for f in dist.files or ():
            if f.suffix in (".po", ".mo"):
                owners[Path(dist.locate_file(f)).resolve()] = dist
    return owners


def _describe(path: Path, owners: dict[Path, metadata.Distribution]) -> tuple[str, str]:
    """(package, license) of a catalog, where known."""
    dist = owners.get(path.resolve())
    if dist is not None:
        meta = dist.metadata
        lic = meta.get("License-Expression") or meta.get("License") or ""
        if not lic or len(lic) > 80:
            lic = next((c.split(" :: ")[-1] for c in meta.get_all("Classifier") or []
                        if c.startswith("License ::")), lic[:80])
        return f"{meta['Name']}=={dist.version}", lic or "unknown"
    domain = path.stem
    copyright_file = Path("/usr/share/doc") / domain / "copyright"
    lic = f"see {copyright_file}" if copyright_file.exists() else "unknown"
    return f"{domain} (system)", lic


# ---------------------------------------------------------------- extraction


def _load(path: Path) -> polib._BaseFile:
    try:
        if path.suffix == ".mo":
            return polib.mofile(str(path))
        return polib.pofile(str(path))
    except (OSError, ValueError, UnicodeDecodeError, IndexError) as e:
        raise CorpusError(f"{path}: cannot read catalog ({str(e).splitlines()[0]})") from None


def _nplurals(catalog: polib._BaseFile) -> int:
    m = re.search(r"nplurals\s*=\s*(\d+)", catalog.metadata.get("Plural-Forms", ""))
    return int(m.group(1)) if m else 2


def entry_texts(entry: polib.POEntry, nplurals: int) -> list[tuple[str, str]]:
    """(source, target) texts of one catalog entry; the context is not text.

    Plural entries give the singular with French form 0 and the plural with
    the last form (French has two: n ≤ 1 and n > 1).
    """
    if entry.obsolete or "fuzzy" in entry.flags:
        return []
    if entry.msgid_plural:
        forms = entry.msgstr_plural
        if not forms or nplurals < 1:
            return []
        last = forms.get(nplurals - 1, forms.get(max(forms), ""))
        return [(entry.msgid, forms.get(0, "")), (entry.msgid_plural, last)]
    return [(entry.msgid, entry.msgstr)]
