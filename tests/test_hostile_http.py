"""A hostile HTTP client: raw bytes on a loopback socket, nested and corrupt bodies, bad
``Authorization`` headers, aborted streams. Every answer is a JSON error with the closest
status, the server stays up, the log holds no traceback and no token (issue 31, rows 4, 5, 7,
8, 14 and 18)."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ServerThread, config_for, http_request, wait_until
from service.api.auth import TokenFile
from service.api.http_json import nested_too_deep

TOKEN = "s3cret-hostile-token"
TRANSLATE = b'{"texts": ["1 2 3"]}'


@pytest.fixture(scope="module")
def tokens_server(reversal_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    with ServerThread(config_for(reversal_repository, "--auth-token-file", str(tokens))) as s:
        yield s


def raw(port: int, data: bytes, *, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` as is; the status, headers (lower-case names) and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
                if b"\r\n\r\n" in out.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n"):
                    head, _, body = out.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n").partition(b"\r\n\r\n")
                    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")]
                    if length and len(body) >= length[0]:
                        break
        except (socket.timeout, ConnectionResetError):
            pass
    head, _, body = out.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n").partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, *headers: bytes) -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"".join(h + b"\r\n" for h in headers) + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r.getMessage() for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_json_nested_a_thousand_deep_is_a_400(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    for body in (b'{"texts": ' + b"[" * 1000 + b"]" * 1000 + b"}",
                 b'{"texts": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"):
        answer = http_request(server.http_port, "POST", "/v1/translate", body,
                              headers={"Content-Type": "application/json"})
        assert answer.status == 400, answer.body[:200]
        assert answer.json() == {"code": "INVALID_ARGUMENT",
                                 "message": "request body must be JSON: arrays and objects nested more than 32 deep (the limit)"}
        answer = http_request(server.http_port, "POST", "/translate", body.replace(b"texts", b"q"),
                              headers={"Content-Type": "application/json"})
        assert answer.status == 400 and answer.json() == {"error": "Invalid request: the body is not valid JSON"}
    no_tracebacks(caplog)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\ab'),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text('[]{}"\\'), inner, max_size=3),
                    max_leaves=60))
def test_the_depth_check_counts_brackets_outside_strings_only(tree: object) -> None:
    body = json.dumps(tree).encode()
    for limit in (1, 2, 4, 8):
        assert nested_too_deep(body, limit) == (depth(tree) > limit), (body, limit)


def depth(tree: object) -> int:
    if isinstance(tree, list):
        return 1 + max(map(depth, tree), default=0)
    if isinstance(tree, dict):
        return 1 + max(map(depth, tree.values()), default=0)
    return 0


@pytest.mark.parametrize("value", [b"Bearer \xff", b"Bearer " + TOKEN.encode() + b"\xff",
                                   b"Bearer \xc3\xa9t\xc3\xa9", b"\xff\xfe"])
def test_a_non_ascii_authorization_is_a_401(tokens_server: ServerThread, value: bytes,
                                            caplog: pytest.LogCaptureFixture) -> None:
    code, headers, body = raw(tokens_server.http_port, post("/v1/translate", TRANSLATE, b"Authorization: " + value))
    assert code == 401, body
    assert headers.get("www-authenticate") == "Bearer"
    assert json.loads(body)["code"] == "UNAUTHENTICATED"
    no_tracebacks(caplog)


def test_a_token_with_a_nul_is_never_logged_nor_echoed(tokens_server: ServerThread,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    code, _, body = raw(tokens_server.http_port, post("/v1/translate", TRANSLATE,
                                                      b"Authorization: Bearer " + TOKEN.encode() + b"\x00"))
    assert code == 400
    assert json.loads(body) == {"code": "INVALID_ARGUMENT", "message": "malformed HTTP request"}
    assert TOKEN.encode() not in body
    assert not any(TOKEN in r.getMessage() or (r.exc_info and TOKEN in str(r.exc_info[1]))
                   for r in caplog.records)
    assert TOKEN not in caplog.text
    ok = http_request(tokens_server.http_port, "POST", "/v1/translate", {"texts": ["1 2"]},
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status == 200


def test_a_401_names_the_bearer_scheme(tokens_server: ServerThread) -> None:
    answer = http_request(tokens_server.http_port, "GET", "/v1/models")
    assert answer.status == 401 and answer.headers["www-authenticate"] == "Bearer"


def test_a_deleted_token_file_is_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\n")
    tokens = TokenFile(path)
    path.unlink()
    for _ in range(3):
        assert tokens.accepts(TOKEN.encode())  # the previous tokens are kept
    lines = [r.getMessage() for r in caplog.records if r.name == "nmt.auth"]
    assert lines == [f"token file {path} cannot be read (deleted?): keeping the previous 1 tokens"]
    path.write_text("another\n")
    assert tokens.accepts(b"another") and not tokens.accepts(TOKEN.encode())


def until_closed(port: int, data: bytes, *, timeout: float = 10) -> bytes:
    """Send ``data``; everything the server sends until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out


@pytest.mark.parametrize("path, content_type, body, error_field", [
    ("/v1/translate", b"application/json", b"not gzip at all", "message"),
    ("/v1/translate", b"application/json", b"\x1f\x8b\x08\x00" + b"\x00" * 20, "message"),
    ("/translate", b"application/json", b"not gzip at all", "error"),
    ("/translate", b"application/x-www-form-urlencoded", b"not gzip at all", "error"),
], ids=["translate-garbage", "translate-truncated", "libretranslate-json", "libretranslate-form"])
def test_an_unreadable_body_is_a_400_that_closes_the_connection(server: ServerThread, path: str, content_type: bytes,
                                                                body: bytes, error_field: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A body that cannot be decoded: the answer closes the connection (the rest of the stream
    cannot be framed), and aiohttp does not linger re-reading the payload whose error it would
    log as unhandled. Reading until the server closes makes the check after its last word."""
    out = until_closed(server.http_port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       + content_type + b"\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    head, _, answer = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), out[:300]
    assert b"connection: close" in head.lower()
    assert "could not be read" in json.loads(answer)[error_field]
    no_tracebacks(caplog)
    assert http_request(server.http_port, "GET", "/healthz").status == 200


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n", 431),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(2000)) + b"\r\n", 431),
    (b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     400),
    (b"GARBAGE\r\n\r\n", 400),
    (post("/v1/translate", b"not gzip at all", b"Content-Encoding: gzip"), 400),
    (b"GET /web/" + b"a" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /web/missing HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
], ids=["long-url", "long-header", "many-headers", "bad-chunk", "cl-and-te", "garbage", "corrupt-gzip", "long-web-path",
        "web-missing", "no-route"])
def test_malformed_requests_get_a_json_error_and_no_traceback(server: ServerThread, request_bytes: bytes,
                                                              status: int, caplog: pytest.LogCaptureFixture) -> None:
    code, headers, body = raw(server.http_port, request_bytes)
    assert code == status, body[:300]
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)
    assert set(error) == {"code", "message"} and error["message"]
    no_tracebacks(caplog)
    assert http_request(server.http_port, "GET", "/healthz").status == 200


def test_expect_100_continue_with_a_body_too_large_is_a_413_before_the_body(server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: 100000000\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    assert b"100 Continue" not in answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "RESOURCE_EXHAUSTED"
    # a body within the limit still gets its 100 Continue and its answer
    code, _, body = raw(server.http_port, post("/v1/translate", TRANSLATE, b"Expect: 100-continue"))
    assert code == 200, body


def test_streams_aborted_after_the_first_event_log_no_traceback(server: ServerThread,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    texts = json.dumps({"texts": ["1 2 3 4 5 6 7 8 9 " * 4] * 8}).encode()
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            s.sendall(post("/v1/translate:stream", texts))
            first = s.recv(4096)
            assert first.startswith(b"HTTP/1.1 200"), first[:100]
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    time.sleep(0.5)
    wait_until(lambda: http_request(server.http_port, "GET", "/healthz").status == 200, timeout=10,
               what="the server answering")
    no_tracebacks(caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
