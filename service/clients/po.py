"""``nmt translate-po``: fill a gettext catalog (``.po`` or ``.pot``) through a running server.

    nmt translate-po messages.pot -o fr.po            # machine output marked fuzzy
    nmt translate-po fr.po -o fr.po --no-fuzzy --beam-size 4

Entries already translated (fuzzy or not), obsolete entries and the header's
other fields are kept as they are unless ``--overwrite``. Plural entries get
``msgstr[0]`` from ``msgid`` and the other forms from ``msgid_plural``;
multi-line messages are translated line by line; a translation that would break
the entry's ``c-format``, ``python-format`` or ``python-brace-format`` flag is
left out with a comment saying why. Input that ``msgfmt --check`` refuses is refused (exit 2,
naming the line: ``po_syntax.py``). The output is written whole or not at all (through a
symbolic link, at its target). Without ``--model``, the catalog's ``Language`` picks the served
model of that direction (``po_models.py``).
"""

from __future__ import annotations

import argparse
import queue
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
import polib

from service.clients import po_catalog as catalogs
from service.clients import po_models
from service.clients.po_catalog import Failure
from service.clients.po_channel import DEFAULT_SERVER, Metadata, add_connection_arguments, open_channel  # noqa: F401
from service.clients.po_channel import positive_seconds
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

MAX_TEXTS = 64  # the server's default --max-texts


# ---- requests: many texts each, several in flight ----

class Progress:
    """A one-line bar on ``stream`` (stderr), redrawn as answers come; nothing when disabled."""

    WIDTH = 30

    def __init__(self, total: int, stream: TextIO, *, enabled: bool) -> None:
        self.total, self.done, self.stream, self.enabled = total, 0, stream, enabled and total > 0

    def advance(self, count: int) -> None:
        self.done += count
        if self.enabled:
            filled = self.WIDTH * self.done // self.total
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                              f"{self.done}/{self.total} texts")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


@dataclass(frozen=True)
class Requests:
    """How texts are sent: to which model, decoded how, how many at once."""

    stub: pb_grpc.TranslatorStub
    model: str
    beam: int
    batch_size: int
    jobs: int  # requests in flight
    timeout: float
    metadata: Metadata


def translate_texts(texts: list[str], how: Requests, progress: Progress) -> dict[str, str]:
    """Each text's best translation. Keeps ``how.jobs`` requests in flight; on the first error,
    cancels the others and raises ``BatchError``."""
    options = pb.DecodingOptions(beam_size=how.beam)
    batches = iter([texts[i:i + how.batch_size] for i in range(0, len(texts), how.batch_size)])
    answered: queue.Queue[grpc.Future] = queue.Queue()  # done callbacks run on gRPC's threads
    pending: dict[grpc.Future, list[str]] = {}

    def send() -> None:
        batch = next(batches, None)
        if batch is not None:
            call = how.stub.Translate.future(pb.TranslateRequest(texts=batch, model=how.model,
                                                                 options=options),
                                             timeout=how.timeout, metadata=how.metadata)
            pending[call] = batch
            call.add_done_callback(answered.put)

    for _ in range(how.jobs):
        send()
    found: dict[str, str] = {}
    while pending:
        call = answered.get()
        batch = pending.pop(call)
        try:
            reply = call.result()
        except grpc.RpcError as e:
            for other in pending:
                other.cancel()
            raise BatchError(batch, e) from None
        found.update(zip(batch, (t.hypotheses[0].text for t in reply.translations)))
        progress.advance(len(batch))
        send()
    return found


class BatchError(Exception):
    """A request the server answered with an error: its texts and the error."""

    def __init__(self, texts: list[str], error: grpc.RpcError) -> None:
        super().__init__(error.details())
        self.texts, self.code, self.details = texts, error.code().name, error.details() or ""

    def failure(self, path: Path, entries: dict[str, polib.POEntry]) -> Failure:
        """One line naming the entry the server refused (when its message says which text)."""
        index = re.search(r"texts\[(\d+)\]", self.details)
        at = int(index.group(1)) if index and int(index.group(1)) < len(self.texts) else None
        entry = entries[self.texts[at or 0]]
        where = "" if at is not None else f" (one of a request of {len(self.texts)} texts)"
        return Failure(1, f"{path}:{entry.linenum}: msgid {entry.msgid[:60]!r}{where}: "
                          f"the server answered {self.code}: {self.details}")


# ---- the run ----

@dataclass
class Summary:
    translated: int = 0
    kept: Counter[str] = field(default_factory=Counter)  # reason -> entries
    skipped: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def line(self, output: Path) -> str:
        def detail(counts: Counter[str]) -> str:
            return f" ({', '.join(f'{n} {why}' for why, n in counts.most_common())})" if counts else ""
        return (f"{output}: {self.translated} translated, {sum(self.kept.values())} kept"
                f"{detail(self.kept)}, {sum(self.skipped.values())} skipped{detail(self.skipped)} "
                f"in {self.seconds:.1f} s")


def plan(catalog: polib.POFile, nplurals: int, *, overwrite: bool,
         summary: Summary) -> tuple[list[polib.POEntry], dict[str, polib.POEntry]]:
    """The entries to translate, and each distinct text to send with the first entry that has
    it (sent once: the same line in two entries gets the same translation); counts the rest."""
    entries: list[polib.POEntry] = []
    texts: dict[str, polib.POEntry] = {}
    for entry in catalog:
        kept = catalogs.keep_reason(entry, overwrite=overwrite)
        skipped = None if kept else catalogs.skip_reason(entry, nplurals)
        if kept:
            summary.kept[kept] += 1
            continue
        if skipped:
            summary.skipped[skipped] += 1
            if skipped == catalogs.TOO_MANY_PLACEHOLDERS:
                catalogs.set_comment(entry, catalogs.TOO_MANY_COMMENT)
            continue
        entries.append(entry)
        for source in catalogs.sources(entry, nplurals):
            for _, core, _ in catalogs.lines(source):
                if core:
                    texts.setdefault(core, entry)
    return entries, texts


def run(args: argparse.Namespace, stderr: TextIO) -> Summary:
    started = time.monotonic()
    source = Path(args.input)
    catalog = catalogs.read_catalog(source)
    output = catalogs.resolve_output(Path(args.output))
    channel, metadata = open_channel(args)
    with channel:
        stub = pb_grpc.TranslatorStub(channel)
        model = po_models.choose(stub, args, metadata, catalog, str(source))
        target = po_models.target_language(model, args.language, stderr)
        nplurals = catalogs.update_header(catalog, target, overwrite=args.overwrite, path=source)
        summary = Summary()
        entries, texts = plan(catalog, nplurals, overwrite=args.overwrite, summary=summary)
        progress = Progress(len(texts), stderr, enabled=args.progress or stderr.isatty())
        # the version ListModels named, not "the default": a version swap mid-run fails the run
        # instead of mixing two models' output under one comment
        how = Requests(stub=stub, model=f"{model.name}/{model.version}", beam=args.beam,
                       batch_size=args.batch_size, jobs=args.jobs, timeout=args.timeout, metadata=metadata)
        try:
            translations = translate_texts(list(texts), how, progress)
        except BatchError as e:
            raise e.failure(source, texts) from None
        finally:
            progress.close()
    filling = catalogs.Filling(nplurals=nplurals, fuzzy=not args.no_fuzzy, encoding=catalog.encoding,
                               comment=f"machine translation by model {model.name} version {model.version}")
    for entry in entries:
        problem = catalogs.fill(entry, translations, filling)
        if problem:
            summary.skipped[problem] += 1
        else:
            summary.translated += 1
    catalogs.write_atomically(catalog, output)
    summary.seconds = time.monotonic() - started
    return summary


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""
    def convert(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value
    return convert


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nmt translate-po", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="the catalog to fill: a .po or .pot")
    p.add_argument("-o", "--output", required=True, help="the catalog to write (may be INPUT)")
    add_connection_arguments(p)
    p.add_argument("--model", default="", help="model name or name/version (default: the served model "
                   "of the catalog's Language, else the server's default)")
    p.add_argument("--beam-size", "--beam", dest="beam", type=_int_in(1, 64), default=1,
                   help="beam size (1 = greedy) [deprecated alias: --beam]")
    p.add_argument("--language", default="", help="target language (default: the catalog's Language, "
                   "else the model's)")
    p.add_argument("--source-language", default="en", help="the msgids' language, to pick the model (default: en)")
    p.add_argument("--overwrite", action="store_true", help="retranslate translated and fuzzy entries")
    p.add_argument("--no-fuzzy", action="store_true", help="do not mark machine output fuzzy")
    p.add_argument("--progress", action="store_true", help="show the progress bar (default: on a TTY)")
    p.add_argument("--batch-size", type=_int_in(1, MAX_TEXTS), default=32, help="texts per request")
    p.add_argument("--jobs", type=_int_in(1, 64), default=4, help="requests in flight")
    p.add_argument("--timeout", type=positive_seconds, default=120.0, help="seconds per request")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        summary = run(args, sys.stderr)
    except Failure as e:
        print(f"nmt translate-po: {e.message}", file=sys.stderr)
        return e.code
    print(summary.line(Path(args.output)))
    return 0
