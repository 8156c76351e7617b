"""``nmt translate-po`` against a server of four directions (``languages_repository``: en-fr,
en-de, en-es, fr-en): without ``--model`` the catalog's ``Language`` picks the model."""

from __future__ import annotations

from pathlib import Path

import polib
import pytest

from harness import ServerThread, config_for
from po_helpers import ours, translate_po

SERVED = "en-fr, en-de, en-es, fr-en"


@pytest.fixture(scope="module")
def served(languages_repository: Path):
    with ServerThread(config_for(languages_repository, "--default-model", "en-fr")) as s:
        yield s


def catalog(path: Path, language: str) -> Path:
    header = f'"Language: {language}\\n"\n' if language else ""
    path.write_text('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n' + header + "\n"
                    'msgid "1 2 3"\nmsgstr ""\n\n'
                    'msgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] ""\nmsgstr[1] ""\n')
    return path


def filled_by(out: Path) -> tuple[str, str]:
    """The model named in the machine-translation comment, and the first entry's translation."""
    result = polib.pofile(str(out))
    return ours(result[0]).removeprefix("machine translation by model "), result[0].msgstr


@pytest.mark.parametrize(("language", "model"), [
    ("de", "en-de"), ("es_ES", "en-es"), ("de_DE", "en-de"), ("fr", "en-fr"), ("", "en-fr")])
def test_the_catalog_language_picks_the_model(served: ServerThread, tmp_path: Path, language: str,
                                              model: str, capsys: pytest.CaptureFixture[str]) -> None:
    source, out = catalog(tmp_path / "in.po", language), tmp_path / "out.po"
    code, _, err = translate_po(capsys, source, "-o", out, "--server", served.address)
    assert code == 0, err
    assert filled_by(out) == (f"{model} version 1", "3 2 1")
    # the header keeps the catalog's own spelling of its language
    assert polib.pofile(str(out)).metadata["Language"] == (language or "fr")


def test_a_language_no_model_produces_exits_2_naming_the_served_directions(
        served: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, out = catalog(tmp_path / "it.po", "it"), tmp_path / "out.po"
    code, stdout, err = translate_po(capsys, source, "-o", out, "--server", served.address)
    assert code == 2 and not stdout and not out.exists()
    assert err == (f"nmt translate-po: {source}: the catalog's Language is 'it': no served model translates "
                   f"en into it (serves {SERVED}; --model to choose one)\n")


def test_language_option_and_source_language(served: ServerThread, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    template, out = catalog(tmp_path / "app.pot", ""), tmp_path / "out.po"
    code, _, err = translate_po(capsys, template, "-o", out, "--server", served.address, "--language", "es")
    assert code == 0, err
    assert filled_by(out)[0] == "en-es version 1"
    assert polib.pofile(str(out)).metadata["Language"] == "es"
    code, _, err = translate_po(capsys, template, "-o", out, "--server", served.address, "--overwrite",
                                "--source-language", "fr", "--language", "en")
    assert code == 0, err
    assert filled_by(out)[0] == "fr-en version 1"
    code, _, err = translate_po(capsys, template, "-o", out, "--server", served.address, "--language", "it")
    assert code == 2 and f"--language it: no served model translates en into it (serves {SERVED}" in err
    # --language that contradicts the catalog's Language: a retarget, refused without --overwrite
    german = catalog(tmp_path / "de.po", "de")
    code, _, err = translate_po(capsys, german, "-o", out, "--server", served.address, "--language", "es")
    assert code == 2 and "Language is 'de', the model translates into 'es' (--overwrite" in err


def test_an_explicit_model_keeps_its_checks(served: ServerThread, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    german, out = catalog(tmp_path / "de.po", "de"), tmp_path / "out.po"
    code, _, err = translate_po(capsys, german, "-o", out, "--server", served.address, "--model", "en-es")
    assert code == 2 and "Language is 'de', the model translates into 'es' (--overwrite" in err
    code, _, err = translate_po(capsys, german, "-o", out, "--server", served.address, "--model", "en-de/1")
    assert code == 0, err
    assert filled_by(out)[0] == "en-de version 1"
    code, _, err = translate_po(capsys, german, "-o", out, "--server", served.address, "--model", "en-de",
                                "--language", "fr")
    assert code == 2 and "--language fr: model en-de/1 translates into de, not fr" in err
