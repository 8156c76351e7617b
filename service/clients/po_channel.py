"""The clients' connection: translate-po's TLS and token options, the channel they open, and the
request timeout both ``nmt translate`` and ``nmt translate-po`` take."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import grpc

from service.clients.po_syntax import Failure

DEFAULT_SERVER = "127.0.0.1:50051"
Metadata = tuple[tuple[str, str], ...]


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (gRPC would take -1 or nan as given)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return value


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=os.environ.get("NMT_SERVER", DEFAULT_SERVER),
                   help="host:port of nmt serve [NMT_SERVER]")
    p.add_argument("--tls-ca-file", help="PEM roots to verify the server (TLS; default: system roots)")
    p.add_argument("--tls-cert-file", help="PEM client certificate (mutual TLS; with --tls-key-file)")
    p.add_argument("--tls-key-file", help="PEM client private key (mutual TLS)")
    p.add_argument("--token-file", help="file holding a bearer token, sent as 'authorization'")


def open_channel(args: argparse.Namespace) -> tuple[grpc.Channel, Metadata]:
    """A channel to ``args.server`` (TLS when any --tls-* option is given) and the call metadata."""
    metadata: Metadata = ()
    if args.token_file:
        token = _read(args.token_file, "--token-file").decode().strip()
        if not token:
            raise Failure(2, f"{args.token_file}: the token file is empty")
        metadata = (("authorization", f"Bearer {token}"),)
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise Failure(2, "--tls-cert-file and --tls-key-file go together")
    if not (args.tls_ca_file or args.tls_cert_file):
        return grpc.insecure_channel(args.server), metadata
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(args.tls_ca_file, "--tls-ca-file") if args.tls_ca_file else None,
        private_key=_read(args.tls_key_file, "--tls-key-file") if args.tls_key_file else None,
        certificate_chain=_read(args.tls_cert_file, "--tls-cert-file") if args.tls_cert_file else None)
    return grpc.secure_channel(args.server, credentials), metadata


def _read(path: str, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise Failure(2, f"{path}: cannot read {option}: {e.strerror}") from None
