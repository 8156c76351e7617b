"""Finding and reading gettext catalogs (``.po`` / ``.mo``) of one target language for the corpus builder.

``find_catalogs`` walks the given directories for one language's catalogs (French by default), never
returning one of a held-out domain (``export/data/heldout-exclude.txt``);
``describe`` names the package that ships one and its licence (for the corpus
manifest): a Python distribution, a Debian package unpacked by
``export/data/debian_catalogs.py`` (its ``debian-package.json``) or a system
package (dpkg's file lists); ``entry_texts`` gives an entry's (source, target)
texts, plural forms included.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import polib


class CorpusError(Exception):
    """A one-line problem with the corpus inputs, naming the path."""

SYSTEM_LOCALE_DIR = Path("/usr/share/locale")
LANGUAGES = {"fr": ("fr", "fr_FR"), "de": ("de", "de_DE"), "es": ("es", "es_ES")}
"""Target languages the corpus builder reads (ISO 639-1 code -> the locale directories that count)."""
LANGUAGE_NAMES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish"}
LANGUAGE_DIRS = tuple(d for dirs in LANGUAGES.values() for d in dirs)  # every language the corpus may read
HELDOUT_FILE = Path(__file__).with_name("heldout-exclude.txt")
"""Gettext domains (and the packages that ship them) reserved for evaluation:
a copy of the shared list, committed so that a clone builds the same corpus."""
DEBIAN_MARKER = "debian-package.json"  # written by export/data/debian_catalogs.py in each package's directory
DPKG_INFO = Path("/var/lib/dpkg/info")


@dataclass(frozen=True)
class Heldout:
    """The held-out list: gettext domains and package names (lower case)."""

    domains: tuple[str, ...]
    packages: tuple[str, ...]

    def has_domain(self, domain: str) -> bool:
        return domain.lower() in self.domains

    def has_package(self, name: str) -> bool:
        return name.lower() in self.packages or name.lower() in self.domains


def load_heldout(path: Path = HELDOUT_FILE) -> Heldout:
    """Parse ``domain: package, package`` lines (``#`` comments)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CorpusError(f"{path}: cannot read the held-out list ({e.strerror})") from None
    domains, packages = [], []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        domain, _, pkgs = line.partition(":")
        domains.append(domain.strip().lower())
        packages += [p.strip().lower() for p in pkgs.split(",") if p.strip()]
    if not domains:
        raise CorpusError(f"{path}: the held-out list names no domain")
    return Heldout(tuple(sorted(set(domains))), tuple(sorted(set(packages))))


HELDOUT = load_heldout()
NOT_MESSAGES = ("iso_*", "libgweather*-locations", "gnome-control-center-2.0-timezones")
"""Tables of language, country, place and time-zone names, not messages."""
DEFAULT_EXCLUDE = NOT_MESSAGES + HELDOUT.domains
"""Domains skipped by default; the held-out ones are skipped even when ``exclude`` omits them."""


def default_roots() -> list[Path]:
    """The system locale directory plus the installed Python packages."""
    roots = [SYSTEM_LOCALE_DIR] if SYSTEM_LOCALE_DIR.is_dir() else []
    return roots + [Path(sysconfig.get_paths()["purelib"])]


def language_dirs(language: str) -> tuple[str, ...]:
    """The locale directories of ``language`` (``fr`` -> ``fr``, ``fr_FR``); refuses one not in LANGUAGES."""
    if language not in LANGUAGES:
        raise CorpusError(f"language {language!r}: not one the corpus reads (one of {', '.join(LANGUAGES)})")
    return LANGUAGES[language]


def find_catalogs(roots: list[Path], exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                  heldout_skipped: list[Path] | None = None, language: str = "fr") -> list[Path]:
    """``language``'s catalogs under ``roots``; a ``.po`` wins over its compiled ``.mo``.

    ``exclude`` holds glob patterns of gettext domains (file stems) to skip;
    held-out domains (``HELDOUT``) are always skipped (and appended to ``heldout_skipped``).
    """
    dirs = language_dirs(language)
    found: dict[Path, Path] = {}
    for root in roots:
        if not root.exists():
            raise CorpusError(f"{root}: catalog directory does not exist")
        if not root.is_dir():
            raise CorpusError(f"{root}: not a directory")
        for path in sorted(root.rglob("LC_MESSAGES/*.[pm]o")):
            if path.parent.parent.name not in dirs or not path.is_file():
                continue
            if HELDOUT.has_domain(path.stem):
                if heldout_skipped is not None:
                    heldout_skipped.append(path)
                continue
            if any(fnmatch.fnmatch(path.stem, pat) for pat in exclude):
                continue
            stem = path.with_suffix("")
            if stem not in found or path.suffix == ".po":
                found[stem] = path
    if not found:
        raise CorpusError(f"{', '.join(map(str, roots))}: no {LANGUAGE_NAMES[language]} .po/.mo catalogs found")
    return sorted(found.values())


# ---------------------------------------------------------------- who ships a catalog, under which licence


@dataclass(frozen=True)
class Origin:
    """The package that ships a catalog (for the manifest and the held-out check)."""

    package: str  # as the manifest shows it: "Django==5.2.19", "coreutils=9.1-1 (Debian)", "tar (system)"
    name: str  # the bare package name, checked against the held-out packages
    license: str
    license_file: str = ""


def _package_files(roots: list[Path]) -> dict[Path, metadata.Distribution]:
    """Catalog path -> the installed distribution that ships it (site-packages and ``roots``)."""
    owners: dict[Path, metadata.Distribution] = {}
    dists = list(metadata.distributions()) + list(metadata.distributions(path=[str(r) for r in roots]))
    for dist in dists:
        for f in dist.files or ():
            if f.suffix in (".po", ".mo"):
                owners[Path(dist.locate_file(f)).resolve()] = dist
    return owners


def _python_license(meta) -> str:
    """SPDX expression, else a short License field, else the trove classifiers."""
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    lic = (meta.get("License") or "").strip()
    short = lic and "\n" not in lic and len(lic) <= 80 and not lic.lower().startswith(("copyright", "the "))
    if short:
        return lic
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " / ".join(classifiers)
    return lic.splitlines()[0][:80] if lic else "unknown"


def _dep5_stanzas(text: str) -> list[dict[str, str]]:
    stanzas, fields, key = [], {}, None
    for line in text.splitlines() + [""]:
        if not line.strip():
            if fields:
                stanzas.append(fields)
            fields, key = {}, None
        elif line[0] in " \t":
            if key:
                fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
    return stanzas


_COMMON = re.compile(r"/usr/share/common-licenses/(GPL|LGPL|GFDL|Apache|Artistic|BSD|MPL)(-\d+(?:\.\d+)?)?")
_GNU = re.compile(r"GNU\s+(Lesser\s+|Library\s+)?General\s+Public\s+License", re.IGNORECASE)


def debian_license(copyright_file: Path) -> str:
    """A Debian copyright file's licence: for a machine-readable (DEP-5) file, the
    licence of the last stanza whose ``Files`` patterns match ``po/fr.po`` (the
    translations; DEP-5's rule), else of the first stanza; otherwise the
    licence its text names, marked ``(from copyright text)``."""
    try:
        text = copyright_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "unknown"
    stanzas = _dep5_stanzas(text)
    if stanzas and re.search(r"copyright-format|dep-?5", stanzas[0].get("format", ""), re.IGNORECASE):
        files = [s for s in stanzas if "files" in s and "license" in s]
        # DEP-5: the last stanza whose patterns match a file applies to it; the French catalog is po/fr.po
        matching = [s for s in files if any(fnmatch.fnmatchcase("po/fr.po", pat) for pat in s["files"].split())]
        chosen = matching[-1] if matching else (files[0] if files else None)
        if chosen:
            return chosen["license"].splitlines()[0].strip() or "unknown"
    m = _COMMON.search(text)
    gnu = _GNU.search(text)
    if gnu and (not m or gnu.start() < m.start()):
        family = "LGPL" if gnu.group(1) else "GPL"
        after = re.split(r"GFDL|Free\s+Documentation", text[gnu.start():gnu.start() + 400])[0]
        version = re.search(r"version\s+(\d(?:\.\d)?)", after, re.IGNORECASE)
        later = re.search(r"any\s+later\s+version", after, re.IGNORECASE)
        lic = family + (f"-{version.group(1)}" if version else "") + ("+" if later else "")
    elif m:
        lic = m.group(1) + (m.group(2) or "")
    elif re.search(r"Permission is hereby granted, free of charge", text):
        lic = "MIT"
    elif re.search(r"Redistribution and use in source and binary forms", text):
        lic = "BSD"
    else:
        return "unknown"
    return f"{lic} (from copyright text)"


@lru_cache(maxsize=1)
def _dpkg_owners() -> dict[str, str]:
    """Installed file -> Debian package, for catalogs (dpkg's file lists; empty off Debian)."""
    owners: dict[str, str] = {}
    for lst in sorted(DPKG_INFO.glob("*.list")) if DPKG_INFO.is_dir() else ():
        pkg = lst.stem.split(":")[0]
        for line in lst.read_text(encoding="utf-8", errors="replace").splitlines():
            if "/LC_MESSAGES/" in line:
                owners[line.strip()] = pkg
    return owners


@lru_cache(maxsize=4096)
def _debian_marker(directory: Path) -> dict | None:
    """The ``debian-package.json`` of the unpacked package holding ``directory``, if any."""
    for d in (directory, *directory.parents):
        marker = d / DEBIAN_MARKER
        if marker.is_file():
            return json.loads(marker.read_text(encoding="utf-8"))
    return None


def describe(path: Path, owners: dict[Path, metadata.Distribution]) -> Origin:
    """The package and licence of a catalog, where known."""
    dist = owners.get(path.resolve())
    if dist is not None:
        return Origin(f"{dist.metadata['Name']}=={dist.version}", dist.metadata["Name"],
                      _python_license(dist.metadata))
    deb = _debian_marker(path.parent.resolve())
    if deb is not None:
        return Origin(f"{deb['package']}={deb['version']} (Debian)", deb["package"], deb["license"],
                      deb.get("license_file", ""))
    owner = _dpkg_owners().get(str(path))
    if owner is not None:
        copyright_file = Path("/usr/share/doc") / owner / "copyright"
        return Origin(f"{owner} (system)", owner, debian_license(copyright_file),
                      str(copyright_file) if copyright_file.exists() else "")
    domain = path.stem
    copyright_file = Path("/usr/share/doc") / domain / "copyright"
    lic = f"see {copyright_file}" if copyright_file.exists() else "unknown"
    return Origin(f"{domain} (system)", domain, lic)


def _describe(path: Path, owners: dict[Path, metadata.Distribution]) -> tuple[str, str]:
    """(package, license) of a catalog, where known."""
    origin = describe(path, owners)
    return origin.package, origin.license


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

    Plural entries give the singular with form 0 and the plural with the last
    form (French, German and Spanish have two: n ≤ 1 or n = 1, and the rest).
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
