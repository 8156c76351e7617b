"""What ``msgfmt --check`` refuses, refused before ``nmt translate-po`` reads a catalog with polib.

polib is lenient where GNU gettext is strict, and its leniency changes text silently: a string
whose closing quote is missing loses its last character (``msgid "Open the file`` becomes
``"Open the fil"``), an escape it does not know (``\\q``) is written back as ``\\\\q``,
``msgstr[10]`` is read as ``msgstr[1]``. So the catalog's lines are checked first, with gettext's
grammar (GNU gettext's ``gettext-tools/src/po-lex.c`` and ``po-gram.y``), and so are the entries' shapes
``msgfmt --check`` refuses (a duplicate message, ``msgstr[0]`` without ``msgid_plural``, plural
forms out of order) and the header's Plural-Forms. Each problem is one line naming the file and
the line, as msgfmt names them.
"""

from __future__ import annotations

import gettext
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_PLURALS = 10  # polib reads one digit of msgstr[N]; no language has more than 6 forms
PLURAL_CHECK_UP_TO = 1000  # msgfmt evaluates the plural expression for n = 0 .. 1000
# escapes gettext and polib both read and write back unchanged
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "v": "\v", "b": "\b", "f": "\f", "\\": "\\", '"': '"'}
_GETTEXT_ONLY = "a01234567x"  # valid for gettext (\a, octal, hex), but polib would rewrite them


class Failure(Exception):
    """Stops the run: ``message`` is the one line printed, ``code`` the exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


_STRING = re.compile(r'"((?:[^"\\]|\\.)*)(")?')  # a quoted string; group 2: its closing quote
_ESCAPE = re.compile(r"\\(.)")
_KEYWORD = re.compile(r"(msgctxt|msgid_plural|msgid|msgstr(?:\[(\d+)\])?)(?=[\s\"]|$)\s*")


@dataclass
class _Entry:
    """One message as the lines spell it: where, and the shape msgfmt checks."""

    line: int  # of its msgid
    context: str | None = None
    msgid: str = ""
    plural_line: int = 0  # of its msgid_plural; 0: none
    forms: list[tuple[int, int | None]] = field(default_factory=list)  # (line, N of msgstr[N] or None)


def check_lines(text: str, path: object) -> None:
    """Failure(2) naming the line of the first lexical or structural problem of ``text``."""
    entries: list[_Entry] = []
    context: str | None = None
    last = None  # the keyword a continuation line continues
    for number, raw in enumerate(io.StringIO(text, newline=None), start=1):  # polib's line breaks
        line = raw.strip().removeprefix("\ufeff") if number == 1 else raw.strip()
        obsolete = line.startswith("#~")
        if obsolete:
            line = line[2:].strip()
        if not line or line.startswith("#") or obsolete and line.startswith("|"):
            continue  # comments, previous msgids (#| and #~|), blank lines
        keyword, index, value = _parse_line(line, lambda problem: Failure(2, f"{path}:{number}: {problem}"))
        last = keyword or last
        if keyword == "msgctxt":
            context = value
        elif keyword == "msgid":
            entries.append(_Entry(line=number, context=context, msgid=value))
            context = None
        elif keyword and entries:
            if keyword == "msgid_plural":
                entries[-1].plural_line = number
            else:
                entries[-1].forms.append((number, index))
        elif keyword is None and last == "msgctxt":
            context = (context or "") + value
        elif keyword is None and last == "msgid" and entries:
            entries[-1].msgid += value
    _check_entries(entries, path)


def _parse_line(line: str, error: Callable[[str], Failure]) -> tuple[str | None, int | None, str]:
    """(keyword or None for a continuation, N of msgstr[N], the string's value) of one line."""
    found = _KEYWORD.match(line)
    keyword, index = (found.group(1), found.group(2)) if found else (None, None)
    rest = line[found.end():] if found else line
    if keyword and keyword.startswith("msgstr["):
        keyword = "msgstr[]"
        if int(index) >= MAX_PLURALS:
            raise error(f"msgstr[{index}]: at most {MAX_PLURALS} plural forms are supported")
    if not rest.startswith('"'):
        what = f"{keyword.replace('[]', f'[{index}]')} has no string in quotes" if keyword else \
            f"not a gettext catalog: a line neither a keyword (msgctxt, msgid, msgid_plural, " \
            f"msgstr) nor a string: {line[:40]!r}"
        raise error(what)
    value, end = _string(rest, error)
    if rest[end:].strip():
        raise error(f"text after the closing quote: {rest[end:].strip()[:40]!r} "
                    "(one string per line)")
    return keyword, int(index) if index is not None else None, value


def _string(text: str, error: Callable[[str], Failure]) -> tuple[str, int]:
    """The value of the string that starts ``text`` (at its opening quote), and where it ends."""
    found = _STRING.match(text)
    assert found is not None  # always: text starts with a quote (checked by the caller)
    body = found.group(1)
    for escape in _ESCAPE.finditer(body):
        c = escape.group(1)
        if c in _GETTEXT_ONLY:
            raise error(f"the escape \\{c} is not supported (it would not be kept as it is): "
                        "write the character itself")
        if c not in _ESCAPES:
            raise error(f"invalid escape \\{c} in a string (msgfmt: invalid control sequence)")
    if found.group(2) is None:
        raise error("the string is not closed: no closing quote before the end of the line")
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], body), found.end()


def _check_entries(entries: list[_Entry], path: object) -> None:
    first: dict[tuple[str | None, str], int] = {}
    for e in entries:
        where = f"{path}:{e.line}: msgid {e.msgid[:60]!r}{f' (msgctxt {e.context!r})' if e.context else ''}"
        if (e.context, e.msgid) in first:  # msgfmt counts obsolete entries too
            raise Failure(2, f"{where} is defined twice (first at line {first[e.context, e.msgid]})")
        first[e.context, e.msgid] = e.line
        indices = [n for _, n in e.forms]
        if not e.plural_line and any(n is not None for n in indices):
            raise Failure(2, f"{path}:{e.forms[0][0]}: msgstr[N] without msgid_plural (for {where})")
        if e.plural_line and None in indices:
            raise Failure(2, f"{path}:{e.forms[0][0]}: msgid_plural needs msgstr[0], msgstr[1], ... "
                             f"not msgstr (for {where})")
        if e.plural_line and indices != list(range(len(indices))):
            raise Failure(2, f"{path}:{e.forms[0][0]}: plural forms out of order: "
                             f"{', '.join(f'msgstr[{n}]' for n in indices)} (for {where})")


def check_plural_forms(forms: str, source: object) -> int:
    """The nplurals of a Plural-Forms value; Failure(2) if msgfmt would refuse it."""
    nplurals = re.search(r"nplurals\s*=\s*(\d+)", forms)
    plural = re.search(r"plural\s*=\s*([^;]+)", forms)
    if not nplurals or not plural:
        raise Failure(2, f"{source}: Plural-Forms {forms!r} lacks nplurals=N or plural=EXPRESSION")
    count = int(nplurals.group(1))
    if not 1 <= count <= MAX_PLURALS:
        raise Failure(2, f"{source}: Plural-Forms nplurals={count}: must be between 1 and {MAX_PLURALS}")
    try:
        choose = gettext.c2py(plural.group(1).strip())
        largest = max(choose(n) for n in range(PLURAL_CHECK_UP_TO + 1))
    except (ValueError, ArithmeticError, RecursionError):
        raise Failure(2, f"{source}: Plural-Forms: invalid plural expression "
                         f"{plural.group(1).strip()!r}") from None
    if largest >= count:
        raise Failure(2, f"{source}: Plural-Forms nplurals={count}, but its plural expression gives "
                         f"forms up to {largest}")
    return count
