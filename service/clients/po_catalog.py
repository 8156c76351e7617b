"""The catalog side of ``nmt translate-po`` (``service/clients/po.py``): read a catalog,
check format flags, split messages into lines, fill entries, write the result.

No gRPC here: what goes over the wire and how is ``po.py``'s business.
"""

from __future__ import annotations

import codecs
import os
import re
import shutil
import textwrap
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import polib

from service.clients import po_syntax
from service.clients.po_syntax import Failure  # noqa: F401 - the error of every step, re-exported
from service.clients.po_format import FORMAT_FLAGS, directives, format_problem  # noqa: F401 - re-exported
from service.text import placeholders

TOO_MANY_PLACEHOLDERS = f"more than {placeholders.MAX_PLACEHOLDERS} placeholders"
TOO_MANY_COMMENT = f"left as it is: {TOO_MANY_PLACEHOLDERS}, which the model cannot keep (split the message)"
MAX_TEXT_CHARS = 2000  # the server's default --max-text-chars: longer lines are not sent
MARK = "nmt translate-po:"  # starts every translator comment this tool writes (replaced on reruns)
COMMENT_WIDTH = 76  # polib wraps a comment line past 78 columns, "# " included
MAX_LINKS = 40  # symbolic links followed to the output's file, as Linux's ELOOP limit
PLURAL_FORMS = {
    "fr": "nplurals=2; plural=(n > 1);", "pt_BR": "nplurals=2; plural=(n > 1);",
    "en": "nplurals=2; plural=(n != 1);", "de": "nplurals=2; plural=(n != 1);",
    "es": "nplurals=2; plural=(n != 1);", "it": "nplurals=2; plural=(n != 1);",
    "nl": "nplurals=2; plural=(n != 1);", "pt": "nplurals=2; plural=(n != 1);",
    "ja": "nplurals=1; plural=0;", "zh": "nplurals=1; plural=0;", "ko": "nplurals=1; plural=0;",
    "ru": "nplurals=3; plural=(n%10==1 && n%100!=11 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || "
          "n%100>=20) ? 1 : 2);",
    "pl": "nplurals=3; plural=(n==1 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);",
}


# ---- format flags: which placeholders a translation must keep, and in what order ----

_LINE = re.compile(r"(\s*)(.*?)(\s*)", re.DOTALL)


def lines(text: str) -> list[tuple[str, str, str]]:
    """``text`` split at line breaks into (leading whitespace, core, trailing whitespace)."""
    return [_LINE.fullmatch(line).groups() for line in text.split("\n")]  # type: ignore[union-attr]


def rejoin(text: str, translations: dict[str, str]) -> str:
    """``text`` with each non-blank line's core replaced by its translation."""
    return "\n".join(lead + (translations[core] if core else "") + trail
                     for lead, core, trail in lines(text))


# ---- the catalog: read, header, which entries to translate, fill, write ----

def read_catalog(path: Path) -> polib.POFile:
    """The catalog at ``path``; Failure(2) naming the file (and line) if it is not one."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise Failure(2, f"{path}: cannot read: {e.strerror}") from None
    if raw[:4] in (b"\xde\x12\x04\x95", b"\x95\x04\x12\xde"):  # the .mo magic number
        raise Failure(2, f"{path}: a compiled .mo catalog, not a .po or .pot")
    encoding = polib.detect_encoding(str(path))  # the header's charset; UTF-8 without one
    _check_encoding(raw, encoding, path)
    po_syntax.check_lines(raw.decode(encoding), path)  # what polib would misread, msgfmt refuses
    try:
        catalog = polib.pofile(str(path), encoding=encoding)
    except (OSError, ValueError) as e:
        raise Failure(2, f"{path}: not a gettext catalog: {e}") from None
    if not catalog.metadata and not len(catalog):
        raise Failure(2, f"{path}: not a gettext catalog: no header and no entries")
    forms = catalog.metadata.get("Plural-Forms", "")
    if re.search(r"nplurals\s*=\s*\d", forms):  # a template's nplurals=INTEGER is filled in later
        po_syntax.check_plural_forms(forms, path)
    return catalog


def _check_encoding(raw: bytes, encoding: str, path: Path) -> None:
    """Failure(2) if ``raw`` is not in ``encoding``: bytes that do not decode (polib's own error
    would not say where), or UTF-8 under another charset, which would decode to mojibake (text
    in a legacy charset with non-ASCII letters is almost never valid UTF-8 by chance)."""
    said = "as its header says" if re.search(rb"charset=", raw) else "(its header names no charset)"
    try:
        raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise Failure(2, f"{path}:{line}: not {encoding} {said} (byte 0x{raw[e.start]:02x})") from None
    if codecs.lookup(encoding).name != "utf-8" and not raw.isascii():
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return
        raise Failure(2, f"{path}: UTF-8, not {encoding} as its header says")


def primary(language: str) -> str:
    """The language of a tag or locale name: ``pt_BR`` and ``pt-BR`` are ``pt``."""
    return re.split(r"[_@.-]", language, maxsplit=1)[0].lower()


def update_header(catalog: polib.POFile, target: str, *, overwrite: bool, path: Path) -> int:
    """Give the header Language, the target's Plural-Forms (when it has none, or when it is
    retargeted: another language's forms do not apply), X-Generator; the nplurals in effect.
    A retargeted catalog's translations are dropped: they are in the old language."""
    meta = catalog.metadata
    language = meta.get("Language", "").strip()
    retarget = bool(language) and primary(language) != primary(target)
    if retarget and not overwrite:
        raise Failure(2, f"{path}: the catalog's Language is {language!r}, the model translates "
                         f"into {target!r} (--overwrite to retarget it)")
    if retarget or not language:
        meta["Language"] = language = target
    forms = meta.get("Plural-Forms", "")
    if retarget or not re.search(r"nplurals\s*=\s*\d+", forms):  # a template's nplurals=INTEGER: none
        forms = PLURAL_FORMS.get(language) or PLURAL_FORMS.get(primary(language), "")
        if not forms and any(e.msgid_plural and not e.obsolete for e in catalog):
            raise Failure(2, f"{path}: no Plural-Forms known for {language!r}: add one to the header")
        meta.pop("Plural-Forms", None)
        if forms:
            meta["Plural-Forms"] = forms
    if "CHARSET" in meta.get("Content-Type", "charset=CHARSET"):  # a template's placeholder
        meta["Content-Type"], catalog.encoding = "text/plain; charset=UTF-8", "utf-8"
    if meta.get("Content-Transfer-Encoding", "ENCODING") == "ENCODING":
        meta["Content-Transfer-Encoding"] = "8bit"
    meta["X-Generator"] = f"nmt-serve {_version()} (nmt translate-po)"
    nplurals = po_syntax.check_plural_forms(forms, path) if forms else 2
    if retarget:
        _drop_translations(catalog)
    _fit_plural_forms(catalog, nplurals, overwrite=overwrite, path=path)
    return nplurals


def _drop_translations(catalog: polib.POFile) -> None:
    for entry in (e for e in catalog if not e.obsolete):
        entry.msgstr, entry.msgstr_plural = "", {}
        entry.flags = [f for f in entry.flags if f != "fuzzy"]
        entry.previous_msgid = entry.previous_msgid_plural = entry.previous_msgctxt = None


def _fit_plural_forms(catalog: polib.POFile, nplurals: int, *, overwrite: bool, path: Path) -> None:
    """Give plural entries the header's number of forms, as msgfmt --check wants of translated
    ones; Failure(2) for a translation that has another number and is kept (not fuzzy, no
    --overwrite): which of its forms go where is for a person to say."""
    for entry in catalog:
        if entry.obsolete or not entry.msgid_plural or len(entry.msgstr_plural) == nplurals:
            continue
        translated = any(entry.msgstr_plural.values())
        if translated and not overwrite and "fuzzy" not in entry.flags:
            raise Failure(2, f"{path}:{entry.linenum}: msgid {entry.msgid[:60]!r} has "
                             f"{len(entry.msgstr_plural)} plural forms, the header's Plural-Forms says "
                             f"nplurals={nplurals} (--overwrite to retranslate it)")
        if not translated or overwrite:
            entry.msgstr_plural = {i: "" for i in range(nplurals)}


def _version() -> str:
    try:
        return version("nmt-serve")
    except PackageNotFoundError:
        return "unknown"


def sources(entry: polib.POEntry, nplurals: int) -> list[str]:
    """The source text of each msgstr form: form 0 from msgid, the others from msgid_plural
    (a one-form language's only form covers every n, so it comes from msgid_plural)."""
    if not entry.msgid_plural:
        return [entry.msgid]
    return [entry.msgid if i == 0 and nplurals > 1 else entry.msgid_plural for i in range(nplurals)]


def keep_reason(entry: polib.POEntry, *, overwrite: bool) -> str | None:
    """Why an entry is kept as it is (obsolete, translated, fuzzy), or None to translate it."""
    if entry.obsolete:
        return "obsolete"
    has_translation = bool(entry.msgstr) or any(entry.msgstr_plural.values())
    if overwrite or not has_translation:
        return None
    return "fuzzy" if "fuzzy" in entry.flags else "translated"


def skip_reason(entry: polib.POEntry, nplurals: int) -> str | None:
    """Why an entry is not sent: the server refuses blank texts and texts over its limit."""
    cores = [core for s in sources(entry, nplurals) for _, core, _ in lines(s) if core]
    if not cores:
        return "blank"
    if max(map(len, cores)) > MAX_TEXT_CHARS:
        return f"a line over {MAX_TEXT_CHARS} characters"
    if max(len(placeholders.find(core)) for core in cores) > placeholders.MAX_PLACEHOLDERS:
        return TOO_MANY_PLACEHOLDERS  # the server refuses them: it could not keep every one
    return None


def set_comment(entry: polib.POEntry, text: str) -> None:
    """Replace this tool's translator comment, keep the others. Every line of it starts with
    MARK and fits polib's 78 columns, which would otherwise wrap it into unmarked lines that a
    rerun could not tell from a translator's."""
    others = [c for c in entry.tcomment.split("\n") if c and not c.startswith(MARK)]
    ours = [f"{MARK} {line}" for line in textwrap.wrap(text, COMMENT_WIDTH - len(MARK) - 1)]
    entry.tcomment = "\n".join(others + ours)


@dataclass(frozen=True)
class Filling:
    """How machine output goes into entries."""

    nplurals: int
    comment: str  # the translator comment naming the model
    fuzzy: bool
    encoding: str  # the catalog's: a translation it cannot hold is left out


def fill(entry: polib.POEntry, translations: dict[str, str], how: Filling) -> str | None:
    """Put the translations into ``entry``; or leave it untranslated and say why (returned)."""
    forms = [(s, rejoin(s, translations)) for s in sources(entry, how.nplurals)]
    problem = _problem(entry, forms, translations, how.encoding)
    if problem is not None:
        set_comment(entry, f"left as it is: the machine translation {problem[1]}")
        return problem[0]
    if entry.msgid_plural:
        entry.msgstr_plural = {i: t for i, (_, t) in enumerate(forms)}
    else:
        entry.msgstr = forms[0][1]
    # the old fuzzy match's previous msgid describes the replaced translation, not this one
    entry.previous_msgid = entry.previous_msgid_plural = entry.previous_msgctxt = None
    set_comment(entry, how.comment)
    flags = [f for f in entry.flags if f != "fuzzy"]
    entry.flags = ["fuzzy", *flags] if how.fuzzy else flags  # first, as msgmerge writes it
    return None


def _problem(entry: polib.POEntry, forms: list[tuple[str, str]], translations: dict[str, str],
             encoding: str) -> tuple[str, str] | None:
    """Why these forms cannot go into ``entry``: (reason counted, details for the comment)."""
    for source, text in forms:
        found = format_problem(entry.flags, source, text)
        if found:
            return found
        if any(not translations[core].strip() for _, core, _ in lines(source) if core):
            return "empty translation", "is empty"  # an msgstr "" would read as untranslated
        if not _encodable(text, encoding):
            return f"not representable in {encoding}", f"is not representable in {encoding}"
    return None


def _encodable(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def resolve_output(output: Path) -> Path:
    """Where ``output`` is written: a symbolic link's target (followed to the end), so that the
    link stays a link; Failure(1) before any translating if it cannot be written."""
    target = output
    for _ in range(MAX_LINKS):
        if not target.is_symlink():
            break
        target = target.parent / os.readlink(target)  # a relative link is relative to its directory
    else:
        raise Failure(1, f"{output}: cannot write: too many levels of symbolic links")
    shown = output if target == output else f"{output} (a link to {target})"
    if target.is_dir():
        raise Failure(1, f"{shown}: cannot write: is a directory")
    if not target.parent.is_dir():
        raise Failure(1, f"{shown}: cannot write: no directory {target.parent}")
    if not os.access(target.parent, os.W_OK):
        raise Failure(1, f"{shown}: cannot write: the directory is not writable")
    return target


def write_atomically(catalog: polib.POFile, output: Path) -> None:
    """Write a temporary file beside ``output`` (a resolved path: no link) and rename it over:
    never a half-written catalog."""
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        catalog.save(str(tmp))
        if output.exists():
            shutil.copymode(output, tmp)
        os.replace(tmp, output)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise Failure(1, f"{output}: cannot write: {e.strerror or e}") from None
