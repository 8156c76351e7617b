"""``nmt translate``: translate text with a running server.

    nmt translate "Open the file"          # one or more texts as arguments
    nmt translate < messages.txt           # one text per line, output in the same order
    nmt translate --beam-size 5 --num-hypotheses 3 --return-attention "Delete %s files?"
    nmt translate --tls-ca-file ca.crt --token-file token "Open the file"   # TLS and a token

The decoding flags are named as the API's options (``beam_size``, ``num_hypotheses``,
``return_attention``). With ``--num-hypotheses`` above 1 each hypothesis prints as
``index ||| text ||| score`` (the Moses n-best format); ``--return-attention`` adds a
table of which source piece each target piece attended to. The old spellings
``--beam``, ``--nbest`` and ``--alignment`` still work, for one release (deprecated).

TLS: ``--tls-ca-file`` (the CA the server's certificate must chain to) turns TLS on;
``--tls-cert-file`` and ``--tls-key-file`` present a client certificate (mTLS).
``--token-file``: its first token (not a ``#`` comment) is sent as
``authorization: Bearer <token>``. Each has an ``NMT_CLIENT_*`` variable (not
``NMT_*``: those are ``nmt serve``'s settings).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence, TextIO

import grpc

from service.clients.po_channel import positive_seconds
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
    # the old names stay as aliases for one release (DEPRECATED_FLAGS; argparse accepts both)
    p.add_argument("--beam-size", "--beam", dest="beam_size", type=int, default=1,
                   help="beam size (1 = greedy) [deprecated alias: --beam]")
    p.add_argument("--num-hypotheses", "--nbest", dest="num_hypotheses", type=int, default=1,
                   help="hypotheses to print per text [deprecated alias: --nbest]")
    p.add_argument("--return-attention", "--alignment", dest="return_attention", action="store_true",
                   help="print an alignment table [deprecated alias: --alignment]")
    p.add_argument("--timeout", type=positive_seconds, default=30.0, help="seconds per request (> 0)")
    for flag, help_ in CLIENT_FLAGS:
        name = client_env(flag)
        p.add_argument(flag, default=os.environ.get(name, ""), help=f"{help_} [{name}]")
    return p.parse_args(argv)


CLIENT_FLAGS = [
    ("--tls-ca-file", "PEM CA certificates to verify the server with (set: TLS)"),
    ("--tls-cert-file", "PEM client certificate (mTLS; with --tls-key-file)"),
    ("--tls-key-file", "PEM private key of --tls-cert-file"),
    ("--tls-server-name", "name to verify the server certificate against (default: the host)"),
    ("--token-file", "file whose first token is sent as 'authorization: Bearer <token>'"),
]


DEPRECATED_FLAGS = {"--beam": "--beam-size", "--nbest": "--num-hypotheses",
                    "--alignment": "--return-attention"}
"""Old flag -> its name as the API's option; the old ones go in the release after next."""


def client_env(flag: str) -> str:
    return "NMT_CLIENT_" + flag.lstrip("-").replace("-", "_").upper()


def read_token(path: str) -> str:
    """The first line that is not blank nor a ``#`` comment."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    raise ValueError(f"{path}: no token in the file")


def open_channel(server: str, *, ca_file: str = "", cert_file: str = "", key_file: str = "",
                 server_name: str = "") -> grpc.Channel:
    """A plaintext channel, or TLS when ``ca_file`` is given (mTLS with cert and key)."""
    if not ca_file:
        if cert_file or key_file:
            raise ValueError("--tls-cert-file and --tls-key-file need --tls-ca-file")
        return grpc.insecure_channel(server)
    if bool(cert_file) != bool(key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(server, creds, options=options)


def auth_metadata(token_file: str) -> Sequence[tuple[str, str]] | None:
    return [("authorization", f"Bearer {read_token(token_file)}")] if token_file else None


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
        lines.append(f"{i} ||| {h.text} ||| {h.score:.4f}" if args.num_hypotheses > 1 else h.text)
        if args.return_attention:
            lines += alignment_table(h)
    return lines


def translate_all(stub: pb_grpc.TranslatorStub, texts: list[str], args: argparse.Namespace,
                  out: TextIO) -> None:
    """Translate non-empty texts in chunks; an empty input line prints an empty line."""
    options = pb.DecodingOptions(beam_size=args.beam_size, num_hypotheses=args.num_hypotheses,
                                 return_attention=args.return_attention)
    wanted = [t for t in texts if t.strip()]
    answers: list[pb.Translation] = []
    for chunk in chunks(wanted, TEXTS_PER_REQUEST):
        reply = stub.Translate(pb.TranslateRequest(texts=chunk, model=args.model, options=options),
                               timeout=args.timeout, metadata=auth_metadata(args.token_file))
        answers += reply.translations
    found = iter(answers)
    for text in texts:
        lines = render(next(found), args) if text.strip() else [""]
        out.write("\n".join(lines) + "\n")


def warn_deprecated(argv: Sequence[str]) -> None:
    """One line on stderr per old flag name used (``--beam`` or ``--beam=5``)."""
    for arg in argv:
        if arg == "--":
            break
        new = DEPRECATED_FLAGS.get(arg.split("=", 1)[0])
        if new:
            print(f"nmt translate: {arg.split('=', 1)[0]} is deprecated, use {new}", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = parse(argv)
    warn_deprecated(argv)
    try:
        channel = open_channel(args.server, ca_file=args.tls_ca_file, cert_file=args.tls_cert_file,
                               key_file=args.tls_key_file, server_name=args.tls_server_name)
        auth_metadata(args.token_file)  # a bad token file fails before stdin is read
    except (OSError, ValueError) as e:
        print(f"nmt translate: {e}", file=sys.stderr)
        return 2
    texts = args.texts or [line.rstrip("\r\n") for line in sys.stdin]
    with channel:
        try:
            translate_all(pb_grpc.TranslatorStub(channel), texts, args, sys.stdout)
        except grpc.RpcError as e:
            print(f"nmt translate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
