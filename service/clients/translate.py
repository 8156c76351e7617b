"""``nmt translate``: translate text with a running server.

    nmt translate "Open the file"          # one or more texts as arguments
    nmt translate < messages.txt           # one text per line, output in the same order
    nmt translate --beam 5 --nbest 3 --alignment "Delete %s files?"

With ``--nbest`` above 1 each hypothesis prints as ``index ||| text ||| score``
(the Moses n-best format); ``--alignment`` adds a table of which source piece
each target piece attended to.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, TextIO

import grpc

from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50051"
TEXTS_PER_REQUEST = 32  # stdin is sent in chunks below the server's --max-texts default


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nmt translate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", help="texts to translate (none: one per line from stdin)")
    p.add_argument("--server", default=os.environ.get("NMT_SERVER", DEFAULT_SERVER),
                   help="host:port of nmt serve [NMT_SERVER]")
    p.add_argument("--model", default="", help="model name (default: the server's default)")
    p.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy)")
    p.add_argument("--nbest", type=int, default=1, help="hypotheses to print per text")
    p.add_argument("--alignment", action="store_true", help="print an alignment table")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    return p.parse_args(argv)


def chunks(lines: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(lines), size):
        yield lines[start:start + size]


def alignment_table(hypothesis: pb.Hypothesis) -> list[str]:
    width = max([len(t) for t in hypothesis.tokens] + [len("target")])
    rows = [f"    {'target':<{width}}  {'source':<12} weight"]
    for a in hypothesis.alignments:
        weight = f"{a.weights[a.source_index]:.2f}" if len(a.weights) > a.source_index else "-"
        token = hypothesis.tokens[a.target_index] if a.target_index < len(hypothesis.tokens) else "?"
        rows.append(f"    {token:<{width}}  {a.source_token:<12} {weight}")
    return rows


def render(translation: pb.Translation, args: argparse.Namespace) -> list[str]:
    """The lines printed for one text."""
    lines = []
    for i, h in enumerate(translation.hypotheses):
        lines.append(f"{i} ||| {h.text} ||| {h.score:.4f}" if args.nbest > 1 else h.text)
        if args.alignment:
            lines += alignment_table(h)
    return lines


def translate_all(stub: pb_grpc.TranslatorStub, texts: list[str], args: argparse.Namespace,
                  out: TextIO) -> None:
    """Translate non-empty texts in chunks; an empty input line prints an empty line."""
    options = pb.DecodingOptions(beam_size=args.beam, num_hypotheses=args.nbest,
                                 return_attention=args.alignment)
    wanted = [t for t in texts if t.strip()]
    answers: list[pb.Translation] = []
    for chunk in chunks(wanted, TEXTS_PER_REQUEST):
        reply = stub.Translate(pb.TranslateRequest(texts=chunk, model=args.model, options=options),
                               timeout=args.timeout)
        answers += reply.translations
    found = iter(answers)
    for text in texts:
        lines = render(next(found), args) if text.strip() else [""]
        out.write("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    args = parse(argv)
    texts = args.texts or [line.rstrip("\r\n") for line in sys.stdin]
    with grpc.insecure_channel(args.server) as channel:
        try:
            translate_all(pb_grpc.TranslatorStub(channel), texts, args, sys.stdout)
        except grpc.RpcError as e:
            print(f"nmt translate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
