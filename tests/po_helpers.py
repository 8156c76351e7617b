"""What the ``nmt translate-po`` tests share (``tests/test_po.py``, ``tests/test_po_checks.py``):
the fixture catalog, a run of the command, and how to find entries and our comments in its output."""

from __future__ import annotations

import polib
import pytest

from harness import ROOT
from service.clients import po
from service.clients import po_catalog as catalogs

FIXTURE = ROOT / "tests" / "fixtures" / "app-fr.po"


def translate_po(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = po.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def key(entry: polib.POEntry) -> tuple[str | None, str, bool]:
    return entry.msgctxt, entry.msgid, entry.obsolete


def by_key(catalog: polib.POFile) -> dict[tuple[str | None, str, bool], polib.POEntry]:
    return {key(e): e for e in catalog}


def ours(entry: polib.POEntry) -> str:
    """This tool's translator comment, its lines rejoined (each line starts with MARK)."""
    return " ".join(line.removeprefix(catalogs.MARK).strip() for line in entry.tcomment.split("\n")
                    if line.startswith(catalogs.MARK))
