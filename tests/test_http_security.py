"""The HTTP/JSON API behind the same TLS files and bearer tokens as gRPC (``tests/test_security.py``'s
certificates): plaintext against HTTPS fails, a known token passes, none or a wrong one is 401
with gRPC's message (the token never echoed) and counted by reason; probes need no token.
"""

from __future__ import annotations

import http.client
import json
import ssl

import grpc
import pytest

pytest.importorskip("cryptography")
from harness import ServerThread  # noqa: E402
from test_security import TOKEN, WRONG_TOKEN, Pki, pki, tls_server  # noqa: E402,F401
from test_security import channel, translate  # noqa: E402

BODY = json.dumps({"texts": ["Open the file"]})


def https(server: ServerThread, pki: Pki, method: str, path: str, token: str | None = None
          ) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=str(pki.dir / "ca.crt"))
    conn = http.client.HTTPSConnection("127.0.0.1", server.http_port, timeout=30, context=context)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        conn.request(method, path, body=BODY if method == "POST" else None, headers=headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def test_tokens_are_checked_as_on_grpc(tls_server: ServerThread, pki: Pki) -> None:
    assert https(tls_server, pki, "POST", "/v1/translate", TOKEN)[0] == 200
    with channel(tls_server.address, pki.ca) as ch:
        assert translate(ch, token=None) == grpc.StatusCode.UNAUTHENTICATED
        grpc_message = None
        try:
            from service.proto.nmt.v1 import translation_pb2 as pb
            from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc
            pb_grpc.TranslatorStub(ch).Translate(pb.TranslateRequest(texts=["a"]), timeout=20)
        except grpc.RpcError as e:
            grpc_message = e.details()
    for token, reason in ((None, "missing"), (WRONG_TOKEN, "invalid")):
        before = tls_server.metric("nmt_auth_failures_total", reason=reason)
        for path in ("/v1/translate", "/v1/translate:stream"):
            status, body = https(tls_server, pki, "POST", path, token)
            assert status == 401 and body == {"code": "UNAUTHENTICATED", "message": grpc_message}
            assert WRONG_TOKEN not in json.dumps(body)
        status, _ = https(tls_server, pki, "GET", "/v1/models", token)
        assert status == 401
        assert tls_server.metric("nmt_auth_failures_total", reason=reason) == before + 3
    assert https(tls_server, pki, "GET", "/healthz")[0] == 200  # probes need no token
    assert https(tls_server, pki, "GET", "/readyz")[0] == 200


def test_plaintext_against_https_fails(tls_server: ServerThread) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", tls_server.http_port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("GET", "/healthz")
        conn.getresponse()
    conn.close()
