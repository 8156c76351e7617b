"""Exit 0 when ``nmt serve`` answers the standard gRPC health check with SERVING.

The container's HEALTHCHECK and the CI smoke test run it; it needs only grpcio
and grpcio-health-checking (both in the serving image). The address comes from
the same ``NMT_HOST``/``NMT_PORT`` variables the server reads, so a container
configured for another port checks that port.

    python healthcheck.py                       # NMT_HOST/NMT_PORT, default 127.0.0.1:50051
    python healthcheck.py --address 127.0.0.1:50061 --service nmt.v1.Translator

With TLS on (``NMT_TLS_CERT_FILE``), it speaks TLS when ``NMT_CLIENT_TLS_CA_FILE`` names
the CA (and presents ``NMT_CLIENT_TLS_CERT_FILE``/``NMT_CLIENT_TLS_KEY_FILE`` under mTLS;
``NMT_CLIENT_TLS_SERVER_NAME``: the name in the server certificate). Health needs no token.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")  # bound everywhere: check over loopback
DEFAULT_PORT = "50051"
TIMEOUT_SECONDS = 2.0  # under the HEALTHCHECK --timeout, so a hung server reads as unhealthy


def default_address() -> str:
    host = os.environ.get("NMT_HOST", "")
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"{host}:{os.environ.get('NMT_PORT', DEFAULT_PORT)}"


def open_channel(address: str) -> grpc.Channel:
    """Plaintext, or TLS with the ``NMT_CLIENT_TLS_*`` files (those of ``nmt translate``)."""
    ca = os.environ.get("NMT_CLIENT_TLS_CA_FILE", "")
    if not ca:
        return grpc.insecure_channel(address)
    cert, key = (os.environ.get(f"NMT_CLIENT_TLS_{k}_FILE", "") for k in ("CERT", "KEY"))
    read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(ca), private_key=read(key), certificate_chain=read(cert))
    name = os.environ.get("NMT_CLIENT_TLS_SERVER_NAME", "")
    return grpc.secure_channel(address, creds,
                               options=[("grpc.ssl_target_name_override", name)] if name else [])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="gRPC health check for nmt serve")
    parser.add_argument("--address", default=default_address(), help="host:port of the server")
    parser.add_argument("--service", default="", help="service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS, help="seconds")
    args = parser.parse_args(argv)
    with open_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
