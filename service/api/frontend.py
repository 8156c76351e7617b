"""The front door: the one transport-neutral path every request takes, and the error table.

Layering::

    server.App ──► grpc_server, http_server (and any later transport: LibreTranslate's routes)
                        │  each parses its own wire format into plain values, and calls
                        ▼
                   frontend.Frontend  (resolve the model, validate, admit, tokenize, map errors)
                        │
                        ▼
                   service.app.ServedModels ──► service.scheduling ──► service.decoding

A transport turns its request into texts, ``DecodingOptions`` and a model name, calls
``Frontend.admit_request``, awaits ``Frontend.translate`` or iterates ``Frontend.stream``,
and renders the translations, or the ``NmtError`` that ``Frontend.failure`` made of an
exception, with the status ``STATUS`` gives its kind. No transport imports another: what
they share is here, in ``convert`` (protobuf <-> dataclasses) and in ``auth`` (TLS, tokens).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc

from service import languages
from service.app import Model, ServedModels
from service.config import ServeConfig
from service.errors import ErrorKind, NmtError, invalid
from service.interface import Event, Prepared, Translation
from service.metrics import Metrics
from service.models.attention import has_attention
from service.options import DecodingOptions, validate_request
from service.text import placeholders

log = logging.getLogger("nmt.server")


@dataclass(frozen=True)
class Status:
    """How one error kind is answered on each transport."""

    grpc: grpc.StatusCode  # the gRPC status code
    http: int  # the HTTP status (grpc-gateway's for the same gRPC code)

    @property
    def name(self) -> str:
        """The name every wire format shows: gRPC's code name, the HTTP error body's ``code``
        and the ``code`` label of ``nmt_requests_total`` on either protocol."""
        return self.grpc.name


STATUS: dict[ErrorKind, Status] = {
    ErrorKind.INVALID_ARGUMENT: Status(grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorKind.UNAUTHENTICATED: Status(grpc.StatusCode.UNAUTHENTICATED, 401),
    ErrorKind.NOT_FOUND: Status(grpc.StatusCode.NOT_FOUND, 404),
    ErrorKind.RESOURCE_EXHAUSTED: Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ErrorKind.CANCELLED: Status(grpc.StatusCode.CANCELLED, 499),
    ErrorKind.INTERNAL: Status(grpc.StatusCode.INTERNAL, 500),
    ErrorKind.UNIMPLEMENTED: Status(grpc.StatusCode.UNIMPLEMENTED, 501),
    ErrorKind.UNAVAILABLE: Status(grpc.StatusCode.UNAVAILABLE, 503),
    ErrorKind.DEADLINE_EXCEEDED: Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504),
}
"""The one mapping from error kinds to gRPC codes and HTTP statuses (a test checks that every
kind has one)."""

OK = "OK"
"""The ``code`` label of an answered call, on every protocol (gRPC's ``StatusCode.OK.name``)."""


def status(kind: ErrorKind) -> Status:
    return STATUS[kind]


MAX_CLIENT_ID = 64
"""Characters of an ``x-client-id`` kept (with ``--trust-client-id``)."""


def peer_address(peer: str) -> str:
    """gRPC's ``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000``, or aiohttp's ``127.0.0.1``: the address."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and rest:
        host = rest.rsplit(":", 1)[0]
        return host.strip("[]")
    return peer or "unknown"


@dataclass(frozen=True)
class Admitted:
    """A request past the front door: the model version that will translate it, and its texts
    validated and tokenized, in request order."""

    model: Model
    prepared: tuple[Prepared, ...]
    client: str = ""  # who sent it: its turn among the others' (``Frontend.client``)


class Frontend:
    """The transport-neutral server API: one instance per server, shared by every transport."""

    def __init__(self, *, config: ServeConfig, models: ServedModels, metrics: Metrics) -> None:
        self.config, self.models, self.metrics = config, models, metrics
        self.ready = False  # every model warmed up and not draining: gRPC health, HTTP /readyz

    def admit_request(self, *, texts: Sequence[str], options: DecodingOptions, model: str = "",
                      source_language: str = "", target_language: str = "", client: str = "") -> Admitted:
        """Validate the whole request (once, here, for every transport), resolve ``model``
        (empty: by the languages, else the default), refuse it at once if the scheduler is full,
        then tokenize its texts. Raises NmtError naming the field, the limit and the value."""
        options = validate_request(texts, options, self.config.limits)
        for i, text in enumerate(texts):
            placeholders.check_count(text, f"texts[{i}]")
        served = self.resolve(model, source_language, target_language)
        if options.return_attention and not has_attention(served.manifest.attention):
            raise invalid("options.return_attention", f"false for model {served.ref!r} (its attention "
                          f"is {served.manifest.attention!r}: no alignments)", True)
        # before tokenizing: under a flood a refusal costs a comparison, not a tokenization
        served.scheduler.refuse_if_full(len(texts) * options.beam_size)
        prepared = tuple(served.engine.prepare_text(text, options, i) for i, text in enumerate(texts))
        return Admitted(model=served, prepared=prepared, client=client)

    def client(self, *, authorization: str | None, peer: str, client_id: str | None = None) -> str:
        """Who sent a request, for fairness between clients: with ``--trust-client-id``, the
        ``x-client-id`` it gives; else, where tokens are on, the token's identity (a hash: the
        token itself is never kept); else the peer's address (without its port). With
        ``--fairness off``, everyone is one client (one queue, arrival order)."""
        if not self.config.fairness:
            return ""
        if self.config.trust_client_id and client_id:
            return "id:" + "".join(c for c in client_id if c.isprintable())[:MAX_CLIENT_ID]
        if self.config.security.auth_token_file is not None and authorization:
            token = authorization.partition(" ")[2].strip().encode("utf-8", "surrogateescape")
            return "token:" + hashlib.sha256(token).hexdigest()[:12]
        return peer_address(peer)

    def resolve(self, model: str, source_language: str = "", target_language: str = "") -> Model:
        """The model a request names; with no name, the served model of its languages (the
        default model first), with neither, the default. A name and languages that disagree,
        or languages no served model translates, are refused naming the served pairs."""
        if not (source_language or target_language):
            return self.models.get(model)
        candidates = [self.models.get(model)] if model else self.served()
        found = languages.route(candidates, [m.manifest.languages for m in candidates],
                                source_language, target_language)
        if found is not None:
            return found
        pairs = languages.served_pairs([m.manifest.languages for m in candidates])
        field = "target_language" if source_language and any(
            m.manifest.languages[0] == languages.normalize(source_language) for m in candidates) else (
            "source_language" if source_language else "target_language")
        asked = f"{source_language or '*'}-{target_language or '*'}"
        raise invalid(field, f"a pair served{f' by model {model!r}' if model else ''} "
                      f"(one of {', '.join(pairs) or 'none'})", asked)

    async def translate(self, admitted: Admitted, *, timeout: float | None) -> list[Translation]:
        """The translations, in request order (``timeout``: the client's deadline in seconds)."""
        return await admitted.model.scheduler.translate(admitted.prepared, timeout=timeout, client=admitted.client)

    def stream(self, admitted: Admitted, *, timeout: float | None) -> AsyncIterator[Event]:
        """``Partial`` updates as decoding goes, then one ``Final``; close it (``aclose``) when
        the client goes away, so that its rows leave the batch."""
        return admitted.model.scheduler.stream(admitted.prepared, timeout=timeout, client=admitted.client)

    def served(self) -> list[Model]:
        """The versions taking requests, the default model's first."""
        return self.models.all

    def failure(self, error: Exception, *, method: str) -> NmtError:
        """The NmtError that answers ``error`` on any transport: itself (a deadline the scheduler
        saw first is counted), else INTERNAL naming it, logged: a bug, and the server goes on."""
        if isinstance(error, NmtError):
            if error.kind is ErrorKind.DEADLINE_EXCEEDED:
                self.metrics.deadline_exceeded.inc()
            return error
        log.exception("%s failed", method, exc_info=error)
        return NmtError(ErrorKind.INTERNAL, f"internal error: {type(error).__name__}: {error}")
