"""What the ``nmt translate-po`` tests share (``tests/test_po.py``, ``tests/test_po_checks.py``,
``tests/test_hostile_po.py``): the fixture catalog, a run of the command, how to find entries and
our comments in its output, and a stand-in server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc
import polib
import pytest

from harness import ROOT
from service.clients import po
from service.clients import po_catalog as catalogs
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

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


class StandIn(pb_grpc.TranslatorServicer):
    """A stand-in server (no model): one model that names ``languages``; its "translation" is
    the text in brackets."""

    def __init__(self, languages: tuple[str, ...]) -> None:
        self.languages = languages

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="echo", version="7", languages=self.languages,
                                                          is_default=True)])

    def Translate(self, request, context):
        return pb.TranslateResponse(translations=[pb.Translation(hypotheses=[pb.Hypothesis(text=f"[{t}]")])
                                                  for t in request.texts])


@contextlib.contextmanager
def stand_in(languages: tuple[str, ...] = ("en", "fr")) -> Iterator[str]:
    """A ``StandIn`` on a loopback port; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TranslatorServicer_to_server(StandIn(languages), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
