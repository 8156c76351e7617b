"""The closed set of error kinds. Mapped to gRPC status codes in one place
(``service.api.grpc_server.GRPC_CODES``); messages name the field, the limit and the value.
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


class NmtError(Exception):
    """An error with a kind; the message is what the client reads."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def shorten(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters (``...`` at the end): what a message may echo."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def invalid(field: str, limit: str, value: object) -> NmtError:
    """INVALID_ARGUMENT naming the field, the limit and the given value."""
    shown = shorten(repr(value))
    return NmtError(ErrorKind.INVALID_ARGUMENT, f"{field} must be {limit}, got {shown}")


class ModelRepositoryError(Exception):
    """A model repository that cannot be served; the message names the file."""


class ProviderUnavailableError(RuntimeError):
    """The requested execution provider cannot run here (no GPU, no onnxruntime-gpu)."""
