"""The closed set of error kinds. Each is mapped to its gRPC status code and HTTP status in one
place, the front door's table (``service.api.frontend.STATUS``), so the layers below the
transports raise kinds and never know a wire format; messages name the field, the limit and
the value.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # a request field is out of its limits
    NOT_FOUND = "not_found"  # unknown model
    RESOURCE_EXHAUSTED = "resource_exhausted"  # queue full, message too large
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the client's deadline passed mid-decode
    CANCELLED = "cancelled"  # the client went away
    UNAVAILABLE = "unavailable"  # draining for shutdown
    INTERNAL = "internal"  # a bug or a runtime failure
    UNAUTHENTICATED = "unauthenticated"  # tokens are on and the call has none or a wrong one
    UNIMPLEMENTED = "unimplemented"  # no such method on an HTTP path (405 with its Allow header)


class NmtError(Exception):
    """An error with a kind; the message is what the client reads."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


SHOWN_CHARS = 60
"""Longest echo of a client's value in a message: a 200 KB value echoed whole would push the
status past gRPC's metadata limit (the client would read RESOURCE_EXHAUSTED, not our error)."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters (with its full length when cut)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return text[:limit - 3] + "..." + size


def invalid(field: str, limit: str, value: object) -> NmtError:
    """INVALID_ARGUMENT naming the field, the limit and the given value (shortened)."""
    return NmtError(ErrorKind.INVALID_ARGUMENT, f"{field} must be {limit}, got {shown(value)}")


class ModelRepositoryError(Exception):
    """A model repository that cannot be served; the message names the file."""


class ProviderUnavailableError(RuntimeError):
    """The requested execution provider cannot run here (no GPU, no onnxruntime-gpu)."""
