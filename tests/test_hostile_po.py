"""Malformed ``.po`` files given to ``nmt translate-po`` (issue 31, rows 9 and 10): each is one that
``msgfmt --check`` refuses, and the command must refuse it too, with exit 2 and one line naming the
file and line, writing nothing, rather than read it with polib's leniency and write a changed
catalog (``msgid "Open the file`` without its closing quote came back as ``"Open the fil"``).

Where GNU gettext's ``msgfmt`` is installed, every case is first checked to be one it refuses
(otherwise that check skips, saying so). A stand-in server answers: nothing here needs a model.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from po_helpers import stand_in, translate_po

MSGFMT = shutil.which("msgfmt")
FRENCH = "nplurals=2; plural=(n > 1);"
FIRST = 7  # the line of a body's first line, after the header below


def catalog(body: str, forms: str = FRENCH) -> str:
    return ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n"Language: fr\\n"\n'
            f'"Plural-Forms: {forms}\\n"\n\n{body}')


@pytest.fixture(scope="module")
def server() -> str:
    with stand_in() as address:
        yield address


def msgfmt_refuses(path: Path) -> None:
    if MSGFMT is None:
        pytest.skip("GNU gettext's msgfmt is not installed (apt-get install gettext): "
                    "cannot confirm that msgfmt --check refuses the case")
    done = subprocess.run([MSGFMT, "--check", "-o", "/dev/null", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0, f"msgfmt --check accepts it:\n{path.read_text()}"


def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, server: str, text: str) -> str:
    """The one line ``nmt translate-po`` printed when it refused ``text`` (exit 2, nothing written)."""
    bad, out = tmp_path / "bad.po", tmp_path / "out.po"
    bad.write_text(text)
    code, stdout, err = translate_po(capsys, bad, "-o", out, "--server", server)
    assert (code, stdout, err.count("\n")) == (2, "", 1), err
    assert not out.exists()
    assert err.startswith(f"nmt translate-po: {bad}")
    return err.removeprefix(f"nmt translate-po: {bad}").strip()


# ---- row 9: lines polib would misread ----------------------------------------------------------

LEXICAL = [
    ("unclosed", 'msgid "Open the file\nmsgstr ""\n', FIRST, "the string is not closed"),
    ("unclosed continuation", 'msgid ""\n"Open the file\nmsgstr ""\n', FIRST + 1, "the string is not closed"),
    ("escaped closing quote", 'msgid "Open the file\\"\nmsgstr ""\n', FIRST, "the string is not closed"),
    ("invalid escape", 'msgid "Open \\q file"\nmsgstr ""\n', FIRST, "invalid escape \\q"),
    ("lone backslash", 'msgid "Open \\', FIRST, "the string is not closed"),
    ("text after the string", 'msgid "Open\\\\" file"\nmsgstr ""\n', FIRST, "text after the closing quote"),
    ("no string", 'msgid Open\nmsgstr ""\n', FIRST, "msgid has no string in quotes"),
    ("unknown keyword", 'msgid "a"\nmsgstring "x"\n', FIRST + 1, "neither a keyword"),
    ("msgstr[10]", 'msgid "a"\nmsgid_plural "b"\nmsgstr[0] "x"\nmsgstr[10] "y"\n', FIRST + 3,
     "at most 10 plural forms"),
    ("in the header", 'msgid "a"\nmsgstr ""\n', 3, "the string is not closed"),
]


@pytest.mark.parametrize("body, line, problem", [case[1:] for case in LEXICAL], ids=[c[0] for c in LEXICAL])
def test_a_malformed_line_is_refused_naming_it(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              body: str, line: int, problem: str) -> None:
    text = catalog(body)
    if line == 3:
        text = text.replace('charset=UTF-8\\n"', "charset=UTF-8\\n")
    said = refused(capsys, tmp_path, server, text)
    assert said.startswith(f":{line}: ") and problem in said, said
    msgfmt_refuses(tmp_path / "bad.po")


def test_escapes_polib_would_rewrite_are_refused(server: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``\\a``, octal and hex escapes are valid gettext, but polib writes them back as ``\\\\a``."""
    for escape in ("\\a", "\\101", "\\x41"):
        said = refused(capsys, tmp_path, server, catalog(f'msgid "Bell {escape}"\nmsgstr ""\n'))
        assert said.startswith(f":{FIRST}: the escape {escape[:2]} is not supported"), said


def test_the_escapes_both_know_are_kept(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, out = tmp_path / "ok.po", tmp_path / "out.po"
    source.write_text(catalog('msgid "Tab\\there, \\"quoted\\", back\\\\slash"\nmsgstr ""\n'))
    code, _, err = translate_po(capsys, source, "-o", out, "--server", server)
    assert code == 0, err
    assert 'msgstr "[Tab\\there, \\"quoted\\", back\\\\slash]"' in out.read_text()


# ---- row 10: entries and headers msgfmt --check refuses ---------------------------------------

STRUCTURAL = [
    ("duplicate", 'msgid "a"\nmsgstr "x"\n\nmsgid "a"\nmsgstr "y"\n', FRENCH,
     f":{FIRST + 3}: msgid 'a' is defined twice (first at line {FIRST})"),
    ("duplicate in a context", 'msgctxt "m"\nmsgid "a"\nmsgstr ""\n\nmsgctxt "m"\nmsgid "a"\nmsgstr ""\n', FRENCH,
     f":{FIRST + 5}: msgid 'a' (msgctxt 'm') is defined twice (first at line {FIRST + 1})"),
    ("duplicate of an obsolete one", 'msgid "a"\nmsgstr ""\n\n#~ msgid "a"\n#~ msgstr "z"\n', FRENCH,
     f":{FIRST + 3}: msgid 'a' is defined twice"),
    ("msgstr[0] without msgid_plural", 'msgid "a"\nmsgstr[0] "x"\n', FRENCH,
     f":{FIRST + 1}: msgstr[N] without msgid_plural"),
    ("msgid_plural with msgstr", 'msgid "a"\nmsgid_plural "b"\nmsgstr "x"\n', FRENCH,
     f":{FIRST + 2}: msgid_plural needs msgstr[0], msgstr[1]"),
    ("plural forms out of order", 'msgid "a"\nmsgid_plural "b"\nmsgstr[1] "x"\nmsgstr[0] "y"\n', FRENCH,
     f":{FIRST + 2}: plural forms out of order: msgstr[1], msgstr[0]"),
    ("nplurals=0", 'msgid "a"\nmsgstr ""\n', "nplurals=0; plural=0;",
     ": Plural-Forms nplurals=0: must be between 1 and 10"),
    ("nplurals=200", 'msgid "a"\nmsgstr ""\n', "nplurals=200; plural=n;",
     ": Plural-Forms nplurals=200: must be between 1 and 10"),
    ("forms past nplurals", 'msgid "a"\nmsgstr ""\n', "nplurals=2; plural=(n%3);",
     ": Plural-Forms nplurals=2, but its plural expression gives forms up to 2"),
    ("division by zero", 'msgid "a"\nmsgstr ""\n', "nplurals=2; plural=(n/0);",
     ": Plural-Forms: invalid plural expression '(n/0)'"),
    ("invalid expression", 'msgid "a"\nmsgstr ""\n', "nplurals=2; plural=(n >;",
     ": Plural-Forms: invalid plural expression '(n >'"),
    ("more forms than nplurals", 'msgid "a"\nmsgid_plural "b"\nmsgstr[0] "x"\nmsgstr[1] "y"\nmsgstr[2] "z"\n',
     FRENCH, f":{FIRST}: msgid 'a' has 3 plural forms, the header's Plural-Forms says nplurals=2"),
]


@pytest.mark.parametrize("body, forms, problem", [case[1:] for case in STRUCTURAL],
                         ids=[c[0] for c in STRUCTURAL])
def test_what_msgfmt_check_refuses_is_refused(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              body: str, forms: str, problem: str) -> None:
    said = refused(capsys, tmp_path, server, catalog(body, forms))
    assert said.startswith(problem), said
    msgfmt_refuses(tmp_path / "bad.po")
