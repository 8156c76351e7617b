"""``nmt translate-po``: a fixture catalog (plurals, contexts, multi-line, each format flag, HTML,
translated, fuzzy and obsolete entries, a header without Plural-Forms) filled by a real server.
(The pure catalog parts, bad input and TLS: ``tests/test_po_checks.py``.)

The untrained tiny model's translations are garbage but deterministic, which is what these
workflow tests need; the server's placeholder protection keeps its placeholders.
"""

from __future__ import annotations

import gettext
import shutil
import subprocess
from pathlib import Path

import polib
import pytest

from harness import ServerThread, config_for
from po_helpers import FIXTURE, by_key, key, ours, translate_po
from service.clients import translate
from service.clients import po_catalog as catalogs

MACHINE = "machine translation by model en-fr version 1"
FRENCH_PLURALS = "nplurals=2; plural=(n > 1);"
MSGFMT = shutil.which("msgfmt")
needs_msgfmt = pytest.mark.skipif(MSGFMT is None, reason="GNU gettext's msgfmt is not installed "
                                                         "(apt-get install gettext; .ci/run does)")


@pytest.fixture(scope="module")
def po_server(tiny_repository: Path):
    """The tiny model served with the server's default 64 texts per request."""
    with ServerThread(config_for(tiny_repository, "--max-texts", "64")) as s:
        yield s


def machine(catalog: polib.POFile) -> list[polib.POEntry]:
    return [e for e in catalog if ours(e) == MACHINE]


def compile_mo(po_path: Path) -> gettext.GNUTranslations:
    """``msgfmt --check`` (fails the test on any error), then the .mo as Python's gettext loads it."""
    mo = po_path.with_suffix(".mo")
    done = subprocess.run([MSGFMT, "--check", "-o", str(mo), str(po_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with mo.open("rb") as f:
        return gettext.GNUTranslations(f)


# ---- the workflow ------------------------------------------------------------------------------

@needs_msgfmt
def test_fills_the_catalog_and_gettext_answers_with_it(po_server, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fr.po"
    code, stdout, err = translate_po(capsys, FIXTURE, "-o", out, "--server", po_server.address,
                                     "--no-fuzzy", "--batch-size", "5", "--jobs", "3")
    assert code == 0, err
    source, result = polib.pofile(str(FIXTURE)), polib.pofile(str(out))
    filled = machine(result)
    assert stdout.startswith(f"{out}: {len(filled)} translated, 4 kept (2 translated, 1 fuzzy, 1 obsolete), ")
    assert "1 blank" in stdout and "1 more than 16 placeholders" in stdout
    assert len(filled) >= 12, stdout
    # the header: Language, Plural-Forms and X-Generator added, the other fields kept
    assert result.metadata.pop("Language") == "fr"
    assert result.metadata.pop("Plural-Forms") == FRENCH_PLURALS
    assert result.metadata.pop("X-Generator").startswith("nmt-serve ")
    assert result.metadata == source.metadata
    assert [key(e) for e in result] == [key(e) for e in source]  # nothing lost, added or moved
    # entries already translated, fuzzy or obsolete: byte-identical
    before, after = by_key(source), by_key(result)
    for k in [(None, "The red car", False), (None, "One file", False), (None, "The green house", False),
              (None, "Unknown option", True), (None, "   ", False)]:
        assert str(after[k]) == str(before[k]), k
    # plural forms from msgid and msgid_plural; contexts; multi-line; machine output not fuzzy
    for e in filled:
        assert "fuzzy" not in e.flags
        if e.msgid_plural:
            assert sorted(e.msgstr_plural) == [0, 1] and all(e.msgstr_plural.values())
        else:
            assert e.msgstr.strip()
    assert {("menu", "Save the file", False), (None, "Save the file", False)} <= {key(e) for e in filled}
    usage = after[(None, "Usage: app [OPTIONS]\n\n  Print the version and exit.\n", False)].msgstr.split("\n")
    assert len(usage) == 4 and usage[1] == usage[3] == "" and usage[2].startswith("  ")
    spaced = after[(None, "  File not found  ", False)].msgstr
    assert spaced.startswith("  ") and spaced.endswith("  ") and spaced.strip()
    # more placeholders than the server protects (it refuses them): not sent, left out, said why
    twenty = after[(None, " ".join(["%s"] * 20), False)]
    assert twenty.msgstr == "" and ours(twenty) == ("left as it is: more than 16 placeholders, which the "
                                                    "model cannot keep (split the message)")
    # msgfmt accepts it, and gettext answers with the machine translations
    answers = compile_mo(out)
    for e in filled:
        if e.msgid_plural:
            assert answers.ngettext(e.msgid, e.msgid_plural, 1) == e.msgstr_plural[0]
            assert answers.ngettext(e.msgid, e.msgid_plural, 2) == e.msgstr_plural[1]
        elif e.msgctxt:
            assert answers.pgettext(e.msgctxt, e.msgid) == e.msgstr
        else:
            assert answers.gettext(e.msgid) == e.msgstr
    assert answers.gettext("The red car") == "La voiture rouge"


@needs_msgfmt
def test_machine_output_is_fuzzy_by_default(po_server, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fr.po"
    code, _, err = translate_po(capsys, FIXTURE, "-o", out, "--server", po_server.address)
    assert code == 0, err
    filled = machine(polib.pofile(str(out)))
    assert filled and all("fuzzy" in e.flags for e in filled)
    answers = compile_mo(out)  # msgfmt leaves fuzzy entries out until a person has reviewed them
    assert answers.gettext("Open the file") == "Open the file"
    assert answers.gettext("The red car") == "La voiture rouge"
    # a rerun keeps the fuzzy machine output, and its comments do not pile up
    again = tmp_path / "again.po"
    code, stdout, err = translate_po(capsys, out, "-o", again, "--server", po_server.address)
    assert code == 0, err
    assert stdout.startswith(f"{again}: 0 translated, {len(filled) + 4} kept ")
    assert {str(e) for e in polib.pofile(str(again))} == {str(e) for e in polib.pofile(str(out))}


def test_overwrite_retranslates_translated_and_fuzzy_entries(po_server, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fr.po"
    code, stdout, err = translate_po(capsys, FIXTURE, "-o", out, "--server", po_server.address,
                                     "--overwrite")
    assert code == 0, err
    assert "1 kept (1 obsolete)" in stdout
    entries = by_key(polib.pofile(str(out)))
    house = entries[(None, "The green house", False)]
    assert ours(house) == MACHINE and house.previous_msgid is None and "fuzzy" in house.flags
    assert entries[(None, "The red car", False)].tcomment.startswith("Reviewed by Ana.\n")


@needs_msgfmt
def test_a_template_gets_a_usable_header(po_server, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    pot = tmp_path / "app.pot"
    pot.write_text('# SOME DESCRIPTIVE TITLE.\n#, fuzzy\nmsgid ""\nmsgstr ""\n'
                   '"Project-Id-Version: app 1.0\\n"\n"Language: \\n"\n'
                   '"Content-Type: text/plain; charset=CHARSET\\n"\n'
                   '"Content-Transfer-Encoding: 8bit\\n"\n'
                   '"Plural-Forms: nplurals=INTEGER; plural=EXPRESSION;\\n"\n\n'
                   '#, c-format\nmsgid "Delete %d file?"\nmsgid_plural "Delete %d files?"\n'
                   'msgstr[0] ""\nmsgstr[1] ""\n', encoding="utf-8")
    out = tmp_path / "fr.po"
    code, _, err = translate_po(capsys, pot, "-o", out, "--server", po_server.address, "--no-fuzzy")
    assert code == 0, err
    header = polib.pofile(str(out)).metadata
    assert (header["Language"], header["Plural-Forms"]) == ("fr", FRENCH_PLURALS)
    assert header["Content-Type"] == "text/plain; charset=UTF-8"
    assert compile_mo(out).ngettext("Delete %d file?", "Delete %d files?", 2).count("%d") == 1


@pytest.mark.parametrize("beam", [1, 3])
def test_same_translations_as_nmt_translate(po_server, tmp_path: Path, beam: int,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fr.po"
    flag = "--beam" if beam == 1 else "--beam-size"  # the old name is an alias for one release
    code, _, err = translate_po(capsys, FIXTURE, "-o", out, "--server", po_server.address, "--no-fuzzy",
                                flag, beam)
    assert code == 0, err
    filled = machine(polib.pofile(str(out)))
    cores = sorted({core for e in filled for s in (e.msgid, e.msgid_plural) if s
                    for _, core, _ in catalogs.lines(s) if core})
    assert translate.main(["--server", po_server.address, flag, str(beam), "--", *cores]) == 0
    reference = dict(zip(cores, capsys.readouterr().out.split("\n")))
    for e in filled:
        if e.msgid_plural:
            assert e.msgstr_plural == {0: catalogs.rejoin(e.msgid, reference),
                                       1: catalogs.rejoin(e.msgid_plural, reference)}
        else:
            assert e.msgstr == catalogs.rejoin(e.msgid, reference)


def test_progress_bar_only_when_asked_or_on_a_tty(po_server, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = translate_po(capsys, FIXTURE, "-o", tmp_path / "a.po", "--server", po_server.address)
    assert (code, err) == (0, "")  # captured stderr is no TTY
    code, _, err = translate_po(capsys, FIXTURE, "-o", tmp_path / "b.po", "--server", po_server.address,
                                "--progress", "--batch-size", "4")
    assert code == 0
    assert err.startswith("\r[") and err.endswith(" texts\n") and err.count("\r") >= 4


def test_lines_over_the_server_limit_are_not_sent(po_server, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    catalog = tmp_path / "long.po"
    catalog.write_text(f'msgid "Open the file"\nmsgstr ""\n\nmsgid "{"word " * 500}"\nmsgstr ""\n')
    code, stdout, err = translate_po(capsys, catalog, "-o", tmp_path / "out.po",
                                     "--server", po_server.address)
    assert code == 0, err
    assert "1 translated, 0 kept, 1 skipped (1 a line over 2000 characters)" in stdout


# ---- refusals that need the server (the others: tests/test_po_checks.py) ---------------------

def test_a_language_the_model_does_not_translate_into(po_server, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    german = tmp_path / "de.po"
    german.write_text(FIXTURE.read_text().replace('"MIME-Version', '"Language: de\\n"\n"MIME-Version'))
    code, _, err = translate_po(capsys, german, "-o", tmp_path / "out.po", "--server", po_server.address)
    assert code == 2 and "Language is 'de': no served model translates en into de (serves en-fr;" in err
    code, _, err = translate_po(capsys, german, "-o", tmp_path / "out.po", "--server", po_server.address,
                                "--model", "en-fr")
    assert code == 2 and "Language is 'de', the model translates into 'fr'" in err


def test_unwritable_output(po_server, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "missing"
    for out, problem in [(missing / "fr.po", f"no directory {missing}"), (tmp_path, "is a directory")]:
        code, _, err = translate_po(capsys, FIXTURE, "-o", out, "--server", po_server.address)
        assert code == 1 and err == f"nmt translate-po: {out}: cannot write: {problem}\n"
    # a write that fails half-way (disk full) leaves the previous output as it was, and no temp file
    out = tmp_path / "fr.po"
    out.write_text("the previous catalog\n")

    def half_written(self: polib.POFile, fpath: str | None = None, repr_method: str = "__unicode__",
                     newline: str | None = None) -> None:
        Path(fpath).write_text("msgid \"Open")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(polib.POFile, "save", half_written)
    code, _, err = translate_po(capsys, FIXTURE, "-o", out, "--server", po_server.address)
    assert code == 1 and err == f"nmt translate-po: {out}: cannot write: No space left on device\n"
    assert out.read_text() == "the previous catalog\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fr.po"]


def test_a_catalog_in_a_legacy_charset_is_written_in_it(po_server, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    catalog, out = tmp_path / "latin1.po", tmp_path / "out.po"
    catalog.write_bytes('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=ISO-8859-1\\n"\n\n'
                        'msgid "Open the file"\nmsgstr ""\n\n'
                        'msgid "The red car"\nmsgstr "La voiture rouge été"\n'
                        .encode("latin-1"))
    code, stdout, err = translate_po(capsys, catalog, "-o", out, "--server", po_server.address)
    assert code == 0, err
    assert stdout.startswith(f"{out}: 1 translated, 1 kept (1 translated)")
    assert 'msgstr "La voiture rouge \xe9t\xe9"'.encode("latin-1") in out.read_bytes()
    result = polib.pofile(str(out))
    assert result.encoding == "ISO-8859-1" and result.metadata["Content-Type"].endswith("ISO-8859-1")
