"""Who may call ``nmt serve``: TLS (mTLS with client CAs) and bearer tokens, both re-read on change.

- ``TlsFiles``: the PEM certificate, key and optional client CAs. Checked at start-up
  (a missing, unreadable or mismatched file is a ``ConfigError`` naming it: the server
  stops with one line). gRPC asks ``fetch`` before every TLS handshake
  (``grpc.dynamic_ssl_server_credentials``); it re-reads the files when their stat
  changed, so a rotated certificate serves new connections without a restart. A
  half-written rotation is kept out: the old certificate stays until the files agree.
- ``TokenFile``: one token per line, ``#`` comments; re-read when it changes.
- ``TokenCheck``: the one token check of every transport: calls without
  ``authorization: Bearer <known token>`` are refused UNAUTHENTICATED (the token is never
  echoed nor logged), counted in ``nmt_auth_failures_total{reason}``. gRPC asks it in
  ``AuthInterceptor`` (health is exempt, so probes need no token); HTTP through the hook
  ``authorizer`` makes, with ``tls_context`` for HTTPS from the same files.

Shared by the transports (``grpc_server``, ``http_server``), which import it and the front
door (``frontend``), never each other.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, Sequence

import grpc
from prometheus_client import Counter

from service.config import ConfigError, SecurityConfig
from service.errors import ErrorKind, NmtError
from service.metrics import Metrics

log = logging.getLogger("nmt.auth")

EXEMPT_PREFIX = "/grpc.health.v1.Health/"  # liveness and readiness probes carry no token
REASONS = ("missing", "malformed", "invalid")  # no header; not "Bearer <token>"; unknown token
REFUSAL = "missing or invalid token: send metadata 'authorization: Bearer <token>'"
Stamp = tuple[tuple[int, int, int], ...] | None
Authorize = Callable[[Mapping[str, str]], None]


def stamp(paths: Sequence[Path]) -> Stamp:
    """What changes when a file is rewritten or replaced (None: one cannot be read now)."""
    try:
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in (os.stat(p) for p in paths))
    except OSError:
        return None


def read_file(path: Path, what: str) -> bytes:
    """The file's bytes, or ConfigError naming it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if not data.strip():
        raise ConfigError(f"{path}: the {what} is empty")
    return data


def _no_password() -> str:
    raise ConfigError("encrypted private keys are not supported")


def check_tls(cert: Path, key: Path, ca: Path | None) -> None:
    """Parse the certificate, the key (it must match the certificate) and the CAs with OpenSSL,
    so that a bad file fails here, naming it, not at the first handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for path, what in ((cert, "TLS certificate"), *(((ca, "client CA file"),) if ca else ())):
        read_file(path, what)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(path))
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"{path}: not a PEM certificate ({e})") from None
    read_file(key, "TLS private key")
    try:
        context.load_cert_chain(str(cert), str(key), password=_no_password)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e) or "key values mismatch" in str(e):
            raise ConfigError(f"{key}: private key does not match the certificate {cert}") from None
        raise ConfigError(f"{key}: not a PEM private key for {cert} ({e})") from None
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


class TlsFiles:
    """The server's TLS files and the credentials that re-read them."""

    def __init__(self, security: SecurityConfig) -> None:
        assert security.tls_cert_file is not None and security.tls_key_file is not None
        self.cert, self.key = security.tls_cert_file, security.tls_key_file
        self.ca = security.tls_client_ca_file
        self.paths = [self.cert, self.key, *([self.ca] if self.ca else [])]
        self.stamp, self.rejected = stamp(self.paths), None
        self.current = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        check_tls(self.cert, self.key, self.ca)
        return grpc.ssl_server_certificate_configuration(
            [(read_file(self.key, "TLS private key"), read_file(self.cert, "TLS certificate"))],
            root_certificates=read_file(self.ca, "client CA file") if self.ca else None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake question: new files (a configuration) or no change (None)."""
        now = stamp(self.paths)
        if now is None or now == self.stamp or now == self.rejected:
            return None
        try:
            config = self._load()
        except ConfigError as e:  # mid-rotation, or a bad file: keep serving the old one
            self.rejected = now
            log.warning("keeping the current TLS certificate: %s", e)
            return None
        self.stamp, self.current = now, config
        log.info("TLS files changed: new connections use %s", self.cert)
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.current, self.fetch,
                                                   require_client_authentication=self.ca is not None)


class TokenFile:
    """The accepted tokens: one per line, blank lines and ``#`` comments ignored."""

    def __init__(self, path: Path) -> None:
        self.path, self.stamp = path, stamp([path])
        self.tokens = self._load()

    def _load(self) -> list[bytes]:
        lines = read_file(self.path, "token file").decode("utf-8", "replace").splitlines()
        tokens = [t.strip().encode() for t in lines if t.strip() and not t.lstrip().startswith("#")]
        if not tokens:
            raise ConfigError(f"{self.path}: the token file has no token (only comments or blanks)")
        return tokens

    def current(self) -> list[bytes]:
        """The tokens, re-read if the file changed (a bad rewrite keeps the old ones)."""
        now = stamp([self.path])
        if now is None and self.stamp is not None:  # once, until it can be read again
            self.stamp = None
            log.warning("token file %s cannot be read (deleted?): keeping the previous %d tokens",
                        self.path, len(self.tokens))
        elif now is not None and now != self.stamp:
            self.stamp = now
            try:
                self.tokens = self._load()
                log.info("token file %s changed: %d tokens", self.path, len(self.tokens))
            except ConfigError as e:
                log.warning("keeping the previous tokens: %s", e)
        return self.tokens

    def accepts(self, presented: bytes) -> bool:
        """Constant time per token, every token compared: no early exit to time."""
        found = False
        for token in self.current():
            found |= hmac.compare_digest(token, presented)
        return found


def refusal_reason(metadata: Sequence[Any] | None, tokens: TokenFile) -> str | None:
    """None if the call carries a known token, else why not (one of REASONS)."""
    values = [m.value for m in metadata or () if m.key == "authorization"]
    if not values:
        return "missing"
    value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "malformed"
    try:  # a header's non-ASCII bytes arrive as surrogates (aiohttp) or characters
        presented = token.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return "malformed"
    return None if tokens.accepts(presented) else "invalid"


class TokenCheck:
    """The token check of every transport: the same tokens, refusal message and counter."""

    def __init__(self, tokens: TokenFile, metrics: Metrics) -> None:
        self.tokens = tokens
        self.failures = Counter("nmt_auth_failures_total", "Calls refused UNAUTHENTICATED, by reason",
                                ["reason"], registry=metrics.registry)
        for reason in REASONS:  # every series from the start, so rate() sees the first failure
            self.failures.labels(reason)

    def refusal(self, metadata: Sequence[Any] | None) -> str | None:
        """None if the call carries a known token, else why not (counted)."""
        reason = refusal_reason(metadata, self.tokens)
        if reason is not None:
            self.failures.labels(reason).inc()
        return reason


class Header(NamedTuple):
    """An HTTP header in the shape of gRPC metadata (for ``TokenCheck.refusal``)."""

    key: str
    value: str


def allow_all(headers: Mapping[str, str]) -> None:
    """The HTTP authorization hook without tokens: every request passes."""


def authorizer(check: TokenCheck | None) -> Authorize:
    """The HTTP hook of the token check (``allow_all`` without tokens): raises NmtError
    UNAUTHENTICATED with the message gRPC sends."""
    if check is None:
        return allow_all

    def authorize(headers: Mapping[str, str]) -> None:
        metadata = [Header("authorization", v) for k, v in headers.items() if k.lower() == "authorization"]
        if check.refusal(metadata) is not None:
            raise NmtError(ErrorKind.UNAUTHENTICATED, REFUSAL)
    return authorize


def tls_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """HTTPS from the gRPC side's files (client certificates required with client CAs); read
    once, at start, unlike gRPC's credentials, which re-read rotated files."""
    if not security.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
    if security.tls_client_ca_file is not None:
        context.load_verify_locations(security.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED without reading the request."""
    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    serializer = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, response_serializer=serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, response_serializer=serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=serializer)
    return grpc.stream_stream_rpc_method_handler(deny, response_serializer=serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but health needs a known bearer token."""

    def __init__(self, check: TokenCheck, metrics: Metrics) -> None:
        self.check, self.requests = check, metrics.requests

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIX):
            return handler
        if self.check.refusal(details.invocation_metadata) is None:
            return handler
        self.requests.labels(method=details.method.rsplit("/", 1)[-1], code="UNAUTHENTICATED",
                             protocol="grpc").inc()
        return _deny(handler)
